"""rounding="stochastic" on the reducing collectives: unbiased where round-to-nearest is
biased, replicas bit-identical, every algorithm and wire format, gradients, errors."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax

import jaxcoll
from tests.helpers import mesh

PRIMITIVES = ("all_reduce", "reduce_scatter", "reduce")
KEYS = 2            # keys per call; with LENGTH values each: 2 x 49152 samples per device
LENGTH = 16384 * 3   # divisible by every axis size used (8, 6, 4)


def run(primitive, x, n, *, keys=KEYS, seed=0, check_vma=True, **kw):
  """``primitive`` over n devices of ``x`` ([n, ...], device r's value at r) once per key
  (the key passed replicated, ``in_specs=P()``); returns ``[keys, n, ...]`` as float64."""
  fn = getattr(jaxcoll, primitive)
  extra = {"tiled": True} if primitive == "reduce_scatter" else {}

  def body(v, key):
    return jnp.stack([fn(v[0], "x", key=jax.random.fold_in(key, i), **extra, **kw)
                      for i in range(keys)])[:, None]

  f = jax.jit(jax.shard_map(body, mesh=mesh(n), in_specs=(jax.P("x"), jax.P()),
                            out_specs=jax.P(None, "x"), check_vma=check_vma))
  return np.asarray(f(jnp.asarray(x), jax.random.key(seed)).astype(jnp.float32), np.float64)


def nearest(primitive, x, n, **kw):
  """The round-to-nearest call's ``[n, ...]`` as float64."""
  fn = getattr(jaxcoll, primitive)
  extra = {"tiled": True} if primitive == "reduce_scatter" else {}
  f = jax.jit(jax.shard_map(lambda v: fn(v[0], "x", **extra, **kw)[None], mesh=mesh(n),
                            in_specs=jax.P("x"), out_specs=jax.P("x")))
  return np.asarray(f(jnp.asarray(x)).astype(jnp.float32), np.float64)


def small_updates(n, dtype=jnp.bfloat16):
  """Device 0 holds 256, the others 0.5: bfloat16's step at 256 is 2, so round-to-nearest
  drops most of the 0.5s whichever order they are added in. Exact sum 256 + 0.5 (n - 1)."""
  x = np.full((n, LENGTH), 0.5, np.float32)
  x[0] = 256.0
  return x.astype(dtype), 256.0 + 0.5 * (n - 1)


def result_of(primitive, y, n):
  """The reduction's values: all_reduce any replica, reduce the root's, reduce_scatter all
  the blocks."""
  return y[..., 0, :] if primitive != "reduce_scatter" else y


def algorithms(primitive):
  return jaxcoll.algorithms(primitive, num_axes=1)


CASES = [(p, a) for p in PRIMITIVES for a in algorithms(p)]


@pytest.mark.quick
@pytest.mark.parametrize("primitive,algorithm", CASES)
def test_unbiased_where_round_to_nearest_is_biased(primitive, algorithm):
  """The mean over 2 keys x 49152 values is within 0.1 of the float32 sum: each result is at
  most 2(N-1) = 14 roundings of a value in [256, 512) (step 2, variance <= 1 each), so the
  mean's standard deviation is at most sqrt(14 / 98304) = 0.012 and 0.1 is 8 of them.
  Round-to-nearest misses by 0.5 or more in every algorithm."""
  n = 8
  x, exact = small_updates(n)
  y = result_of(primitive, run(primitive, x, n, algorithm=algorithm, rounding="stochastic"), n)
  assert abs(y.mean() - exact) < 0.1, (y.mean(), exact)
  biased = result_of(primitive, nearest(primitive, x, n, algorithm=algorithm)[None], n)
  assert abs(biased.mean() - exact) >= 0.5


@pytest.mark.quick
@pytest.mark.parametrize("primitive", ["all_reduce", "reduce_scatter"])
@pytest.mark.parametrize("algorithm", ["native", "ring", "halving_doubling"])
@pytest.mark.parametrize("op", ["sum", "mean"])
def test_unbiased_with_float32_partial_sums_and_a_mean(primitive, algorithm, op):
  """accumulate_dtype="float32": one stochastic rounding of the float32 result (a mean's
  division inside it), on 6 devices (not a power of two: the mean's 1/6 is inexact)."""
  n = 6
  x, exact = small_updates(n)
  exact = exact / n if op == "mean" else exact
  y = result_of(primitive, run(primitive, x, n, algorithm=algorithm, op=op,
                               accumulate_dtype="float32", rounding="stochastic"), n)
  step = 2.0 / n if op == "mean" else 2.0   # one rounding, variance <= step^2 / 4
  assert abs(y.mean() - exact) < 5 * step / 2 / np.sqrt(y.size), (y.mean(), exact)


# quick (on the oldest jax too): every test, this one on 8 devices (1 and 3: the full suite)
@pytest.mark.parametrize("n", [1, 3, pytest.param(8, marks=pytest.mark.quick)])
@pytest.mark.parametrize("wire", [None, *jaxcoll.WIRE_DTYPES[1:]])
def test_replicas_bit_identical_every_algorithm_and_wire_format(n, wire):
  """Random bfloat16 data: every all_reduce algorithm, plain, with float32 partial sums and
  with each wire format that compresses bfloat16 (bfloat16 itself does not), leaves every
  replica with the same bits; the same key gives the same bits again and another key other
  bits (uncompressed: a compressed result is on the format's grid, exact in bfloat16); the
  result is within the wire's error of the float64 sum."""
  rng = np.random.default_rng(n)
  x = jnp.asarray(rng.standard_normal((n, 2048)), jnp.bfloat16)
  exact = np.asarray(x, np.float64).sum(0)
  names = [a for a in algorithms("all_reduce") if not (wire and a == "native")]
  for accumulate in ([None, "float32"] if wire is None else [None]):
    kw = dict(rounding="stochastic", wire_dtype=wire, accumulate_dtype=accumulate)
    f = jax.jit(jax.shard_map(   # every algorithm in one program: one compile
        lambda v, k, kw=kw: {a: jaxcoll.all_reduce(v[0], "x", algorithm=a, key=k, **kw)[None]
                             for a in names},
        mesh=mesh(n), in_specs=(jax.P("x"), jax.P()), out_specs=jax.P("x")))
    as_f64 = lambda out: {a: np.asarray(y.astype(jnp.float32), np.float64)   # noqa: E731
                          for a, y in out.items()}
    ys, again, other = (as_f64(f(x, jax.random.key(s))) for s in (0, 0, 1))
    for algorithm in names:
      y = ys[algorithm]
      np.testing.assert_array_equal(y, np.broadcast_to(y[:1], y.shape), err_msg=algorithm)
      np.testing.assert_array_equal(y, again[algorithm])
      # a compressed result lies on the format's grid, which bfloat16 holds exactly
      assert n == 1 or wire is not None or not np.array_equal(y, other[algorithm])
      steps = jaxcoll.schedule("all_reduce", algorithm if algorithm != "native" else "ring",
                               n).num_steps + 2
      eps = 2.0 ** -7 + (jaxcoll.WireFormat(wire).relative_error if wire else 0.0)
      scale = np.abs(np.asarray(x, np.float64)).sum(0).max()
      assert np.abs(y[0] - exact).max() <= steps * eps * scale, algorithm


@pytest.mark.quick
@pytest.mark.parametrize("primitive", PRIMITIVES)
@pytest.mark.parametrize("wire", ["int8", "float8_e4m3fn", "float8_e5m2"])
def test_every_reducing_primitive_with_a_wire_format(primitive, wire):
  """reduce_scatter and reduce take the rounding where they take a wire format (reduce sends
  uncompressed): results within the wire's bound of the float64 reduction."""
  n = 4
  x = np.random.default_rng(0).standard_normal((n, 1024)).astype(jnp.bfloat16)
  kw = {"wire_dtype": wire} if primitive != "reduce" else {}
  y = result_of(primitive, run(primitive, x, n, algorithm="ring" if primitive != "reduce"
                               else "binomial_tree", rounding="stochastic", **kw), n)[0]
  exact = np.asarray(x, np.float64).sum(0)
  if primitive == "reduce_scatter":
    y = y.reshape(-1)
  bound = 8 * (2.0 ** -7 + jaxcoll.WireFormat(wire).relative_error) * np.abs(
      np.asarray(x, np.float64)).sum(0).max()
  assert np.abs(y - exact).max() <= bound


@pytest.mark.quick
def test_the_fused_kernel_rounds_with_the_same_bits():
  """The Pallas combine (interpret mode here) and the jax.numpy combine give the same bits."""
  n = 4
  x = np.random.default_rng(1).standard_normal((n, 4096)).astype(jnp.bfloat16)
  with jaxcoll.config(fused_kernel=False):
    plain = run("all_reduce", x, n, algorithm="ring", rounding="stochastic")
  with jaxcoll.config(fused_kernel=True):
    fused = run("all_reduce", x, n, algorithm="ring", rounding="stochastic")
  np.testing.assert_array_equal(plain, fused)


@pytest.mark.quick
@pytest.mark.parametrize("algorithm", ["native", "ring", "halving_doubling"])
@pytest.mark.parametrize("extra", [{}, {"accumulate_dtype": "float32"}, {"wire_dtype": "int8"}])
def test_gradients_pass_straight_through(algorithm, extra):
  """jax.grad through a stochastic all_reduce and reduce_scatter equals jax.grad through the
  round-to-nearest one (the rounding is invisible to gradients), and lax's (a loss linear
  in the results: its gradient is the collectives' transpose alone)."""
  if algorithm == "native" and "wire_dtype" in extra:
    pytest.skip("native sends no wire format")
  n = 4
  m = mesh(n)
  x = jnp.asarray(np.random.default_rng(2).standard_normal((n, 64)), jnp.bfloat16)
  w = jnp.asarray(np.random.default_rng(3).standard_normal((n, 64)), jnp.bfloat16)

  def loss(rounding, lax_too=False):
    def per_device(x, w, key):
      kw = dict(algorithm=algorithm, rounding=rounding, **extra)
      if rounding == "stochastic":
        kw["key"] = key
      y = lax.psum(x, "x") if lax_too else jaxcoll.all_reduce(x, "x", **kw)
      s = lax.psum_scatter(x[0], "x", tiled=True) if lax_too else jaxcoll.reduce_scatter(
          x[0], "x", tiled=True, **kw)
      return (jnp.sum((y * w).astype(jnp.float32)) +
              jnp.sum((s * w[0, :s.shape[0]]).astype(jnp.float32)))[None]
    f = jax.shard_map(per_device, mesh=m, in_specs=(jax.P("x"), jax.P("x"), jax.P()),
                      out_specs=jax.P("x"))
    return jax.jit(jax.grad(lambda x: jnp.sum(f(x, w, jax.random.key(0)))))(x)

  stochastic, rounded, reference = loss("stochastic"), loss("nearest"), loss("nearest", True)
  np.testing.assert_array_equal(np.asarray(stochastic, np.float32),
                                np.asarray(rounded, np.float32))
  np.testing.assert_allclose(np.asarray(stochastic, np.float32),
                             np.asarray(reference, np.float32), rtol=2e-2, atol=2e-2)


@pytest.mark.quick
def test_pytrees_round_their_low_precision_leaves_each_with_its_own_bits():
  """A float32 leaf beside bfloat16 ones is reduced as lax reduces it; two equal bfloat16
  leaves get different bits (the leaf's index is folded into the key)."""
  n = 4
  x, _ = small_updates(n)
  f32 = np.random.default_rng(0).standard_normal((n, 8)).astype(np.float32)
  f = jax.jit(jax.shard_map(
      lambda a, b, c, k: jaxcoll.all_reduce({"a": a[0], "b": b[0], "c": c[0]}, "x",
                                            rounding="stochastic", key=k),
      mesh=mesh(n), in_specs=(jax.P("x"),) * 3 + (jax.P(),), out_specs=jax.P()))
  out = f(jnp.asarray(x), jnp.asarray(x), f32, jax.random.key(0))
  assert not np.array_equal(np.asarray(out["a"], np.float32), np.asarray(out["b"], np.float32))
  np.testing.assert_allclose(np.asarray(out["c"]), f32.sum(0), rtol=1e-6)


@pytest.mark.quick
@settings(deadline=None, max_examples=12)
@given(n=st.integers(1, 8), length=st.integers(1, 300), half=st.booleans(),
       raw=st.booleans())
def test_any_size_and_dtype_and_key_kind(n, length, half, raw):
  """bfloat16 and float16, any length (padded chunks), any axis size, typed and raw keys:
  replicas agree and the result is within 2(N-1) + 1 steps of its float64 sum."""
  dtype = jnp.float16 if half else jnp.bfloat16
  x = np.random.default_rng(length).standard_normal((n, length)).astype(dtype)
  key = jax.random.PRNGKey(3) if raw else jax.random.key(3)
  f = jax.jit(jax.shard_map(
      lambda v, k: jaxcoll.all_reduce(v[0], "x", algorithm="ring", rounding="stochastic",
                                      key=k)[None],
      mesh=mesh(n), in_specs=(jax.P("x"), jax.P()), out_specs=jax.P("x")))
  y = np.asarray(f(jnp.asarray(x), key).astype(jnp.float32), np.float64)
  np.testing.assert_array_equal(y, np.broadcast_to(y[:1], y.shape))
  eps = 2.0 ** -7 if not half else 2.0 ** -10
  scale = np.abs(np.asarray(x, np.float64)).sum(0).max()
  assert np.abs(y[0] - np.asarray(x, np.float64).sum(0)).max() <= 2 * n * eps * scale


@pytest.mark.quick
def test_errors_name_the_argument():
  n = 2
  m = mesh(n)
  bf = jnp.ones((n, 4), jnp.bfloat16)

  def call(x=bf, key=None, in_key=None, **kw):
    key = jax.random.key(0) if key is None else key
    in_key = jax.P() if in_key is None else in_key
    per_device = (lambda k: k[0]) if in_key != jax.P() else (lambda k: k)
    f = jax.shard_map(lambda v, k: jaxcoll.all_reduce(v, "x", key=per_device(k), **kw),
                      mesh=m, in_specs=(jax.P("x"), in_key), out_specs=jax.P("x"))
    return jax.jit(f)(x, key)

  with pytest.raises(ValueError, match="rounding='up': expected one of"):
    call(rounding="up")
  with pytest.raises(ValueError, match="key= is for rounding='stochastic'"):
    call(rounding="nearest")
  with pytest.raises(TypeError, match="expected a jax.random key"):
    call(key=jnp.ones(3, jnp.float32), rounding="stochastic")
  with pytest.raises(ValueError, match="op='max' selects a value"):
    call(rounding="stochastic", op="max")
  with pytest.raises(ValueError, match="rounds bfloat16 and float16 results; the data has "
                                       "float32"):
    call(x=jnp.ones((n, 4)), rounding="stochastic")
  with pytest.raises(ValueError, match=r"key= varies over \['x'\]"):
    call(key=jax.random.split(jax.random.key(0), n), in_key=jax.P("x"), rounding="stochastic")
  f = jax.shard_map(lambda v: jaxcoll.reduce(v, "x", rounding="stochastic"), mesh=m,
                    in_specs=jax.P("x"), out_specs=jax.P("x"))
  with pytest.raises(ValueError, match="rounding='stochastic' needs key="):
    f(bf)
  packed = jax.ShapeDtypeStruct((4,), jnp.bfloat16)
  for bad in ("up", None, ["stochastic"]):
    g = jax.shard_map(lambda v, bad=bad: jaxcoll.tools.algorithm_of(
        "all_reduce", packed, "x", rounding=bad) and v, mesh=m, in_specs=jax.P("x"),
        out_specs=jax.P("x"))
    with pytest.raises(ValueError, match=re.escape(f"rounding={bad!r}: expected one of")):
      g(bf)


# ---- the integrations: gradient sync, optax, FSDP ----

def grads_tree(n):
  """Per device: a bfloat16 leaf of small updates to 256 (see small_updates), a bfloat16
  leaf of noise and a float32 leaf."""
  x, exact = small_updates(n)
  rng = np.random.default_rng(5)
  return {"big": x[:, :4096], "noise": rng.standard_normal((n, 300)).astype(jnp.bfloat16),
          "f32": rng.standard_normal((n, 7)).astype(np.float32)}, exact


def sharded(tree):
  return jax.tree.map(lambda v: v[0], tree)


@pytest.mark.quick
def test_sync_gradients_and_sync_in_backward_are_unbiased():
  """bfloat16 leaves round stochastically (the mean over keys within 0.1 of the float32 sum,
  as for all_reduce), the float32 leaf as lax reduces it."""
  n = 8
  g, exact = grads_tree(n)
  m = mesh(n)

  def synced(g, key):
    return jaxcoll.sync_gradients(sharded(g), "x", op="sum", rounding="stochastic", key=key)

  def in_backward(g, key):
    params = jax.tree.map(lambda v: jnp.zeros(v.shape[1:], v.dtype), g)   # replicated
    loss = lambda p: sum(jnp.sum((a * b).astype(jnp.float32)) for a, b in zip(   # noqa: E731
        jax.tree.leaves(jaxcoll.sync_in_backward(p, "x", op="sum", rounding="stochastic",
                                                 key=key)), jax.tree.leaves(sharded(g))))
    return jax.grad(loss)(params)

  spec = (jax.P("x"), jax.P())
  f = jax.jit(jax.shard_map(synced, mesh=m, in_specs=spec, out_specs=jax.P(),
                            check_vma=False))
  b = jax.jit(jax.shard_map(in_backward, mesh=m, in_specs=spec, out_specs=jax.P()))
  outs = [f(g, jax.random.key(s)) for s in range(2)]
  big = np.concatenate([np.asarray(o["big"], np.float64) for o in outs])
  assert abs(big.mean() - exact) < 0.1
  np.testing.assert_allclose(np.asarray(outs[0]["f32"]), g["f32"].sum(0), rtol=1e-5)
  np.testing.assert_allclose(np.asarray(outs[0]["noise"], np.float32),
                             np.asarray(g["noise"], np.float32).sum(0), atol=0.1)
  backward = [b(g, jax.random.key(s)) for s in range(2)]
  big = np.concatenate([np.asarray(o["big"], np.float64) for o in backward])
  assert abs(big.mean() - exact) < 0.1
  np.testing.assert_allclose(np.asarray(backward[0]["f32"]), g["f32"].sum(0), rtol=1e-5)


@pytest.mark.quick
def test_optax_sync_keeps_its_key_in_the_state_and_splits_it_every_step():
  """Each update rounds with a key split off the state's (the same as sync_gradients with
  that key) and leaves the rest for the next step; parameters stay replicated."""
  optax = pytest.importorskip("optax")
  n = 4
  g, _ = grads_tree(n)
  tx = jaxcoll.optax.sync("x", op="sum", rounding="stochastic", key=jax.random.key(7))
  state = tx.init(sharded(g))
  next_key, step_key = jax.random.split(jax.random.key(7))

  def step(g, state):
    updates, state = tx.update(sharded(g), state)
    want = jaxcoll.sync_gradients(sharded(g), "x", op="sum", rounding="stochastic",
                                  key=step_key)
    return updates, want, state

  f = jax.jit(jax.shard_map(step, mesh=mesh(n), in_specs=(jax.P("x"), jax.P()),
                            out_specs=jax.P(), check_vma=False))
  updates, want, new = f(g, state)
  for k in updates:
    np.testing.assert_array_equal(np.asarray(updates[k]), np.asarray(want[k]))
  np.testing.assert_array_equal(jax.random.key_data(new.key), jax.random.key_data(next_key))
  assert isinstance(optax.chain(tx, optax.sgd(1.0)).init(sharded(g)), tuple)


@pytest.mark.quick
@pytest.mark.parametrize("secondary", [False, True])
def test_fsdp_gradients_round_stochastically_and_unbiased(secondary):
  """bfloat16 shards: the layer's gradient, reduce-scattered in float32, rounds once,
  stochastically. Every entry's gradient is 1 + 2**-7 + 7 * 2**-10 (device 0's input plus
  the other seven's), between the bfloat16 neighbours 1 + 2**-7 and 1 + 2**-6: nearest
  misses by 2**-10 = 9.8e-4 every time; the mean over 2 keys x 4096 entries (standard
  deviation at most 2**-8 / sqrt(8192) = 4.3e-5) is within 3e-4. With hpZ (two stages) too."""
  n = 8
  axes = ("node", "local") if secondary else ("x",)
  m = jax.sharding.Mesh(np.array(jax.devices()[:n]).reshape((2, 4) if secondary else (n,)),
                        axes)
  blocks = jaxcoll.fsdp.place(jaxcoll.fsdp.shard({"w": jnp.ones((8, 512), jnp.bfloat16)}, n),
                              m, axes)
  x = np.full((n, 8), 2.0 ** -10, np.float32)
  x[0] = 1 + 2.0 ** -7
  x = jnp.asarray(x, jnp.bfloat16)
  exact = 1 + 2.0 ** -7 + 7 * 2.0 ** -10
  kw = dict(secondary_axis="local") if secondary else {}
  specs = jaxcoll.fsdp.specs(blocks, axes)

  def grads(rounding, seeds):
    dense = jaxcoll.fsdp.layer(lambda p, x: x @ p["w"], axes, rounding=rounding, **kw)

    def one(b, x, k):
      key = k if rounding == "stochastic" else None
      return jax.grad(lambda b: jnp.sum(dense(b, x, key=key).astype(jnp.float32)))(b)

    f = jax.jit(jax.shard_map(one, mesh=m, in_specs=(specs, jax.P(axes), jax.P()),
                              out_specs=specs, check_vma=False))
    return np.stack([np.asarray(jaxcoll.fsdp.unshard(f(blocks, x, jax.random.key(s)))["w"]
                                .astype(jnp.float32), np.float64) for s in seeds])

  stochastic = grads("stochastic", range(2))
  assert abs(stochastic.mean() - exact) < 3e-4
  if not secondary:   # (hpZ rounds between its two stages too: still unbiased)
    assert set(np.unique(stochastic)) == {1 + 2.0 ** -7, 1 + 2.0 ** -6}
  assert abs(grads("nearest", [0]).mean() - exact) > 9e-4
  with pytest.raises(ValueError, match="needs key="):
    jax.shard_map(lambda b, x: jaxcoll.fsdp.layer(lambda p, x: x @ p["w"], axes,
                                                  rounding="stochastic", **kw)(b, x),
                  mesh=m, in_specs=(specs, jax.P(axes)), out_specs=jax.P(),
                  check_vma=False)(blocks, x)
