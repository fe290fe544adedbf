"""Compressed wire formats: the encoding, and compressed collectives against float64 NumPy."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcoll
from jaxcoll._src.wire import formats as wire
from tests.helpers import per_device, ppermute_bytes_per_rank

pytestmark = pytest.mark.quick   # also on the oldest supported jax (.ci/run)

FORMATS = jaxcoll.WIRE_DTYPES
SCALED = ("int8", "float8_e4m3fn", "float8_e5m2")
B = wire.DEFAULT_BLOCK_SIZE


def algos(primitive):
  return [a for a in jaxcoll.algorithms(primitive, num_axes=1) if a != "native"]


def adversarial(rng, shape, blocks_of=B):
  """Signed values whose magnitude spans 1e-30..1e30 across blocks and 1e-6..1 within one."""
  *lead, length = shape
  block_scale = 10.0 ** rng.uniform(-30, 30, (*lead, length // blocks_of, 1))
  inner = 10.0 ** rng.uniform(-6, 0, (*lead, length // blocks_of, blocks_of))
  signs = rng.choice([-1.0, 1.0], inner.shape)
  return (signs * inner * block_scale).reshape(shape).astype(np.float32)


def block_amax(x, axis=0):
  """Per value: the sum over ranks (axis) of each rank's largest magnitude in that value's
  block of B: a bound on the largest magnitude of any partial sum in the block."""
  *lead, length = x.shape
  m = np.abs(x.astype(np.float64)).reshape(*lead, length // B, B).max(-1, keepdims=True)
  return np.broadcast_to(m.sum(axis), x.shape[1:-1] + (length // B, B)).reshape(x.shape[1:])


# ---- the encoding ----

def test_wire_format_sizes_and_errors():
  assert jaxcoll.WireFormat("int8").bytes_per_value == 1 + 1 / 256
  assert jaxcoll.WireFormat("bfloat16").ratio(np.float32) == 0.5
  assert jaxcoll.WireFormat("float8_e5m2", 128).ratio(np.float32) == pytest.approx(
      (1 + 1 / 128) / 4)
  assert wire.wire_format("float32", np.float32) is None
  assert wire.wire_format(jnp.bfloat16, ml_dtypes.bfloat16) is None
  assert wire.wire_format("int8", ml_dtypes.bfloat16).name == "int8"
  with pytest.raises(ValueError, match="wire_dtype='float16'.*expected one of"):
    wire.wire_format("float16", np.float32)
  with pytest.raises(ValueError, match="wire_block_size=100 must be a positive power of two"):
    wire.wire_format("int8", np.float32, 100)
  with pytest.raises(ValueError, match="compresses floating data; x has dtype int32"):
    wire.wire_format("int8", np.int32)
  with pytest.raises(ValueError, match="not smaller than x's dtype float16"):
    wire.wire_format("bfloat16", np.float16)


@pytest.mark.parametrize("name", FORMATS)
@given(seed=st.integers(0, 2**16), log_block=st.integers(0, 8), spread=st.booleans())
def test_decode_encode_is_idempotent_and_within_its_bound(name, seed, log_block, spread):
  fmt = jaxcoll.WireFormat(name, 1 << log_block)
  rng = np.random.default_rng(seed)
  shape = (3, 4 << log_block)
  x = adversarial(rng, shape, 1 << log_block) if spread else rng.standard_normal(shape).astype(
      np.float32)
  values, exps = fmt.encode(jnp.asarray(x))
  assert values.dtype == fmt.dtype
  decoded = np.asarray(fmt.decode(values, exps))
  again = np.asarray(fmt.decode(*fmt.encode(jnp.asarray(decoded))))
  np.testing.assert_array_equal(again.view(np.uint32), decoded.view(np.uint32))
  amax = np.abs(x).reshape(3, -1, 1 << log_block).max(-1, keepdims=True)
  err = np.abs(decoded - x).reshape(amax.shape[:-1] + (-1,))
  assert np.all(err <= fmt.relative_error * amax * (1 + 1e-6))


def assert_non_finite_as(got, want):
  """Every inf of ``want`` in ``got`` with its sign, every NaN a NaN, nothing else."""
  for test in (np.isnan, np.isposinf, np.isneginf):
    np.testing.assert_array_equal(test(got), test(want), err_msg=test.__name__)


def finite_block_amax(x, b=B):
  """Per value: its block's largest finite magnitude (blocks of b along the last axis)."""
  *lead, length = x.shape
  a = np.where(np.isfinite(x), np.abs(x.astype(np.float64)), 0.0)
  m = a.reshape(*lead, length // b, b).max(-1, keepdims=True)
  return np.broadcast_to(m, (*lead, length // b, b)).reshape(x.shape)


@pytest.mark.parametrize("name", FORMATS)
def test_non_finite_values_arrive_as_sent_and_their_blocks_stay_finite(name):
  """An inf arrives with its sign and a NaN as NaN; the finite values of the same block are
  scaled by the finite ones alone (within eps of the finite block maximum), zeros stay
  zero, and decode(encode(.)) stays a fixed point."""
  fmt = jaxcoll.WireFormat(name, 4)
  x = np.array([[1.0, np.inf, 2.0, 3.0, 0.0, 0.0, 0.0, 0.0, 5.0, np.nan, 1.0, 1.0,
                 -np.inf, 4.0, -7.0, 0.5, np.inf, -np.inf, np.nan, np.inf,
                 1e-30, -np.inf, 3e-31, 1e38]], np.float32)
  decoded = np.asarray(fmt.decode(*fmt.encode(jnp.asarray(x))))
  assert_non_finite_as(decoded, x)
  finite = np.isfinite(x)
  err = np.abs(decoded - x)[finite]
  assert np.all(err <= fmt.relative_error * finite_block_amax(x, 4)[finite] * (1 + 1e-6))
  np.testing.assert_array_equal(decoded[0, 4:8], 0.0)
  again = np.asarray(fmt.decode(*fmt.encode(jnp.asarray(decoded))))
  np.testing.assert_array_equal(again.view(np.uint32)[finite], decoded.view(np.uint32)[finite])
  assert_non_finite_as(again, x)


def test_error_feedback_residual_is_zero_where_the_value_is_not_finite():
  fmt = jaxcoll.WireFormat("int8", 4)
  x = jnp.asarray([1.0, np.inf, 0.3, np.nan, -np.inf, 2.0, 0.1, 0.7])
  err = np.asarray(fmt.error(x))
  np.testing.assert_array_equal(err[[1, 3, 4]], 0.0)
  np.testing.assert_allclose(err[[0, 2, 5, 6, 7]], np.asarray(
      x - fmt.round_trip(x))[[0, 2, 5, 6, 7]])


# ---- compressed collectives ----

def run_all_reduce(x, n, algorithm, name, **kw):
  f = per_device(lambda v: jaxcoll.all_reduce(v, "x", algorithm=algorithm, wire_dtype=name,
                                              **kw), n)
  return np.asarray(f(x))


def check_all_reduce(x, y, n, algorithm, name):
  """Replicas bit-identical; error within (steps + 1) * eps * (block amax summed over ranks):
  one encode per step a value travels, and the final pass."""
  for r in range(1, n):
    np.testing.assert_array_equal(y[r].view(np.uint32), y[0].view(np.uint32))
  exact = x.astype(np.float64).sum(0)
  steps = jaxcoll.schedule("all_reduce", algorithm, n).num_steps + 1
  eps = jaxcoll.WireFormat(name).relative_error
  bound = (steps * eps + steps * 2.0 ** -23) * block_amax(x)
  assert np.all(np.abs(y[0] - exact) <= bound), np.max(np.abs(y[0] - exact) / bound)


@pytest.mark.parametrize("n", [1, 3, 6, 8])
def test_every_all_reduce_algorithm_compressed(n):
  """Every algorithm in int8 (the format does not change the schedule), random data."""
  x = np.random.default_rng(n).standard_normal((n, 2 * B * 8)).astype(np.float32)
  names = algos("all_reduce")
  ys = per_device(lambda v: {a: jaxcoll.all_reduce(v, "x", algorithm=a, wire_dtype="int8")
                             for a in names}, n)(x)   # one program: one compile
  for algorithm in names:
    check_all_reduce(x, np.asarray(ys[algorithm]), n, algorithm, "int8")


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("algorithm", ["ring", "halving_doubling", "recursive_doubling"])
def test_every_format_on_adversarial_data(name, algorithm):
  n = 6
  x = adversarial(np.random.default_rng(0), (n, 4 * B * 6))
  check_all_reduce(x, run_all_reduce(x, n, algorithm, name), n, algorithm, name)


def test_odd_sizes_pad_to_blocks_and_keep_shape():
  n = 5
  x = np.random.default_rng(1).standard_normal((n, 3, 77)).astype(ml_dtypes.bfloat16)
  y = run_all_reduce(x, n, "ring", "int8")
  assert y.shape == x.shape and y.dtype == x.dtype
  exact = x.astype(np.float64).sum(0)
  bound = 10 / 127 * np.abs(x.astype(np.float64)).max(axis=(1, 2)).sum() + 2.0 ** -7 * np.abs(
      exact)
  assert np.all(np.abs(y[0].astype(np.float64) - exact) <= bound)


def test_wire_dtype_equal_to_the_input_dtype_is_the_uncompressed_path():
  x = jnp.ones((8, 1000), jnp.bfloat16)
  for algorithm in ("ring", "recursive_doubling"):
    plain = jax.make_jaxpr(per_device(lambda v, a=algorithm: jaxcoll.all_reduce(
        v, "x", algorithm=a), 8, jit=False))(x)
    same = jax.make_jaxpr(per_device(lambda v, a=algorithm: jaxcoll.all_reduce(
        v, "x", algorithm=a, wire_dtype="bfloat16"), 8, jit=False))(x)
    assert str(plain) == str(same)


@pytest.mark.parametrize("name", FORMATS)
def test_wire_bytes_equal_the_schedule_bytes_times_the_format_ratio(name):
  n, length = 8, B * 8 * 4
  x = jnp.ones((n, length), jnp.float32)
  sched = jaxcoll.schedule("all_reduce", "ring", n)
  fmt = jaxcoll.WireFormat(name)
  for wire_dtype, ratio in ((None, 1.0), (name, fmt.ratio(np.float32))):
    f = per_device(lambda v, w=wire_dtype: jaxcoll.all_reduce(
        v, "x", algorithm="ring", wire_dtype=w), n, jit=False)
    traced = ppermute_bytes_per_rank(jax.make_jaxpr(f)(x), n).max()
    assert traced == pytest.approx(sched.bytes_per_rank(length * 4 * ratio))
  assert 1 / fmt.ratio(np.float32) == pytest.approx(2.0 if name == "bfloat16" else 3.98,
                                                    rel=0.01)


@pytest.mark.parametrize("name", ["bfloat16", "int8"])
def test_reduce_scatter_and_all_gather_compressed(name):
  n = 4
  rng = np.random.default_rng(2)
  x = rng.standard_normal((n, n * B * 2)).astype(np.float32)
  eps = jaxcoll.WireFormat(name).relative_error
  for algorithm in algos("reduce_scatter"):
    y = np.asarray(per_device(lambda v, a=algorithm: jaxcoll.reduce_scatter(
        v, "x", tiled=True, algorithm=a, wire_dtype=name), n)(x))
    exact = x.astype(np.float64).sum(0).reshape(n, -1)
    steps = jaxcoll.schedule("reduce_scatter", algorithm, n).num_steps
    bound = steps * (eps + 2.0 ** -23) * block_amax(x).reshape(n, -1)
    assert np.all(np.abs(y - exact) <= bound), algorithm
  piece = rng.standard_normal((n, 3 * B)).astype(np.float32)
  for algorithm in algos("all_gather"):
    y = np.asarray(per_device(lambda v, a=algorithm: jaxcoll.all_gather(
        v, "x", algorithm=a, wire_dtype=name), n)(piece))
    for r in range(n):   # every device holds the same bits, its own piece included
      np.testing.assert_array_equal(y[r].view(np.uint32), y[0].view(np.uint32))
    amax = np.abs(piece).reshape(n, -1, B).max(-1, keepdims=True)
    err = np.abs(y[0] - piece).reshape(n, -1, B)   # one encode: fixed points after it
    assert np.all(err <= eps * amax * (1 + 1e-6)), algorithm


@pytest.mark.parametrize("name", FORMATS)
def test_all_to_all_compressed_within_one_encode_per_hop(name):
  """Own blocks exact; every other block within the format's bound times its hops."""
  n = 4
  rng = np.random.default_rng(3)
  x = rng.standard_normal((n, n * 2 * B)).astype(np.float32)
  eps = jaxcoll.WireFormat(name).relative_error
  want = x.reshape(n, n, -1).transpose(1, 0, 2)          # device r gets block r of each
  for algorithm in algos("all_to_all"):
    y = np.asarray(per_device(lambda v, a=algorithm: jaxcoll.all_to_all(
        v, "x", 0, 0, tiled=True, algorithm=a, wire_dtype=name), n)(x)).reshape(n, n, -1)
    hops = jaxcoll.schedule("all_to_all", algorithm, n).num_steps
    for r in range(n):
      np.testing.assert_array_equal(y[r, r], want[r, r])
      amax = np.abs(want[r]).reshape(n, -1, B).max(-1, keepdims=True)
      err = np.abs(y[r] - want[r]).reshape(n, -1, B)
      assert np.all(err <= hops * eps * amax * (1 + 1e-6)), (algorithm, r)


def test_hierarchical_compressed_over_two_axes():
  mesh = jax.make_mesh((2, 4), ("node", "local"))
  x = np.random.default_rng(3).standard_normal((8, 4 * B)).astype(np.float32)
  f = jax.jit(jax.shard_map(
      lambda v: jaxcoll.all_reduce(v, ("node", "local"), algorithm="hierarchical",
                                   wire_dtype="int8"),
      mesh=mesh, in_specs=P(("node", "local")), out_specs=P()))
  y = np.asarray(f(jax.device_put(x.reshape(-1), NamedSharding(mesh, P(("node", "local"))))))
  exact = x.astype(np.float64).sum(0)
  steps = jaxcoll.schedule("all_reduce", "hierarchical", 8, axis_sizes=(2, 4)).num_steps + 1
  assert np.all(np.abs(y - exact) <= steps * (1 / 127 + 2.0 ** -23) * block_amax(x))


def with_non_finite(n, length, seed=0):
  """Random data with infs that add up to +inf, -inf and NaN (inf - inf), a NaN, and infs in
  otherwise finite blocks, placed on different devices."""
  x = np.random.default_rng(seed).standard_normal((n, length)).astype(np.float32)
  x[0, 3], x[n - 1, 3] = np.inf, -np.inf        # inf - inf: NaN
  x[n - 1, 10] = np.inf                         # +inf
  x[0, 30] = x[n // 2, 30] = -np.inf            # -inf twice: -inf
  x[n // 2, 40] = np.nan                        # NaN
  x[1 % n, length - 1] = -np.inf
  return x


NON_FINITE_CASES = [(p, name) for p in ("all_reduce", "reduce_scatter", "all_gather",
                                        "all_to_all") for name in FORMATS]


@pytest.mark.parametrize("n", [3, 4])
@pytest.mark.parametrize("primitive,name", NON_FINITE_CASES)
def test_non_finite_values_come_out_where_lax_puts_them(primitive, name, n):
  """Every algorithm of the primitive, compressed: inf, -inf and NaN exactly where lax's
  uncompressed collective has them (inf - inf is NaN, as in lax), and every finite value
  within (steps + 1) eps of the sum over devices of the finite block maxima."""
  x = with_non_finite(n, B * n * 2)
  names = algos(primitive)
  f = per_device(lambda v: {a: jaxcoll.tools.flat_call(primitive, v, "x", a, wire_dtype=name)
                            for a in names}, n)
  want = per_device(lambda v: jaxcoll.tools.flat_call(primitive, v, "x", "native"), n)(x)
  want = np.asarray(want)
  for algorithm, got in f(x).items():
    got = np.asarray(got)
    assert_non_finite_as(got, want)
    finite = np.isfinite(want)
    steps = jaxcoll.schedule(primitive, algorithm, n).num_steps + 1
    amax = finite_block_amax(x).sum(0).max()
    bound = steps * (jaxcoll.WireFormat(name).relative_error + 2.0 ** -23) * amax
    err = np.abs(got[finite] - want[finite])
    assert np.all(err <= bound), (algorithm, err.max())


@pytest.mark.parametrize("op", ["sum", "mean"])
def test_gradients_are_those_of_the_uncompressed_collective(op):
  n = 4
  x = jnp.asarray(np.random.default_rng(4).standard_normal((n, 2 * B)), jnp.float32)

  def loss(x, wire_dtype):
    y = per_device(lambda v: jaxcoll.all_reduce(v, "x", op=op, algorithm="ring",
                                                wire_dtype=wire_dtype), n, jit=False)(x)
    return jnp.sum(y * jnp.arange(y.size, dtype=jnp.float32).reshape(y.shape))

  want = jax.jit(jax.grad(loss), static_argnums=1)(x, None)
  got = jax.jit(jax.grad(loss), static_argnums=1)(x, "int8")
  np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("wire", jaxcoll.WIRE_DTYPES)
@pytest.mark.parametrize("op", ["max", "min"])
def test_a_max_or_a_min_on_a_lossy_wire_is_an_error_naming_both(op, wire):
  """A max selects one device's value; a rounded one matches none (int8 gave 69.0 for
  lax.pmax's 69.132). Every path refuses it rather than round it: all_reduce (every
  schedule and auto), reduce_scatter, sync_gradients."""
  n = 4
  x = jnp.asarray(np.random.default_rng(6).standard_normal((n, 2 * B)) * 40, jnp.float32)
  calls = [lambda v, a=a: jaxcoll.all_reduce(v, "x", op=op, algorithm=a, wire_dtype=wire)
           for a in ("auto", *jaxcoll.algorithms("all_reduce", num_axes=1))
           if a not in ("native", "schedule")]
  calls.append(lambda v: jaxcoll.reduce_scatter(v, "x", op=op, tiled=True, algorithm="ring",
                                                wire_dtype=wire))
  calls.append(lambda v: jaxcoll.sync_gradients({"g": v}, "x", op=op, wire_dtype=wire))
  for call in calls:
    with pytest.raises(ValueError, match=rf"wire_dtype=.*{wire}.*op='{op}'.*exact"):
      per_device(call, n, check_vma=False)(x)


def test_gradients_of_compressed_reduce_scatter_and_all_gather():
  n = 4
  x = jnp.asarray(np.random.default_rng(5).standard_normal((n, n * B)), jnp.float32)
  for fn in (lambda v, w: jaxcoll.reduce_scatter(v, "x", tiled=True, algorithm="ring",
                                                 wire_dtype=w),
             lambda v, w: jaxcoll.all_gather(v, "x", algorithm="ring", wire_dtype=w)):
    def loss(x, w, fn=fn):
      y = per_device(lambda v: fn(v, w), n, jit=False)(x)
      return jnp.sum(y * jnp.arange(y.size, dtype=jnp.float32).reshape(y.shape))
    grad = jax.jit(jax.grad(loss), static_argnums=1)
    np.testing.assert_array_equal(grad(x, "int8"), grad(x, None))


def test_errors_name_the_argument():
  x = jnp.ones((8, 512), jnp.float32)
  with pytest.raises(ValueError, match="algorithm='native'.*cannot send wire_dtype='int8'"):
    per_device(lambda v: jaxcoll.all_reduce(v, "x", algorithm="native", wire_dtype="int8"),
               8)(x)
  with pytest.raises(ValueError, match="wire_dtype='int8' compresses floating data"):
    per_device(lambda v: jaxcoll.all_reduce(v, "x", wire_dtype="int8"), 8)(x.astype(jnp.int32))
  with pytest.raises(ValueError, match="accumulate_dtype=float64 (conflicts|needs 64-bit)"):
    per_device(lambda v: jaxcoll.all_reduce(v, "x", wire_dtype="int8",
                                            accumulate_dtype="float64"), 8)(x)
  with pytest.raises(ValueError, match="wire_block_size=3"):
    per_device(lambda v: jaxcoll.all_gather(v, "x", wire_dtype="int8", wire_block_size=3), 8)(x)


def test_auto_never_picks_native_for_a_compressed_call():
  x = jnp.ones((8, 16), jnp.float32)   # tiny: auto would pick native uncompressed
  jaxpr = jax.make_jaxpr(per_device(lambda v: jaxcoll.all_reduce(v, "x", wire_dtype="int8"),
                                    8, jit=False))(x)
  assert ppermute_bytes_per_rank(jaxpr, 8).max() > 0
  assert "psum" not in str(jaxpr)


def test_a_wire_format_object_is_taken_where_a_name_is():
  """Integrations pass the WireFormat they checked, not its name: the same program."""
  x = jnp.asarray(np.random.default_rng(3).standard_normal((8, 300)), jnp.float32)
  by_name = per_device(lambda v: jaxcoll.all_reduce(v, "x", algorithm="ring", wire_dtype="int8",
                                                    wire_block_size=64), 8)(x)
  fmt = jaxcoll.WireFormat("int8", 64)
  by_object = per_device(lambda v: jaxcoll.all_reduce(v, "x", algorithm="ring",
                                                      wire_dtype=fmt), 8)(x)
  np.testing.assert_array_equal(by_name, by_object)
  assert wire.wire_format(fmt, np.float32) == fmt and wire.compresses(fmt, np.float32)
  assert wire.wire_format(jaxcoll.WireFormat("bfloat16"), jnp.bfloat16) is None   # x's own
  with pytest.raises(ValueError, match="wire_block_size=32 conflicts"):
    per_device(lambda v: jaxcoll.all_reduce(v, "x", algorithm="ring", wire_dtype=fmt,
                                            wire_block_size=32), 8)(x)
