"""The fused reduce kernel (Pallas, interpret mode on CPU) against NumPy and its jnp reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxcoll
from jaxcoll import kernels
from tests.helpers import count_primitive, iter_eqns, per_device

pytestmark = pytest.mark.quick   # also on the oldest supported jax (.ci/run)

DTYPES = (np.float32, ml_dtypes.bfloat16, np.float16, np.int32)
LENGTHS = (1, 4096, 70001)   # one value; in place in one tile; padded, partial last tile
NP_OPS = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}


def data(rng, dtype, length, op):
  if np.dtype(dtype) == np.int32:
    return rng.integers(-1000, 1000, length).astype(dtype)
  scale = 1.0 if op == "prod" else 100.0
  return (rng.standard_normal(length) * scale).astype(dtype)


def bits_of(x):
  x = np.asarray(x)
  return x.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[x.dtype.itemsize])


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("op", list(NP_OPS))
def test_round_to_nearest_equals_numpy_and_the_reference_bit_for_bit(op, dtype):
  rng = np.random.default_rng(0)
  for length in LENGTHS:
    a, b = data(rng, dtype, length, op), data(rng, dtype, length, op)
    work = np.float32 if np.dtype(dtype).itemsize == 2 else dtype   # fp32 for bf16/f16
    want = NP_OPS[op](a.astype(work), b.astype(work)).astype(dtype)
    got = kernels.fused_combine(a, b, op=op)
    assert got.dtype == dtype and got.shape == a.shape
    np.testing.assert_array_equal(bits_of(got), bits_of(want))
    np.testing.assert_array_equal(bits_of(kernels.fused_combine_reference(a, b, op=op)),
                                  bits_of(want))


@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float16])
def test_scale_and_output_dtype(dtype):
  rng = np.random.default_rng(1)
  a = rng.standard_normal((3, 333)).astype(dtype)
  b = rng.standard_normal((3, 333)).astype(np.float32)
  want = ((a.astype(np.float32) + b) * np.float32(0.125)).astype(np.float32)
  got = kernels.fused_combine(a, b, scale=0.125, out_dtype=jnp.float32)
  np.testing.assert_array_equal(np.asarray(got), want)
  want = ((a.astype(np.float32) + b) * np.float32(0.125)).astype(dtype)
  np.testing.assert_array_equal(bits_of(kernels.fused_combine(a, b, scale=0.125)), bits_of(want))


def test_decodes_a_block_scaled_wire_chunk():
  rng = np.random.default_rng(2)
  fmt = jaxcoll.WireFormat("int8", 128)
  acc = jnp.asarray(rng.standard_normal((4, 512)), jnp.float32)
  values, exps = fmt.encode(jnp.asarray(rng.standard_normal((4, 512)) * 1e3, jnp.float32))
  want = np.asarray(acc) + np.asarray(fmt.decode(values, exps))
  got = kernels.fused_combine(acc, values, recv_exponents=exps)
  np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.parametrize("out", [ml_dtypes.bfloat16, np.float16])
def test_stochastic_rounding_is_unbiased_and_deterministic(out):
  """For y between two neighbours lo < hi of ``out``, each value rounds up with probability
  p = (y - lo) / (hi - lo): over n values the mean error has standard deviation
  (hi - lo) sqrt(p (1 - p) / n); we require |mean error| < 5 of those (a false failure
  has probability below 1e-6)."""
  n = 1 << 15
  info = ml_dtypes.finfo(out)
  for y in (1.0 + 0.3 * float(info.eps), -3.0 - 0.77 * 2 * float(info.eps),
            # float16's subnormals (bfloat16's are float32 subnormals, which XLA's CPU flushes)
            float(info.smallest_subnormal) * 2.4 if out == np.float16 else 3.3e-30, 1000.123):
    acc = jnp.full((n,), y, jnp.float32)
    zero = jnp.zeros((n,), jnp.float32)
    key = jax.random.key(7)
    got = np.asarray(kernels.fused_combine(acc, zero, out_dtype=out, rounding="stochastic",
                                           key=key)).astype(np.float64)
    lo, hi = np.sort(np.unique(got))[[0, -1]]
    assert len(np.unique(got)) == 2 and lo < np.float32(y) < hi   # only the two neighbours
    p = (np.float32(y) - lo) / (hi - lo)
    sd = (hi - lo) * np.sqrt(p * (1 - p) / n)
    assert abs(got.mean() - np.float32(y)) < 5 * sd, (y, got.mean(), sd)
    again = kernels.fused_combine(acc, zero, out_dtype=out, rounding="stochastic", key=key)
    np.testing.assert_array_equal(bits_of(again), bits_of(got.astype(out)))
    other = kernels.fused_combine(acc, zero, out_dtype=out, rounding="stochastic",
                                  key=jax.random.key(8))
    assert not np.array_equal(bits_of(other), bits_of(got.astype(out)))
    ref = kernels.fused_combine_reference(acc, zero, out_dtype=out, rounding="stochastic",
                                          key=key)
    np.testing.assert_array_equal(bits_of(ref), bits_of(got.astype(out)))


def test_stochastic_rounding_mean_over_keys_tends_to_the_value():
  """Mean over 200 keys of a small random array: error shrinks like 1/sqrt(keys)."""
  x = jnp.asarray(np.random.default_rng(3).standard_normal(256), jnp.float32)
  f = jax.jit(lambda k: kernels.fused_combine(x, jnp.zeros_like(x), out_dtype=jnp.bfloat16,
                                              rounding="stochastic", key=k).astype(jnp.float32))
  keys = jax.random.split(jax.random.key(0), 200)
  mean = np.mean([np.asarray(f(k)) for k in keys], axis=0)
  nearest = np.asarray(x.astype(jnp.bfloat16).astype(jnp.float32))
  spacing = np.asarray(2.0 ** (np.floor(np.log2(np.abs(x))) - 7))
  assert np.all(np.abs(mean - x) < 5 * spacing / np.sqrt(200) / 2 + 1e-7)
  assert np.abs(mean - x).mean() < 0.5 * np.abs(nearest - x).mean() + 1e-3 * spacing.mean()


def test_in_place_aliasing_is_taken():
  a = jnp.ones((8, 1024), jnp.float32)
  def pallas_eqn(jaxpr):
    (eqn,) = [e for e, _ in iter_eqns(jaxpr) if e.primitive.name == "pallas_call"]
    return eqn
  call = pallas_eqn(jax.make_jaxpr(kernels.fused_combine)(a, a))
  assert call.params["input_output_aliases"] == ((0, 0),)
  hlo = jax.jit(kernels.fused_combine, donate_argnums=0).lower(a, a).compile().as_text()
  assert "input_output_alias" in hlo
  other = jax.make_jaxpr(lambda x, y: kernels.fused_combine(x, y, out_dtype=jnp.bfloat16))(a, a)
  assert pallas_eqn(other).params["input_output_aliases"] == ()   # a new dtype cannot alias


def test_gradients_equal_those_of_the_reference():
  rng = np.random.default_rng(4)
  a, b = (jnp.asarray(rng.standard_normal(300), jnp.float32) for _ in range(2))
  def loss(f, a, b, kw):
    return jnp.sum(f(a, b, **kw) * jnp.arange(300.0))
  for kw in ({"op": "sum", "scale": 0.5}, {"op": "max"}, {"op": "prod"}):
    grads = [jax.grad(loss, (1, 2))(f, a, b, kw)
             for f in (kernels.fused_combine, kernels.fused_combine_reference)]
    np.testing.assert_array_equal(grads[0], grads[1])


def test_errors_name_the_argument():
  a = jnp.ones(8, jnp.float32)
  with pytest.raises(ValueError, match="op='xor'"):
    kernels.fused_combine(a, a, op="xor")
  with pytest.raises(ValueError, match=r"recv.shape \(4,\) must equal acc.shape \(8,\)"):
    kernels.fused_combine(a, a[:4])
  with pytest.raises(ValueError, match="rounding='stochastic' needs key="):
    kernels.fused_combine(a, a, out_dtype=jnp.bfloat16, rounding="stochastic")
  with pytest.raises(ValueError, match="rounds float32 work to bfloat16 or float16"):
    kernels.fused_combine(a, a, rounding="stochastic", key=jax.random.key(0))
  with pytest.raises(ValueError, match="key= is for rounding='stochastic'"):
    kernels.fused_combine(a, a, key=jax.random.key(0))
  with pytest.raises(ValueError, match="scale=2.0 applies to floating data"):
    kernels.fused_combine(a.astype(jnp.int32), a.astype(jnp.int32), scale=2.0)
  with pytest.raises(ValueError, match="rounding='up'"):
    kernels.fused_combine(a, a, rounding="up")
  with pytest.raises(ValueError, match="recv_exponents must be int8"):
    kernels.fused_combine(a, a, recv_exponents=jnp.zeros(3, jnp.int8))
  with pytest.raises(ValueError, match="fused_kernel='yes'"):
    jaxcoll.config(fused_kernel="yes")


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_executor_with_the_kernel_equals_it_without(dtype):
  """config(fused_kernel=True) runs every reduce step through the kernel (interpret mode
  here): the same bits as plain jax.numpy, for plain and compressed messages."""
  n = 4
  x = np.random.default_rng(5).standard_normal((n, 2 * 1024)).astype(dtype)
  calls = {(a, w): (lambda v, a=a, w=w: jaxcoll.all_reduce(v, "x", algorithm=a, wire_dtype=w))
           for a in ("ring", "recursive_doubling") for w in (None, "int8")}
  calls["reduce_scatter"] = lambda v: jaxcoll.reduce_scatter(v, "x", tiled=True,
                                                             algorithm="halving_doubling")
  body = lambda v: {str(k): f(v) for k, f in calls.items()}   # noqa: E731
  plain = per_device(body, n)(x)
  with jaxcoll.config(fused_kernel=True):
    fused = per_device(body, n)(x)
    assert count_primitive(jax.make_jaxpr(per_device(body, n, jit=False))(x),
                           "pallas_call") > 0
  for k in plain:
    np.testing.assert_array_equal(bits_of(fused[k]), bits_of(plain[k]))
  auto = jax.make_jaxpr(per_device(body, n, jit=False))(x)
  assert count_primitive(auto, "pallas_call") == 0   # "auto": plain jnp on CPU
