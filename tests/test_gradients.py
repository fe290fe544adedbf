"""Autodiff and vmap through every collective and algorithm, against jax.lax's."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from jax.test_util import check_grads

import jaxcoll
from tests.helpers import call, call_lax, input_length

pytestmark = pytest.mark.quick   # also on the oldest supported jax (.ci/run)

PRIMITIVES = jaxcoll.PRIMITIVES
# (mesh shape, names, axis_name): one axis of a non-power-of-two size, and a (node, local) tuple
MESHES = {"x5": ((5,), ("x",), "x"), "2x4": ((2, 4), ("node", "local"), ("node", "local"))}


def algorithms(primitive, axes):
  multi = isinstance(axes, tuple)
  return [a for a in jaxcoll.algorithms(primitive) if a != "native" and
          (a == "hierarchical") == multi]


def sharded(fn, mesh_key, out_spec=None):
  shape, names, axes = MESHES[mesh_key]
  mesh = Mesh(np.array(jax.devices()[:int(np.prod(shape))]).reshape(shape), names)
  spec = P(names)
  body = lambda v: jax.tree.map(lambda o: o[None], fn(jax.tree.map(lambda i: i[0], v), axes))
  if out_spec is not None:
    body = lambda v: fn(jax.tree.map(lambda i: i[0], v), axes)
  return jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=out_spec or spec), axes


def weighted_loss(f, weights):
  return lambda x: sum(jnp.sum(o.astype(jnp.float32) * w) for o, w in
                       zip(jax.tree.leaves(f(x)), jax.tree.leaves(weights)))


def tolerance(dtype, n):
  return {"rtol": 1e-5, "atol": 1e-5} if dtype == np.float32 else {"rtol": 0.05, "atol": 0.05 * n}


@pytest.mark.parametrize("mesh_key", MESHES)
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("primitive", PRIMITIVES)
def test_vjp_equals_lax(primitive, dtype, mesh_key):
  """Cotangents of every algorithm equal lax's (the transpose pairs: all_gather <->
  reduce_scatter, all_to_all reversed, shift reversed, broadcast <-> reduce)."""
  devices = int(np.prod(MESHES[mesh_key][0]))
  n = devices if mesh_key != "x5" else 5
  _, _, axes = MESHES[mesh_key]
  algos = algorithms(primitive, axes)
  if not algos:
    pytest.skip(f"{primitive} has no hierarchical algorithm")
  rng = np.random.default_rng(7)
  x = rng.standard_normal((devices, input_length(primitive, n, 3))).astype(dtype)
  root = n - 2
  ours, _ = sharded(lambda v, ax: {a: call(primitive, v[a], ax, a, root) for a in algos},
                    mesh_key)
  lax_f, _ = sharded(lambda v, ax: call_lax(primitive, v, ax, root), mesh_key)
  out = jax.eval_shape(lax_f, x)
  w = rng.standard_normal(out.shape).astype(np.float32)
  want = jax.jit(jax.grad(weighted_loss(lax_f, w)))(x)
  got = jax.jit(jax.grad(weighted_loss(ours, {a: w for a in algos})))({a: x for a in algos})
  for a in algos:
    assert got[a].dtype == want.dtype
    np.testing.assert_allclose(np.asarray(got[a], np.float32), np.asarray(want, np.float32),
                               err_msg=a, **tolerance(dtype, n))


@pytest.mark.parametrize("primitive", ["all_reduce", "broadcast", "all_gather"])
def test_vjp_of_replicated_results_leaving_with_out_specs_p(primitive):
  """Invariant results (out_specs=P()) get lax's cotangents too."""
  x = np.random.default_rng(1).standard_normal((5, 15)).astype(np.float32)
  kw = {"to": "invarying"} if primitive == "all_gather" else {}
  def lax_fn(v, ax):
    if primitive == "all_gather":
      return jax.lax.all_gather(v, ax, tiled=True, to="invarying")
    return call_lax(primitive, v, ax)
  lax_f, _ = sharded(lax_fn, "x5", P())
  w = np.random.default_rng(2).standard_normal(jax.eval_shape(lax_f, x).shape)
  want = jax.jit(jax.grad(weighted_loss(lax_f, w)))(x)
  for a in algorithms(primitive, "x"):
    ours, _ = sharded(lambda v, ax, a=a: getattr(jaxcoll, primitive)(v, ax, algorithm=a, **kw)
                      if primitive != "all_gather" else
                      jaxcoll.all_gather(v, ax, tiled=True, algorithm=a, **kw), "x5", P())
    np.testing.assert_allclose(jax.jit(jax.grad(weighted_loss(ours, w)))(x), want, rtol=1e-5,
                               atol=1e-5, err_msg=a)


@pytest.mark.parametrize("primitive", PRIMITIVES)
def test_jvp_equals_lax(primitive):
  rng = np.random.default_rng(3)
  x, t = (rng.standard_normal((5, input_length(primitive, 5, 2))).astype(np.float32)
          for _ in range(2))
  algos = algorithms(primitive, "x")
  lax_f, _ = sharded(lambda v, ax: call_lax(primitive, v, ax, 1), "x5")
  ours, _ = sharded(lambda v, ax: {a: call(primitive, v, ax, a, 1) for a in algos}, "x5")
  want = jax.jit(lambda x, t: jax.jvp(lax_f, (x,), (t,)))(x, t)
  got = jax.jit(lambda x, t: jax.jvp(ours, (x,), (t,)))(x, t)
  for a in algos:
    chex.assert_trees_all_close((got[0][a], got[1][a]), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("primitive", PRIMITIVES)
def test_grad_taken_inside_shard_map_equals_lax(primitive):
  """jax.grad of a per-device loss, inside the shard_map body."""
  rng = np.random.default_rng(6)
  x = rng.standard_normal((5, input_length(primitive, 5, 2))).astype(np.float32)
  algos = algorithms(primitive, "x")
  def grads(fn):
    def body(v, ax):
      w = jax.lax.axis_index(ax).astype(jnp.float32) + 1.0
      return jax.grad(lambda u: jnp.sum(fn(u, ax) * w))(v)
    return jax.jit(sharded(body, "x5")[0])(x)
  want = grads(lambda u, ax: call_lax(primitive, u, ax, 2))
  for a in algos:
    got = grads(lambda u, ax, a=a: call(primitive, u, ax, a, 2))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=a)


@pytest.mark.parametrize("primitive,algorithm", [
    ("all_reduce", "ring"), ("all_reduce", "double_binary_tree"), ("reduce_scatter", "direct"),
    ("all_gather", "bruck"), ("all_to_all", "bruck"), ("shift", "direct"),
    ("broadcast", "binomial_tree"), ("reduce", "reduce_scatter_gather")])
def test_check_grads_numerically(primitive, algorithm):
  x = np.random.default_rng(4).standard_normal((5, input_length(primitive, 5, 2)))
  f, _ = sharded(lambda v, ax: call(primitive, v, ax, algorithm, 3), "x5")
  check_grads(jax.jit(lambda v: jnp.sin(f(v))), (x.astype(np.float32),), order=1,
              modes=("fwd", "rev"), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("mesh_key", MESHES)
@pytest.mark.parametrize("primitive", PRIMITIVES)
def test_vmap_over_a_leading_batch_dimension(primitive, mesh_key):
  devices = int(np.prod(MESHES[mesh_key][0]))
  n = devices if mesh_key != "x5" else 5
  axes = MESHES[mesh_key][2]
  algos = algorithms(primitive, axes)
  if not algos:
    pytest.skip(f"{primitive} has no hierarchical algorithm")
  x = np.random.default_rng(5).standard_normal(
      (devices, 3, input_length(primitive, n, 2))).astype(np.float32)
  ours, _ = sharded(lambda v, ax: {a: jax.vmap(lambda b, a=a: call(primitive, b, ax, a, 1))(v)
                                   for a in algos}, mesh_key)
  lax_f, _ = sharded(lambda v, ax: jax.vmap(lambda b: call_lax(primitive, b, ax, 1))(v),
                     mesh_key)
  want = np.asarray(jax.jit(lax_f)(x))
  chex.assert_trees_all_close(jax.jit(ours)(x), {a: want for a in algos}, rtol=1e-5, atol=1e-5)


@pytest.mark.quick
@pytest.mark.parametrize("mesh_key", MESHES)
@pytest.mark.parametrize("primitive", PRIMITIVES)
def test_remat_saves_the_input_alone(primitive, mesh_key):
  """JAX's own shard_map_test.py::test_collectives_not_saved with every jaxcoll algorithm:
  under jax.remat nothing but the input is saved (the executor's index tables are
  recomputed, not kept as residuals)."""
  from jax._src.ad_checkpoint import saved_residuals
  _, _, axes = MESHES[mesh_key]
  n = 5 if mesh_key == "x5" else 8
  x = jnp.ones((n, input_length(primitive, n, 2)), jnp.float32)
  wires = [None, "int8"] if primitive in ("all_reduce", "all_gather") else [None]
  for algorithm in algorithms(primitive, axes):
    for wire in wires:
      extra = {} if wire is None else {"wire_dtype": wire}
      fn = lambda v, a, algorithm=algorithm, extra=extra: call(primitive, v, a, algorithm,
                                                               **extra)
      f, _ = sharded(lambda v, a, fn=fn: fn(v, a) * fn(v, a), mesh_key)
      saved = saved_residuals(jax.remat(f), x)
      assert len(saved) == 1 and saved[0][1].startswith("from the argument"), \
          (algorithm, wire, saved)
