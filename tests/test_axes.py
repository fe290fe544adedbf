"""jaxcoll._src.axes: axis names inside shard_map, their sizes, and ppermute over a tuple.

The module's claim: over a tuple of axes ranks are numbered as ``lax.axis_index(axes)``
numbers them (row-major in the order given), and :func:`axes.ppermute_args` turns a
permutation in that numbering into arguments that ``lax.ppermute`` reads the same way on
every supported jax (the tuple in mesh order, every pair renumbered). Checked by running
``lax.ppermute`` on the devices: every device must receive from the device the permutation
names, found from the devices' mesh coordinates in NumPy.
"""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcoll._src import axes as axes_lib

pytestmark = pytest.mark.quick

# (mesh shape, mesh axis names, the axis_name tuple)
MESHES = [
    ((8,), ("x",), ("x",)),
    ((2, 4), ("node", "local"), ("node", "local")),
    ((2, 4), ("node", "local"), ("local", "node")),
    ((2, 4), ("node", "local"), ("local",)),
    ((4, 2), ("a", "b"), ("b", "a")),
    ((2, 3), ("a", "b"), ("b", "a")),
    ((2, 2, 2), ("x", "y", "z"), ("z", "y")),
    ((2, 2, 2), ("x", "y", "z"), ("z", "x", "y")),
    ((2, 2, 2), ("x", "y", "z"), ("y", "x")),
    ((2, 2, 2), ("x", "y", "z"), ("x", "z")),
    ((2, 2, 2), ("x", "y", "z"), ("y", "z", "x")),
]


def make_mesh(shape, names) -> Mesh:
  return Mesh(np.array(jax.devices()[:math.prod(shape)]).reshape(shape), names)


def run(mesh: Mesh, body, x: np.ndarray):
  """``body`` on every device (one leading row of x and of the result per device)."""
  spec = P(mesh.axis_names)
  f = jax.jit(jax.shard_map(
      lambda v: jax.tree.map(lambda o: o[None], body(v[0])),
      mesh=mesh, in_specs=spec, out_specs=spec))
  return jax.tree.map(np.asarray, f(jax.device_put(x, NamedSharding(mesh, spec))))


def trace(mesh: Mesh, body, **kw):
  """Traces ``body`` inside shard_map over ``mesh`` (nothing runs)."""
  jax.make_jaxpr(jax.shard_map(lambda v: body() or v, mesh=mesh, in_specs=P(), out_specs=P(),
                               **kw))(np.zeros(1, np.float32))


def index_in(coords: np.ndarray, names, axes, shape) -> np.ndarray:
  """Each device's rank over ``axes``, row-major in the order given (NumPy)."""
  sizes = dict(zip(names, shape))
  return np.ravel_multi_index([coords[:, names.index(a)] for a in axes],
                              [sizes[a] for a in axes])


def permutations(n: int, rng: np.random.Generator) -> list[list[tuple[int, int]]]:
  """Cyclic shifts, a reversal, random bijections and partial maps on n ranks."""
  perms = [[(i, (i + 1) % n) for i in range(n)], [(i, (i - 1) % n) for i in range(n)],
           [(i, n - 1 - i) for i in range(n)], [(0, n - 1)], [(n - 1, 0), (0, n - 1)]]
  for _ in range(3):
    perms.append(list(enumerate(rng.permutation(n).tolist())))
  some = rng.choice(n, size=max(1, n // 2), replace=False)
  perms.append(list(zip(some.tolist(), rng.permutation(some).tolist())))
  return [sorted(set(p)) for p in perms]


@pytest.mark.parametrize("shape,names,axes", MESHES, ids=str)
def test_ppermute_args_moves_data_as_the_axis_index_numbering_says(shape, names, axes):
  mesh = make_mesh(shape, names)
  n = math.prod(dict(zip(names, shape))[a] for a in axes)
  perms = permutations(n, np.random.default_rng(n + len(axes)))

  def body(v):
    out = {"me": lax.axis_index(axes)}
    for i, perm in enumerate(perms):
      name, pairs = axes_lib.ppermute_args(axes, perm)
      out[f"perm{i}"] = lax.ppermute(v, name, pairs)
    return out

  devices = mesh.size
  got = run(mesh, body, np.arange(1, devices + 1, dtype=np.int32).reshape(devices, 1))
  coords = np.stack(np.unravel_index(np.arange(devices), shape), 1)   # device -> coordinates
  rank = index_in(coords, names, axes, shape)
  np.testing.assert_array_equal(got["me"].reshape(-1), rank)   # axis_index's numbering
  others = [i for i, a in enumerate(names) if a not in axes]
  for i, perm in enumerate(perms):
    received = got[f"perm{i}"][:, 0]
    for dev in range(devices):
      senders = [s for s, d in perm if d == rank[dev]]
      if not senders:
        assert received[dev] == 0, (perm, dev)   # ppermute zero-fills ranks nobody sends to
        continue
      src = [d for d in range(devices) if rank[d] == senders[0]
             and (coords[d, others] == coords[dev, others]).all()]   # same group
      assert received[dev] == src[0] + 1, (perm, dev)


@pytest.mark.parametrize("shape,names,axes", MESHES, ids=str)
def test_ppermute_args_gives_the_tuple_in_mesh_order(shape, names, axes):
  mesh = make_mesh(shape, names)
  n = math.prod(dict(zip(names, shape))[a] for a in axes)
  perm = np.array([(i, (i + 1) % n) for i in range(n)], np.int64)
  seen = []
  trace(mesh, lambda: seen.append(axes_lib.ppermute_args(axes, perm)))
  (name, pairs), = seen
  assert name == tuple(sorted(axes, key=names.index))
  assert all(type(v) is int for pair in pairs for v in pair)
  assert sorted(s for s, _ in pairs) == list(range(n))      # still a permutation of the ranks
  assert sorted(d for _, d in pairs) == list(range(n))
  if list(axes) == sorted(axes, key=names.index):           # numberings agree: pairs unchanged
    assert pairs == tuple((i, (i + 1) % n) for i in range(n))


def test_ppermute_args_single_axis_and_empty_permutation_pass_through():
  mesh = make_mesh((2, 4), ("node", "local"))
  seen = []

  def body():
    seen.append(axes_lib.ppermute_args(("local",), [(np.int32(3), np.int64(0))]))
    seen.append(axes_lib.ppermute_args(("local", "node"), []))

  trace(mesh, body)
  assert seen == [(("local",), ((3, 0),)), (("node", "local"), ())]


@pytest.mark.parametrize("given,want", [
    ("y", ("y",)), (("z",), ("z",)), (["z", "x"], ("z", "x")), (("x", "y", "z"), ("x", "y", "z")),
    (("y", "x", "z"), ("y", "x", "z"))])
def test_normalize_gives_a_tuple_in_the_order_given_and_sizes_follow_it(given, want):
  mesh = make_mesh((2, 1, 4), ("x", "y", "z"))
  mesh_sizes = {"x": 2, "y": 1, "z": 4}
  seen = []

  def body():
    got = axes_lib.normalize(given)
    seen.append((got, axes_lib.sizes(got), axes_lib.size(got),
                 tuple(lax.axis_size(a) for a in got)))

  trace(mesh, body)
  (got, sizes, size, lax_sizes), = seen
  assert got == want
  assert sizes == lax_sizes == tuple(mesh_sizes[a] for a in want)
  assert size == math.prod(mesh_sizes[a] for a in want)


@pytest.mark.parametrize("axis_name,match", [
    ((), "at least one mesh axis"),
    ([], "at least one mesh axis"),
    (("x", "x"), r"axis_name=\('x', 'x'\) repeats an axis"),
    (["y", "x", "y"], "repeats an axis"),
    ("w", r"axis_name='w' is not an axis of the enclosing shard_map; "
          r"bound axes: \('x', 'y'\)"),
    (("x", "w"), "axis_name='w' is not an axis"),
])
def test_normalize_errors_name_the_argument(axis_name, match):
  mesh = make_mesh((2, 4), ("x", "y"))
  with pytest.raises(ValueError, match=match):
    trace(mesh, lambda: axes_lib.normalize(axis_name))


def test_normalize_outside_shard_map_says_no_axis_is_bound():
  with pytest.raises(ValueError, match="axis_name='x'.*inside jax.shard_map.*no shard_map"):
    axes_lib.normalize("x")


def test_normalize_lists_only_the_manual_axes_of_a_partial_shard_map():
  """A shard_map manual over "b" only: "a" is a mesh axis but not bound inside it."""
  mesh = make_mesh((2, 4), ("a", "b"))
  seen = []
  trace(mesh, lambda: seen.append(axes_lib.normalize("b")), axis_names={"b"})
  assert seen == [("b",)]
  with pytest.raises(ValueError, match=r"axis_name='a' is not an axis.*bound axes: \('b',\)"):
    trace(mesh, lambda: axes_lib.normalize(("b", "a")), axis_names={"b"})
