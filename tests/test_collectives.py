"""Every algorithm of every primitive against jax.lax (or NumPy where lax has none)."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import lax

import jaxcoll
from jaxcoll._src.schedules.executor import execute
from tests.helpers import (
  AXIS,
  call,
  count_primitive,
  input_length,
  per_device,
  ppermute_bytes_per_rank,
)

SIZES = range(1, 9)
DTYPES = (np.float32, ml_dtypes.bfloat16, np.float16, np.int32)
SHAPES = ((), (7,), (3, 5, 2))


def algos(primitive):
  """The single-axis scheduled algorithms (hierarchical needs a tuple of axes)."""
  return [a for a in jaxcoll.algorithms(primitive, num_axes=1) if a != "native"]


def inputs(n, op, seed=0, shapes=SHAPES):
  """Per-device values (leading axis n) for every dtype and shape; prod stays small."""
  rng = np.random.default_rng(seed)
  tree = {}
  for dt in DTYPES:
    for shape in shapes:
      if op == "prod":
        v = rng.choice([-1.0, 1.0, 2.0] if dt == np.int32 else [0.5, 1.0, -1.25, 1.5],
                       size=(n, *shape))
      elif dt == np.int32:
        v = rng.integers(-50, 50, size=(n, *shape))
      else:
        v = rng.standard_normal((n, *shape))
      tree[f"{np.dtype(dt).name}{shape}"] = v.astype(dt)
  return tree


def np_reduce(op, v):
  v64 = v.astype(np.float64) if v.dtype != np.int32 else v.astype(np.int64)
  fn = {"sum": np.sum, "prod": np.prod, "min": np.min, "max": np.max, "mean": np.mean}[op]
  return fn(v64, axis=0)


def assert_close(got, want, dtype, n, scale=None):
  got = np.asarray(got)
  if np.dtype(dtype) == np.int32:
    np.testing.assert_array_equal(got, want)
    return
  eps = float(jnp.finfo(dtype).eps)
  scale = np.abs(want).max(initial=1.0) if scale is None else scale
  np.testing.assert_allclose(got.astype(np.float64), want, atol=2 * n * eps * scale,
                             rtol=2 * n * eps)


def assert_replicas_bit_identical(out):
  for leaf in jax.tree.leaves(out):
    leaf = np.asarray(leaf)
    for r in range(1, leaf.shape[0]):
      np.testing.assert_array_equal(np.atleast_1d(leaf[r]).view(np.uint8),
                                    np.atleast_1d(leaf[0]).view(np.uint8))


def check_all_reduce(algorithm, n, ops, shapes):
  xs = {op: inputs(n, op, seed=n, shapes=shapes) for op in ops}
  f = per_device(lambda t: {op: jaxcoll.all_reduce(t[op], AXIS, op=op, algorithm=algorithm)
                            for op in ops}, n)
  out = f(xs)
  for op in ops:
    for key, v in xs[op].items():
      got = np.asarray(out[op][key])
      want_dtype = np.float32 if (op == "mean" and v.dtype == np.int32) else v.dtype
      assert got.dtype == want_dtype, (op, key)
      v64 = np.abs(v.astype(np.float64))
      scale = v64.sum(0).max(initial=1.0) if op in ("sum", "mean") else None
      for r in range(n):
        assert_close(got[r], np_reduce(op, v), want_dtype, n, scale)
  assert_replicas_bit_identical(out)


@pytest.mark.parametrize("algorithm", algos("all_reduce"))
@pytest.mark.parametrize("n", SIZES)
def test_all_reduce_every_dtype_and_shape(algorithm, n):
  """Scalars, odd lengths and multi-dimensional arrays of every dtype, on N = 1..8."""
  check_all_reduce(algorithm, n, ("sum",), SHAPES)


@pytest.mark.parametrize("algorithm", algos("all_reduce"))
@pytest.mark.parametrize("n", SIZES)
def test_all_reduce_every_op(algorithm, n):
  check_all_reduce(algorithm, n, ("sum", "prod", "min", "max", "mean"), ((7,),))


@pytest.mark.quick
@pytest.mark.parametrize("primitive,algorithm",
                         [(p, a) for p in jaxcoll.PRIMITIVES for a in algos(p)])
def test_simulate_agrees_with_the_jax_execution_bit_for_bit(primitive, algorithm):
  """Same schedule, same combine order: the NumPy simulator and XLA give the same bits."""
  n = 7
  rng = np.random.default_rng(4)
  x = rng.standard_normal((n, input_length(primitive, n, 5))).astype(np.float32)
  root = 2 if primitive in ("broadcast", "reduce") else 0
  got = np.asarray(per_device(lambda v: call(primitive, v, AXIS, algorithm, root), n)(x))
  sched = jaxcoll.schedule(primitive, algorithm, n, root=root)
  for r, want in enumerate(sched.simulate(list(x))):
    np.testing.assert_array_equal(got[r].reshape(-1), want)


@pytest.mark.quick
@pytest.mark.parametrize("n", [3, 8])
def test_all_reduce_equals_lax_exactly_on_integers(n):
  x = inputs(n, "sum")
  ints = {k: v for k, v in x.items() if v.dtype == np.int32}
  lax_fns = {"sum": lax.psum, "min": lax.pmin, "max": lax.pmax}
  for op, fn in lax_fns.items():
    want = per_device(lambda t, fn=fn: jax.tree.map(lambda v: fn(v, AXIS), t), n)(ints)
    for algorithm in jaxcoll.algorithms("all_reduce", num_axes=1):
      got = per_device(lambda t, op=op, a=algorithm: jaxcoll.all_reduce(t, AXIS, op=op,
                                                                        algorithm=a), n)(ints)
      chex.assert_trees_all_equal(got, want)


@pytest.mark.parametrize("primitive", ["reduce_scatter", "all_gather"])
@pytest.mark.parametrize("n", SIZES)
def test_scatter_gather_equal_lax(primitive, n):
  rng = np.random.default_rng(n)
  if primitive == "reduce_scatter":
    cases = [dict(scatter_dimension=0, tiled=False, shape=(n,)),
             dict(scatter_dimension=1, tiled=False, shape=(3, n, 2)),
             dict(scatter_dimension=0, tiled=True, shape=(2 * n, 3)),
             dict(scatter_dimension=-1, tiled=True, shape=(5, 3 * n))]
  else:
    cases = [dict(axis=0, tiled=False, shape=()), dict(axis=1, tiled=False, shape=(3, 5)),
             dict(axis=-1, tiled=False, shape=(3, 2)), dict(axis=0, tiled=True, shape=(3, 2)),
             dict(axis=-1, tiled=True, shape=(2, 3))]
  entries = {}
  for dt in DTYPES:
    for i, case in enumerate(cases):
      kw = {k: v for k, v in case.items() if k != "shape"}
      x = (rng.standard_normal((n, *case["shape"])) * 10).astype(dt)
      entries[f"{np.dtype(dt).name}-{i}"] = (kw, x)
  xs = {k: x for k, (_, x) in entries.items()}
  lax_fn = lax.psum_scatter if primitive == "reduce_scatter" else lax.all_gather
  # lax.psum_scatter fails to lower a negative scatter_dimension: pass it normalized
  lax_kws = {k: dict(kw) for k, (kw, _) in entries.items()}
  for k, (kw, x) in entries.items():
    if "scatter_dimension" in kw:
      lax_kws[k]["scatter_dimension"] = kw["scatter_dimension"] % (x.ndim - 1)
  want = per_device(lambda t: {k: lax_fn(v, AXIS, **lax_kws[k]) for k, v in t.items()}, n)(xs)
  fn = getattr(jaxcoll, primitive)
  algorithms = jaxcoll.algorithms(primitive, num_axes=1)
  every = per_device(lambda t: {a: {k: fn(v, AXIS, algorithm=a, **entries[k][0])
                                    for k, v in t.items()} for a in algorithms}, n)(xs)
  for algorithm in algorithms:   # one program for them all: one compile
    got = every[algorithm]
    for k, (_, x) in entries.items():
      g, w = np.asarray(got[k]), np.asarray(want[k])
      assert g.shape == w.shape and g.dtype == w.dtype, (algorithm, k)
      if primitive == "all_gather":
        np.testing.assert_array_equal(g, w)
      else:
        assert_close(g, w.astype(np.float64), x.dtype, n,
                     np.abs(x.astype(np.float64)).sum(0).max())


@pytest.mark.quick
@pytest.mark.parametrize("op", ["sum", "max", "mean"])
def test_reduce_scatter_ops(op):
  n = 6
  x = np.random.default_rng(0).integers(-9, 9, (n, 2 * n, 3)).astype(np.float32)
  want = np_reduce(op, x).reshape(n, 2, 3)
  for algorithm in jaxcoll.algorithms("reduce_scatter", num_axes=1):
    got = per_device(lambda v, a=algorithm: jaxcoll.reduce_scatter(v, AXIS, tiled=True, op=op,
                                                                   algorithm=a), n)(x)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6)


@pytest.mark.parametrize("primitive", ["broadcast", "reduce"])
@pytest.mark.parametrize("n", SIZES)
def test_rooted_collectives(primitive, n):
  rng = np.random.default_rng(n)
  x = {"f": rng.standard_normal((n, 5, 3)).astype(np.float32),
       "i": rng.integers(-9, 9, (n, 7)).astype(np.int32),
       "b": rng.standard_normal((n,)).astype(ml_dtypes.bfloat16)}
  fn = getattr(jaxcoll, primitive)
  for root in sorted({0, n - 1, n // 2}):
    for algorithm in jaxcoll.algorithms(primitive, num_axes=1):
      out = per_device(lambda t, a=algorithm, r=root: fn(t, AXIS, root=r, algorithm=a), n)(x)
      for key, v in x.items():
        got = np.asarray(out[key])
        for r in range(n):
          if primitive == "broadcast":
            np.testing.assert_array_equal(got[r], v[root])
          elif r == root:
            assert_close(got[r], np_reduce("sum", v), v.dtype, n,
                         np.abs(v.astype(np.float64)).sum(0).max(initial=1.0))
          else:
            np.testing.assert_array_equal(got[r], np.zeros_like(v[0]))


@pytest.mark.quick
@pytest.mark.parametrize("primitive,algorithm",
                         [(p, a) for p in jaxcoll.PRIMITIVES for a in algos(p)])
@pytest.mark.parametrize("n", [5, 8])
def test_traced_bytes_equal_schedule_bytes(primitive, algorithm, n):
  length = 8 * 3 * n  # divisible by every schedule's chunk count here
  x = jnp.zeros((n, length if primitive != "all_gather" else length // n), jnp.float32)
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:n]), (AXIS,))
  sm = jax.shard_map(lambda v: call(primitive, v[0], AXIS, algorithm)[None], mesh=mesh,
                     in_specs=jax.P(AXIS), out_specs=jax.P(AXIS))
  traced = ppermute_bytes_per_rank(jax.make_jaxpr(sm)(x), n).max()
  sched = jaxcoll.schedule(primitive, algorithm, n)
  assert traced == sched.bytes_per_rank(length * 4)


@pytest.mark.quick
def test_long_ring_compiles_as_a_loop():
  """Each ring phase is one fori_loop: two ppermutes in the jaxpr, whatever N."""
  for n in (4, 8):
    f = lambda v: jaxcoll.all_reduce(v, AXIS, algorithm="ring")
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:n]), (AXIS,))
    jaxpr = jax.make_jaxpr(jax.shard_map(f, mesh=mesh, in_specs=jax.P(AXIS),
                                         out_specs=jax.P()))(jnp.zeros((n * 16,)))
    assert count_primitive(jaxpr, "ppermute") == 2
  sched = jaxcoll.schedule("all_reduce", "ring", 8)
  for loop_min in (2, 100):  # looped and unrolled executions agree
    out = per_device(lambda v, m=loop_min: execute(sched, v.reshape(8, 2), AXIS,
                                                   loop_min_steps=m).reshape(-1), 8)(
        np.arange(8 * 16, dtype=np.float32).reshape(8, 16))
    np.testing.assert_array_equal(np.asarray(out)[0],
                                  np.arange(128, dtype=np.float32).reshape(8, 16).sum(0))


@pytest.mark.quick
@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float16])
def test_half_precision_messages_travel_at_their_own_size(dtype):
  """XLA's CPU backend widens a bfloat16 collective-permute to float32 (twice the bytes);
  the executor sends 16-bit floats as uint16, and gradients still flow."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), (AXIS,))
  f = jax.jit(jax.shard_map(lambda v: jaxcoll.all_reduce(v, AXIS, algorithm="ring"), mesh=mesh,
                            in_specs=jax.P(AXIS), out_specs=jax.P()))
  x = jax.device_put(jnp.ones(4 * 64, dtype), jax.NamedSharding(mesh, jax.P(AXIS)))
  permutes = [line for line in f.lower(x).compile().as_text().splitlines()
              if "collective-permute(" in line]
  assert permutes and all("= u16[" in line for line in permutes), permutes
  np.testing.assert_array_equal(np.asarray(f(x), np.float32), 4.0)
  grad = jax.jit(jax.grad(lambda v: jnp.sum(f(v).astype(jnp.float32))))(x)
  np.testing.assert_array_equal(np.asarray(grad, np.float32), 1.0)


@pytest.mark.quick
def test_accumulate_dtype_float32():
  n = 8
  rng = np.random.default_rng(1)
  x = (rng.standard_normal((n, 4096)) * np.exp(rng.uniform(-3, 3, (n, 4096)))).astype(
      ml_dtypes.bfloat16)
  exact = x.astype(np.float64).sum(0)
  lax_err = np.abs(np.asarray(per_device(lambda v: lax.psum(v, AXIS), n)(x))[0]
                   .astype(np.float64) - exact).max()
  for algorithm in algos("all_reduce"):
    got = per_device(lambda v, a=algorithm: jaxcoll.all_reduce(
        v, AXIS, algorithm=a, accumulate_dtype="float32"), n)(x)
    got = np.asarray(got)
    assert got.dtype == ml_dtypes.bfloat16
    assert_replicas_bit_identical(got)
    err = np.abs(got[0].astype(np.float64) - exact).max()
    assert err <= lax_err, (algorithm, err, lax_err)


def sequential_rounded_error(x, exact):
  acc = x[0].astype(np.float32)
  for v in x[1:]:
    acc = (acc + v.astype(np.float32)).astype(x.dtype).astype(np.float32)
  return np.abs(acc.astype(np.float64) - exact)


@pytest.mark.quick
@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float16])
def test_low_precision_error_bounded_by_sequential_sum(dtype):
  """Per-step rounding: no worse than a sequential sum rounded each step; trees do better."""
  n = 8
  rng = np.random.default_rng(2)
  x = rng.uniform(0.5, 1.5, (n, 1 << 14)).astype(dtype)  # same signs: errors accumulate
  exact = x.astype(np.float64).sum(0)
  seq = sequential_rounded_error(x, exact).mean()
  errors = {}
  for algorithm in algos("all_reduce"):
    got = np.asarray(per_device(lambda v, a=algorithm: jaxcoll.all_reduce(v, AXIS, algorithm=a),
                                n)(x))[0]
    errors[algorithm] = np.abs(got.astype(np.float64) - exact).mean()
    assert errors[algorithm] <= seq * 1.05, (algorithm, errors[algorithm], seq)
  # log-depth reductions (3 roundings on the way) beat the ring's 7
  assert errors["halving_doubling"] < errors["ring"]
  assert errors["recursive_doubling"] < errors["ring"]


@pytest.mark.quick
def test_jit_scan_and_eager():
  n = 4
  x = np.arange(n * 6, dtype=np.float32).reshape(n, 6)

  def body(v):
    def step(carry, _):
      # like lax.pmean, the result is invariant: cast back to carry's varying type
      out = jaxcoll.all_reduce(carry, AXIS, algorithm="ring", op="mean")
      return lax.pcast(out, AXIS, to="varying"), None
    out, _ = lax.scan(step, v, None, length=3)
    return out

  got = per_device(body, n)(x)
  np.testing.assert_allclose(np.asarray(got)[1], x.mean(0), rtol=1e-6)
  eager = per_device(lambda v: jaxcoll.all_reduce(v, AXIS, algorithm="halving_doubling"), n,
                     jit=False)(x)
  np.testing.assert_allclose(np.asarray(eager)[0], x.sum(0))


@pytest.mark.quick
@pytest.mark.parametrize("check_vma", [True, False])
def test_replicated_results_leave_with_out_specs_p(check_vma):
  n = 8
  x = np.arange(n * 3, dtype=np.float32).reshape(n, 3)
  for algorithm in jaxcoll.algorithms("all_reduce", num_axes=1):
    got = per_device(lambda v, a=algorithm: jaxcoll.all_reduce(v, AXIS, algorithm=a), n,
                     replicated_out=True, check_vma=check_vma)(x)
    np.testing.assert_array_equal(np.asarray(got), x.sum(0))
  for algorithm in jaxcoll.algorithms("all_gather", num_axes=1):
    got = per_device(lambda v, a=algorithm: jaxcoll.all_gather(v, AXIS, algorithm=a,
                                                               to="invarying"), n,
                     replicated_out=True, check_vma=check_vma)(x)
    np.testing.assert_array_equal(np.asarray(got), x)
  for algorithm in jaxcoll.algorithms("broadcast", num_axes=1):
    got = per_device(lambda v, a=algorithm: jaxcoll.broadcast(v, AXIS, root=3, algorithm=a), n,
                     replicated_out=True, check_vma=check_vma)(x)
    np.testing.assert_array_equal(np.asarray(got), x[3])


@pytest.mark.quick
def test_lax_semantics_corner_cases():
  n = 4
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:n]), (AXIS,))

  # psum of a value invariant over the axis multiplies it by the axis size
  def invariant(v):
    c = jnp.float32(3.0)
    return {a: jaxcoll.all_reduce(c, AXIS, algorithm=a)
            for a in jaxcoll.algorithms("all_reduce", num_axes=1)}

  out = jax.jit(jax.shard_map(invariant, mesh=mesh, in_specs=jax.P(AXIS), out_specs=jax.P()))(
      jnp.zeros(n))
  for a, v in out.items():
    assert float(v) == 12.0, a

  b = np.array([[True, False], [True, True], [False, False], [True, False]])
  for algorithm in jaxcoll.algorithms("all_reduce", num_axes=1):
    s = np.asarray(per_device(lambda v, a=algorithm: jaxcoll.all_reduce(v, AXIS, algorithm=a),
                              n)(b))
    assert s.dtype == np.int32
    np.testing.assert_array_equal(s[0], b.sum(0))
    m = np.asarray(per_device(lambda v, a=algorithm: jaxcoll.all_reduce(v, AXIS, op="mean",
                                                                        algorithm=a), n)(b))
    assert m.dtype == np.float32
    np.testing.assert_allclose(m[0], b.mean(0))

  z = (np.arange(n * 3) + 1j * np.arange(n * 3)[::-1]).astype(np.complex64).reshape(n, 3)
  for algorithm in jaxcoll.algorithms("all_reduce", num_axes=1):
    got = np.asarray(per_device(lambda v, a=algorithm: jaxcoll.all_reduce(v, AXIS, algorithm=a),
                                n)(z))
    np.testing.assert_allclose(got[0], z.sum(0), rtol=1e-6)

  mixed = {"a": np.ones((n, 2), np.float32), "b": [np.arange(n, dtype=np.int32),
                                                     np.ones((n, 1), ml_dtypes.bfloat16)]}
  got = per_device(lambda t: jaxcoll.all_reduce(t, AXIS, algorithm="ring"), n)(mixed)
  chex.assert_trees_all_equal_structs(got, mixed)
  chex.assert_trees_all_equal_dtypes(got, mixed)
  np.testing.assert_array_equal(np.asarray(got["b"][0]), np.full(n, 6))


@pytest.mark.quick
def test_checkpoint_and_custom_vjp_around_the_call():
  n = 4
  x = np.arange(n * 3, dtype=np.float32).reshape(n, 3) / 7

  def custom(inner):
    @jax.custom_vjp
    def synced(v):
      return inner(v)

    synced.defvjp(lambda v: (inner(v), None),
                  lambda _, g: (lax.pcast(2 * inner(g), AXIS, to="varying"),))
    return synced

  def loss(fn):
    def body(v):
      return jnp.sum(fn(v) ** 2)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:n]), (AXIS,))
    f = jax.shard_map(lambda v: body(v)[None], mesh=mesh, in_specs=jax.P(AXIS),
                      out_specs=jax.P(AXIS))
    return jax.jit(jax.grad(lambda v: f(v).sum()))(x)

  ref = loss(lambda v: lax.psum(v, AXIS))
  got = loss(jax.checkpoint(lambda v: jaxcoll.all_reduce(v, AXIS, algorithm="halving_doubling")))
  np.testing.assert_allclose(got, ref, rtol=1e-6)
  np.testing.assert_allclose(
      loss(custom(lambda v: jaxcoll.all_reduce(v, AXIS, algorithm="ring"))),
      loss(custom(lambda v: lax.psum(v, AXIS))), rtol=1e-6)


@pytest.mark.quick
def test_integer_inputs_get_float0_cotangents():
  n = 4
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:n]), (AXIS,))
  f = jax.shard_map(lambda v, i: jaxcoll.all_reduce(v * i, AXIS, algorithm="ring"), mesh=mesh,
                    in_specs=jax.P(AXIS), out_specs=jax.P())
  g = jax.grad(lambda v, i: f(v, i).sum(), argnums=(0, 1), allow_int=True)(
      jnp.ones(n), jnp.arange(n, dtype=jnp.int32))
  assert g[1].dtype == jax.dtypes.float0
  np.testing.assert_allclose(g[0], np.arange(n))


@pytest.mark.quick
def test_errors_name_the_argument():
  n = 4
  x = np.zeros((n, 4), np.float32)

  def raises(fn, match, data=x):
    with pytest.raises((ValueError, NotImplementedError), match=match):
      per_device(fn, n)(data)

  raises(lambda v: jaxcoll.all_reduce(v, "y"), "axis_name='y'")
  raises(lambda v: jaxcoll.all_reduce(v, AXIS, algorithm="bruck"), "algorithm='bruck'")
  raises(lambda v: jaxcoll.all_reduce(v, AXIS, op="avg"), "op='avg'")
  raises(lambda v: jaxcoll.all_reduce(v, AXIS, op="max"), "complex",
         x.astype(np.complex64))
  raises(lambda v: jaxcoll.broadcast(v, AXIS, root=4), "root=4")
  raises(lambda v: jaxcoll.reduce(v, AXIS, root=-1), "root=-1")
  raises(lambda v: jaxcoll.reduce_scatter(v, AXIS), "scatter_dimension=0",
         np.zeros((n, 3), np.float32))
  raises(lambda v: jaxcoll.reduce_scatter(v, AXIS, tiled=True, scatter_dimension=0), "divisible",
         np.zeros((n, 3), np.float32))
  raises(lambda v: jaxcoll.all_gather(v, AXIS, axis=3), "axis=3")
  raises(lambda v: jaxcoll.all_gather(v, AXIS, to="everywhere"), "to='everywhere'")
  raises(lambda v: jaxcoll.all_reduce(v, AXIS, accumulate_dtype="float32"), "accumulate_dtype",
         x.astype(np.int32))
  with pytest.raises(ValueError, match="shard_map"):
    jaxcoll.all_reduce(jnp.zeros(3), "x")


@pytest.mark.quick
@pytest.mark.parametrize("primitive", ["all_gather", "all_to_all", "broadcast", "shift"])
def test_prng_key_arrays_travel_as_lax_moves_them(primitive):
  """``jax.random.key`` arrays (a gathered key table, keys under ``vmap``) move exact, by
  every algorithm, equal to lax's move of the same keys; a sum of keys and keys on a lossy
  wire are TypeErrors naming x."""
  n = 4
  keys = jax.random.split(jax.random.key(0), n * 6).reshape(n, 2, 3)
  lax_of = {"all_gather": lambda k: lax.all_gather(k, AXIS, axis=1, tiled=True),
            "all_to_all": lambda k: lax.all_to_all(k, AXIS, 0, 0, tiled=True),
            "broadcast": lambda k: jax.random.wrap_key_data(   # lax cannot stack keys
                lax.all_gather(jax.random.key_data(k), AXIS)[1]),
            "shift": lambda k: lax.ppermute(k, AXIS, [(i, (i + 1) % n) for i in range(n)])}
  ours = {"all_gather": lambda k, a: jaxcoll.all_gather(k, AXIS, axis=-1, tiled=True,
                                                          algorithm=a),
          "all_to_all": lambda k, a: jaxcoll.all_to_all(k, AXIS, 0, 0, tiled=True,
                                                          algorithm=a),
          "broadcast": lambda k, a: jaxcoll.broadcast(k, AXIS, root=1, algorithm=a),
          "shift": lambda k, a: jaxcoll.shift(k, AXIS, algorithm=a)}
  keys = jnp.stack([jnp.concatenate([k] * n) for k in keys]) if primitive == "all_to_all" \
      else keys
  algorithms = jaxcoll.algorithms(primitive, num_axes=1)
  want = per_device(lax_of[primitive], n, check_vma=False)(keys)
  got = per_device(lambda k: {a: ours[primitive](k, a) for a in algorithms}, n,
                   check_vma=False)(keys)
  for a in algorithms:
    np.testing.assert_array_equal(jax.random.key_data(got[a]), jax.random.key_data(want))
  with pytest.raises(TypeError, match="x, a PRNG key array"):
    per_device(lambda k: jaxcoll.all_reduce(k, AXIS), n)(keys)
  if primitive == "all_gather":
    with pytest.raises(TypeError, match="x, a PRNG key array .*wire_dtype='int8'"):
      per_device(lambda k: jaxcoll.all_gather(k, AXIS, wire_dtype="int8"), n)(keys)
