"""``jaxcoll.use(f)`` keeps what ``jax.jit(f)`` promises, for the programs of JAX's own
documentation: the same values, dtypes, weak types and output shardings (type, mesh, spec
with its unreduced and reduced sets), and where jit refuses a program, use refuses it with
jax's error type.

Programs, copied from jax-ml/jax (names in ``CASES`` say which):

- ``docs/jit-compilation.md`` (Python values, static arguments, what jit refuses);
- the distributed-arrays notebook (``docs/notebooks/Distributed_arrays_and_automatic_
  parallelization.md`` before a900877d84e0: computations on sharded arrays, arrays on two
  meshes refused, ``with_sharding_constraint``);
- ``docs/new_docs/201/sharding.md`` (explicit sharding: types, ``reshard``, ``out_sharding``,
  ``auto_axes``/``explicit_axes``, shard_map on an Explicit mesh);
- ``docs/new_docs/301/sharding-ad.md`` (``unreduced`` and ``reduced``: an einsum left
  unreduced, cashed in by ``reshard``; reduced weights whose gradients are unreduced; a
  gradient accumulator kept unreduced across a scan; shard_map with unreduced and reduced
  specs);
- ``jax.jit``'s documented arguments: Python and NumPy scalars, ``None`` leaves, keyword,
  static and donated arguments, declared ``in_shardings``/``out_shardings`` (NamedSharding
  or a bare PartitionSpec under a mesh, with and without arguments), ``pjit`` under the
  older ``with Mesh`` context.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pjit import pjit
from jax.sharding import AxisType, Mesh, NamedSharding, auto_axes, explicit_axes
from jax.sharding import PartitionSpec as P

import jaxcoll

pytestmark = pytest.mark.quick   # also on the oldest supported jax (.ci/run)


def _mesh(shape, names, explicit=True):
  types = (AxisType.Explicit if explicit else AxisType.Auto,) * len(shape)
  return jax.make_mesh(shape, names, axis_types=types)


def _shards(x) -> list:
  """An array's data: per device where it is unreduced (a sum not taken), else whole (a
  PRNG key array's: its key data)."""
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  if getattr(x, "sharding", None) is not None and getattr(x.sharding, "spec", P()).unreduced:
    return [np.asarray(s.data) for s in sorted(x.addressable_shards, key=lambda s: s.device.id)]
  return [np.asarray(x)]


def assert_like_jit(f, args, ctx=contextlib.nullcontext, kwargs=None, jit_raises=False):
  """``use(f)`` against ``f`` (jitted): values within float32 reduction-order tolerance (the
  programs sum at most 16 terms of magnitude <= 100), dtypes, weak types, shardings. Where
  ``f`` raises (as ``jit_raises`` says it must; None: either), ``use(f)`` raises the same
  type. ``args``: a function giving fresh arguments (donation deletes them)."""
  kwargs = kwargs or {}
  try:
    with ctx():
      want = f(*args(), **kwargs)
  except Exception as e:   # noqa: BLE001 - whatever jit raises, use raises alike
    assert jit_raises is not False, f"the program fails under jit itself: {e!r}"
    with pytest.raises(type(e)), ctx():
      jaxcoll.use(f)(*args(), **kwargs)
    return
  assert jit_raises is not True, "the program was expected to fail under jit"
  with ctx():
    got = jaxcoll.use(f)(*args(), **kwargs)
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert (jnp.shape(g), jnp.result_type(g)) == (jnp.shape(w), jnp.result_type(w))
    assert jax.typeof(g).weak_type == jax.typeof(w).weak_type
    assert type(g.sharding) is type(w.sharding), (g.sharding, w.sharding)
    assert g.sharding.is_equivalent_to(w.sharding, jnp.ndim(w)), (g.sharding, w.sharding)
    if isinstance(w.sharding, NamedSharding):
      assert g.sharding.spec.unreduced == w.sharding.spec.unreduced
      assert g.sharding.spec.reduced == w.sharding.spec.reduced
    for a, b in zip(_shards(g), _shards(w), strict=True):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=16 * 100 * np.finfo(np.float32).eps)


# ---- jit's arguments ----

def _row_mesh():
  return _mesh((8,), ("x",), explicit=False)


def _rows(mesh, n=16):
  return jax.device_put(jnp.arange(n * 4.).reshape(n, 4), NamedSharding(mesh, P("x")))


def jit_arguments(name):
  mesh = _row_mesh()
  rows = lambda: _rows(mesh)   # noqa: E731
  w = jax.device_put(jnp.ones((4,)), NamedSharding(mesh, P()))

  @jax.jit
  def step(w, x, lr):
    return w - lr * jax.grad(lambda w: jnp.mean((x @ w) ** 2))(w)

  pjit_mesh = Mesh(np.array(jax.devices()[:2]), ("x",))
  explicit_mesh = _mesh((8,), ("x",))
  return {
      "python_int": (jax.jit(lambda x: x + 2), lambda: (1,)),
      "python_float": (jax.jit(lambda x: x * 2), lambda: (1.5,)),
      "numpy_scalar": (jax.jit(lambda x: x + 2), lambda: (np.float32(1),)),
      "python_float_learning_rate": (step, lambda: (w, rows(), 0.1)),
      "constant_output": (jax.jit(lambda x: jnp.array(1)), lambda: (rows(),)),
      "scatter_of_literal": (jax.jit(lambda x: x.at[:, jnp.array([0, 2])].add(5.0)),
                             lambda: (rows(),)),
      "truncated_normal_bounds": (
          jax.jit(lambda k, x: x + jax.random.truncated_normal(k, -1., 2., x.shape)),
          lambda: (jax.random.key(0), rows())),
      "none_leaf": (jax.jit(lambda d: d["a"] * 2), lambda: ({"a": rows(), "b": None},)),
      "static_argnums": (jax.jit(lambda x, n: x * n, static_argnums=1), lambda: (rows(), 3)),
      "donate_argnums": (jax.jit(lambda x: x * 2, donate_argnums=0), lambda: (rows(),)),
      "out_shardings_no_arguments": (
          jax.jit(lambda: jnp.zeros((8, 4)), out_shardings=NamedSharding(mesh, P("x"))),
          lambda: ()),
      "in_and_out_shardings": (
          jax.jit(lambda x: x * 2, in_shardings=NamedSharding(mesh, P("x")),
                  out_shardings=NamedSharding(mesh, P())), lambda: (jnp.ones((16, 4)),)),
      "pjit_under_with_mesh": (
          pjit(lambda x: x, in_shardings=P("x"), out_shardings=P("x")),
          lambda: (jnp.arange(8.),), lambda: pjit_mesh),
      "partition_spec_under_set_mesh": (
          jax.jit(lambda: jnp.zeros((8, 4)), out_shardings=P("x")), lambda: (),
          lambda: jax.set_mesh(mesh)),
      **{f"out_shardings_in_{kind}_memory": (
          jax.jit(lambda x: (x * 2, x.T), out_shardings=(
              NamedSharding(mesh, P("x"), memory_kind=kind), None)), lambda: (rows(),))
         for kind in ("pinned_host", "unpinned_host")},
      **{f"out_shardings_no_arguments_in_{kind}_memory": (
          jax.jit(lambda: jnp.ones((8, 4)), out_shardings=NamedSharding(mesh, P("x"),
                                                                       memory_kind=kind)),
          lambda: ()) for kind in ("pinned_host", "unpinned_host")},
      "in_shardings_partition_spec_under_set_mesh": (
          jax.jit(lambda w, x: jax.grad(lambda w: ((x @ w) ** 2).mean())(w),
                  in_shardings=(P(), P("x"))),
          lambda: (np.ones(4, np.float32), np.arange(64, dtype=np.float32).reshape(16, 4)),
          lambda: jax.set_mesh(mesh)),
      "in_shardings_partition_spec_explicit_mesh": (
          jax.jit(lambda x: x.sum(0), in_shardings=P("x")),
          lambda: (np.ones((16, 4), np.float32),),
          lambda: jax.set_mesh(explicit_mesh)),
      "out_shardings_partition_spec_explicit_mesh": (
          jax.jit(lambda x: x * 2, out_shardings=P("x")),
          lambda: (np.ones((16, 4), np.float32),),
          lambda: jax.set_mesh(explicit_mesh)),
      "auto_reductions_and_transposes": (
          jax.jit(lambda x: (x.sum(0), x.sum(1), x.T, x.reshape(8, 8))), lambda: (rows(),)),
  }[name]


# ---- docs/notebooks/Distributed_arrays_and_automatic_parallelization.md (removed in
# a900877d84e0; its programs on 64 x 64 arrays, its meshes Auto as they were then) ----

def distributed_arrays(name):
  x = jax.random.normal(jax.random.key(0), (64, 64))
  mesh = _mesh((4, 2), ("a", "b"), explicit=False)
  xy = jax.device_put(x, NamedSharding(mesh, P("a", "b")))
  y = jax.device_put(x, NamedSharding(mesh, P("a", None)))
  z = jax.device_put(x, NamedSharding(mesh, P(None, "b")))
  devices = jax.devices()
  permuted_devices = [devices[i] for i in [0, 1, 2, 3, 6, 7, 4, 5]]
  sharding1 = NamedSharding(Mesh(devices, "x"), P("x"))
  sharding2 = NamedSharding(Mesh(permuted_devices, "x"), P("x"))
  halves = (NamedSharding(Mesh(devices[:4], "x"), P("x")),
            NamedSharding(Mesh(devices[4:], "x"), P("x")))
  mesh_xy = _mesh((4, 2), ("x", "y"), explicit=False)
  x_xy = jax.device_put(x, NamedSharding(mesh_xy, P("x", "y")))

  def f_transposed(x):
    x = x + 1
    y = jax.lax.with_sharding_constraint(x, NamedSharding(mesh_xy, P("y", "x")))
    return y

  def f_replicated(x):
    x = x + 1
    y = jax.lax.with_sharding_constraint(x, NamedSharding(mesh_xy, P()))
    return y

  return {
      "sin": (jax.jit(jnp.sin), lambda: (xy,)),
      "dot": (jax.jit(jnp.dot), lambda: (y, z)),
      "copy": (jax.jit(jnp.copy), lambda: (jnp.dot(y, z),)),
      "add_ones_like": (jax.jit(lambda y: y + jnp.ones_like(y)),
                        lambda: (jax.device_put(x, sharding1),)),
      "add_arange": (jax.jit(lambda y: y + jnp.arange(y.size).reshape(y.shape)),
                     lambda: (jax.device_put(x, sharding1),)),
      "devices_of_two_meshes_refused": (jax.jit(lambda y, z: y + z),
                                        lambda: tuple(jax.device_put(x, s) for s in halves)),
      "permuted_devices_refused": (
          jax.jit(lambda y, z: y + z),
          lambda: (jax.device_put(x, sharding1), jax.device_put(x, sharding2))),
      "sharding_constraint_transposed": (jax.jit(f_transposed), lambda: (x_xy,)),
      "sharding_constraint_replicated": (jax.jit(f_replicated), lambda: (x_xy,)),
  }[name]


# ---- docs/jit-compilation.md ----

def jit_compilation(name):
  mesh = _row_mesh()

  def selu(x, alpha=1.67, lambda_=1.05):
    return lambda_ * jnp.where(x > 0, x, alpha * jnp.exp(x) - alpha)

  def f(x):
    if x > 0:
      return x
    else:
      return 2 * x

  def g(x, n):
    i = 0
    while i < n:
      i += 1
    return x + i

  x = jax.device_put(jnp.arange(1024.) - 512, NamedSharding(mesh, P("x")))
  return {
      "selu": (jax.jit(selu), lambda: (x,)),
      "selu_unsharded": (jax.jit(selu), lambda: (jnp.arange(1000),)),
      "value_condition_refused": (jax.jit(f), lambda: (10,)),
      "loop_on_value_refused": (jax.jit(g), lambda: (10, 20)),
      "static_argnums": (jax.jit(f, static_argnums=0), lambda: (10,)),
      "static_argnames": (jax.jit(g, static_argnames=["n"]), lambda: (10, 20)),
      "static_argnames_sharded": (jax.jit(g, static_argnames=["n"]), lambda: (x, 20)),
  }[name]


# ---- docs/new_docs/201/sharding.md ----

def sharding_201(name):
  mesh = _mesh((4, 2), ("X", "Y"))
  auto = _mesh((4, 2), ("X", "Y"), explicit=False)
  on, on_auto = (lambda: jax.set_mesh(mesh)), (lambda: jax.set_mesh(auto))
  with jax.set_mesh(mesh):
    x = jax.device_put(jnp.arange(8 * 4.).reshape(8, 4), jax.P("X", "Y"))
    arg0 = jax.device_put(np.arange(4).reshape(4, 1), jax.P("X", None))
    arg1 = jax.device_put(np.arange(8).reshape(1, 8), jax.P(None, "Y"))
    xr = jax.random.normal(jax.random.key(0), (8, 4), out_sharding=jax.P("X", "Y"))
    x2 = jax.device_put(jnp.arange(8 * 4.).reshape(8, 4), jax.P(None, "X"))
    y2 = jax.device_put(jnp.arange(4 * 16.).reshape(4, 16), jax.P("X", None))
    xa = jax.device_put(np.arange(16.).reshape(4, 4), jax.P("X", None))
    ya = jax.device_put(np.arange(16.).reshape(4, 4), jax.P(None, "X"))
    my_array = jnp.sin(jax.device_put(np.arange(8.), jax.P("X")))

    @jax.shard_map(out_specs=jax.P("X", None))
    def matmul(x_shard, y_shard):
      z_summand = jnp.dot(x_shard, y_shard)
      return jax.lax.psum_scatter(z_summand, "X", tiled=True)
  with jax.set_mesh(auto):
    x3 = jax.device_put(jnp.arange(8 * 4.).reshape(8, 4), jax.P(None, "X"))
    y3 = jax.device_put(jnp.arange(4 * 16.).reshape(4, 16), jax.P("X", None))
    x4 = jax.device_put(np.arange(16.).reshape(4, 4), jax.P("X", "Y"))

  @auto_axes
  def add2(x, y):
    return x + y

  def f33(x, y):
    z = jnp.dot(x, y)
    z = jax.lax.with_sharding_constraint(z, jax.P("X", None))
    return z

  @explicit_axes
  def explicit_g(y):
    z = y * 2
    return z

  def f34(arr1):
    x = jnp.sin(arr1)
    z = explicit_g(x, in_sharding=jax.P("X", "Y"))
    return z + 1

  @auto_axes
  def check_in_auto_context(x):
    return x

  return {
      "sin_transpose": (jax.jit(lambda x: jnp.sin(x).T), lambda: (x,), on),
      "broadcast_add": (jax.jit(lambda x, y: x + y), lambda: (arg0, arg1), on),
      "sum_over_split": (jax.jit(lambda x: x.sum(0)), lambda: (xr,), on),
      "random_out_sharding": (
          jax.jit(lambda k: jax.random.normal(k, (8, 4), out_sharding=jax.P("X", "Y"))),
          lambda: (jax.random.key(0),), on),
      "dot_without_out_sharding_refused": (jax.jit(jnp.dot), lambda: (x2, y2), on),
      "dot_out_sharding": (jax.jit(lambda x, y: jnp.dot(x, y, out_sharding=jax.P("X", None))),
                           lambda: (x2, y2), on),
      "add_of_conflicting_splits_refused": (jax.jit(lambda x, y: x + y), lambda: (xa, ya), on),
      "auto_axes": (jax.jit(lambda x, y: add2(x, y, out_sharding=jax.P("X", None))),
                    lambda: (xa, ya), on),
      "auto_mesh_with_sharding_constraint": (jax.jit(f33), lambda: (x3, y3), on_auto),
      "explicit_axes_in_auto_program": (jax.jit(f34), lambda: (x4,), on_auto),
      "auto_axes_context": (
          jax.jit(lambda x: check_in_auto_context(x, out_sharding=jax.P("X"))),
          lambda: (my_array,), on),
      "shard_map_on_explicit_mesh": (matmul, lambda: (x2, y2), on),
      "shard_map_on_explicit_mesh_jitted": (jax.jit(matmul), lambda: (x2, y2), on),
  }[name]


# ---- docs/new_docs/301/sharding-ad.md ----

def sharding_ad_301(name):
  mesh = _mesh((2,), ("X",))
  on = lambda: jax.set_mesh(mesh)   # noqa: E731
  with jax.set_mesh(mesh):
    x = jax.device_put(jnp.arange(8 * 4.).reshape(8, 4), jax.P("X", None))
    w = jax.device_put(jnp.arange(4 * 2.).reshape(4, 2) / 10., jax.P(None, None))
    a = jax.device_put(jnp.arange(4.).reshape(2, 2), jax.P(None, "X"))
    b = jax.device_put(jnp.arange(4., 8.).reshape(2, 2), jax.P("X", None))
    x1 = jax.device_put(jnp.ones((8, 4)), jax.P("X", None))
    x2 = jax.device_put(jnp.ones((8, 4)), jax.P("X", None))
    stacked_ws = jax.device_put(jnp.stack([jnp.eye(4) / 2] * 3), jax.P(reduced={"X"}))
    xs = jax.device_put(jnp.ones((5, 2, 4)), jax.P(None, "X", None))
    ws_replicated = jax.reshard(stacked_ws, jax.P())
    w_r = jax.reshard(w, jax.P(None, None, reduced={"X"}))

    @jax.shard_map(in_specs=(jax.P(None, "X"), jax.P("X", None)),
                   out_specs=jax.P(None, None, unreduced={"X"}))
    def matmul_partial(a, b):
      out = a @ b   # a local matmul of this device's pieces: a partial sum
      return jax.lax.pcast(out, "X", to="unreduced")

    @jax.shard_map(in_specs=(jax.P("X", None), jax.P(None, None, reduced={"X"})),
                   out_specs=jax.P("X", None))
    def apply_layer(x, w):
      return jnp.tanh(x @ w)

  def loss(w, x):
    return jnp.sum((x @ w) ** 2)

  def unreduced(a, b):
    return jnp.einsum("ij,jk->ik", a, b, out_sharding=jax.P(None, None, unreduced={"X"}))

  def c_plus_c2(a, b):
    c = unreduced(a, b)
    c2 = jnp.einsum("ij,jk->ik", 2. * a, b, out_sharding=jax.P(None, None, unreduced={"X"}))
    return jax.reshard(c + c2, jax.P(None, None))

  def loss2(w, x):
    w = jax.reshard(w, jax.P(None, None, reduced={"X"}))
    return jnp.sum((x @ w) ** 2)

  def loss_fanout(w, x1, x2):
    w = jax.reshard(w, jax.P(None, None, reduced={"X"}))
    return jnp.sum(x1 @ w) + jnp.sum(x2 @ w)

  def predict(stacked_ws, xs):  # stacked_ws: [layer, features, features]
    def apply_layer(xs, w):
      return jnp.tanh(xs @ w), None
    final_xs, _ = jax.lax.scan(apply_layer, xs, stacked_ws)
    return final_xs

  def loss3(stacked_ws, batch):
    return jnp.sum(predict(stacked_ws, batch) ** 2)

  @jax.jit
  def step(stacked_ws, xs):  # xs: [microbatch, batch@X, features]
    def microbatch_step(grad_acc, xs_mb):
      grads = jax.grad(loss3)(stacked_ws, xs_mb)
      # ws are reduced, so grads are unreduced -- and we can check it!
      assert jax.typeof(grads).sharding.spec.unreduced == {"X"}
      return grad_acc + grads, None

    grad_acc = jax.reshard(jnp.zeros_like(stacked_ws), jax.P(unreduced={"X"}))
    grad_acc, _ = jax.lax.scan(microbatch_step, grad_acc, xs)
    grads = jax.reshard(grad_acc, jax.P())        # the one AllReduce
    ws = jax.reshard(stacked_ws, jax.P())         # free: full copies already
    return ws - 0.01 * grads

  @jax.jit
  def step_replicated(stacked_ws, xs):
    def microbatch_step(grad_acc, xs_mb):
      grads = jax.grad(loss3)(stacked_ws, xs_mb)  # replicated: AllReduce inside!
      return grad_acc + grads, None
    grad_acc = jnp.zeros_like(stacked_ws)
    grad_acc, _ = jax.lax.scan(microbatch_step, grad_acc, xs)
    return stacked_ws - 0.01 * grad_acc

  def matmul_loss(a, b):
    return jnp.sum(jax.reshard(matmul_partial(a, b), jax.P(None, None)))

  layer_loss = lambda w, x: jnp.sum(apply_layer(x, w) ** 2)   # noqa: E731
  return {
      "gradients": (jax.jit(jax.grad(loss, argnums=(0, 1))), lambda: (w, x), on),
      "matmul_of_conflicting_splits_refused": (jax.jit(lambda a, b: a @ b),
                                               lambda: (a, b), on),
      "einsum_replicated_out": (
          jax.jit(lambda a, b: jnp.einsum("ij,jk->ik", a, b, out_sharding=jax.P(None, None))),
          lambda: (a, b), on),
      "einsum_unreduced_out": (jax.jit(unreduced), lambda: (a, b), on),
      "unreduced_reshard": (jax.jit(lambda a, b: jax.reshard(unreduced(a, b), jax.P(None, None))),
                            lambda: (a, b), on),
      "add_of_unreduced": (jax.jit(c_plus_c2), lambda: (a, b), on),
      "cos_of_unreduced_refused": (jax.jit(lambda a, b: jnp.cos(unreduced(a, b))),
                                   lambda: (a, b), on),
      "reshard_to_reduced": (jax.jit(lambda w: jax.reshard(w, jax.P(None, None,
                                                                    reduced={"X"}))),
                             lambda: (w,), on),
      "reduced_weight_gradient": (jax.jit(jax.grad(loss2)), lambda: (w, x), on),
      "reduced_fanout_gradient": (jax.jit(jax.grad(loss_fanout)), lambda: (w, x1, x2), on),
      "unreduced_accumulator_scan": (step, lambda: (stacked_ws, xs), on),
      "replicated_accumulator_scan": (step_replicated, lambda: (ws_replicated, xs), on),
      "shard_map_unreduced_out": (matmul_partial, lambda: (a, b), on),
      "shard_map_unreduced_out_jitted": (jax.jit(matmul_partial), lambda: (a, b), on),
      "shard_map_unreduced_gradient": (jax.jit(jax.grad(matmul_loss, argnums=(0, 1))),
                                       lambda: (a, b), on),
      "shard_map_reduced_in_gradient": (jax.grad(layer_loss), lambda: (w_r, x), on),
      "shard_map_reduced_in_gradient_jitted": (jax.jit(jax.grad(layer_loss)),
                                               lambda: (w_r, x), on),
  }[name]


# ---- beyond the docs: mixed Manual + Explicit, what jax rejects of unreduced values ----

def explicit_more(name):
  mesh = _mesh((2, 4), ("x", "y"))
  on = lambda: jax.set_mesh(mesh)   # noqa: E731
  with jax.set_mesh(mesh):
    a = jax.device_put(jnp.arange(128.).reshape(16, 8) / 10, P("x", "y"))
    b = jax.device_put(jnp.arange(64.).reshape(8, 8) / 10, P("y", None))
    w = jax.device_put(jnp.arange(16.).reshape(2, 8), P(None, None))

  def manual_over_x(a):   # a shard_map over x inside a program whose y stays Explicit
    def body(a):
      whole = jax.sharding.reshard(a, P(None, None))
      return jnp.where(whole < 3., whole, 0.)
    return jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"),
                         axis_names={"x"})(a)

  def reduced_plus_unreduced(a, b, w):
    c = jnp.einsum("xy,yz->xz", a, b, out_sharding=P("x", None, unreduced={"y"}))
    return c[:2] + jax.reshard(w, P(None, None, reduced={"y"}))

  with jax.set_mesh(mesh):
    table = jax.device_put(jnp.arange(64.).reshape(16, 4), P(None, "y"))
    ids = jax.device_put(jnp.array([1, 5, 9, 3, 0, 2, 4, 6]), P("x"))
    rows = jax.device_put(jnp.array([0, 3, 5, 9]), P(None))

  return {
      "reshape_out_sharding": (   # it was gathered over y: 4x the memory per device
          jax.jit(lambda a: jnp.reshape(a, (16, 2, 4), out_sharding=P("x", None, "y"))),
          lambda: (a,), on),
      "closed_over_table_gather": (   # a laid-out constant of a nested jit: an input
          jax.jit(lambda i: table.at[i].get(out_sharding=P("x", "y"))), lambda: (ids,), on),
      "gather_out_sharding": (jax.jit(lambda t, i: t.at[i].get(out_sharding=P("x", None))),
                              lambda: (table, ids), on),
      "scatter_out_sharding": (
          jax.jit(lambda a, i: a.at[i].set(1.0, out_sharding=P("x", "y"))),
          lambda: (a, rows), on),
      "shard_map_over_some_axes": (jax.jit(manual_over_x), lambda: (a,), on),
      "add_of_reduced_and_unreduced_refused": (jax.jit(reduced_plus_unreduced),
                                               lambda: (a, b, w), on),
  }[name]


def jax_tests(name):
  """Programs of JAX's own tests (``tests/shard_map_test.py``, ``tests/pjit_test.py`` in
  jax-ml/jax; the test each comes from beside it), copied but for the harness: typed
  unreduced and reduced inputs to a shard_map, PRNG key arrays through layout changes,
  meshes of other axis types, arrays committed to devices a program does not span."""
  auto = lambda shape, names, devices=None: jax.make_mesh(   # noqa: E731
      shape, names, axis_types=(AxisType.Auto,) * len(shape), devices=devices)
  x2 = _mesh((2,), ("x",))
  on_x2 = lambda: jax.set_mesh(x2)   # noqa: E731

  def on(mesh, make):   # arguments made under the mesh (Explicit types)
    def args():
      with jax.set_mesh(mesh):
        return make()
    return args

  # shard_map_test.py test_eager_unreduced_in / test_eager_reduced_in
  unreduced_in = jax.shard_map(lambda x: jax.lax.psum_scatter(x, "x", tiled=True),
                               out_specs=P("x"))
  reduced_in = jax.shard_map(lambda x: jax.lax.pcast(x, "x", to="varying"), out_specs=P("x"))
  unreduced_args = on(x2, lambda: (jax.reshard(jnp.arange(8.), P(unreduced={"x"})),))
  reduced_args = on(x2, lambda: (jax.device_put(np.arange(8.), P(reduced={"x"})),))

  def scan_with_random_key_inside_jit(xs):   # pjit_test.py, same name
    def step(carry, x):
      next_carry = jax.vmap(jax.random.fold_in)(carry, x)
      next_carry = jnp.where(x % 2 == 0, carry, next_carry)
      return next_carry, None
    rng = jnp.broadcast_to(jax.random.key(0), xs.shape[1:])
    rng, _ = jax.lax.scan(step, rng, xs)
    return rng

  keys8 = jax.random.split(jax.random.key(0), 8)
  i4j2 = auto((4, 2), ("i", "j"))
  x2y2 = _mesh((2, 2), ("x", "y"))
  x2y2_auto = auto((2, 2), ("x", "y"))

  def full_user_to_full_auto(x):   # pjit_test.py, same name
    y = x * 2
    with jax.sharding.use_abstract_mesh(x2y2.abstract_mesh.update_axis_types(
        {"x": AxisType.Auto, "y": AxisType.Auto})):
      y = jax.sharding.reshard(y, P(None, None))
      z = jnp.sin(y)
      a = z @ z.T
    return jax.sharding.reshard(a, P("x", None))

  def full_auto_to_full_user(x):   # pjit_test.py, same name
    y = x * 2
    with jax.sharding.use_abstract_mesh(x2y2_auto.abstract_mesh.update_axis_types(
        {"x": AxisType.Explicit, "y": AxisType.Explicit})):
      y = jax.sharding.reshard(y, P(None, "y"))
      z = jnp.sin(y)
    return jax.sharding.reshard(z, P(None, None))

  x2y4 = _mesh((2, 4), ("x", "y"))
  with jax.set_mesh(x2y4):
    y_split = jax.device_put(jnp.arange(8.), P("y"))

  def closes_over_an_explicit_value(a):   # jit: reduce_sum under a Manual+Explicit mesh
    return jax.shard_map(lambda a: a * y_split.sum(), mesh=x2y4, in_specs=P("x"),
                         out_specs=P("x"), axis_names={"x"})(a)

  rows8 = auto((8,), ("x",))
  on_devices_2_3 = auto((2,), ("x",), devices=jax.devices()[2:4])
  first4 = auto((4,), ("x",), devices=jax.devices()[:4])
  batch = jax.sharding.Mesh(jax.devices(), axis_names=["batch"])
  committed = lambda i: jax.device_put(np.array([1, 2, 3]), jax.devices()[i])  # noqa: E731
  return {
      "eager_unreduced_in": (unreduced_in, unreduced_args, on_x2),
      "eager_unreduced_in_grad": (jax.grad(lambda x: unreduced_in(x).sum()), unreduced_args,
                                  on_x2),
      "eager_reduced_in": (reduced_in, reduced_args, on_x2),
      "eager_reduced_in_grad": (jax.grad(lambda x: reduced_in(x).sum()), reduced_args, on_x2),
      # shard_map_test.py test_random_normal_rules, test_partial_auto_of_random_keys
      "random_normal_rules": (
          jax.shard_map(lambda k: jax.random.normal(k[0], (1,)), mesh=auto((4,), ("i",)),
                        in_specs=P("i"), out_specs=P("i")),
          lambda: (jax.random.split(jax.random.key(0), 4),)),
      "partial_auto_of_random_keys": (
          jax.jit(lambda x: jax.shard_map(lambda k: k, mesh=i4j2, in_specs=P("i"),
                                          out_specs=P("i"), check_vma=False,
                                          axis_names=frozenset({"i"}))(keys8)),
          lambda: (keys8,)),
      # pjit_test.py test_prng_key_wsc, test_where_with_prng_sharded_inp
      "prng_key_wsc": (jax.jit(lambda x: jax.lax.with_sharding_constraint(
          x, NamedSharding(auto((2,), ("x",)), P())).T), lambda: (jax.random.key(0),)),
      "where_with_prng_sharded_inp": (
          jax.jit(lambda c, x, y: jnp.where(c, x, y)),
          lambda: (jax.device_put(jnp.zeros([32, 1], dtype=jnp.bool),
                                  NamedSharding(batch, P("batch"))),
                   *[jax.device_put(jnp.broadcast_to(jax.random.key(i), [32, 32]),
                                    NamedSharding(batch, P("batch"))) for i in (0, 1)])),
      "scan_with_random_key_inside_jit": (
          jax.jit(scan_with_random_key_inside_jit),
          lambda: (jax.device_put(jnp.arange(8).reshape(2, 4),
                                  NamedSharding(auto((2,), ("x",)), P(None, "x"))),)),
      "switch_under_vmap_with_keys": (   # keys gathered and split under vmap
          jax.jit(jax.vmap(lambda i, k: jax.lax.switch(
              i, [lambda k: jax.random.normal(k, ()), lambda k: jax.random.uniform(k, ())],
              k))),
          lambda: (jax.device_put(jnp.arange(16) % 2, NamedSharding(rows8, P("x"))),
                   jax.device_put(jax.random.split(jax.random.key(0), 16),
                                  NamedSharding(rows8, P("x"))))),
      "full_user_to_full_auto": (jax.jit(full_user_to_full_auto), on(x2y2, lambda: (
          jax.device_put(np.arange(16.).reshape(8, 2), P("x", "y")),)),
          lambda: jax.set_mesh(x2y2)),
      "full_auto_to_full_user": (jax.jit(full_auto_to_full_user), lambda: (
          jax.device_put(np.arange(16.).reshape(8, 2), NamedSharding(x2y2_auto, P("x", "y"))),),
          lambda: jax.set_mesh(x2y2_auto)),
      "closes_over_an_explicit_value_refused": (
          jax.jit(closes_over_an_explicit_value),
          on(x2y4, lambda: (jax.device_put(jnp.arange(16.).reshape(4, 4), P("x", "y")),)),
          lambda: jax.set_mesh(x2y4)),
      # pjit_test.py test_pjit_committed_array_different_devices(_variadic_args)
      "committed_array_different_devices_refused": (
          jax.jit(lambda x, y: (x, y)), lambda: (committed(0), committed(1))),
      "committed_array_different_devices_variadic_args_refused": (
          jax.jit(lambda *x: x), lambda: (committed(0), committed(1))),
      "arrays_on_two_meshes_refused": (jax.jit(lambda a, b: a + b), lambda: (
          jax.device_put(jnp.arange(8.), NamedSharding(on_devices_2_3, P("x"))),
          jax.device_put(jnp.arange(8.), NamedSharding(rows8, P("x"))))),
      # pjit_test.py test_pjit_uncommitted_array_reshard, ..._and_committed_array
      "uncommitted_array_reshard": (
          jax.jit(lambda x: x * 2, in_shardings=NamedSharding(rows8, P("x"))),
          lambda: (jnp.arange(16.).reshape(8, 2),)),
      "uncommitted_and_committed_array": (
          jax.jit(lambda a, b: (a * 2, b @ b.T)),
          lambda: (jnp.arange(16.).reshape(8, 2),
                   jax.device_put(jnp.arange(16.).reshape(8, 2),
                                  NamedSharding(auto((4, 2), ("x", "y")), P("x", "y"))))),
      "committed_to_a_device_subset": (
          jax.jit(lambda x: (x * 2, x.sum(0))),
          lambda: (jax.device_put(jnp.arange(16.).reshape(8, 2),
                                  NamedSharding(on_devices_2_3, P("x"))),)),
      "out_shardings_on_a_device_subset": (
          jax.jit(lambda x: x * 2, out_shardings=NamedSharding(first4, P("x"))),
          lambda: (jax.device_put(jnp.arange(8.), NamedSharding(first4, P())),)),
      "one_device_array": (jax.jit(lambda x: x @ x.T),
                           lambda: (jax.device_put(jnp.ones((4, 4)), jax.devices()[3]),)),
      "constants_beside_a_split_value": (
          jax.jit(lambda x: (jnp.zeros(8), x + 1, jnp.arange(4) * 2)),
          lambda: (jax.device_put(jnp.arange(16.), NamedSharding(rows8, P("x"))),)),
  }[name]


CASES = {
    **{f"jit/{n}": (jit_arguments, n) for n in (
        "python_int", "python_float", "numpy_scalar", "python_float_learning_rate",
        "constant_output", "scatter_of_literal", "truncated_normal_bounds", "none_leaf",
        "static_argnums", "donate_argnums", "out_shardings_no_arguments",
        "in_and_out_shardings", "pjit_under_with_mesh", "partition_spec_under_set_mesh",
        "out_shardings_in_pinned_host_memory", "out_shardings_in_unpinned_host_memory",
        "out_shardings_no_arguments_in_pinned_host_memory",
        "out_shardings_no_arguments_in_unpinned_host_memory",
        "in_shardings_partition_spec_under_set_mesh", "in_shardings_partition_spec_explicit_mesh",
        "out_shardings_partition_spec_explicit_mesh",
        "auto_reductions_and_transposes")},
    **{f"distributed_arrays/{n}": (distributed_arrays, n) for n in (
        "sin", "dot", "copy", "add_ones_like", "add_arange", "devices_of_two_meshes_refused",
        "permuted_devices_refused", "sharding_constraint_transposed",
        "sharding_constraint_replicated")},
    **{f"explicit_more/{n}": (explicit_more, n) for n in (
        "reshape_out_sharding", "closed_over_table_gather", "gather_out_sharding",
        "scatter_out_sharding",
        "shard_map_over_some_axes", "add_of_reduced_and_unreduced_refused")},
    **{f"jax_tests/{n}": (jax_tests, n) for n in (
        "eager_unreduced_in", "eager_unreduced_in_grad", "eager_reduced_in",
        "eager_reduced_in_grad", "random_normal_rules", "partial_auto_of_random_keys",
        "prng_key_wsc", "where_with_prng_sharded_inp", "scan_with_random_key_inside_jit",
        "switch_under_vmap_with_keys", "full_user_to_full_auto", "full_auto_to_full_user",
        "closes_over_an_explicit_value_refused", "committed_array_different_devices_refused",
        "committed_array_different_devices_variadic_args_refused",
        "arrays_on_two_meshes_refused", "uncommitted_array_reshard",
        "uncommitted_and_committed_array", "committed_to_a_device_subset",
        "out_shardings_on_a_device_subset", "one_device_array",
        "constants_beside_a_split_value")},
    **{f"jit_compilation/{n}": (jit_compilation, n) for n in (
        "selu", "selu_unsharded", "value_condition_refused", "loop_on_value_refused",
        "static_argnums", "static_argnames", "static_argnames_sharded")},
    **{f"sharding_201/{n}": (sharding_201, n) for n in (
        "sin_transpose", "broadcast_add", "sum_over_split", "random_out_sharding",
        "dot_without_out_sharding_refused", "dot_out_sharding",
        "add_of_conflicting_splits_refused", "auto_axes", "auto_mesh_with_sharding_constraint",
        "explicit_axes_in_auto_program", "auto_axes_context", "shard_map_on_explicit_mesh",
        "shard_map_on_explicit_mesh_jitted")},
    **{f"sharding_ad_301/{n}": (sharding_ad_301, n) for n in (
        "gradients", "matmul_of_conflicting_splits_refused", "einsum_replicated_out",
        "einsum_unreduced_out", "unreduced_reshard", "add_of_unreduced",
        "cos_of_unreduced_refused", "reshard_to_reduced", "reduced_weight_gradient",
        "reduced_fanout_gradient", "unreduced_accumulator_scan", "replicated_accumulator_scan",
        "shard_map_unreduced_out", "shard_map_unreduced_out_jitted",
        "shard_map_unreduced_gradient", "shard_map_reduced_in_gradient",
        "shard_map_reduced_in_gradient_jitted")},
}


@pytest.mark.parametrize("case", list(CASES))
def test_use_equals_jit_in_values_and_output_shardings(case):
  make, name = CASES[case]
  f, args, *ctx = make(name)
  assert_like_jit(f, args, *ctx, jit_raises=name.endswith("_refused"))


def test_keyword_arguments_pass_as_jit_passes_them():
  mesh = _row_mesh()
  assert_like_jit(jax.jit(lambda x, *, s: x * s), lambda: (_rows(mesh),), kwargs={"s": 3.0})


def test_a_new_python_learning_rate_is_not_a_new_program():
  """jit traces a Python number as a weakly typed scalar: a schedule's next value reuses the
  compiled step. So does use."""
  mesh = _row_mesh()
  traces = []

  @jax.jit
  def step(w, x, lr):
    traces.append(lr)
    return w - lr * jax.grad(lambda w: jnp.mean((x @ w) ** 2))(w)

  w = jax.device_put(jnp.ones((4,)), NamedSharding(mesh, P()))
  used = jaxcoll.use(step)
  outs = [used(w, _rows(mesh), lr) for lr in (0.1, 0.2, 0.3)]
  assert len(traces) == 1
  for lr, out in zip((0.1, 0.2, 0.3), outs):
    np.testing.assert_allclose(out, step(w, _rows(mesh), lr), rtol=1e-6)


def test_a_program_on_another_mesh_is_refused_by_name():
  """sharding.md's ``use_abstract_mesh`` example moves a value to a mesh of other axes; use
  runs a program per device over one mesh, and says so instead of returning it elsewhere."""
  mesh = _mesh((4, 2), ("X", "Y"))

  @jax.jit
  def f(x):
    abstract_mesh = jax.sharding.AbstractMesh((8,), ("A",), (AxisType.Explicit,))
    with jax.sharding.use_abstract_mesh(abstract_mesh):
      y = jax.reshard(x, jax.P("A", None))
      return y * 2

  with jax.set_mesh(mesh):
    x = jax.device_put(jnp.arange(32.).reshape(8, 4), jax.P("X", "Y"))
    with pytest.raises(ValueError, match=r"reshard at .*a mesh of axes \('A',\)"):
      jaxcoll.use(f)(x)


def test_explicit_tp_unreduced_reduction_runs_as_a_jaxcoll_collective():
  """An einsum left ``unreduced`` over the model axis, cashed in by ``reshard``: its one
  reduction is jaxcoll's ring all_reduce where the program asks for it, collective-permutes
  only in the compiled step."""
  mesh = _mesh((2, 4), ("x", "y"))
  with jax.set_mesh(mesh):
    a = jax.device_put(jnp.arange(128.).reshape(16, 8) / 100, P("x", "y"))
    b = jax.device_put(jnp.arange(64.).reshape(8, 8) / 100, P("y", None))

    @jax.jit
    def tp(a, b):
      c = jnp.einsum("xy,yz->xz", a, b, out_sharding=P("x", None, unreduced={"y"}))
      return jax.sharding.reshard(jnp.tanh(jax.sharding.reshard(c, P("x", None))),
                                  P("x", None))

    used = jaxcoll.use(tp, algorithm="ring")
    assert_like_jit(tp, lambda: (a, b))
    report = jaxcoll.explain_step(used, a, b)
    assert [(x.what, x.axes) for x in report.collectives] == [("all_reduce", ("y",))]
    assert report.collectives[0].nbytes == 8 * 8 * 4   # this device's rows, once
    assert report.compiled["collective-permute"] > 0 and report.xla_collectives == 0, report


def test_explicit_fsdp_gradient_is_a_reduce_scatter():
  """Parameters split over an Explicit axis, gathered by ``reshard`` for the matmul: the
  gradient, a partial sum over the batch, lands split as the parameter is, by one
  reduce-scatter (no all-reduce), as jit types it."""
  mesh = _mesh((8,), ("x",))
  with jax.set_mesh(mesh):
    w = jax.device_put(jnp.arange(64.).reshape(8, 8) / 100, P("x", None))
    xb = jax.device_put(jnp.arange(128.).reshape(16, 8) / 100, P("x", None))

    @jax.jit
    def fsdp(w, xb):
      def loss(w):
        whole = jax.sharding.reshard(w, P(None, None))
        return jnp.sum(jnp.tanh(xb @ whole) ** 2)
      return w - 0.1 * jax.grad(loss)(w)

    used = jaxcoll.use(fsdp, algorithm="ring")
    assert_like_jit(fsdp, lambda: (w, xb))
    report = jaxcoll.explain_step(used, w, xb)
    assert sorted(x.what for x in report.collectives) == ["all_gather", "reduce_scatter"]
    assert report.compiled["collective-permute"] > 0 and report.xla_collectives == 0, report


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("in_axes", [(0, 0), (None, 0)])
def test_vmap_with_spmd_axis_name_around_and_inside_use(check_vma, in_axes):
  """``jax.vmap(..., spmd_axis_name=)`` over a shard_map'd loss (how pipeline stages are
  written, MaxText's pipeline among them): its batch is split over the spmd axis, which the
  shard_map's specs may not name. use(vmap) and vmap(use) give jit's gradients and layout."""
  mesh = _mesh((2, 4), ("x", "y"), explicit=False)

  def f(w, x):
    def body(w, x):
      return jax.lax.psum(jnp.sum(jnp.tanh(x @ w)), "y")
    return jax.shard_map(body, mesh=mesh, in_specs=(P(), P("y")), out_specs=P(),
                         check_vma=check_vma)(w, x)

  w = jnp.arange(2 * 16.).reshape(2, 4, 4) / 32
  if in_axes[0] is None:
    w = w[0]
  x = jnp.arange(2 * 8 * 4.).reshape(2, 8, 4) / 100
  grad = lambda g: jax.jit(jax.vmap(jax.grad(g), in_axes=in_axes,   # noqa: E731
                                    spmd_axis_name="x"))
  want = grad(f)(w, x)
  for got in (jaxcoll.use(grad(f))(w, x), grad(jaxcoll.use(f))(w, x)):
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    assert got.sharding.is_equivalent_to(want.sharding, want.ndim)


# ---- jax.numpy and lax operations on a value split over both axes of a 2x4 mesh ----

OPS = {
    "reshape_merge": lambda a: a.reshape(128),
    "reshape_split": lambda a: a.reshape(2, 8, 8),
    "stack": lambda a: jnp.stack([a, 2 * a]),
    "stack_inner": lambda a: jnp.stack([a, 2 * a], axis=1),
    "tile": lambda a: jnp.tile(a, (2, 1)),
    "slice": lambda a: a[:8],
    "slice_columns": lambda a: a[:, :4],
    "squeeze": lambda a: a[None].squeeze(0),
    "expand_dims": lambda a: a[:, None],
    "concatenate": lambda a: jnp.concatenate([a, a], 0),
    "scatter": lambda a: a.at[jnp.array([0, 3])].set(1.0),
    "reduce_window": lambda a: jax.lax.reduce_window(a, 0., jax.lax.add, (2, 1), (2, 1),
                                                     "VALID"),
    "bitcast_convert_type": lambda a: jax.lax.bitcast_convert_type(a, jnp.int32),
    "cumsum": lambda a: jnp.cumsum(a, 0),
    "sort": lambda a: jnp.sort(-a, 1),
    "argmax": lambda a: jnp.argmax(a, 1),
    "transpose": lambda a: a.T,
    "sum": lambda a: a.sum(),
    "mean": lambda a: a.mean(1),
    "outer": lambda a: jnp.einsum("ij,ik->ijk", a, a),
    "scan": lambda a: jax.lax.scan(lambda c, r: (c + r, c * r), jnp.zeros(8), a)[1],
    "where": lambda a: jnp.where(a > 3, a, 0.),
    "pad": lambda a: jnp.pad(a, ((0, 0), (1, 1))),
    "reverse": lambda a: a[::-1],
    "dynamic_slice": lambda a: jax.lax.dynamic_slice_in_dim(a, 2, 8, 0),
    "gather": lambda a: a[jnp.array([1, 5, 9])],
    "softmax": lambda a: jax.nn.softmax(a, -1),
    "astype": lambda a: a.astype(jnp.bfloat16),
}


@pytest.mark.parametrize("spec", [P("x", "y"), P(("x", "y"), None), P(None, ("x", "y"))],
                         ids=["rows_x_columns_y", "rows_xy", "columns_xy"])
@pytest.mark.parametrize("explicit", [False, True], ids=["auto", "explicit"])
@pytest.mark.parametrize("op", list(OPS))
def test_operations_on_a_split_value_land_as_under_jit(op, explicit, spec):
  """Auto mesh: where XLA's partitioner leaves each result (a slice keeps its operand's
  split, or the major part of it that divides the result; a tile splits what it does not
  repeat; a reshape of rows split over (x, y) into (2, 8) splits the 2 over x and the 8
  over y). Explicit mesh: where its type says, or jit's error where the type is ambiguous
  (a scatter, a pad, a gather of split rows)."""
  mesh = _mesh((2, 4), ("x", "y"), explicit=explicit)
  with jax.set_mesh(mesh):
    a = jax.device_put(jnp.arange(128.).reshape(16, 8) / 10, spec)
  assert_like_jit(jax.jit(OPS[op]), lambda: (a,), lambda: jax.set_mesh(mesh),
                  jit_raises=None if explicit else False)


def test_errors_jax_raises_use_raises():
  """A shard_map over an AbstractMesh given an array that lives on no mesh, and a jax.Ref
  returned from a shard_map: jit's ValueError, eager and jitted, before anything runs."""
  abstract = jax.sharding.AbstractMesh((8,), ("x",), (AxisType.Auto,))
  mesh = _row_mesh()

  def on_abstract(x):
    return jax.shard_map(lambda v: v * 2, mesh=abstract, in_specs=P("x"), out_specs=P("x"))(x)

  def returns_ref(x):
    return jax.shard_map(lambda v: jax.new_ref(v), mesh=mesh, in_specs=P("x"),
                         out_specs=P("x"))(x)

  for f in (on_abstract, jax.jit(on_abstract)):
    assert_like_jit(f, lambda: (jnp.arange(8.),), jit_raises=True)
  if hasattr(jax, "new_ref"):
    assert_like_jit(returns_ref, lambda: (_rows(mesh, 8)[:, 0],), jit_raises=True)


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("program", ["reduced_in_psum", "reduced_in_psum_grad",
                                     "zero_unreduced_out", "reduced_out"])
@pytest.mark.parametrize("jitted", [True, False], ids=["jit", "eager"])
def test_shard_map_with_unreduced_and_reduced_specs(program, check_vma, jitted):
  """shard_map programs whose specs carry unreduced or reduced sets, typed (check_vma) or
  not, eager or jitted: a reduced input summed after a cast (and its gradient, an unreduced
  cotangent), a zero unreduced output, a reduced output."""
  mesh = _mesh((2, 4), ("x", "y"))
  with jax.set_mesh(mesh):
    r = jax.device_put(jnp.arange(8.), P(None, reduced={"y"}))
    v = jax.device_put(jnp.arange(16.), P(("x", "y")))
  cast = (lambda x, axes, to: jax.lax.pcast(x, axes, to=to)) if check_vma else \
      (lambda x, axes, to: x)
  smap = lambda body, in_specs, out_specs: jax.shard_map(  # noqa: E731
      body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check_vma)

  def reduced_in(r, v):
    return smap(lambda r, v: jax.lax.psum(cast(r, "y", "varying") * v.sum(), "y"),
                (P(None, reduced={"y"}), P(("x", "y"))), P("x"))(r, v)

  programs = {
      "reduced_in_psum": (reduced_in, (r, v)),
      "reduced_in_psum_grad": (jax.grad(lambda r, v: reduced_in(r, v).sum(), argnums=(0, 1)),
                               (r, v)),
      "zero_unreduced_out": (
          lambda v: smap(lambda v: cast(cast(jnp.zeros(4), ("y",), "varying"), ("y",),
                                        "unreduced"),
                         P(("x", "y")), P(None, unreduced={"y"}))(v), (v,)),
      "reduced_out": (lambda v: smap(lambda v: cast(jnp.ones(4), "x", "reduced"),
                                     P(("x", "y")), P(reduced={"x"}))(v), (v,)),
  }
  f, args = programs[program]
  assert_like_jit(jax.jit(f) if jitted else f, lambda: args, lambda: jax.set_mesh(mesh))


def test_the_unreduced_accumulator_is_reduced_once_by_jaxcoll():
  """sharding-ad.md's microbatched step: gradients of reduced weights are unreduced, added
  across a scan, and one ``reshard`` reduces them ("the one AllReduce"). Under use that
  reduction is one jaxcoll all_reduce of the accumulator (3 x 4 x 4 floats), after the
  loop, and the compiled step holds collective-permutes only."""
  make, name = CASES["sharding_ad_301/unreduced_accumulator_scan"]
  step, args, on = make(name)
  with on():
    used = jaxcoll.use(step, algorithm="ring")
    report = jaxcoll.explain_step(used, *args())
  assert [(x.what, x.nbytes, x.count) for x in report.collectives] == [
      ("all_reduce", 3 * 4 * 4 * 4, 1)]
  assert report.compiled["collective-permute"] > 0 and report.xla_collectives == 0, report
