"""Tuple axis names, hierarchical algorithms, all_to_all and shift against jax.lax."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcoll
from jaxcoll._src import axes as axes_lib
from jaxcoll._src import compat
from tests.helpers import call, call_lax, input_length, mesh_perm, ppermute_bytes_per_rank

pytestmark = pytest.mark.quick   # also on the oldest supported jax (.ci/run)

TUPLE_PRIMITIVES = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast",
                    "reduce", "shift")
# (mesh shape, mesh axis names, the axis_name tuple the collectives run over)
MESHES = [
    ((2, 4), ("node", "local"), ("node", "local")),
    ((4, 2), ("node", "local"), ("node", "local")),
    ((2, 2, 2), ("x", "y", "z"), ("x", "y", "z")),
    ((2, 2, 2), ("x", "y", "z"), ("z", "y")),
    ((2, 2, 2), ("x", "y", "z"), ("z", "x", "y")),
    ((2, 3), ("a", "b"), ("a", "b")),
    ((3, 2), ("a", "b"), ("b", "a")),
    ((2, 4), ("node", "local"), ("local",)),
]


def make_mesh(shape, names):
  return Mesh(np.array(jax.devices()[:math.prod(shape)]).reshape(shape), names)


def run(mesh, body, x):
  """``body`` on every device of ``mesh``; x and the result carry one leading row per device."""
  spec = P(mesh.axis_names)
  f = jax.jit(jax.shard_map(
      lambda v: jax.tree.map(lambda o: o[None], body(jax.tree.map(lambda i: i[0], v))),
      mesh=mesh, in_specs=spec, out_specs=spec))
  return jax.tree.map(np.asarray, f(jax.device_put(x, NamedSharding(mesh, spec))))


def group_size(shape, names, axes):
  return math.prod(dict(zip(names, shape))[a] for a in axes)


@pytest.mark.parametrize("shape,names,axes", MESHES, ids=lambda v: str(v))
def test_every_algorithm_over_a_tuple_equals_lax(shape, names, axes):
  """Integer-valued floats: every sum is exact, so results must equal lax bit for bit."""
  mesh, n = make_mesh(shape, names), group_size(shape, names, axes)
  cases = [(p, a) for p in TUPLE_PRIMITIVES for a in jaxcoll.algorithms(p)
           if a != "hierarchical" or len(axes) > 1]
  rng = np.random.default_rng(n)
  xs = {p: rng.integers(-8, 8, (mesh.size, input_length(p, n, 6))).astype(np.float32)
        for p in TUPLE_PRIMITIVES}
  root = n - 1
  got = run(mesh, lambda v: {f"{p}/{a}": call(p, v[p], axes, a, root) for p, a in cases}, xs)
  want = run(mesh, lambda v: {p: call_lax(p, v[p], axes, root) for p in TUPLE_PRIMITIVES}, xs)
  for p, a in cases:
    np.testing.assert_array_equal(got[f"{p}/{a}"], want[p], err_msg=f"{p} {a} over {axes}")


@pytest.mark.parametrize("shape,names,axes", MESHES[:5], ids=lambda v: str(v))
def test_all_reduce_replicas_bit_identical_over_a_tuple(shape, names, axes):
  mesh = make_mesh(shape, names)
  x = np.random.default_rng(0).standard_normal((mesh.size, 37)).astype(np.float32)
  algos = [a for a in jaxcoll.algorithms("all_reduce") if a != "native"]
  out = run(mesh, lambda v: {a: jaxcoll.all_reduce(v, axes, algorithm=a) for a in algos}, x)
  coords = np.stack(np.unravel_index(np.arange(mesh.size), shape), 1)
  others = [names.index(a) for a in names if a not in axes]
  group = np.ravel_multi_index(coords[:, others].T, [shape[i] for i in others]) if others \
      else np.zeros(mesh.size, int)
  want = run(mesh, lambda v: lax.psum(v, axes), x)
  for a in algos:
    for g in np.unique(group):
      bits = out[a][group == g].view(np.uint32)
      np.testing.assert_array_equal(bits, np.broadcast_to(bits[0], bits.shape), err_msg=a)
    np.testing.assert_allclose(out[a], want, rtol=1e-5, atol=1e-5, err_msg=a)


def test_axis_index_and_ppermute_number_a_tuple_differently():
  """What jaxcoll's ppermute translation rests on, pinned for every supported jax:
  axis_index(('z', 'y')) is z-major; ppermute's perm over the mesh-ordered ('y', 'z') is
  y-major. Over ('z', 'y') itself, jax 0.10.2 reads perm in mesh order (y-major) and jax
  0.12 refuses the tuple. A jax that changes either fails here."""
  mesh = make_mesh((2, 2, 2), ("x", "y", "z"))
  coords = np.stack(np.unravel_index(np.arange(8), (2, 2, 2)), 1)   # device -> (x, y, z)
  index = run(mesh, lambda v: lax.axis_index(("z", "y")), np.zeros((8, 1)))
  np.testing.assert_array_equal(index, coords[:, 2] * 2 + coords[:, 1])
  perm = [(i, (i + 1) % 4) for i in range(4)]
  mesh_order = coords[:, 1] * 2 + coords[:, 2]       # y-major
  src = run(mesh, lambda v: lax.ppermute(lax.axis_index(("x", "y", "z")), ("y", "z"), perm),
            np.zeros((8, 1)))
  np.testing.assert_array_equal(mesh_order[src], (mesh_order - 1) % 4)
  out_of_order = lambda: run(mesh, lambda v: lax.ppermute(lax.axis_index(("x", "y", "z")),
                                                          ("z", "y"), perm), np.zeros((8, 1)))
  if compat.JAX_VERSION < (0, 12):
    np.testing.assert_array_equal(mesh_order[out_of_order()], (mesh_order - 1) % 4)
  else:
    with pytest.raises(RuntimeError, match="same order as the axis_names"):
      out_of_order()
  # the test helper's translation (and jaxcoll's) turns axis_index pairs into mesh pairs
  fixed = mesh_perm(("z", "y"), perm, ("x", "y", "z"), (2, 2))
  src = run(mesh, lambda v: lax.ppermute(lax.axis_index(("x", "y", "z")), ("y", "z"), fixed),
            np.zeros((8, 1)))
  np.testing.assert_array_equal(index[src], (index - 1) % 4)
  seen = []
  run(mesh, lambda v: seen.append(axes_lib.ppermute_args(("z", "y"), perm)) or v,
      np.zeros((8, 1)))
  assert seen == [(("y", "z"), tuple(fixed))]


@pytest.mark.parametrize("axes", [("node", "local"), ("local", "node"), "local"])
@pytest.mark.parametrize("offset", [1, -1, 3, 9, 0])
@pytest.mark.parametrize("wrap", [True, False])
@pytest.mark.parametrize("algorithm", ["direct", "native"])
def test_shift_sends_to_rank_plus_offset(axes, offset, wrap, algorithm):
  mesh = make_mesh((2, 4), ("node", "local"))
  n = 8 if isinstance(axes, tuple) else 4

  def body(v):
    me = lax.axis_index(axes)
    return me, jaxcoll.shift(v + 100.0 * me, axes, offset, wrap=wrap, algorithm=algorithm)

  x = np.arange(8, dtype=np.float32).reshape(8, 1)
  me, got = run(mesh, body, x)
  for dev in range(8):
    src = (me[dev] - offset) % n if wrap else me[dev] - offset
    peers = np.flatnonzero((me == src) & (np.arange(8) // n == dev // n)) if n == 8 else \
        np.flatnonzero((me == src) & (np.arange(8) // 4 == dev // 4))
    want = x[peers[0]] + 100.0 * src if 0 <= src < n else 0.0
    np.testing.assert_array_equal(got[dev], want, err_msg=f"device {dev}")


@pytest.mark.parametrize("split,concat,tiled,shape", [
    (0, 0, False, (4, 3)), (0, 1, False, (4, 3)), (1, 0, False, (3, 4)), (2, 0, False, (2, 3, 4)),
    (0, 2, False, (4, 3, 5)), (-1, -2, False, (3, 5, 4)),
    (0, 1, True, (8, 3)), (1, 0, True, (3, 8)), (1, 2, True, (2, 12, 3)), (0, 0, True, (4,))])
@pytest.mark.parametrize("algorithm", ["direct", "bruck", "native"])
def test_all_to_all_axes_and_tiling_equal_lax(split, concat, tiled, shape, algorithm):
  mesh = make_mesh((4,), ("x",))
  x = np.random.default_rng(1).standard_normal((4, *shape)).astype(np.float32)
  got = run(mesh, lambda v: jaxcoll.all_to_all(v, "x", split, concat, tiled=tiled,
                                               algorithm=algorithm), x)
  nd = len(shape)   # lax asserts on negative axes; jaxcoll takes them as numpy does
  want = run(mesh, lambda v: lax.all_to_all(v, "x", split % nd, concat % nd, tiled=tiled), x)
  assert got.shape == want.shape
  np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("n", range(1, 9))
@pytest.mark.parametrize("algorithm", ["direct", "bruck"])
def test_all_to_all_any_axis_size(n, algorithm):
  mesh = make_mesh((n,), ("x",))
  x = np.random.default_rng(n).standard_normal((n, n, 3)).astype(np.float32)
  got = run(mesh, lambda v: jaxcoll.all_to_all(v, "x", 0, 1, algorithm=algorithm), x)
  np.testing.assert_array_equal(got, run(mesh, lambda v: lax.all_to_all(v, "x", 0, 1), x))


def test_hierarchical_per_axis_choice_runs_and_matches_lax():
  mesh = make_mesh((2, 4), ("node", "local"))
  axes = ("node", "local")
  x = np.random.default_rng(2).integers(-9, 9, (8, 48)).astype(np.float32)
  choices = {
      "all_reduce": jaxcoll.Hierarchical(("recursive_doubling", "halving_doubling")),
      "reduce_scatter": jaxcoll.Hierarchical(("halving_doubling", "direct")),
      "all_gather": jaxcoll.Hierarchical(("bruck", None)),
      "all_to_all": jaxcoll.Hierarchical(("bruck", "direct")),
      "all_reduce/pieces": jaxcoll.Hierarchical(("ring", "ring"), pieces=(4, 1)),
      "reduce_scatter/pieces": jaxcoll.Hierarchical(pieces=(3, 2)),
      "all_gather/pieces": jaxcoll.Hierarchical(pieces=(2, 1)),
      "all_to_all/pieces": jaxcoll.Hierarchical(pieces=(4, 2)),
  }
  def inputs(v):
    return {"all_gather": v[:6]}.get
  prim = lambda key: key.split("/")[0]
  got = run(mesh, lambda v: {k: call(prim(k), inputs(v)(prim(k), v), axes, a)
                             for k, a in choices.items()}, x)
  want = run(mesh, lambda v: {k: call_lax(prim(k), inputs(v)(prim(k), v), axes)
                              for k in choices}, x)
  for k in choices:
    np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_hierarchical_traced_bytes_per_axis_equal_the_schedule():
  """Counted from the jaxpr's ppermutes (mesh-order pairs): bytes that cross "node"."""
  mesh = make_mesh((2, 4), ("node", "local"))
  length = 8 * 24
  for primitive in ("all_reduce", "all_to_all"):
    sched = jaxcoll.schedule(primitive, "hierarchical", 8, axis_sizes=(2, 4))
    f = jax.shard_map(lambda v, p=primitive: call(p, v[0], ("node", "local"), "hierarchical")[None],
                      mesh=mesh, in_specs=P(("node", "local")), out_specs=P(("node", "local")))
    jaxpr = jax.make_jaxpr(f)(jnp.zeros((8, length), jnp.float32))
    total = ppermute_bytes_per_rank(jaxpr, 8)
    assert total.max() == sched.bytes_per_rank(length * 4)
    outer, inner = sched.traffic(length * 4)
    assert total.max() == pytest.approx(outer.bytes + inner.bytes)


def test_tuple_errors_name_the_argument():
  mesh = make_mesh((2, 4), ("node", "local"))
  x = np.zeros((8, 8), np.float32)

  def raises(fn, match, data=x):
    with pytest.raises((ValueError, TypeError), match=match):
      run(mesh, fn, data)

  raises(lambda v: jaxcoll.all_reduce(v, "local", algorithm="hierarchical"), "tuple of .*mesh axes")
  raises(lambda v: jaxcoll.all_reduce(v, ("node", "local"),
                                      algorithm=jaxcoll.Hierarchical(("ring",))), "per_axis")
  raises(lambda v: jaxcoll.all_reduce(v, ("node", "gpu")), "axis_name='gpu'")
  raises(lambda v: jaxcoll.all_reduce(v, ("node", "node")), "repeats")
  raises(lambda v: jaxcoll.all_to_all(v, "local", 0, 0), "split_axis=0")
  raises(lambda v: jaxcoll.all_to_all(v, "local", 0, 2), "concat_axis=2")
  raises(lambda v: jaxcoll.all_to_all(v, "local", 0, 0, tiled=True), "divisible",
         np.zeros((8, 6), np.float32))
  raises(lambda v: jaxcoll.all_to_all(v, "local", 0, 0, tiled=True, algorithm="ring"),
         "algorithm=.ring.")
  raises(lambda v: jaxcoll.shift(v, "local", 1.5), "offset=1.5")
  raises(lambda v: jaxcoll.all_reduce(v, "local", algorithm=3), "algorithm=3")
