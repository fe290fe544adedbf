"""The sorted MoE layout (``dispatch(layout="sorted")``) and ``grouped_matmul`` against a
single-device dense reference and ``jax.lax.ragged_dot``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxcoll import moe

D = 8
MESHES = [((1,), ("x",), "x"), ((2,), ("x",), "x"), ((4,), ("x",), "x"), ((8,), ("x",), "x"),
          ((2, 4), ("node", "local"), ("node", "local"))]


def kept_pairs(ids, num_experts, rows):
  """Which pairs of ``ids [N, T, k]`` get a row: each device receives, in order of (local
  expert, source, the pair's rank among the source's pairs to that expert, choice-major),
  the first ``rows``; ids outside [0, E) get none. Written from dispatch's docstring."""
  n, t, k = ids.shape
  local = num_experts // n
  kept = np.zeros(ids.shape, bool)
  for dst in range(n):
    place = 0
    for e in range(dst * local, (dst + 1) * local):
      for src in range(n):
        for j in range(k):
          for i in range(t):
            if ids[src, i, j] == e:
              kept[src, i, j] = place < rows
              place += 1
  return kept


def dense(x, w, ids, gates, kept):
  """Each token's gated sum of tanh(x @ w[e]) over its kept pairs: [N, T, d]."""
  y = jnp.tanh(jnp.einsum("ntd,edf->ntef", x, w))
  picked = jnp.take_along_axis(y, jnp.asarray(np.clip(ids, 0, w.shape[0] - 1))[..., None], axis=2)
  return jnp.sum(picked * (gates * kept)[..., None], axis=2)


def sorted_moe(shape, names, axes, e, k, **options):
  mesh = Mesh(np.array(jax.devices()[:int(np.prod(shape))]).reshape(shape), names)
  spec = P(names)

  def body(x, ids, gates, w):
    h, state = moe.dispatch(x[0], ids[0], num_experts=e, capacity=None, axis_name=axes,
                            layout="sorted", **options)
    y = jnp.tanh(moe.grouped_matmul(h, w, state.group_sizes))
    return (moe.combine(y, state, gates[0])[None], state.dropped[None],
            moe.total_dropped(state)[None], h.shape[0] + 0 * state.exchanged[None])

  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 4, out_specs=(spec,) * 4))


def routed(n, t, e, k, skew, seed):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((n, t, D)).astype(np.float32)
  logits = rng.standard_normal((n, t, e)).astype(np.float32)
  logits[..., e // 2] += skew
  w = (rng.standard_normal((e, D, D)) / np.sqrt(D)).astype(np.float32)
  ids, gates = jax.vmap(lambda row: moe.route(row, k))(jnp.asarray(logits))
  return x, np.asarray(ids), np.asarray(gates), w


def check(f, x, ids, gates, w, kept):
  got, dropped, total, rows = f(x, ids, gates, w)
  np.testing.assert_allclose(got, dense(x, w, ids, gates, kept), rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(dropped, (~kept).sum(axis=(1, 2)))
  np.testing.assert_array_equal(total, np.full(x.shape[0], (~kept).sum()))
  loss = lambda x, w, g: jnp.sum(jnp.sin(f(x, ids, g, w)[0]))
  want = lambda x, w, g: jnp.sum(jnp.sin(dense(x, w, ids, g, kept)))
  for a, b in zip(jax.grad(loss, (0, 1, 2))(x, w, gates), jax.grad(want, (0, 1, 2))(x, w, gates)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
  return int(rows[0])


@pytest.mark.parametrize("case", MESHES, ids=lambda c: "x".join(map(str, c[0])))
@pytest.mark.parametrize("skew", [pytest.param(0.0, marks=pytest.mark.quick), 2.0, 100.0],
                         ids=["no skew", "mild skew", "total skew"])
def test_sorted_equals_the_dense_reference_under_any_skew(case, skew):
  """Dropless (buffer_factor None): nothing is dropped however skewed; forward and the
  gradients of tokens, expert weights and gates equal the dense reference."""
  shape, names, axes = case
  n = int(np.prod(shape))
  e, k, t = 2 * n, 2, 8
  x, ids, gates, w = routed(n, t, e, k, skew, seed=n + int(skew))
  f = sorted_moe(shape, names, axes, e, k, chunk=3)
  rows = check(f, x, ids, gates, w, kept_pairs(ids, e, n * t * k))
  assert rows == n * t * k


@pytest.mark.quick
@pytest.mark.parametrize("case", [MESHES[2], MESHES[4]], ids=["4", "2x4"])
@pytest.mark.parametrize("buffer_factor,skew", [(1.0, 0.0), (1.25, 2.0), (1.5, 100.0),
                                                (0.5, 1.0)])
def test_buffer_factor_drops_exactly_the_pairs_past_the_bound(case, buffer_factor, skew):
  """Rows past R = ceil(buffer_factor * T * k) are dropped in the documented order, counted
  by their source, and add nothing to the outputs or the gradients."""
  shape, names, axes = case
  n = int(np.prod(shape))
  e, k, t = 2 * n, 2, 12
  x, ids, gates, w = routed(n, t, e, k, skew, seed=7)
  rows = int(np.ceil(buffer_factor * t * k))
  kept = kept_pairs(ids, e, rows)
  f = sorted_moe(shape, names, axes, e, k, buffer_factor=buffer_factor)
  assert check(f, x, ids, gates, w, kept) == rows
  if skew >= 2.0:
    assert (~kept).sum() > 0   # the case drops something


@settings(max_examples=8, deadline=None)
@given(data=st.data())
def test_any_routing_chunk_and_bound(data):
  """Random expert ids (some outside [0, E): dropped), chunks and bounds on 4 devices."""
  n, e, k, t = 4, 8, 3, 5
  ids = np.array(data.draw(st.lists(st.integers(-1, e), min_size=n * t * k,
                                    max_size=n * t * k))).reshape(n, t, k)
  chunk = data.draw(st.integers(1, t * k))
  factor = data.draw(st.sampled_from([None, 0.25, 1.0, 2.0]))
  rng = np.random.default_rng(0)
  x = rng.standard_normal((n, t, D)).astype(np.float32)
  w = rng.standard_normal((e, D, D)).astype(np.float32)
  gates = rng.random((n, t, k)).astype(np.float32)
  rows = n * t * k if factor is None else int(np.ceil(factor * t * k))
  f = sorted_moe((n,), ("x",), "x", e, k, chunk=chunk, buffer_factor=factor)
  check(f, x, ids, gates, w, kept_pairs(ids, e, rows))


@pytest.mark.quick
@pytest.mark.parametrize("wire", ["bfloat16", "int8"])
def test_compressed_sorted_dispatch(wire):
  """The dispatch rows go compressed; the result stays within the wire format's error of the
  uncompressed layout."""
  n, e, k, t = 4, 8, 2, 16
  x, ids, gates, w = routed(n, t, e, k, 1.0, seed=3)
  plain = sorted_moe((n,), ("x",), "x", e, k)(x, ids, gates, w)[0]
  packed = sorted_moe((n,), ("x",), "x", e, k, wire_dtype=wire)(x, ids, gates, w)[0]
  scale = float(np.max(np.abs(plain)))
  assert 0 < float(np.max(np.abs(packed - plain))) < 0.05 * scale


@pytest.mark.quick
def test_sorted_layout_errors_name_the_argument():
  mesh = Mesh(np.array(jax.devices()[:4]), ("x",))

  def call(**options):
    def body(x):
      ids = jnp.zeros((6, 2), jnp.int32)
      options.setdefault("capacity", None)
      h, state = moe.dispatch(x[0], ids, num_experts=8, axis_name="x", **options)
      return moe.combine(h, state, jnp.ones((6, 2)))[None]
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))(
        np.zeros((4, 6, D), np.float32))

  with pytest.raises(ValueError, match="layout='dense'"):
    call(layout="dense")
  with pytest.raises(ValueError, match="capacity=4 applies to layout='buffers'"):
    call(layout="sorted", capacity=4)
  with pytest.raises(ValueError, match="algorithm='allgather'"):
    call(layout="sorted", algorithm="allgather")
  with pytest.raises(ValueError, match="buffer_factor=2.0 applies to layout='sorted'"):
    call(buffer_factor=2.0)
  with pytest.raises(ValueError, match="buffer_factor=0"):
    call(layout="sorted", buffer_factor=0)
  with pytest.raises(ValueError, match="chunk=13"):
    call(layout="sorted", chunk=13)
  with pytest.raises(ValueError, match="group_sizes: a dispatch of layout='sorted'"):
    _ = moe.RoutingState(*[jnp.zeros(1)] * 6, 4, 1, "x", "direct").group_sizes


def test_sorted_combine_checks_the_rows():
  mesh = Mesh(np.array(jax.devices()[:2]), ("x",))

  def body(x):
    h, state = moe.dispatch(x[0], jnp.zeros((6, 2), jnp.int32), num_experts=2, capacity=None,
                            axis_name="x", layout="sorted")
    return moe.combine(h[:-1], state, jnp.ones((6, 2)))[None]

  with pytest.raises(ValueError, match=r"expert_outputs must be \[24, d\]"):
    jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))(
        np.zeros((2, 6, D), np.float32))


# grouped_matmul

def grouped_reference(x, w, sizes):
  ids = np.repeat(np.arange(len(sizes)), sizes)
  y = np.zeros((x.shape[0], w.shape[2]), np.float64)
  y[:len(ids)] = np.einsum("rd,rdf->rf", x[:len(ids)].astype(np.float64),
                           w[ids].astype(np.float64))
  return y


@pytest.mark.quick
@settings(max_examples=20, deadline=None)
@given(sizes=st.lists(st.integers(0, 9), min_size=1, max_size=6), spare=st.integers(0, 5),
       tile=st.integers(1, 16), implementation=st.sampled_from(["tiled", "ragged_dot"]))
def test_grouped_matmul_equals_the_per_row_product(sizes, spare, tile, implementation):
  """Any group sizes (empty groups, rows past the groups), tiles dividing the rows or not:
  the product and its gradients equal the per-row reference."""
  sizes = np.array(sizes, np.int32)
  m = int(sizes.sum()) + spare
  rng = np.random.default_rng(m)
  x = rng.standard_normal((m, 3)).astype(np.float32)
  w = rng.standard_normal((len(sizes), 3, 4)).astype(np.float32)
  f = lambda x, w: moe.grouped_matmul(x, w, jnp.asarray(sizes), implementation=implementation,
                                      tile=tile)
  np.testing.assert_allclose(f(x, w), grouped_reference(x, w, sizes), rtol=1e-5, atol=1e-5)
  dy = rng.standard_normal((m, 4)).astype(np.float32)
  gx, gw = jax.vjp(f, x, w)[1](jnp.asarray(dy))
  ids = np.repeat(np.arange(len(sizes)), sizes)
  want_gx = np.zeros_like(x)
  want_gx[:len(ids)] = np.einsum("rf,rdf->rd", dy[:len(ids)], w[ids])
  want_gw = np.zeros_like(w)
  np.add.at(want_gw, ids, np.einsum("rd,rf->rdf", x[:len(ids)], dy[:len(ids)]))
  np.testing.assert_allclose(gx, want_gx, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(gw, want_gw, rtol=1e-5, atol=1e-5)


@pytest.mark.quick
def test_grouped_matmul_bfloat16_accumulates_in_float32():
  sizes = jnp.array([100, 0, 156], jnp.int32)
  rng = np.random.default_rng(1)
  x = rng.standard_normal((256, 64)).astype(np.float32)
  w = rng.standard_normal((3, 64, 32)).astype(np.float32)
  want = grouped_reference(x.astype(jnp.bfloat16).astype(np.float32),
                           w.astype(jnp.bfloat16).astype(np.float32), np.asarray(sizes))
  for implementation in ("tiled", "ragged_dot"):
    got = moe.grouped_matmul(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16), sizes,
                             implementation=implementation)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=1e-2, atol=5e-2)


@pytest.mark.quick
def test_grouped_matmul_errors_name_the_argument():
  x, w, sizes = jnp.ones((4, 2)), jnp.ones((2, 2, 3)), jnp.array([2, 2])
  with pytest.raises(ValueError, match=r"x must be \[m, d\]"):
    moe.grouped_matmul(jnp.ones(4), w, sizes)
  with pytest.raises(ValueError, match=r"w must be \[G, d, f\] with d = 2"):
    moe.grouped_matmul(x, jnp.ones((2, 3, 3)), sizes)
  with pytest.raises(ValueError, match=r"group_sizes must be \[G\] = \[2\] integers"):
    moe.grouped_matmul(x, w, jnp.array([2.0, 2.0]))
  with pytest.raises(ValueError, match="implementation='megablox'"):
    moe.grouped_matmul(x, w, sizes, implementation="megablox")
  with pytest.raises(ValueError, match="tile=0"):
    moe.grouped_matmul(x, w, sizes, tile=0)


@pytest.mark.quick
def test_sorted_bfloat16_tokens():
  """bfloat16 tokens and experts: the rows keep their dtype through both exchanges, and the
  layer is within bfloat16's rounding of the float32 reference."""
  n, e, k, t = 4, 8, 2, 16
  x, ids, gates, w = routed(n, t, e, k, 1.0, seed=9)
  f = sorted_moe((n,), ("x",), "x", e, k)
  got = f(x.astype(jnp.bfloat16), ids, gates.astype(jnp.bfloat16), w.astype(jnp.bfloat16))[0]
  assert got.dtype == jnp.bfloat16
  want = dense(x, w, ids, gates, np.ones(ids.shape, bool))
  np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=5e-2)
