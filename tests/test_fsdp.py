"""jaxcoll.fsdp against lax's all_gather and against data-parallel (one-device) training."""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxcoll
from jaxcoll import fsdp
from jaxcoll._src import compat

TUPLE = ("node", "local")


def flat_mesh(n=8):
  return Mesh(np.array(jax.devices()[:n]), ("x",))


def tuple_mesh():
  return Mesh(np.array(jax.devices()).reshape(2, 4), TUPLE)


# ---------------------------------------------------------------------------- shard / unshard

def test_shard_unshard_round_trip_uneven_leaves_and_specs():
  params = {"w": jnp.arange(13 * 5, dtype=jnp.float32).reshape(13, 5), "b": jnp.ones(5),
            "s": jnp.float32(3.0), "i": jnp.arange(3, dtype=jnp.int32)}
  sharded = fsdp.shard(params, 8)
  assert sharded["w"].value.shape == (16, 5) and sharded["b"].value.shape == (8,)
  assert sharded["s"].value.shape == (8,) and sharded["s"].shape == ()
  np.testing.assert_array_equal(sharded["w"].value[13:], 0)
  chex.assert_trees_all_equal(fsdp.unshard(sharded), params)
  along1 = fsdp.shard({"w": params["w"]}, 4, axis=1)
  assert along1["w"].value.shape == (13, 8) and along1["w"].axis == 1
  chex.assert_trees_all_equal(fsdp.unshard(along1), {"w": params["w"]})
  mixed = fsdp.shard({"w": params["w"], "b": params["b"]}, 4, axis={"w": 1, "b": 0})
  assert (mixed["w"].axis, mixed["b"].axis) == (1, 0)
  spec = fsdp.specs(sharded, "x")
  assert spec["w"].value == P("x") and along1["w"].axis == 1
  assert fsdp.specs(along1, "x")["w"].value == P(None, "x")
  placed = fsdp.place(sharded, flat_mesh(), "x")
  assert placed["w"].value.addressable_shards[0].data.shape == (2, 5)


def test_shard_errors_name_the_leaf():
  with pytest.raises(ValueError, match=r"params\['b'\].*axis=1"):
    fsdp.shard({"b": jnp.ones(5)}, 2, axis=1)
  with pytest.raises(ValueError, match="num_shards"):
    fsdp.shard({"b": jnp.ones(5)}, 0)
  with pytest.raises(ValueError, match="secondary_axis"):
    jax.shard_map(lambda v: fsdp.gather(v, TUPLE, secondary_axis="node"), mesh=tuple_mesh(),
                  in_specs=P(TUPLE), out_specs=P())(fsdp.shard(jnp.ones(8), 8))
  with pytest.raises(TypeError, match="unexpected keyword argument 'wire'"):
    fsdp.train_step(lambda p, b: 0.0, optax.sgd(0.1), flat_mesh(), "x", wire="int8")


# ---------------------------------------------------------------------------- gather vs lax

def _gather_vs_lax(shape, axis, n, algorithm, secondary=False):
  mesh = tuple_mesh() if secondary else flat_mesh(n)
  axes = TUPLE if secondary else "x"
  n = mesh.size
  rng = np.random.default_rng(sum(shape) + axis + n)
  x = rng.standard_normal(shape).astype(np.float32)
  c = rng.standard_normal(shape).astype(np.float32)
  sharded = fsdp.shard(x, n, axis=axis)
  spec = fsdp.specs(sharded, axes)

  def ours(s):
    full = fsdp.gather(s, axes, algorithm=algorithm,
                       secondary_axis="local" if secondary else None)
    return jnp.sum(jnp.sin(full) * c)

  def theirs(s):
    full = lax.all_gather(s.value, axes, axis=s.axis, tiled=True)
    return jnp.sum(jnp.sin(lax.slice_in_dim(full, 0, shape[axis], axis=axis)) * c)

  def run(f):
    g = jax.shard_map(lambda s: (f(s)[None], jax.grad(f)(s)), mesh=mesh, in_specs=(spec,),
                      out_specs=(P(axes), spec), check_vma=False)
    return jax.jit(g)(sharded)

  (va, ga), (vb, gb) = run(ours), run(theirs)
  np.testing.assert_allclose(va, vb, rtol=1e-6, atol=1e-5)
  np.testing.assert_allclose(ga.value, gb.value, rtol=1e-6, atol=1e-5)


@settings(max_examples=6, deadline=None)
@given(shape=st.lists(st.integers(1, 9), min_size=1, max_size=3),
       axis=st.integers(0, 2), n=st.sampled_from([1, 2, 4, 8]))
def test_gather_and_its_gradient_equal_lax_all_gather(shape, axis, n):
  _gather_vs_lax(tuple(shape), axis % len(shape), n, "auto")


@pytest.mark.quick
@pytest.mark.parametrize("algorithm", ["ring", "native", "bruck"])
@pytest.mark.parametrize("secondary", [False, True], ids=["flat", "hpZ"])
def test_gather_gradient_per_algorithm(algorithm, secondary):
  _gather_vs_lax((11, 3), 0, 8, algorithm, secondary)


# ---------------------------------------------------------------------------- models

def mlp_init(key, sizes=(13, 37, 29, 5)):
  keys = jax.random.split(key, len(sizes) - 1)
  return [{"w": jax.random.normal(k, (a, b)) / np.sqrt(a), "b": jnp.zeros(b) + 0.01}
          for k, a, b in zip(keys, sizes[:-1], sizes[1:])]


def dense(p, h, last=False):
  h = h @ p["w"] + p["b"]
  return h if last else jnp.tanh(h)


def mlp(params, x, run_layer=lambda f, p, h: f(p, h)):
  for i, p in enumerate(params):
    x = run_layer(functools.partial(dense, last=i == len(params) - 1), p, x)
  return x


def mse(params, batch, **kw):
  x, y = batch
  return jnp.mean((mlp(params, x, **kw) - y) ** 2)


def block_init(key, d=12, hidden=20):
  k = jax.random.split(key, 6)
  w = lambda kk, a, b: jax.random.normal(kk, (a, b)) / np.sqrt(a)   # noqa: E731
  return {"ln": jnp.ones(d), "wq": w(k[0], d, d), "wk": w(k[1], d, d), "wv": w(k[2], d, d),
          "wo": w(k[3], d, d), "w1": w(k[4], d, hidden), "w2": w(k[5], hidden, d)}


def block(p, x):
  """A pre-norm transformer block (one head) on x [B, S, d]."""
  h = x * lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * p["ln"]
  q, k, v = h @ p["wq"], h @ p["wk"], h @ p["wv"]
  att = jax.nn.softmax(q @ jnp.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1]), axis=-1)
  x = x + (att @ v) @ p["wo"]
  return x + jax.nn.gelu(x @ p["w1"]) @ p["w2"]


def blocks_loss(params, batch, run_layer=lambda f, p, h: f(p, h)):
  x, y = batch
  for p in params:
    x = run_layer(block, p, x)
  return jnp.mean((x - y) ** 2)


def reference(loss_fn, params, batch, tx, steps, n, dtype=None):
  """Data-parallel training on one device: each of n devices' batch shares gives a gradient
  (parameters cast to ``dtype`` for compute), averaged in float32."""
  cast = (lambda p: p) if dtype is None else (
      lambda p: jax.tree.map(lambda v: v.astype(dtype), p))
  shares = jax.tree.map(lambda v: v.reshape((n, -1) + v.shape[1:]), batch)

  @jax.jit
  def step(p, s):   # one share at a time: the same shapes (and bf16 roundings) as a device's
    grads = [jax.grad(lambda q, i=i: loss_fn(cast(q), jax.tree.map(lambda v: v[i], shares)))(p)
             for i in range(n)]
    grads = jax.tree.map(lambda *g: sum(g) / n, *grads)
    updates, s = tx.update(grads, s, p)
    return optax.apply_updates(p, updates), s

  state = tx.init(params)
  for _ in range(steps):
    params, state = step(params, state)
  return params


def data(key, shape_x, shape_y):
  """Inputs, and targets from a random linear teacher plus noise (the loss has a floor)."""
  kx, kw, kn = jax.random.split(key, 3)
  x = jax.random.normal(kx, shape_x)
  teacher = jax.random.normal(kw, (shape_x[-1], shape_y[-1])) / np.sqrt(shape_x[-1])
  return x, jnp.sin(x @ teacher) + 0.3 * jax.random.normal(kn, shape_y)


def train(step, params, batch, steps):
  state = step.init(params)
  losses = []
  for _ in range(steps):
    state, loss = step(state, batch)
    losses.append(float(loss))
  return step.params(state), losses


def layerwise(loss_fn, axes, **options):
  """loss_fn over Sharded blocks, each layer an FSDP unit (fsdp.layer)."""
  def run_layer(f, p, h):
    return fsdp.layer(f, axes, **options)(p, h)
  return lambda shards, batch: loss_fn(shards, batch, run_layer=run_layer)


@pytest.mark.quick
@pytest.mark.parametrize("how", ["whole", "layerwise", "layerwise-hpZ"])
def test_mlp_trains_as_data_parallel(how):
  mesh = tuple_mesh() if how.endswith("hpZ") else flat_mesh()
  axes = TUPLE if how.endswith("hpZ") else "x"
  params = mlp_init(jax.random.key(0))
  batch = data(jax.random.key(1), (32, 13), (32, 5))
  tx = optax.adam(1e-2)
  want = reference(mse, params, batch, tx, 10, 8)
  if how == "whole":
    step = fsdp.train_step(mse, tx, mesh, axes)
  else:
    options = {"secondary_axis": "local"} if how.endswith("hpZ") else {}
    step = fsdp.train_step(layerwise(mse, axes, **options), tx, mesh, axes, gather_params=False)
  got, losses = train(step, params, batch, 10)
  chex.assert_trees_all_close(got, want, atol=1e-5, rtol=1e-5)
  assert losses[-1] < losses[0]


def stacked(loss_fn, axes, **options):
  """loss_fn(blocks, batch) with every layer in one fsdp.layers stack (prefetching)."""
  def loss(shards, batch):
    x, y = batch
    fns = [functools.partial(dense, last=i == len(shards) - 1) for i in range(len(shards))]
    return loss_fn(fsdp.layers(fns, axes, **options)(shards, x), y)
  return loss


@pytest.mark.parametrize("how, prefetch", [
    pytest.param(how, 1, marks=pytest.mark.quick) for how in ("flat-ring", "flat-native", "hpZ")
] + [("flat-native", prefetch) for prefetch in (0, 2, 5)])
def test_prefetching_layers_train_as_data_parallel(prefetch, how):
  """fsdp.layers over the 3-layer MLP: 10 Adam steps equal one-device data parallel, for every
  prefetch distance (0: fsdp.layer's order; 5: past the last layer)."""
  mesh, axes = (tuple_mesh(), TUPLE) if how == "hpZ" else (flat_mesh(), "x")
  options = ({"secondary_axis": "local"} if how == "hpZ" else
             {"algorithm": how.split("-")[1]})
  params = mlp_init(jax.random.key(0))
  batch = data(jax.random.key(1), (32, 13), (32, 5))
  tx = optax.adam(1e-2)
  want = reference(mse, params, batch, tx, 10, 8)
  loss = stacked(lambda out, y: jnp.mean((out - y) ** 2), axes, prefetch=prefetch, **options)
  got, losses = train(fsdp.train_step(loss, tx, mesh, axes, gather_params=False), params,
                      batch, 10)
  chex.assert_trees_all_close(got, want, atol=1e-5, rtol=1e-5)
  assert losses[-1] < losses[0]


@pytest.mark.parametrize("how", ["layer", "layers"])
def test_layers_gradients_equal_one_gather_of_every_layer(how):
  """fsdp.layers (one function for every layer) and fsdp.layer per layer, against
  fsdp.gather of the whole tree then the layers in sequence, on one device's share: the
  same values and gradients, the input's and an unsharded leaf's too (fsdp.layer gave such
  a leaf its own value back as its gradient before fsdp.layers)."""
  params = [block_init(k) for k in jax.random.split(jax.random.key(12), 3)]
  blocks = [dict(fsdp.shard({k: v for k, v in p.items() if k != "ln"}, 8), ln=p["ln"])
            for p in params]
  x = jax.random.normal(jax.random.key(13), (16, 6, 12))
  spec = [dict(fsdp.specs({k: v for k, v in b.items() if k != "ln"}, "x"), ln=P())
          for b in blocks]

  def run(loss):
    f = jax.shard_map(lambda b, x: (loss(b, x)[None], *jax.grad(loss, (0, 1))(b, x)),
                      mesh=flat_mesh(), in_specs=(spec, P("x")),
                      out_specs=(P("x"), [dict(s, ln=P("x")) for s in spec], P("x")),
                      check_vma=False)
    return jax.jit(f)(blocks, x)

  def ours(b, x):
    if how == "layers":
      return jnp.sum(jnp.sin(fsdp.layers(block, "x", prefetch=1)(b, x)))
    for p in b:
      x = fsdp.layer(block, "x")(p, x)
    return jnp.sum(jnp.sin(x))

  def theirs(b, x):
    for p in fsdp.gather(b, "x"):
      x = block(p, x)
    return jnp.sum(jnp.sin(x))

  chex.assert_trees_all_close(run(ours), run(theirs), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("prefetch", [0, 1, 3])
def test_layers_issue_each_gather_prefetch_layers_ahead(prefetch):
  """The traced order: with native gathers, before layer i's matmul (forward) stand the
  gathers of layers 0..i+prefetch; in backward, before layer i's recomputed matmul, the
  re-gathers of layers i-prefetch..L-1 (each behind the barrier that releases it)."""
  layers_, width = 6, 8
  params = [{"w": jnp.eye(width)} for _ in range(layers_)]
  blocks = fsdp.shard(params, 8)
  stack = fsdp.layers(lambda p, h: jnp.tanh(h @ p["w"]), "x", prefetch=prefetch,
                      algorithm="native")
  loss = lambda b, x: jnp.sum(stack(b, x))   # noqa: E731
  jaxpr = jax.make_jaxpr(jax.shard_map(
      jax.grad(loss), mesh=flat_mesh(), in_specs=(fsdp.specs(blocks, "x"), P("x")),
      out_specs=fsdp.specs(blocks, "x"), check_vma=False))(blocks, jnp.ones((8, width)))
  order = [e.primitive.name for e in _equations(jaxpr.jaxpr)
           if e.primitive.name in ("all_gather", "dot_general")]
  gathers_before_dot = [order[:i].count("all_gather") for i, n in enumerate(order)
                        if n == "dot_general"]
  forward = [min(i + prefetch + 1, layers_) for i in range(layers_)]
  # backward, layer by layer from the last: its recomputed matmul, then its two gradient
  # matmuls; the gathers before them: forward's L, then L - i + prefetch re-gathers
  backward = [layers_ + min(layers_ - i + prefetch, layers_)
              for i in reversed(range(layers_)) for _ in range(3)]
  assert gathers_before_dot == forward + backward


def _equations(jaxpr):
  """Every equation of ``jaxpr`` and of the jaxprs inside it, in program order."""
  for e in jaxpr.eqns:
    subs = [v for v in e.params.values() if hasattr(v, "eqns") or hasattr(v, "jaxpr")]
    if subs:
      for sub in subs:
        yield from _equations(getattr(sub, "jaxpr", sub))
    else:
      yield e


def test_layers_bad_calls_name_the_argument():
  stack = fsdp.layers([lambda p, x: x] * 2, "x")
  blocks = fsdp.shard([{"w": jnp.ones(8)}] * 3, 8)
  with pytest.raises(ValueError, match="fn holds 2 functions and blocks 3"):
    jax.shard_map(stack, mesh=flat_mesh(), in_specs=(fsdp.specs(blocks, "x"), P()),
                  out_specs=P(), check_vma=False)(blocks, jnp.ones(2))
  with pytest.raises(TypeError, match="blocks of type dict"):
    stack({"w": blocks[0]}, jnp.ones(2))
  with pytest.raises(TypeError, match="fn="):
    fsdp.layers([], "x")


@pytest.mark.parametrize("how", ["flat", "hpZ"])
def test_transformer_blocks_train_as_data_parallel(how):
  mesh, axes = (flat_mesh(), "x") if how == "flat" else (tuple_mesh(), TUPLE)
  params = [block_init(k) for k in jax.random.split(jax.random.key(2), 2)]
  batch = data(jax.random.key(3), (16, 6, 12), (16, 6, 12))
  tx = optax.adamw(3e-3, weight_decay=0.01)
  want = reference(blocks_loss, params, batch, tx, 10, 8)
  options = {"secondary_axis": "local"} if how == "hpZ" else {}
  step = fsdp.train_step(layerwise(blocks_loss, axes, algorithm="ring", **options), tx, mesh,
                         axes, gather_params=False)
  got, _ = train(step, params, batch, 10)
  chex.assert_trees_all_close(got, want, atol=1e-5, rtol=1e-5)


def test_bfloat16_compute_with_a_float32_master_copy():
  params = mlp_init(jax.random.key(4))
  batch = data(jax.random.key(5), (32, 13), (32, 5))
  batch = jax.tree.map(lambda v: v.astype(jnp.bfloat16), batch)
  tx = optax.adam(1e-2)
  loss = lambda p, b: mse(p, b).astype(jnp.float32)   # noqa: E731
  want = reference(loss, params, batch, tx, 10, 8, dtype=jnp.bfloat16)
  step = fsdp.train_step(loss, tx, flat_mesh(), "x", dtype=jnp.bfloat16)
  got, losses = train(step, params, batch, 10)
  assert all(v.dtype == jnp.float32 for v in jax.tree.leaves(got))
  chex.assert_trees_all_close(got, want, atol=1e-5, rtol=1e-5)
  assert losses[-1] < losses[0]


def test_int8_weights_and_gradients_converge_with_the_uncompressed_run():
  """qwZ + qgZ + hpZ on 2x4: 100 adam steps reach the uncompressed loss within 2%."""
  params = mlp_init(jax.random.key(6))
  batch = data(jax.random.key(7), (2048, 13), (2048, 5))
  tx = optax.adam(3e-3)
  plain = fsdp.train_step(layerwise(mse, TUPLE, secondary_axis="local"), tx, tuple_mesh(),
                          TUPLE, gather_params=False)
  packed = fsdp.train_step(layerwise(mse, TUPLE, secondary_axis="local", wire_dtype="int8",
                                     grad_wire_dtype="int8"), tx, tuple_mesh(), TUPLE,
                           gather_params=False)
  _, l_plain = train(plain, params, batch, 100)
  _, l_packed = train(packed, params, batch, 100)
  assert l_packed[-1] == pytest.approx(l_plain[-1], rel=0.02)
  assert l_packed[-1] < 0.5 * l_packed[0]


@pytest.mark.parametrize("secondary", [None, "local"], ids=["flat", "hpZ"])
def test_qwz_and_qgz_stay_within_the_wire_bound(secondary):
  """qwZ: the gathered weights err by at most eps * max|w| per stage that encodes them
  (docs/compression.md: a decoded value re-encodes to itself within one stage). qgZ: the
  reduce-scattered gradient errs by at most (encodes) * (eps + 2^-23) * S, S the sum over
  devices of each device's largest cotangent, at most 8 encodes on 8 devices."""
  eps = jaxcoll.WireFormat("int8").relative_error
  mesh = tuple_mesh()
  w = np.random.default_rng(0).standard_normal((37, 29)).astype(np.float32)
  ct = np.random.default_rng(1).standard_normal((8, 37, 29)).astype(np.float32)
  sharded = fsdp.shard(w, 8)
  spec = fsdp.specs(sharded, TUPLE)

  def run(**options):
    def body(s, c):
      full, pull = jax.vjp(lambda s: fsdp.gather(s, TUPLE, secondary_axis=secondary,
                                                 algorithm="ring", **options), s)
      return full[None], pull(c[0])[0]
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, P(TUPLE)),
                                 out_specs=(P(TUPLE), spec), check_vma=False))(sharded, ct)

  full, grad = run()
  qfull, qgrad = run(wire_dtype="int8", grad_wire_dtype="int8")
  stages = 1 if secondary is None else 2
  assert float(jnp.max(jnp.abs(qfull - full))) <= stages * eps * np.abs(w).max()
  assert float(jnp.max(jnp.abs(qfull - full))) > 0     # it did compress
  s = float(np.abs(ct).reshape(8, -1).max(1).sum())
  err = float(jnp.max(jnp.abs(qgrad.value - grad.value)))
  assert 0 < err <= 8 * (eps + 2**-23) * s


# ---------------------------------------------------------------------------- traffic

def test_hpz_backward_gathers_never_cross_the_node_axis():
  """Bytes over "node" per step, from the traced step's ppermutes (ring gathers): the
  backward re-gather of plain FSDP crosses "node"; hpZ's stays inside "local"."""
  params = mlp_init(jax.random.key(8))
  batch = data(jax.random.key(9), (32, 13), (32, 5))
  mesh = tuple_mesh()
  sharded = fsdp.shard(params, 8)

  def node_bytes(grad, **options):
    loss = layerwise(mse, TUPLE, algorithm="ring", **options)
    run = (lambda s, b: jax.grad(loss)(s, b)) if grad else (lambda s, b: loss(s, b)[None])
    f = jax.shard_map(run, mesh=mesh, in_specs=(fsdp.specs(sharded, TUPLE), P(TUPLE)),
                      out_specs=fsdp.specs(sharded, TUPLE) if grad else P(TUPLE),
                      check_vma=False)
    t = jaxcoll.traffic(f, mesh, sharded, batch)
    assert not t.collectives and t.bytes["node"] > 0
    return t.bytes["node"]

  # a ring gather and a ring reduce-scatter send the same bytes across "node". hpZ: the
  # forward gather and the reduce-scatter cross it, the backward re-gather never does;
  # plain FSDP's re-gather (of the weights; backward needs no bias) crosses it too
  hpz = {"secondary_axis": "local"}
  assert node_bytes(True, **hpz) == pytest.approx(2 * node_bytes(False, **hpz))
  assert node_bytes(True) > 2.5 * node_bytes(False)


# ---------------------------------------------------------------------------- memory

def peak_bytes(fn, *args) -> int:
  """Per-device peak of one compiled call: arguments + outputs - aliased + temporaries."""
  m = fn.lower(*args).compile().memory_analysis()
  return (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
          + m.temp_size_in_bytes)


@pytest.mark.parametrize("algorithm", ["ring", "bruck", "native"])
def test_peak_memory_is_a_shard_of_the_state_plus_two_layers(algorithm):
  """8 layers, 8 devices, Adam: FSDP's step holds 1/N of params, grads and Adam's two moments
  (4P/N), two layers' gathered parameters and the saved layer inputs; data parallel holds
  every device's full copy (at least 4P)."""
  layers, width, tokens = 8, 128, 32
  params = mlp_init(jax.random.key(10), sizes=(width,) * (layers + 1))
  batch = data(jax.random.key(11), (8 * tokens, width), (8 * tokens, width))
  tx = optax.adam(1e-3)
  p_bytes = sum(v.nbytes for v in jax.tree.leaves(params))
  layer_bytes = p_bytes / layers
  saved_inputs = layers * tokens * width * 4
  batch_bytes = 2 * tokens * width * 4
  step = fsdp.train_step(layerwise(mse, "x", algorithm=algorithm), tx, flat_mesh(), "x",
                         gather_params=False)
  state = step.init(params)
  fsdp_peak = peak_bytes(jax.jit(step.__call__, donate_argnums=0), state, batch)
  # jaxlib 0.10.2's XLA merges each backward re-gather with its forward gather: every
  # layer's gathered parameters (and then some) stay live
  gathered = 2 * layer_bytes if compat.REMAT_COLLECTIVES_STAY_SEPARATE else 2 * p_bytes
  tables = 1024   # a schedule's per-rank index tables and loop counters (bytes, not state)
  assert fsdp_peak <= 4 * p_bytes / 8 + gathered + saved_inputs + batch_bytes + tables

  def dp(p, s, b):
    grads = jaxcoll.sync_gradients(jax.grad(mse)(p, b), "x")
    updates, s = tx.update(grads, s, p)
    return optax.apply_updates(p, updates), s
  dp_step = jax.jit(jax.shard_map(dp, mesh=flat_mesh(), in_specs=(P(), P(), P("x")),
                                  out_specs=(P(), P()), check_vma=False), donate_argnums=(0, 1))
  dp_peak = peak_bytes(dp_step, params, tx.init(params), batch)
  assert dp_peak >= 4 * p_bytes
  assert fsdp_peak < dp_peak / (4 if compat.REMAT_COLLECTIVES_STAY_SEPARATE else 2)


@pytest.mark.parametrize("algorithm", ["ring", "native"])
def test_prefetch_holds_at_most_one_more_layer_per_unit(algorithm):
  """fsdp.layers' memory bound: each unit of ``prefetch`` adds one more layer's gather in
  flight to the step's peak (8 layers, 8 devices, Adam): XLA's own all_gather holds its
  result (at most one layer's parameters); a schedule's also its loop's buffer while it runs
  (at most two; measured on jax 0.12.1: 1.25 and 2.25 layers at prefetch 1 and 2, native
  1.00 and 2.00). prefetch=0 holds at most one layer more than fsdp.layer per layer: a
  layer's unreduced gradient waits for the next layer's recomputed forward before its
  reduce-scatter starts (measured 0.63 layers). (jax 0.10.2's XLA keeps every layer gathered
  from forward to backward whatever the order: no change, see the test above.)"""
  layers_, width, tokens = 8, 128, 32
  params = mlp_init(jax.random.key(10), sizes=(width,) * (layers_ + 1))
  batch = data(jax.random.key(11), (8 * tokens, width), (8 * tokens, width))
  layer_bytes = sum(v.nbytes for v in jax.tree.leaves(params)) / layers_

  def peak(loss):
    step = fsdp.train_step(loss, optax.adam(1e-3), flat_mesh(), "x", gather_params=False)
    return peak_bytes(jax.jit(step.__call__, donate_argnums=0), step.init(params), batch)

  def stack(prefetch):
    return peak(stacked(lambda out, y: jnp.mean((out - y) ** 2), "x", prefetch=prefetch,
                        algorithm=algorithm))

  base = stack(0)   # one layer more than fsdp.layer's: a gradient waits for the next layer
  assert base <= peak(layerwise(mse, "x", algorithm=algorithm)) + layer_bytes + 1024
  for prefetch in (1, 2):
    held = 1 if algorithm == "native" else 2
    assert stack(prefetch) <= base + prefetch * held * layer_bytes + 1024, prefetch
