"""Data-parallel training: bucketed gradient sync, sync in backward, the optax
transformation with error feedback, and data_parallel against one-device training."""

from __future__ import annotations

import re

import chex
import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxcoll
from jaxcoll._src import compat
from jaxcoll._src.training import buckets

pytestmark = pytest.mark.quick   # differentiates through shard_map: every supported jax
AXIS = "data"


def mesh(n=8):
  return Mesh(np.array(jax.devices()[:n]), (AXIS,))


def per_device(fn, n=8, check_vma=True):
  """fn on one device's pytree; the wrapper takes and returns a leading axis of n."""
  return jax.jit(jax.shard_map(
      lambda t: jax.tree.map(lambda v: v[None], fn(jax.tree.map(lambda v: v[0], t))),
      mesh=mesh(n), in_specs=P(AXIS), out_specs=P(AXIS), check_vma=check_vma))


def mixed_tree(n, seed=0):
  rng = np.random.default_rng(seed)
  f = lambda *s: rng.standard_normal((n, *s)).astype(np.float32)
  return {"layers": [{"w": f(5, 3), "b": f(3)} for _ in range(3)], "scalar": f(),
          "empty": f(0, 4), "half": f(300).astype(ml_dtypes.bfloat16),
          "count": rng.integers(0, 9, (n, 2)).astype(np.int32)}


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("bucket_bytes,first", [(25 * 2**20, 2**20), (64, 16), (1, 1)])
def test_sync_gradients_equals_per_leaf_pmean(bucket_bytes, first, check_vma):
  tree = mixed_tree(8)
  got = per_device(lambda t: jaxcoll.sync_gradients(t, AXIS, bucket_bytes=bucket_bytes,
                                                    first_bucket_bytes=first,
                                                    algorithm="ring"), check_vma=check_vma)(tree)
  want = per_device(lambda t: jax.tree.map(lambda v: lax.pmean(v, AXIS), t),
                    check_vma=check_vma)(tree)
  chex.assert_trees_all_equal_structs(got, want)
  chex.assert_trees_all_equal_dtypes(got, want)     # bfloat16 stays, int32 means are float32
  for g, w, x in zip(jax.tree.leaves(got), jax.tree.leaves(want), jax.tree.leaves(tree)):
    # bfloat16: the ring rounds each of its N-1 partial sums (lax sums in float32)
    atol = 1e-6 if g.dtype == np.float32 else 8 * 2.0**-8 * float(np.abs(
        x.astype(np.float32)).max(initial=0))
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                               rtol=1e-6, atol=atol)


@pytest.mark.parametrize("check_vma", [True, False])
def test_a_native_bucket_of_large_leaves_is_not_packed_in_one_process(check_vma):
  """Where a bucket's all_reduce is the lax collective (one process) and its leaves are
  large, they go to it as they are: no concatenate, values equal per-leaf pmean's."""
  rng = np.random.default_rng(0)
  tree = [rng.standard_normal((8, 128, 128)).astype(np.float32) for _ in range(3)]
  sync = lambda t: jaxcoll.sync_gradients(t, AXIS, algorithm="native")  # noqa: E731
  jaxpr = jax.make_jaxpr(per_device(sync, check_vma=check_vma))(tree)
  assert "concatenate" not in str(jaxpr)
  got = per_device(sync, check_vma=check_vma)(tree)
  want = per_device(lambda t: jax.tree.map(lambda v: lax.pmean(v, AXIS), t),
                    check_vma=check_vma)(tree)
  chex.assert_trees_all_equal_dtypes(got, want)
  chex.assert_trees_all_close(got, want, rtol=1e-6, atol=1e-6)


def test_sync_gradients_sum_on_a_registered_dataclass_and_an_optax_state():
  params = {"w": np.ones((8, 4), np.float32)}
  state = jax.tree.map(lambda v: np.stack([v] * 8), optax.adam(1.0).init(
      {"w": np.ones(4, np.float32)}))
  got = per_device(lambda t: jaxcoll.sync_gradients(t, AXIS, op="sum"))((params, state))
  want = per_device(lambda t: jax.tree.map(lambda v: lax.psum(v, AXIS), t))((params, state))
  chex.assert_trees_all_close(got, want)


@hypothesis.given(sizes=st.lists(st.integers(0, 40), min_size=1, max_size=12),
                  bucket=st.integers(1, 200), first=st.integers(1, 200))
def test_bucket_plan_covers_every_leaf_once_in_reverse_order(sizes, bucket, first):
  leaves = [jax.ShapeDtypeStruct((s,), np.float32 if i % 3 else np.int32)
            for i, s in enumerate(sizes)]
  plan = buckets.assign(leaves, bucket, first)
  seen = sorted(i for b in plan for i in b.leaves)
  assert seen == list(range(len(leaves)))
  for b in plan:
    assert all(np.dtype(leaves[i].dtype) == b.dtype for i in b.leaves)
    assert list(b.leaves) == sorted(b.leaves, reverse=True)
    # a closed bucket is at most one leaf past its target
    assert b.nbytes - b.sizes[-1] * b.dtype.itemsize < max(bucket, first)


def test_sync_in_backward_equals_lax_gradients():
  rng = np.random.default_rng(1)
  params = {"w1": rng.standard_normal((4, 16)).astype(np.float32),
            "w2": rng.standard_normal((16, 2)).astype(np.float32), "b": np.zeros(2, np.float32)}
  x = rng.standard_normal((32, 4)).astype(np.float32)

  def loss(p, xb):
    return jnp.mean((jnp.tanh(xb @ p["w1"]) @ p["w2"] + p["b"]) ** 2)

  def grads(body, check_vma):
    return jax.jit(jax.shard_map(body, mesh=mesh(), in_specs=(P(), P(AXIS)), out_specs=P(),
                                 check_vma=check_vma))(params, x)

  want = jax.grad(loss)(params, x)   # one device, the full batch: mean of the 8 local means
  for check_vma in (True, False):
    got = grads(lambda p, xb: jax.grad(lambda q: loss(jaxcoll.sync_in_backward(
        q, AXIS, bucket_bytes=64, first_bucket_bytes=16, algorithm="ring"), xb))(p), check_vma)
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)


def mlp_problem(seed=0):
  rng = np.random.default_rng(seed)
  params = {"w1": rng.standard_normal((6, 32)).astype(np.float32) * 0.5,
            "b1": np.zeros(32, np.float32),
            "w2": rng.standard_normal((32, 1)).astype(np.float32) * 0.5}
  x = rng.standard_normal((64, 6)).astype(np.float32)
  y = np.sin(x.sum(1, keepdims=True)).astype(np.float32)
  return params, (x, y)


def mlp_loss(p, batch):
  x, y = batch
  return jnp.mean((jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] - y) ** 2)


def make_step(tx, sync=None):
  def step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(mlp_loss)(params, batch)
    if sync is not None:
      grads = sync(grads)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, {"loss": loss}
  return step


@pytest.mark.parametrize("how", ["sync_gradients", "optax_sync"])
def test_data_parallel_trains_as_one_device_does(how):
  params, batch = mlp_problem()
  adam = optax.adam(1e-2)
  if how == "optax_sync":
    tx = optax.chain(jaxcoll.optax.sync(AXIS, algorithm="ring"), adam)
    dp = jaxcoll.data_parallel(make_step(tx), mesh(), AXIS)
  else:
    tx = adam
    dp = jaxcoll.data_parallel(make_step(tx, lambda g: jaxcoll.sync_gradients(g, AXIS)),
                               mesh(), AXIS)
  one = jax.jit(make_step(adam))
  p_dp, s_dp, p_one, s_one = params, tx.init(params), params, adam.init(params)
  for _ in range(10):
    p_dp, s_dp, m_dp = dp(p_dp, s_dp, batch)
    p_one, s_one, m_one = one(p_one, s_one, batch)
    np.testing.assert_allclose(m_dp["loss"], m_one["loss"], rtol=1e-5)
  chex.assert_trees_all_close(p_dp, p_one, atol=1e-5, rtol=1e-5)


def test_error_feedback_state_and_bit_identical_replicas():
  """int8 sync with error feedback: replicas bit-identical; residual = sent - Q(sent) for
  the leaf the wire compresses (w1: more than 64 values), unchanged for those that travel
  exact (b1, w2: 32 values, which on a block of their own would take more bytes)."""
  params, batch = mlp_problem(2)
  fmt = jaxcoll.WireFormat("int8")
  tx = jaxcoll.optax.sync(AXIS, wire_dtype="int8", algorithm="ring")
  n = 8

  def body(p, state, xb, yb):
    grads = jax.grad(mlp_loss)(p, (xb, yb))
    local = jaxcoll.PerDevice(jax.tree.map(lambda v: v[0], state.residual.value))
    synced, new = tx.update(grads, jaxcoll.optax.SyncState(local))
    sent = jax.tree.map(jnp.add, grads, local.value)
    want_residual = {k: sent[k] - fmt.round_trip(sent[k]) if sent[k].size > 64
                     else local.value[k] for k in sent}
    stack = lambda t: jax.tree.map(lambda v: v[None], t)
    return stack(synced), stack(new.residual.value), stack(want_residual)

  state = tx.init(params)
  stacked = jaxcoll.optax.SyncState(jaxcoll.PerDevice(
      jax.tree.map(lambda v: np.random.default_rng(3).standard_normal((n, *v.shape)).astype(
          np.float32) * 1e-3, state.residual.value)))
  f = jax.jit(jax.shard_map(body, mesh=mesh(), in_specs=(P(), P(AXIS), P(AXIS), P(AXIS)),
                            out_specs=P(AXIS), check_vma=False))
  synced, residual, want = f(params, stacked, *batch)
  for leaf in jax.tree.leaves(synced):
    bits = np.asarray(leaf).view(np.uint32)
    np.testing.assert_array_equal(bits, np.broadcast_to(bits[0], bits.shape))
  chex.assert_trees_all_close(residual, want, rtol=0, atol=0)
  assert all(float(jnp.abs(r).max()) > 0 for r in jax.tree.leaves(residual))


def test_data_parallel_keeps_per_device_residuals():
  params, batch = mlp_problem(4)
  tx = optax.chain(jaxcoll.optax.sync(AXIS, wire_dtype="int8", algorithm="ring"),
                   optax.sgd(0.1))
  dp = jaxcoll.data_parallel(make_step(tx), mesh(), AXIS)
  p, s = params, tx.init(params)
  assert not s[0].residual.stacked
  for _ in range(3):
    p, s, _ = dp(p, s, batch)
  res = s[0].residual
  assert res.stacked and res.value["w1"].shape == (8, 6, 32)
  rows = np.asarray(res.value["w1"]).reshape(8, -1)
  assert not np.allclose(rows[0], rows[1])    # each device keeps its own error


def test_errors_name_the_argument():
  tree = {"ok": np.ones((8, 2), np.float32), "z": np.ones((8, 2), np.complex64)}
  with pytest.raises(ValueError, match=r"grads\['z'\] \(dtype complex64\).*'max'"):
    per_device(lambda t: jaxcoll.sync_gradients(t, AXIS, op="max"))(tree)
  with pytest.raises(ValueError, match="axis_name='model'"):
    per_device(lambda t: jaxcoll.sync_gradients(t, "model"))(tree)
  with pytest.raises(ValueError, match=r"grads\['w'\] is already invariant"):
    jax.jit(jax.shard_map(lambda p, x: jaxcoll.sync_gradients(
        jax.grad(lambda q: jnp.sum(q["w"] * x))(p), AXIS), mesh=mesh(),
        in_specs=(P(), P(AXIS)), out_specs=P()))({"w": np.ones(2, np.float32)},
                                                 np.ones((8, 2), np.float32))
  with pytest.raises(ValueError, match="bucket_bytes=0"):
    per_device(lambda t: jaxcoll.sync_gradients(t, AXIS, bucket_bytes=0))(tree)
  step = make_step(optax.sgd(0.1), lambda g: jaxcoll.sync_gradients(g, AXIS))
  with pytest.raises(ValueError, match="axis_name='model' is not an axis of the mesh"):
    jaxcoll.data_parallel(step, mesh(), "model")
  params, (x, y) = mlp_problem()
  with pytest.raises(ValueError, match=r"argument 2\[0\] has shape \(63, 6\)"):
    jaxcoll.data_parallel(step, mesh(), AXIS)(params, optax.sgd(0.1).init(params),
                                             (x[:63], y[:63]))


def entry_ops(compiled_text: str, names=("dot", "while", "all-reduce")) -> list[str]:
  """The scheduled order of some ops in the entry computation of compiled HLO text (a
  fusion whose computation holds a matmul counts as a dot, whatever XLA names it: jax
  0.12.1's CPU backend calls them ``ynn_fusion`` over ``fused_computation.N``)."""
  bodies = dict(re.findall(r"\n%?([\w.-]+) [^\n]*\{\n(.*?)\n\}", compiled_text, re.S))
  entry = compiled_text[compiled_text.index("\nENTRY"):]
  entry = entry[:entry.index("\n}\n")]
  seq = []
  for line in entry.splitlines()[1:]:
    m = re.search(r"= .*? ([a-z][\w-]*)\(", line)
    if m is None:
      continue
    op = m.group(1)
    called = re.search(r"calls=%?([\w.-]+)", line)
    if op == "fusion" and called and re.search(r" dot\(", bodies.get(called.group(1), "")):
      op = "dot"
    if op in names:
      seq.append(op)
  return seq


def test_bucket_reduces_are_scheduled_between_backward_matmuls():
  """A 6-layer MLP, one bucket per layer, ring all-reduces (two while loops each in HLO):
  from sync_in_backward the reduces run while backward still has matmuls to do. XLA
  schedules the whole step as one dataflow graph, so sync_gradients after jax.grad in the
  same jit compiles to the same interleaved schedule (measured: identical op order)."""
  rng = np.random.default_rng(0)
  params = [{"w": rng.standard_normal((128, 128)).astype(np.float32) * 0.1}
            for _ in range(6)]
  x = rng.standard_normal((64, 128)).astype(np.float32)
  layer = 128 * 128 * 4
  opts = dict(bucket_bytes=layer, first_bucket_bytes=layer, algorithm="ring")

  def loss(ps, xb):
    for p in ps:
      xb = jnp.tanh(xb @ p["w"])
    return jnp.mean(xb ** 2)

  def schedule(body):
    f = jax.jit(jax.shard_map(body, mesh=mesh(), in_specs=(P(), P(AXIS)), out_specs=P(),
                              check_vma=False))
    return entry_ops(f.lower(params, x).compile().as_text())

  hooked = schedule(lambda ps, xb: jax.grad(
      lambda q: loss(jaxcoll.sync_in_backward(q, AXIS, **opts), xb))(ps))
  after = schedule(lambda ps, xb: jaxcoll.sync_gradients(jax.grad(loss)(ps, xb), AXIS, **opts))
  last_dot = max(i for i, op in enumerate(hooked) if op == "dot")
  assert hooked.count("while") == 12, hooked
  assert hooked[:last_dot].count("while") >= 3, hooked
  assert after == hooked


@pytest.mark.parametrize("layers", [2, 4])
def test_lax_bucket_reduces_stay_one_per_bucket_in_order(layers):
  """Buckets that run the lax all-reduce are ordered, each after the one before: XLA would
  otherwise combine them into one all-reduce that waits for the last gradient (DDP's first
  bucket overlaps the backward pass; measured on 8 ranks over 2 processes, 16 MiB: 87-94 ms
  in order against 122-151 ms combined). The result equals per-leaf pmean. jax 0.10.2's
  XLA drops the barrier's unused operand and combines them (compat)."""
  rng = np.random.default_rng(0)
  params = [{"w": rng.standard_normal((128, 128)).astype(np.float32) * 0.1}
            for _ in range(layers)]
  x = rng.standard_normal((64, 128)).astype(np.float32)
  layer = 128 * 128 * 4

  def loss(ps, xb):
    for p in ps:
      xb = jnp.tanh(xb @ p["w"])
    return jnp.mean(xb ** 2)

  def compiled(sync):
    f = jax.jit(jax.shard_map(lambda ps, xb: sync(jax.grad(loss)(ps, xb)), mesh=mesh(),
                              in_specs=(P(), P(AXIS)), out_specs=P(), check_vma=False))
    return f, f.lower(params, x).compile().as_text()

  synced, text = compiled(lambda g: jaxcoll.sync_gradients(
      g, AXIS, bucket_bytes=layer, first_bucket_bytes=layer, algorithm="native"))
  ordered = compat.BARRIERS_ORDER_COLLECTIVES   # jax 0.10.2's XLA combines them anyway
  assert len(re.findall(r"\ball-reduce(?:-start)?\(", text)) == (layers if ordered else 1)
  reference, _ = compiled(lambda g: jax.tree.map(lambda v: jax.lax.pmean(v, AXIS), g))
  chex.assert_trees_all_close(synced(params, x), reference(params, x), rtol=1e-6, atol=1e-7)


def test_params_stay_bit_identical_on_every_device_over_compressed_steps():
  params, batch = mlp_problem(5)
  tx = optax.chain(jaxcoll.optax.sync(AXIS, wire_dtype="int8", algorithm="ring"),
                   optax.adam(1e-2))

  def body(p, xb, yb):
    state = tx.init(p)
    for _ in range(4):
      grads = jax.grad(mlp_loss)(p, (xb, yb))
      updates, state = tx.update(grads, state, p)
      p = optax.apply_updates(p, updates)
    return jax.tree.map(lambda v: v[None], p)

  f = jax.jit(jax.shard_map(body, mesh=mesh(), in_specs=(P(), P(AXIS), P(AXIS)),
                            out_specs=P(AXIS), check_vma=False))
  out = f(params, *batch)
  for leaf, start in zip(jax.tree.leaves(out), jax.tree.leaves(params)):
    bits = np.asarray(leaf).view(np.uint32)
    np.testing.assert_array_equal(bits, np.broadcast_to(bits[0], bits.shape))
    assert not np.array_equal(np.asarray(leaf[0]), start)   # the steps did move them
