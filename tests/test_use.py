"""``jaxcoll.use``: a function's lax collectives rerouted, results and gradients unchanged."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import LAX_COLLECTIVES, eqns, primitives
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxcoll
from jaxcoll._src.use.collective_rules import shift_of

pytestmark = pytest.mark.quick   # reads jaxprs: runs on every supported jax (.ci/run)

FORCED = {"all_reduce": "ring", "reduce_scatter": "ring", "all_gather": "ring",
          "all_to_all": "direct", "shift": "direct"}
MESH = Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))



def cv_psum(v):
  """A custom_vjp whose primal and backward both hold collectives."""
  @jax.custom_vjp
  def f(v):
    return lax.psum(v, "b") * 2.0

  def fwd(v):
    return f(v), None

  def bwd(_, ct):
    return (lax.all_gather(ct, "b", tiled=True)[:ct.shape[0]] * 2.0 +
            lax.pcast(lax.psum(ct, "b"), "b", to="varying") * 0.0,)

  f.defvjp(fwd, bwd)
  return f(v)


def cj_psum(v):
  @jax.custom_jvp
  def f(v):
    return lax.psum(jnp.sin(v), "b")

  f.defjvp(lambda p, t: (f(p[0]), lax.psum(jnp.cos(p[0]) * t[0], "b")))
  return f(v)


def uniform(v):
  """A value equal on every device (a cond predicate every device takes alike)."""
  return lax.psum(jnp.sum(v), ("a", "b"))


# name -> a per-device body over x: f32[8] on mesh (a=2, b=4); each returns f32[k]
BODIES = {
    "psum": lambda x: lax.psum(x, "b"),
    "psum_tuple": lambda x: lax.psum(x, ("a", "b")),
    "psum_tuple_out_of_mesh_order": lambda x: lax.psum(x, ("b", "a")),
    "psum_many": lambda x: sum(lax.psum((x, 2.0 * x, x[:3]), "b")[:2]),
    "pmean": lambda x: lax.pmean(x, "b"),
    "pmax_pmin": lambda x: lax.pmax(x, "b") + lax.pmin(x, "a"),
    "all_gather": lambda x: lax.all_gather(x, "b").reshape(-1),
    "all_gather_tiled_axis1": lambda x: lax.all_gather(x.reshape(2, 4), "b", axis=1,
                                                       tiled=True).reshape(-1),
    "all_gather_invariant": lambda x: lax.all_gather(x, "b", tiled=True, to="invarying")
                                      * (1.0 + lax.axis_index("b")),
    "psum_scatter": lambda x: lax.psum_scatter(x, "b", tiled=True),
    "psum_scatter_untiled": lambda x: lax.psum_scatter(x[:4], "b"),
    "all_to_all_tiled": lambda x: lax.all_to_all(x, "b", 0, 0, tiled=True),
    "all_to_all_untiled": lambda x: lax.all_to_all(x.reshape(4, 2), "b", 0, 1).reshape(-1),
    "shift_wrap": lambda x: lax.ppermute(x, "b", [(i, (i + 1) % 4) for i in range(4)]),
    "shift_no_wrap": lambda x: lax.ppermute(x, ("a", "b"), [(i, i - 3) for i in range(3, 8)]),
    "nested_jit": lambda x: jax.jit(lambda v: lax.psum(jnp.sin(v), "b"))(x),
    "scan": lambda x: lax.scan(lambda c, v: (c + lax.psum(v, "b"), c), x[:2],
                               x.reshape(4, 2))[1].reshape(-1),
    "while": lambda x: lax.while_loop(
        lambda c: c[0] < 3,
        lambda c: (c[0] + 1, lax.pcast(lax.psum(c[1], "b") / 4, "b", to="varying")),
        (0, x))[1],
    "cond": lambda x: lax.cond(uniform(x) > 0, lambda v: lax.pmean(v, "b") * 2.0,
                               lambda v: lax.pmean(v, "b"), x),
    "remat": lambda x: jax.checkpoint(lambda v: lax.psum(jnp.sin(v) * v, "b"),
                                      policy=jax.checkpoint_policies.nothing_saveable)(x),
    "custom_vjp": cv_psum,
    "custom_jvp": cj_psum,
    "grad_inside": lambda x: jax.grad(lambda v: jnp.sum(lax.psum(v * v, "b") *
                                                       lax.all_gather(v, "a", tiled=True)[:8]))(x),
}
# pmax/pmin have no derivative in lax; reverse mode cannot go through a while loop; lax's own
# gradient of an untiled all_to_all fails ("Expected cotangent type f32[4,2,1] but got
# f32[4,1,2]", jax 0.10.2 and 0.12)
NO_GRAD = {"pmax_pmin", "while", "all_to_all_untiled"}


def sharded(body):
  """body on every device of MESH; x and the result have one row per device."""
  return jax.shard_map(lambda v: body(v[0])[None], mesh=MESH, in_specs=P(("a", "b")),
                       out_specs=P(("a", "b")))


def inputs(seed=0):
  return jnp.asarray(np.random.default_rng(seed).standard_normal((8, 8)), jnp.float32)


@pytest.mark.parametrize("name", BODIES)
def test_use_equals_the_function_and_leaves_no_lax_collective(name):
  f = sharded(BODIES[name])
  g = jaxcoll.use(f, algorithm=FORCED)
  x = inputs()
  chex.assert_trees_all_close(jax.jit(g)(x), jax.jit(f)(x), rtol=1e-5, atol=1e-5)
  left = LAX_COLLECTIVES & set(primitives(jax.make_jaxpr(g)(x)))
  assert not left, left
  assert "ppermute" in primitives(jax.make_jaxpr(g)(x))


@pytest.mark.parametrize("name", sorted(set(BODIES) - NO_GRAD))
def test_grad_outside_and_inside_use_equal_lax(name):
  f = sharded(BODIES[name])
  loss = lambda h: lambda x: jnp.sum(jnp.sin(h(x)))
  x = inputs(1)
  want = jax.jit(jax.grad(loss(f)))(x)
  outside = jax.jit(jax.grad(loss(jaxcoll.use(f, algorithm=FORCED))))(x)
  inside = jax.jit(jaxcoll.use(jax.grad(loss(f)), algorithm=FORCED))(x)
  scale = float(jnp.abs(want).max()) + 1.0
  chex.assert_trees_all_close(outside, want, atol=1e-5 * scale, rtol=1e-5)
  chex.assert_trees_all_close(inside, want, atol=1e-5 * scale, rtol=1e-5)
  assert not LAX_COLLECTIVES & set(primitives(jax.make_jaxpr(
      jaxcoll.use(jax.grad(loss(f)), algorithm=FORCED))(x)))


def test_decorator_forms_and_a_name_applies_where_it_is_offered():
  body = lambda x: lax.psum(x, "b") + lax.all_gather(x, "b", tiled=True)[:8]
  f = sharded(body)
  x = inputs(2)
  want = jax.jit(f)(x)
  for g in (jaxcoll.use(f), jaxcoll.use()(f), jaxcoll.use(algorithm="ring")(f),
            sharded(jaxcoll.use(body, algorithm="ring"))):
    chex.assert_trees_all_close(jax.jit(g)(x), want, rtol=1e-5, atol=1e-5)
  # "bruck" exists for all_gather only: psum gets "schedule" (auto among the schedules),
  # so that forcing a schedule leaves no lax collective; "auto" keeps native where cheaper
  names = set(primitives(jax.make_jaxpr(jaxcoll.use(f, algorithm="bruck"))(x)))
  assert not names & {"all_gather", "psum", "psum_invariant"}, names
  names = set(primitives(jax.make_jaxpr(jaxcoll.use(f, algorithm="auto"))(x)))
  assert names & {"psum", "psum_invariant"}, names


def test_what_use_leaves_alone():
  """A ppermute that is no shift (pairwise swaps) stays a ppermute of that permutation."""
  perm = ((0, 1), (1, 0), (2, 3), (3, 2))
  f = sharded(lambda x: lax.ppermute(x, "b", perm))
  x = inputs(3)
  g = jaxcoll.use(f, algorithm=FORCED)
  chex.assert_trees_all_close(jax.jit(g)(x), jax.jit(f)(x))
  perms = [e.params["perm"] for e in eqns(jax.make_jaxpr(g)(x)) if e.primitive.name == "ppermute"]
  assert [tuple(map(tuple, p)) for p in perms] == [perm]


def test_nested_shard_map():
  """An inner shard_map over "b" inside an outer one over "a": both bodies rewritten."""
  def inner(v):
    return lax.psum(v, "b") * 1.5

  def outer(v):
    v = lax.psum(v, "a")
    return jax.shard_map(inner, mesh=jax.sharding.get_abstract_mesh(), in_specs=P(None, "b"),
                         out_specs=P(None, "b"),
                         axis_names={"b"})(v)

  f = jax.shard_map(outer, mesh=MESH, in_specs=P("a"), out_specs=P(), axis_names={"a"})
  x = inputs(5)
  g = jaxcoll.use(f, algorithm=FORCED)
  chex.assert_trees_all_close(jax.jit(g)(x), jax.jit(f)(x), rtol=1e-5, atol=1e-5)
  names = [e.primitive.name for e in eqns(jax.make_jaxpr(g)(x))]
  assert names.count("shard_map") == 2 and not LAX_COLLECTIVES & set(names)


def test_checkpoint_policy_is_kept():
  policy = jax.checkpoint_policies.nothing_saveable
  f = sharded(BODIES["remat"])
  jaxpr = jax.make_jaxpr(jaxcoll.use(f, algorithm=FORCED))(inputs())
  found = [e.params["policy"] for e in eqns(jaxpr)
           if e.primitive.name in ("checkpoint", "remat2", "remat")]
  assert found == [policy]


def test_wire_dtype_compresses_floating_collectives():
  """A float psum of 256 values a device travels int8 (values and exponents packed as
  bytes), an int32 one as it is; one of 8 values (8 values on a block of their own would
  take more bytes) and a scalar's travel exact."""
  f = sharded(lambda x: lax.psum(x, "b") + lax.psum(x.astype(jnp.int32), "b"))
  x = jnp.asarray(np.random.default_rng(4).standard_normal((8, 256)), jnp.float32) * 10
  g = jaxcoll.use(f, algorithm="ring", wire_dtype="int8")
  got, want = jax.jit(g)(x), jax.jit(f)(x)
  err = float(jnp.abs(got - want).max() / jnp.abs(want).max())
  assert 0 < err < 0.05
  jaxpr = jax.make_jaxpr(g)(x)
  dtypes = {str(e.invars[0].aval.dtype) for e in eqns(jaxpr) if e.primitive.name == "ppermute"}
  assert "uint8" in dtypes and "int32" in dtypes
  small = sharded(lambda x: lax.psum(x, "b") + lax.psum(jnp.sum(x), "b"))
  np.testing.assert_allclose(jax.jit(jaxcoll.use(small, algorithm="ring", wire_dtype="int8"))(
      inputs(4)), jax.jit(small)(inputs(4)), rtol=1e-6)


@pytest.mark.parametrize("perm,n,want", [
    ([(0, 1), (1, 2), (2, 0)], 3, (1, True)), ([(1, 0), (2, 1), (0, 2)], 3, (2, True)),
    ([(0, 2), (1, 3)], 4, (2, False)), ([(3, 0)], 4, (-3, False)), ([(0, 0)], 1, (0, True)),
    ([(0, 2), (2, 0), (1, 3), (3, 1)], 4, (2, True)), ([(0, 1), (1, 0)], 4, None),
    ([(0, 1)], 4, None)])
def test_shift_detection(perm, n, want):
  assert shift_of(perm, n) == want


def test_errors_name_the_argument():
  f = sharded(BODIES["psum"])
  with pytest.raises(ValueError, match="use\\(algorithm='nope'\\)"):
    jaxcoll.use(f, algorithm="nope")
  with pytest.raises(ValueError, match="'psum' is not a collective"):
    jaxcoll.use(f, algorithm={"psum": "ring"})
  with pytest.raises(ValueError, match="bruck"):
    jaxcoll.use(f, algorithm={"all_reduce": "bruck"})
  with pytest.raises((ValueError, TypeError), match="float12"):
    jaxcoll.use(f, wire_dtype="float12")
