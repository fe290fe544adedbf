"""``jaxcoll.use`` sends no more than the step needs: no collective that jit's compiled step
does without, and outputs laid out as jit's.

- optax's Muon (``optax.contrib.muon``): its Newton-Schulz iterations on a replicated
  momentum stay replicated, as under jit, on a data-parallel mesh and a data x model one;
  the step's collectives carry the gradients and the loss, each once (data parallel), and
  send no more than jit's compiled step;
- a hypothesis test over small programs mixing replicated and split inputs: the bytes a
  device receives for jaxcoll's collectives never exceed what it receives for those of
  jit's compiled step by more than 1% (each collective priced as a bandwidth-optimal one,
  whatever algorithm runs it: ``helpers.report_bytes``), per-device flops never exceed
  jit's by more than 10%, and the outputs have jit's values and layouts.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import hlo_collective_bytes, report_bytes
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from small_mlp import SHAPES, mesh_and_specs, mlp_loss, setup

import jaxcoll

pytestmark = pytest.mark.quick   # reads jaxprs: on every supported jax

def make_step(tx):
  @jax.jit
  def step(p, s, x, y):
    loss, g = jax.value_and_grad(mlp_loss)(p, x, y)
    updates, s = tx.update(g, s, p)
    return optax.apply_updates(p, updates), s, loss
  return step


def muon():
  """optax's Muon where the installed optax has it; else its Newton-Schulz iteration
  (optax/contrib/_muon.py's coefficients) on the momentum of each matrix, Adam elsewhere."""
  contrib = getattr(optax, "contrib", None)
  if hasattr(contrib, "muon"):
    return contrib.muon(1e-2)

  def orthogonalize(g):
    x = g / (jnp.linalg.norm(g) + 1e-7)
    for _ in range(5):
      a = x @ x.T
      x = 3.4445 * x + (-4.7750 * a + 2.0315 * a @ a) @ x
    return x
  matrices = optax.GradientTransformation(
      lambda p: optax.EmptyState(),
      lambda u, s, p=None: (jax.tree.map(lambda g: orthogonalize(g) if g.ndim == 2 else g, u),
                            s))
  return optax.chain(optax.trace(0.95), matrices, optax.scale(-1e-2))


@pytest.mark.parametrize("layout", ["dp", "dp_tp"])
def test_muon_keeps_its_replicated_work_replicated(layout):
  step = make_step(muon())
  mesh, params, state, x, y = setup(layout, muon())
  used = jaxcoll.use(step, algorithm="ring")
  with jax.set_mesh(mesh):
    want, got = step(params, state, x, y), used(params, state, x, y)
    report = jaxcoll.explain_step(used, params, state, x, y)
    compiled = step.lower(params, state, x, y).compile()
  jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5), got, want)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert g.sharding.is_equivalent_to(w.sharding, g.ndim), (g.sharding, w.sharding)
  if layout == "dp":   # the gradients and the loss, each once
    assert report.bytes_by_kind() == {
        "all_reduce": 4 * (sum(int(np.prod(s)) for s in SHAPES.values()) + 1)}, report
  sent = sum(report_bytes(report, mesh).values())
  assert sent <= 1.01 * sum(hlo_collective_bytes(compiled.as_text()).values()), report
  assert {x.what for x in report.collectives} == {"all_reduce"}, report


# ---- any small program of replicated and split inputs ----

B, D = 64, 16
OPS = ("matmul", "gram", "contract_rows", "add", "tanh", "scale_by_sum")


def _apply(op: str, a, b):
  """One step of a program: ``op`` on pool values ``a``, ``b`` where their shapes allow it,
  else ``tanh(a)``."""
  if op == "matmul" and a.shape[-1] == b.shape[0] == D and b.shape == (D, D):
    return a @ b
  if op == "gram" and a.shape == (D, D):
    return a @ a.T
  if op == "contract_rows" and a.shape == (B, D) and b.shape == (B, D):
    return a.T @ b          # a sum over the batch's rows: partial where they are split
  if op == "add" and a.shape == b.shape:
    return a + b
  if op == "scale_by_sum":
    return a * jnp.sum(b)
  return jnp.tanh(a)


def small_program(ops):
  """The program of ``ops``: each appends ``op`` of two pool values (by index) to the pool;
  v, the one input that may be split by columns, is read at most once (a later read takes w)."""
  def program(x, w, v):
    pool, read = [x, w, v], set()

    def take(i):
      i %= len(pool)
      if i == 2 and 2 in read:
        return w
      read.add(i)
      return pool[i]
    for op, i, j in ops:
      pool.append(_apply(op, take(i), take(j)))
    return pool[-1], jnp.sum(pool[-2])
  return program


@settings(max_examples=20)
@given(ops=st.lists(st.tuples(st.sampled_from(OPS), st.integers(0, 7), st.integers(0, 7)),
                    min_size=1, max_size=5),
       layout=st.sampled_from(["dp", "dp_tp"]), v_split=st.booleans())
def test_small_programs_send_no_more_than_jit_and_work_no_more(ops, layout, v_split):
  """x (B, D) split over "data" by rows, w (D, D) replicated, v (D, D) replicated or split
  over "model" (or "data") by columns.

  Not covered: a sum over the batch broadcast back against a split matrix
  (``jnp.sum(tanh(x), 0) + v``, v split by columns over "model"). jit's partitioner
  propagates v's split back through the sum into the work on the batch (each device sums,
  and first computes, only its columns); ``use`` places each equation as it meets it,
  computes those columns whole over "model" and slices after (3.4x jit's flops and 2.6x
  its bytes for that program on a 2x4 mesh). Nor v read by two products (``v @ (v @ w)``):
  jit's partitioner lays out the first product for the second (v moved to rows by an
  all-to-all, the inner product split by rows), ``use`` lays it out for itself (v gathered,
  as jit gathers it for ``v @ w`` alone) and moves it for the second: 1.5x jit's bytes."""
  mesh, _ = mesh_and_specs(layout)
  keys = jax.random.split(jax.random.key(len(ops)), 3)
  put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))   # noqa: E731
  x = put(jax.random.normal(keys[0], (B, D)) / 4, P("data"))
  w = put(jax.random.normal(keys[1], (D, D)) / 4, P())
  v = put(jax.random.normal(keys[2], (D, D)) / 4,
          P(None, mesh.axis_names[-1]) if v_split else P())
  step = jax.jit(small_program(ops))
  used = jaxcoll.use(step, algorithm="ring")
  with jax.set_mesh(mesh):
    want, got = step(x, w, v), used(x, w, v)
    report = jaxcoll.explain_step(used, x, w, v)
    compiled = step.lower(x, w, v).compile()
    flops = jaxcoll.tools.flops_of(jaxcoll.use(step, algorithm="native").lower(x, w, v).compile())
  for g, want_leaf in zip(got, want):
    scale = 1 + float(jnp.max(jnp.abs(want_leaf)))
    np.testing.assert_allclose(g, want_leaf, rtol=1e-4, atol=1e-4 * scale)
    assert g.sharding.is_equivalent_to(want_leaf.sharding, g.ndim), (g.sharding,
                                                                   want_leaf.sharding)
  sent = sum(report_bytes(report, mesh).values())
  assert sent <= 1.01 * sum(hlo_collective_bytes(compiled.as_text()).values()), report
  assert flops <= 1.1 * jaxcoll.tools.flops_of(compiled), report


# ---- FSDP in JAX's explicit mode: gradients reduce-scattered however the step gathers ----

FSDP_SHAPES = {"w1": (32, 64), "b1": (64,), "w2": (64, 16), "b2": (16,)}


def fsdp_step(order, inline: bool):
  """The MLP with every parameter split over "fsdp" on its first dimension, gathered whole
  (``reshard(p, P())``) before its layer, in the given ``order`` (all four before the first
  matmul), or inline in the expressions."""
  def loss(p, x, y):
    if inline:
      h = jax.nn.relu(x @ jax.sharding.reshard(p["w1"], P()) + jax.sharding.reshard(p["b1"], P()))
      return jnp.mean((h @ jax.sharding.reshard(p["w2"], P()) +
                       jax.sharding.reshard(p["b2"], P()) - y) ** 2)
    whole = {k: jax.sharding.reshard(p[k], P()) for k in order}
    h = jax.nn.relu(x @ whole["w1"] + whole["b1"])
    return jnp.mean((h @ whole["w2"] + whole["b2"] - y) ** 2)

  @jax.jit
  def step(p, x, y):
    value, g = jax.value_and_grad(loss)(p, x, y)
    return jax.tree.map(lambda a, b: a - 0.1 * b, p, g), value
  return step


@settings(max_examples=6)
@given(order=st.permutations(sorted(FSDP_SHAPES)), inline=st.booleans())
def test_fsdp_gradients_are_reduce_scattered_whatever_the_order_of_the_reshards(order, inline):
  """Each gradient is a partial sum over "fsdp" (the batch is split over it) headed for its
  parameter's split: one reduce-scatter each (in buckets), the gathers of the forward, the
  loss's all-reduce; nothing all-reduced whole and sliced, whichever reshard comes first."""
  mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(AxisType.Explicit,))
  keys = jax.random.split(jax.random.key(1), 6)
  with jax.set_mesh(mesh):
    params = {k: jax.device_put(jax.random.normal(key, s) / 8, P("fsdp"))
              for key, (k, s) in zip(keys, sorted(FSDP_SHAPES.items()))}
    x = jax.device_put(jax.random.normal(keys[4], (64, 32)), P("fsdp"))
    y = jax.device_put(jax.random.normal(keys[5], (64, 16)), P("fsdp"))
    step = fsdp_step(order, inline)
    used = jaxcoll.use(step, algorithm="ring")
    want, got = step(params, x, y), used(params, x, y)
    report = jaxcoll.explain_step(used, params, x, y)
  jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6), got, want)
  values = sum(int(np.prod(s)) for s in FSDP_SHAPES.values()) * 4
  assert report.bytes_by_kind() == {"all_gather": values // 8, "reduce_scatter": values,
                                    "all_reduce": 4}, report
