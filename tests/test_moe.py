"""jaxcoll.moe against a single-device dense reference that loops over experts."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxcoll
from jaxcoll import moe

D = 8


def expert_fn(w, h):
  return jnp.tanh(h @ w)


def reference(x, logits, w, k, cap):
  """Dense MoE on one device. x [N, T, d]: each source device's tokens, routed and
  capacity-limited per source exactly as dispatch specifies (choice-major slots)."""
  n, t, _ = x.shape
  e = w.shape[0]
  out, dropped = [], 0
  for s in range(n):
    ids, gates = moe.route(logits[s], k)
    ids, gates = np.asarray(ids), gates
    fill = np.zeros(e, int)
    y = jnp.zeros((t, x.shape[-1]), x.dtype)
    kept = np.zeros((t, k), bool)
    for j in range(k):
      for i in range(t):
        if fill[ids[i, j]] < cap:
          kept[i, j] = True
        fill[ids[i, j]] += 1
    dropped += int((~kept).sum())
    for j in range(k):
      for ex in range(e):
        rows = (ids[:, j] == ex) & kept[:, j]
        contrib = expert_fn(w[ex], x[s]) * (gates[:, j] * rows)[:, None]
        y = y + contrib
    out.append(y)
  return jnp.stack(out), dropped


def sharded_moe(mesh_shape, names, axes, e, k, cap, algorithm):
  mesh = Mesh(np.array(jax.devices()[:int(np.prod(mesh_shape))]).reshape(mesh_shape), names)
  spec = P(names)

  def body(x, logits, w):
    ids, gates = moe.route(logits[0], k)
    h, state = moe.dispatch(x[0], ids, num_experts=e, capacity=cap, axis_name=axes,
                            algorithm=algorithm)
    y = jax.vmap(expert_fn)(w, h)
    return moe.combine(y, state, gates)[None], state.dropped[None]

  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, spec, spec),
                               out_specs=(spec, spec)))


CASES = [((1,), ("x",), "x"), ((2,), ("x",), "x"), ((4,), ("x",), "x"), ((8,), ("x",), "x"),
         ((2, 4), ("node", "local"), ("node", "local"))]


def algorithms_for(axes, every=True):
  """Every exchange (``every``), or the scheduled one and the all-gather dispatch alone: the
  cases that vary routing, not the exchange (each exchange is also checked against lax's in
  tests/test_collectives.py)."""
  if not every:
    return ["direct", "allgather"]
  algos = ["auto", "direct", "bruck", "native", "allgather"]
  return algos + (["hierarchical"] if isinstance(axes, tuple) else [])


# each k and each count of experts per device, k below, equal to and above that count (the
# full 3 x 3 grid of them took 370 s of CI), every exchange with k=2 of 4 per device; the
# quick subset's case: that one on the two-axis mesh
@pytest.mark.parametrize("case,k,per_device", [
    pytest.param(case, k, per_device, id=f"{k}-{per_device}-{'x'.join(map(str, case[0]))}",
                 marks=[pytest.mark.quick] if (case, k, per_device) == (CASES[-1], 2, 4) else [])
    for k, per_device in [(1, 1), (2, 4), (4, 2), (2, 1)] for case in CASES])
def test_forward_and_gradients_equal_the_dense_reference(case, k, per_device):
  shape, names, axes = case
  n = int(np.prod(shape))
  e = per_device * n
  if k > e:
    pytest.skip(f"k={k} > {e} experts")
  t = 6
  rng = np.random.default_rng(n * 100 + k * 10 + per_device)
  x = rng.standard_normal((n, t, D)).astype(np.float32)
  logits = rng.standard_normal((n, t, e)).astype(np.float32)
  w = rng.standard_normal((e, D, D)).astype(np.float32) / np.sqrt(D)
  cap = t * k            # nothing drops
  want, dropped = reference(x, logits, w, k, cap)
  assert dropped == 0
  loss_ref = lambda x, w: jnp.sum(jnp.sin(reference(x, logits, w, k, cap)[0]))
  gx_ref, gw_ref = jax.grad(loss_ref, argnums=(0, 1))(x, w)
  for algorithm in algorithms_for(axes, every=(k, per_device) == (2, 4)):
    f = sharded_moe(shape, names, axes, e, k, cap, algorithm)
    got, drops = f(x, logits, w)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=algorithm)
    assert int(np.sum(drops)) == 0
    gx, gw = jax.grad(lambda x, w, f=f: jnp.sum(jnp.sin(f(x, logits, w)[0])),
                      argnums=(0, 1))(x, w)
    np.testing.assert_allclose(gx, gx_ref, rtol=1e-5, atol=1e-5, err_msg=algorithm)
    np.testing.assert_allclose(gw, gw_ref, rtol=1e-5, atol=1e-5, err_msg=algorithm)


def run_one(shape, names, axes, e, k, cap, algorithm, x, logits, w):
  f = sharded_moe(shape, names, axes, e, k, cap, algorithm)
  return f(x, logits, w)


@pytest.mark.quick
@pytest.mark.parametrize("algorithm", ["direct", "allgather"])
def test_capacity_drops_exactly_the_pairs_the_reference_drops(algorithm):
  """Skewed logits (most tokens prefer expert 0), capacity below demand: the output equals
  the reference's capacity-limited one and the dropped count is exact."""
  n, t, e, k = 4, 12, 8, 2
  rng = np.random.default_rng(7)
  x = rng.standard_normal((n, t, D)).astype(np.float32)
  logits = rng.standard_normal((n, t, e)).astype(np.float32)
  logits[..., 0] += 3.0
  w = rng.standard_normal((e, D, D)).astype(np.float32) / np.sqrt(D)
  cap = moe.capacity(t, e, k, 1.0)
  want, dropped = reference(x, logits, w, k, cap)
  assert dropped > 0
  got, drops = run_one((n,), ("x",), "x", e, k, cap, algorithm, x, logits, w)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  assert int(np.sum(drops)) == dropped


@pytest.mark.quick
def test_route_with_a_key_samples_the_softmax_and_gates_without_noise():
  """Gumbel noise on the choice (DeepSpeed's RSample): a token's first choice is a sample of
  softmax(logits), frequencies within 0.015 of it over 20000 tokens; the gates are the
  noiseless probabilities of the experts chosen; k choices stay distinct."""
  row = jnp.array([0.0, 1.0, 2.0, -1.0])
  logits = jnp.tile(row, (20000, 1))
  ids, gates = moe.route(logits, 1, renormalize=False, key=jax.random.key(5))
  freq = np.bincount(np.asarray(ids)[:, 0], minlength=4) / 20000
  np.testing.assert_allclose(freq, jax.nn.softmax(row), atol=0.015)
  np.testing.assert_allclose(gates[:, 0], jax.nn.softmax(row)[np.asarray(ids)[:, 0]],
                             rtol=1e-6)
  ids, gates = moe.route(logits[:500], 3, key=jax.random.key(6))
  assert all(len(set(r)) == 3 for r in np.asarray(ids).tolist())
  np.testing.assert_allclose(np.sum(gates, axis=1), 1.0, rtol=1e-6)
  assert len({tuple(r) for r in np.asarray(ids).tolist()}) > 1   # the noise varies choices


@pytest.mark.quick
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_jitter_scales_within_its_band(dtype):
  x = jnp.asarray(np.random.default_rng(0).standard_normal((64, 32)), dtype)
  y = moe.jitter(x, jax.random.key(1), 0.05)
  assert y.dtype == dtype
  ratio = np.asarray(y, np.float32) / np.asarray(x, np.float32)
  tol = 0.01 if dtype == jnp.bfloat16 else 1e-6
  assert ratio.min() >= 0.95 - tol and ratio.max() <= 1.05 + tol and ratio.std() > 0.01
  np.testing.assert_array_equal(moe.jitter(x, jax.random.key(1), 0.0), x)
  with pytest.raises(ValueError, match="epsilon=1.0"):
    moe.jitter(x, jax.random.key(1), 1.0)


# MaxText's DeepSeek-V3 routing, copied unchanged from AI-Hypercomputer/maxtext
# src/MaxText/layers/moe.py (RoutedMoE.expert_group_mask, deepseek_routing,
# deepseek_scale_weights; the values they read from self and self.config made arguments).
def maxtext_expert_group_mask(gate_logits, n_routing_groups, topk_routing_group, num_experts):
  scores_grouped = jnp.reshape(
      gate_logits,
      gate_logits.shape[:-1] + (n_routing_groups, -1),
  )
  top2_in_group_vals, _ = jax.lax.top_k(scores_grouped, k=2)
  group_scores = jnp.sum(jnp.astype(top2_in_group_vals, jnp.float32), axis=-1)
  _, group_idx = jax.lax.top_k(group_scores, k=topk_routing_group)

  # Mask selected groups so that only those experts are considered.
  group_mask = jax.nn.one_hot(group_idx, num_classes=n_routing_groups, dtype=jnp.float32)
  group_mask = jnp.sum(group_mask, axis=-2)

  # Apply masks and get top-k indices.
  score_mask_expanded = jnp.broadcast_to(
      group_mask[..., None],
      group_mask.shape + (num_experts // n_routing_groups,),
  )
  return jnp.reshape(
      score_mask_expanded,
      score_mask_expanded.shape[:-2] + (num_experts,),
  )


def maxtext_deepseek_routing(gate_logits, pre_bias_logits, n_routing_groups, topk_routing_group,
                             num_experts, num_experts_per_tok):
  expert_mask = 1 if n_routing_groups == -1 else maxtext_expert_group_mask(
      gate_logits, n_routing_groups, topk_routing_group, num_experts)
  _, top_k_indices = jax.lax.top_k(
      jnp.where(expert_mask > 0, gate_logits, -jnp.inf),
      k=num_experts_per_tok,
  )
  top_k_weights = jnp.take_along_axis(pre_bias_logits, top_k_indices, axis=-1)
  return top_k_weights, top_k_indices


def maxtext_deepseek_scale_weights(weights, routed_score_func, routed_scaling_factor):
  if routed_score_func == "sigmoid":
    weights /= weights.sum(-1, keepdims=True)
  weights *= routed_scaling_factor
  return weights


def maxtext_gate(logits, bias, groups, top_groups, k, scale):
  """GateLogit with score_func "sigmoid" and a bias (pre_bias_logits: the sigmoid scores),
  then get_topk's DeepSeek path."""
  pre_bias_logits = jax.nn.sigmoid(logits)
  gate_logits = pre_bias_logits + bias
  weights, indices = maxtext_deepseek_routing(gate_logits, pre_bias_logits,
                                              groups if groups > 1 else -1, top_groups,
                                              logits.shape[-1], k)
  return indices, maxtext_deepseek_scale_weights(weights, "sigmoid", scale)


@pytest.mark.quick
@pytest.mark.parametrize("groups,top_groups,k", [(1, 1, 2), (1, 1, 8), (4, 2, 4), (8, 3, 6),
                                                 (16, 4, 1)])
def test_route_biased_equals_maxtext_deepseek_routing(groups, top_groups, k):
  """Ids, gates and the gates' gradient equal MaxText's DeepSeek-V3 routing."""
  t, e = 24, 32
  rng = np.random.default_rng(groups * 10 + k)
  logits = jnp.asarray(rng.standard_normal((t, e)), jnp.float32)
  bias = jnp.asarray(rng.standard_normal(e) * 0.3, jnp.float32)
  want_ids, want_gates = maxtext_gate(logits, bias, groups, top_groups, k, 2.5)
  ids, gates = moe.route_biased(logits, k, bias, groups=groups, top_groups=top_groups,
                                scale=2.5)
  np.testing.assert_array_equal(ids, want_ids)
  np.testing.assert_allclose(gates, want_gates, rtol=1e-6)
  probe = jnp.asarray(rng.standard_normal((t, k)), jnp.float32)
  got = jax.grad(lambda z: jnp.sum(probe * moe.route_biased(
      z, k, bias, groups=groups, top_groups=top_groups, scale=2.5)[1]))(logits)
  want = jax.grad(lambda z: jnp.sum(probe * maxtext_gate(z, bias, groups, top_groups, k,
                                                         2.5)[1]))(logits)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
  if groups > 1:   # every token's experts lie in at most top_groups groups
    assert max(len(set(row)) for row in np.asarray(ids) // (e // groups)) <= top_groups


@pytest.mark.quick
def test_update_bias_balances_a_skewed_router_without_a_loss():
  """DeepSeek-V3's rule on a router that prefers two experts: the bias alone (no gradient)
  brings the busiest expert's load from 3x the mean to within 1.5x of it."""
  t, e, k = 256, 8, 2
  rng = np.random.default_rng(3)
  logits = jnp.asarray(rng.standard_normal((t, e)) + np.r_[2.0, 2.0, np.zeros(e - 2)],
                       jnp.float32)
  bias = jnp.zeros(e)
  load = lambda b: np.bincount(np.asarray(moe.route_biased(logits, k, b)[0]).reshape(-1),
                               minlength=e)
  first = load(bias)
  assert first.max() > 3 * first.mean()
  for _ in range(300):
    bias = moe.update_bias(bias, load(bias), 0.01)
  assert load(bias).max() < 1.5 * first.mean()
  np.testing.assert_array_equal(moe.update_bias(jnp.zeros(3), jnp.array([6, 2, 4]), 0.5),
                                [-0.5, 0.5, 0.0])


@pytest.mark.quick
def test_route_biased_errors_name_the_argument():
  logits = jnp.zeros((4, 8))
  for kwargs, match in [(dict(k=2, groups=3), "groups=3 must divide"),
                        (dict(k=2, groups=4, top_groups=5), "top_groups=5"),
                        (dict(k=5, groups=4, top_groups=2), "k=5"),
                        (dict(k=2, score="relu"), "score='relu'"),
                        (dict(k=2, bias=jnp.zeros(7)), r"bias must be \[E\] = \[8\]"),
                        (dict(k=2, scale=0.0), "scale=0.0")]:
    with pytest.raises(ValueError, match=match):
      moe.route_biased(logits, **kwargs)
  with pytest.raises(ValueError, match="bias and load must both be"):
    moe.update_bias(jnp.zeros(4), jnp.zeros(3))


@pytest.mark.quick
@pytest.mark.parametrize("case", [CASES[2], CASES[4]], ids=["4", "2x4"])
def test_global_statistics_count_every_device(case):
  """expert_load is the bincount of every device's choices and total_dropped the reference's
  drops over all devices, the same figures on every device."""
  shape, names, axes = case
  n, t, e, k = int(np.prod(shape)), 12, 8, 2
  rng = np.random.default_rng(12)
  x = rng.standard_normal((n, t, D)).astype(np.float32)
  logits = rng.standard_normal((n, t, e)).astype(np.float32)
  logits[..., 3] += 2.0
  w = rng.standard_normal((e, D, D)).astype(np.float32)
  cap = moe.capacity(t, e, k, 1.0)
  mesh = Mesh(np.array(jax.devices()[:n]).reshape(shape), names)

  def body(x, logits):
    ids, _ = moe.route(logits[0], k)
    _, state = moe.dispatch(x[0], ids, num_experts=e, capacity=cap, axis_name=axes)
    return moe.expert_load(state)[None], moe.total_dropped(state)[None]

  load, dropped = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(names),
                                        out_specs=P(names)))(x, logits)
  ids = np.concatenate([np.asarray(moe.route(logits[s], k)[0]).reshape(-1) for s in range(n)])
  want_dropped = reference(x, logits, w, k, cap)[1]
  assert want_dropped > 0
  np.testing.assert_array_equal(load, np.tile(np.bincount(ids, minlength=e), (n, 1)))
  np.testing.assert_array_equal(dropped, np.full(n, want_dropped))


@pytest.mark.quick
def test_routing_edge_cases():
  """Every token to one expert (the others empty), and one device."""
  n, t, e, k = 4, 5, 4, 1
  rng = np.random.default_rng(8)
  x = rng.standard_normal((n, t, D)).astype(np.float32)
  logits = np.zeros((n, t, e), np.float32)
  logits[..., 2] = 10.0
  w = rng.standard_normal((e, D, D)).astype(np.float32)
  for cap in (t, 2):
    want, dropped = reference(x, logits, w, k, cap)
    got, drops = run_one((n,), ("x",), "x", e, k, cap, "direct", x, logits, w)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert int(np.sum(drops)) == dropped == n * (t - cap)
  got, drops = run_one((1,), ("x",), "x", 3, 2, 2, "direct", x[:1], logits[:1, :, :3],
                       w[:3])
  want, dropped = reference(x[:1], logits[:1, :, :3], w[:3], 2, 2)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  assert int(np.sum(drops)) == dropped


@pytest.mark.quick
def test_bfloat16_tokens():
  n, t, e, k = 4, 6, 8, 2
  rng = np.random.default_rng(9)
  x = rng.standard_normal((n, t, D)).astype(jnp.bfloat16)
  logits = rng.standard_normal((n, t, e)).astype(np.float32)
  w = (rng.standard_normal((e, D, D)) / np.sqrt(D)).astype(jnp.bfloat16)
  got, _ = run_one((n,), ("x",), "x", e, k, t * k, "direct", x, logits, w)
  want, _ = reference(x.astype(np.float32), logits, w.astype(np.float32), k, t * k)
  assert got.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=0.05, atol=0.05)


@pytest.mark.quick
def test_route_capacity_and_losses():
  logits = jnp.asarray(np.random.default_rng(1).standard_normal((10, 6)), jnp.float32)
  ids, gates = moe.route(logits, 2)
  probs = jax.nn.softmax(logits)
  order = np.argsort(-np.asarray(probs), axis=1)[:, :2]
  np.testing.assert_array_equal(ids, order)
  top = np.take_along_axis(np.asarray(probs), order, 1)
  np.testing.assert_allclose(gates, top / top.sum(1, keepdims=True), rtol=1e-6)
  np.testing.assert_allclose(moe.route(logits, 2, renormalize=False)[1], top, rtol=1e-6)
  assert moe.capacity(100, 8, 2) == 25 and moe.capacity(100, 8, 2, 1.25, multiple=4) == 32
  balanced = jnp.zeros((8, 4))
  np.testing.assert_allclose(moe.load_balancing_loss(balanced, jnp.arange(8)[:, None] % 4),
                             1.0, rtol=1e-6)
  skewed = jnp.zeros((8, 4)).at[:, 0].set(5.0)
  assert moe.load_balancing_loss(skewed, jnp.zeros((8, 1), jnp.int32)) > 3.0
  np.testing.assert_allclose(moe.router_z_loss(balanced), np.log(4.0) ** 2, rtol=1e-6)


@pytest.mark.quick
def test_errors_name_the_argument():
  mesh = Mesh(np.array(jax.devices()[:4]), ("x",))

  def call(e, cap, ids_shape=(6, 2)):
    def body(x):
      return moe.dispatch(x[0], jnp.zeros(ids_shape, jnp.int32), num_experts=e, capacity=cap,
                          axis_name="x")[0][None]
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))(
        np.zeros((4, 6, D), np.float32))

  with pytest.raises(ValueError, match="num_experts=6 must be a positive multiple"):
    call(6, 4)
  with pytest.raises(ValueError, match="capacity=0"):
    call(8, 0)
  with pytest.raises(ValueError, match=r"expert_ids must be \[T, k\] with T = 6"):
    call(8, 4, (5, 2))
  with pytest.raises(ValueError, match="k=7"):
    moe.route(jnp.zeros((3, 4)), 7)
  with pytest.raises(ValueError, match="factor=0"):
    moe.capacity(10, 4, 1, 0)
  with pytest.raises(ValueError, match="convention='switch'"):
    moe.capacity(10, 4, 1, convention="switch")
  with pytest.raises(ValueError, match="min_capacity=-1"):
    moe.capacity(10, 4, 1, min_capacity=-1)


# The frameworks' own capacity expressions, copied unchanged (only the names they read from
# self / self.config made arguments).
def flaxformer_capacity(capacity_factor, tokens_per_group, num_experts, min_expert_capacity):
  # google/flaxformer flaxformer/architectures/moe/moe_layers.py, MoeLayer.__call__
  # Each group will send expert_capacity tokens to each expert.
  expert_capacity = int(
      round(capacity_factor * tokens_per_group / num_experts))
  expert_capacity = max(expert_capacity, min_expert_capacity)
  return expert_capacity


def maxtext_capacity(seq_len, num_experts_per_tok, num_experts, capacity_factor):
  # AI-Hypercomputer/maxtext src/MaxText/layers/moe.py, RoutedMoE.generate_masks
  tokens_per_batch = seq_len * num_experts_per_tok
  # this is to avoid expert_capacity_per_batch = 0
  expert_capacity_per_batch = int(
      max(
          math.ceil(tokens_per_batch / num_experts) * capacity_factor,
          capacity_factor,
      )
  )
  return expert_capacity_per_batch


@pytest.mark.quick
@settings(max_examples=200, deadline=None)
@given(tokens=st.integers(0, 1 << 16), experts=st.integers(1, 256), k=st.integers(1, 8),
       factor=st.floats(0.05, 8.0), least=st.integers(0, 8))
def test_capacity_conventions_equal_the_frameworks_own_expressions(tokens, experts, k, factor,
                                                                   least):
  assert moe.capacity(tokens, experts, k, factor, convention="flaxformer",
                      min_capacity=least) == flaxformer_capacity(factor, tokens, experts, least)
  assert moe.capacity(tokens, experts, k, factor, convention="maxtext") == maxtext_capacity(
      tokens, k, experts, factor)
  assert moe.capacity(tokens, experts, k, factor) == moe.capacity(
      tokens, experts, k, factor, convention="gshard") == math.ceil(k * tokens * factor / experts)


@pytest.mark.quick
@pytest.mark.parametrize("algorithm", ["direct", "bruck", "allgather"])
@pytest.mark.parametrize("wire", ["bfloat16", "int8", "float8_e4m3fn"])
def test_compressed_dispatch_within_the_wire_bound(algorithm, wire):
  n, t, e, k = 4, 16, 8, 2
  mesh = Mesh(np.array(jax.devices()[:n]), ("x",))
  rng = np.random.default_rng(11)
  x = rng.standard_normal((n, t, 64)).astype(np.float32)
  logits = rng.standard_normal((n, t, e)).astype(np.float32)

  def body(x, logits, w):
    ids, _ = moe.route(logits[0], k)
    h, _ = moe.dispatch(x[0], ids, num_experts=e, capacity=t * k, axis_name="x",
                        algorithm=algorithm, wire_dtype=w)
    return h[None]

  run = lambda f, w: np.asarray(jax.jit(jax.shard_map(
      lambda a, b: f(a, b, w), mesh=mesh, in_specs=P("x"), out_specs=P("x")))(x, logits))
  exact, compressed = run(body, None), run(body, wire)
  hops = 1 if algorithm == "allgather" else jaxcoll.schedule("all_to_all", algorithm, n).num_steps
  eps = jaxcoll.WireFormat(wire).relative_error
  err = np.abs(compressed - exact).max()
  assert 0 < err <= hops * eps * np.abs(x).max(), err

  def both(x, logits, w):   # identity experts: out = sum of gates * x (gates sum to 1)
    ids, gates = moe.route(logits[0], k)
    h, state = moe.dispatch(x[0], ids, num_experts=e, capacity=t * k, axis_name="x",
                            algorithm=algorithm, wire_dtype=w)
    return moe.combine(h, state, gates, wire_dtype=w)[None]

  err = np.abs(run(both, wire) - x).max()
  bound = 2 * hops * eps * np.abs(x).max() * n   # allgather's reduce_scatter adds N partials
  assert 0 < err <= bound, (err, bound)


def dropless_moe(mesh_shape, names, axes, e, k, algorithm, chunk=None):
  mesh = Mesh(np.array(jax.devices()[:int(np.prod(mesh_shape))]).reshape(mesh_shape), names)
  spec = P(names)

  def body(x, logits, w):
    ids, gates = moe.route(logits[0], k)
    h, state = moe.dispatch(x[0], ids, num_experts=e, capacity=None, axis_name=axes,
                            algorithm=algorithm, chunk=chunk)
    y = jax.vmap(expert_fn)(w, h)
    return moe.combine(y, state, gates)[None], state.dropped[None], state.exchanged[None]

  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, spec, spec),
                               out_specs=(spec, spec, spec)))


@pytest.mark.parametrize("case,skew", [
    pytest.param(case, skew, id=f"{skew}-{name}",
                 marks=[pytest.mark.quick] if (skew, name) == (50.0, "2x4") else [])
    for skew in (0.0, 2.0, 50.0) for case, name in ((CASES[2], "4"), (CASES[4], "2x4"))])
def test_dropless_equals_the_reference_under_any_skew(case, skew):
  shape, names, axes = case
  n = int(np.prod(shape))
  e, k, t = 2 * n, 2, 8
  rng = np.random.default_rng(int(skew) + n)
  x = rng.standard_normal((n, t, D)).astype(np.float32)
  logits = rng.standard_normal((n, t, e)).astype(np.float32)
  logits[..., 1] += skew
  w = rng.standard_normal((e, D, D)).astype(np.float32) / np.sqrt(D)
  want, _ = reference(x, logits, w, k, t * k)
  loss_ref = lambda x, w: jnp.sum(jnp.sin(reference(x, logits, w, k, t * k)[0]))
  gx_ref, gw_ref = jax.grad(loss_ref, argnums=(0, 1))(x, w)
  for algorithm in algorithms_for(axes, every=skew == 50.0):
    f = dropless_moe(shape, names, axes, e, k, algorithm, chunk=2)
    got, dropped, _ = f(x, logits, w)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=algorithm)
    assert int(np.sum(dropped)) == 0
    gx, gw = jax.grad(lambda x, w, f=f: jnp.sum(jnp.sin(f(x, logits, w)[0])),
                      argnums=(0, 1))(x, w)
    np.testing.assert_allclose(gx, gx_ref, rtol=1e-5, atol=1e-5, err_msg=algorithm)
    np.testing.assert_allclose(gw, gw_ref, rtol=1e-5, atol=1e-5, err_msg=algorithm)


@pytest.mark.quick
def test_dropless_exchange_follows_the_real_load():
  """Balanced routing exchanges about the balanced capacity; all tokens to one expert the
  worst case T * k; the slots exchanged are ceil(max count / chunk) chunks."""
  n, e, k, t = 4, 8, 2, 16
  rng = np.random.default_rng(5)
  x = rng.standard_normal((n, t, D)).astype(np.float32)
  w = rng.standard_normal((e, D, D)).astype(np.float32)
  balanced = np.full((n, t, e), -10.0, np.float32)
  for i in range(t):       # token i prefers experts 2i and 2i+1 mod E: 4 pairs per expert
    balanced[:, i, (2 * i) % e] = 10.0
    balanced[:, i, (2 * i + 1) % e] = 9.0
  skewed = np.zeros((n, t, e), np.float32)
  skewed[..., 3] = 10.0
  skewed[..., 5] = 9.0
  f = dropless_moe((n,), ("x",), "x", e, k, "direct", chunk=4)
  _, _, ex_bal = f(x, balanced, w)
  _, _, ex_skew = f(x, skewed, w)
  # bytes per device: (N-1)/N * E * exchanged * d * itemsize, 4x more when skewed
  assert set(np.asarray(ex_bal)) == {4} and set(np.asarray(ex_skew)) == {16}


BANDWIDTH = jaxcoll.Profile(links={"*": jaxcoll.Link(alpha=1e-6, beta=1e-9)}, name="bandwidth")


@pytest.mark.quick
@pytest.mark.parametrize("k,factor,want", [(1, 1.0, "all_to_all"), (4, 2.0, "allgather")])
def test_auto_runs_the_formulation_the_cost_model_prices_faster(k, factor, want):
  """On a bandwidth-bound profile the ring of experts sends less once k * factor > N
  (2 (N-1) T d against 2 (N-1)/N k f T d): auto picks it there, all_to_all below, and
  either way the layer equals the dense reference."""
  n, t, e, d = 4, 64, 8, 64
  rng = np.random.default_rng(k)
  x = rng.standard_normal((n, t, d)).astype(np.float32)
  logits = rng.standard_normal((n, t, e)).astype(np.float32)
  w = rng.standard_normal((e, d, d)).astype(np.float32) / np.sqrt(d)
  cap = moe.capacity(t, e, k, factor)
  plan = moe.explain(jax.ShapeDtypeStruct((t, d), jnp.float32), k, num_experts=e, capacity=cap,
                     mesh={"x": n}, axis_name="x", profile=BANDWIDTH)
  assert plan.chosen == want
  other = "allgather" if want == "all_to_all" else "all_to_all"
  assert plan.predicted_s(want) < plan.predicted_s(other)
  a2a = [c.explanation for c in plan.calls if c.formulation == "all_to_all"]
  assert [c.nbytes for c in a2a] == [e * cap * d * 4] * 2
  assert plan.chosen in str(plan) and "<- auto" in str(plan)
  seen = []
  mesh = Mesh(np.array(jax.devices()[:n]), ("x",))

  def body(x, logits, w):
    ids, gates = moe.route(logits[0], k)
    h, state = moe.dispatch(x[0], ids, num_experts=e, capacity=cap, axis_name="x")
    seen.append(state.algorithm)
    return moe.combine(jax.vmap(expert_fn)(w, h), state, gates)[None]

  with jaxcoll.config(profile=BANDWIDTH):
    got = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))(
        x, logits, w)
  assert seen == ["allgather" if want == "allgather" else "auto"]
  np.testing.assert_allclose(got, reference(x, logits, w, k, cap)[0], rtol=1e-5, atol=1e-5)


def test_explain_prices_compressed_exchanges_on_their_wire_bytes():
  x = jax.ShapeDtypeStruct((256, 128), jnp.float32)
  plain = moe.explain(x, 2, num_experts=16, capacity=40, mesh={"x": 8}, axis_name="x",
                      profile=BANDWIDTH)
  packed = moe.explain(x, 2, num_experts=16, capacity=40, mesh={"x": 8}, axis_name="x",
                       profile=BANDWIDTH, wire_dtype="int8")
  compressed = [(c.formulation, c.phase, c.explanation.primitive) for c in packed.calls
                if c.explanation.wire_dtype]
  assert compressed == [("all_to_all", "dispatch", "all_to_all"),
                        ("allgather", "dispatch", "all_gather")]
  for a, b in zip(plain.calls, packed.calls):
    assert a.explanation.nbytes == b.explanation.nbytes
    if b.explanation.wire_dtype:   # int8 + block scales: about 0.26x float32's bytes
      assert b.explanation.predicted_s < 0.5 * a.explanation.predicted_s
      assert b.explanation.chosen != "native"
    else:
      assert b.explanation.predicted_s == a.explanation.predicted_s


def explicit_reference(x, ids, gates, w, cap):
  """Dense MoE on given ids: pairs with an id outside [0, E) take no slot and add nothing;
  the rest are capacity-limited per source in choice-major order."""
  n, t, _ = x.shape
  e, k = w.shape[0], ids.shape[-1]
  out, dropped = [], 0
  for s in range(n):
    fill, y = np.zeros(e, int), jnp.zeros((t, x.shape[-1]), x.dtype)
    for j in range(k):
      for i in range(t):
        ex = int(ids[s, i, j])
        if not 0 <= ex < e:
          dropped += 1
          continue
        if fill[ex] < cap:
          y = y.at[i].add(gates[s, i, j] * expert_fn(w[ex], x[s, i]))
        else:
          dropped += 1
        fill[ex] += 1
    out.append(y)
  return jnp.stack(out), dropped


@pytest.mark.quick
@pytest.mark.parametrize("algorithm,cap", [("direct", 3), ("allgather", 3), ("direct", None),
                                           ("auto", 2)])
def test_expert_ids_outside_the_experts_are_dropped_pairs(algorithm, cap):
  """A -1 from a masked router, or an id from a router wider than num_experts: the pair is
  dropped and counted, takes no slot, and adds nothing to the output or the gradients
  (its row used to receive another token's data)."""
  n, t, k, e = 4, 6, 2, 8
  rng = np.random.default_rng(7)
  x = rng.standard_normal((n, t, D)).astype(np.float32)
  w = rng.standard_normal((e, D, D)).astype(np.float32) / np.sqrt(D)
  ids = rng.integers(0, e, (n, t, k)).astype(np.int32)
  ids[:, ::2, 1] = -1            # masked second choices
  ids[:, 1, 0] = e + 3           # a router wider than num_experts
  gates = rng.uniform(0.1, 1.0, (n, t, k)).astype(np.float32)
  mesh = Mesh(np.array(jax.devices()[:n]), ("x",))

  def body(x, ids, gates, w):
    h, state = moe.dispatch(x[0], ids[0], num_experts=e, capacity=cap, axis_name="x",
                            algorithm=algorithm)
    y = moe.combine(jax.vmap(expert_fn)(w, h), state, gates[0])
    return y[None], state.dropped[None], moe.total_dropped(state)

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"),) * 4,
                            out_specs=(P("x"), P("x"), P())))
  limit = t * k if cap is None else cap
  want, dropped = explicit_reference(x, ids, gates, w, limit)
  got, per_device, total = f(x, ids, gates, w)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  assert int(np.sum(per_device)) == int(total) == dropped
  assert dropped >= n * (t // 2 + 1)     # at least every invalid pair
  loss = lambda x, w: jnp.sum(jnp.sin(f(x, ids, gates, w)[0]))   # noqa: E731
  loss_ref = lambda x, w: jnp.sum(jnp.sin(explicit_reference(x, ids, gates, w, limit)[0]))  # noqa
  for g, g_ref in zip(jax.grad(loss, argnums=(0, 1))(x, w),
                      jax.grad(loss_ref, argnums=(0, 1))(x, w)):
    np.testing.assert_allclose(g, g_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.quick
def test_route_checks_the_router_width_and_explain_prices_dropless():
  logits = np.zeros((4, 16), np.float32)
  with pytest.raises(ValueError, match="num_experts=8 differs from the router's width"):
    moe.route(logits, 2, num_experts=8)
  assert moe.route(logits, 2, num_experts=16)[0].shape == (4, 2)
  sds = jax.ShapeDtypeStruct((64, 16), jnp.float32)
  dropless = moe.explain(sds, 2, num_experts=8, capacity=None, mesh={"x": 8}, axis_name="x")
  assert dropless.capacity == moe.capacity(64, 8, 2)     # one trip of the default chunk
  assert "C=16" in str(dropless)
