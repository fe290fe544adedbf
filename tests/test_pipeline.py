"""jaxcoll.pipeline: the tick tables (every operation once, in dependency order, bubble
fractions equal the published formulas, live microbatches), and one SPMD training step per
schedule equal to the unpipelined model's ``jax.value_and_grad`` (loss and every gradient),
for PP in {2, 4} and M in {PP, 2 PP, 4 PP}, under jax.jit and jaxcoll.use, on a stage x data
mesh with the gradients synced over "data"; bad input named."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxcoll
from jaxcoll._src.pipeline.schedules import BACKWARD, FORWARD, IDLE, WEIGHT, formula_bubble

VIRTUAL = {"gpipe": 1, "1f1b": 1, "interleaved": 2, "zero_bubble": 1}
GRID = [(s, pp, m) for s in VIRTUAL for pp in (2, 4) for m in (pp, 2 * pp, 4 * pp)]


def check_table(t):
  """Every (kind, microbatch, virtual stage) exactly once, each after what it reads: F after
  the previous stage's F, B after its own F and the next stage's B, W after its B."""
  p, v, m = t.stages, t.virtual, t.microbatches
  when = {}
  for tick in range(t.ticks):
    for s in range(p):
      kind = int(t.kind[tick, s])
      if kind != IDLE:
        key = (kind, int(t.micro[tick, s]), int(t.chunk[tick, s]) * p + s)
        assert key not in when, key
        when[key] = tick
  kinds = (FORWARD, BACKWARD) + ((WEIGHT,) if t.split else ())
  assert set(when) == {(k, i, s) for k in kinds for i in range(m) for s in range(p * v)}
  for (kind, i, k), tick in when.items():
    if kind == FORWARD and k > 0:
      assert when[FORWARD, i, k - 1] < tick
    if kind == BACKWARD:
      assert when[FORWARD, i, k] < tick
      if k < p * v - 1:
        assert when[BACKWARD, i, k + 1] < tick
    if kind == WEIGHT:
      assert when[BACKWARD, i, k] < tick


@pytest.mark.quick
@pytest.mark.parametrize("schedule, pp, m", GRID)
def test_tables_keep_dependencies_and_their_bubbles_equal_the_formulas(schedule, pp, m):
  t = jaxcoll.pipeline.schedule(schedule, pp, m, VIRTUAL[schedule])
  check_table(t)
  assert t.bubble == pytest.approx(formula_bubble(schedule, pp, m, VIRTUAL[schedule]))
  if schedule == "gpipe":
    assert t.peak_live == m
  if schedule in ("1f1b", "zero_bubble"):
    assert t.peak_live == min(pp, m)
  lines = str(t).splitlines()
  assert len(lines) == pp + 1 and f"bubble {t.bubble:.3f}" in lines[0]
  assert lines[1].split()[2] == ("F0.0" if schedule == "interleaved" else "F0")


def test_zero_bubble_idles_a_third_of_1f1b_and_interleaving_less():
  """In the same units (F, B, W one tick each; 1F1B's backward B and W together), ZB-H1's
  idle ticks are a third of 1F1B's; interleaving two chunks halves the bubble's share."""
  for pp, m in ((4, 8), (4, 16)):
    zb = jaxcoll.pipeline.schedule("zero_bubble", pp, m)
    ofb = jaxcoll.pipeline.schedule("1f1b", pp, m)
    # 1F1B's table idles 2(PP-1) ticks a device with B one tick, so 3(PP-1) with B two
    # (B and W); zero-bubble PP-1: a third
    assert 2 * np.sum(zb.kind == IDLE) == np.sum(ofb.kind == IDLE)
    inter = jaxcoll.pipeline.schedule("interleaved", pp, m, 2)
    assert inter.bubble < ofb.bubble


# ---------------------------------------------------------------------------- the step

D = 6


def stage_fn(p, h):
  return jnp.tanh(h @ p["w"] + p["b"])


def loss_fn(y, t):
  return jnp.mean((y - t) ** 2)


def model(num_stages, key=0):
  ks = jax.random.split(jax.random.key(key), num_stages)
  return [{"w": jax.random.normal(k, (D, D)) / 2, "b": jnp.full((D,), 0.1 * i)}
          for i, k in enumerate(ks)]


def reference(stages, x, y):
  """The unpipelined model: the mean over microbatches of the loss of the stages in turn."""
  def one(xm, ym):
    h = xm
    for sp in stages:
      h = stage_fn(sp, h)
    return loss_fn(h, ym)
  return jnp.mean(jax.vmap(one)(x, y))


def pipelined(schedule, pp, data=None):
  names = ("stage",) if data is None else ("data", "stage")
  devices = np.array(jax.devices()[:pp * (data or 1)])
  mesh = Mesh(devices.reshape((data, pp) if data else (pp,)), names)

  def step(w, x, y):
    loss, grads = jaxcoll.pipeline.run(stage_fn, w, x, y, "stage", loss_fn=loss_fn,
                                       schedule=schedule, virtual_stages=VIRTUAL[schedule])
    if data:   # data parallel over the stage program: mean over the data replicas
      loss = jaxcoll.all_reduce(loss, "data", op="mean")
      grads = jaxcoll.sync_gradients(grads, "data")
    return loss, grads
  batch = P() if data is None else P(None, "data")
  return mesh, jax.shard_map(step, mesh=mesh, in_specs=(P("stage"), batch, batch),
                             out_specs=(P(), P("stage")))


def run_case(schedule, pp, m, data=None, wrap=jax.jit):
  stages = model(pp * VIRTUAL[schedule])
  rows = 3 * (data or 1)
  x = jax.random.normal(jax.random.key(1), (m, rows, D))
  y = jax.random.normal(jax.random.key(2), (m, rows, D))
  want_loss, want_grads = jax.value_and_grad(reference)(stages, x, y)
  _, step = pipelined(schedule, pp, data)
  loss, grads = wrap(step)(jaxcoll.pipeline.stack(stages, pp), x, y)
  np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
  chex.assert_trees_all_close(grads, jaxcoll.pipeline.stack(want_grads, pp),
                              atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("schedule, pp, m", [
    pytest.param(*case, marks=pytest.mark.quick) if case[2] == 2 * case[1] else case
    for case in GRID])
def test_loss_and_gradients_equal_the_unpipelined_model(schedule, pp, m):
  run_case(schedule, pp, m)


@pytest.mark.parametrize("schedule", sorted(VIRTUAL))
def test_stage_by_data_mesh_syncs_gradients_over_data(schedule):
  """4 stages x 2 data replicas, each replica a half of every microbatch: the loss and the
  gradients synced over "data" equal the model's on the whole batch."""
  run_case(schedule, 4, 8, data=2)


@pytest.mark.parametrize("schedule", ["1f1b", "zero_bubble"])
def test_under_use_as_under_jit(schedule):
  run_case(schedule, 2, 4, wrap=jaxcoll.use)


@pytest.mark.parametrize("call, match", [
    (dict(schedule="pipedream"), r"schedule='pipedream'"),
    (dict(schedule="interleaved", virtual_stages=2, m=3), r"microbatches=3.*multiple of 2"),
    (dict(schedule="1f1b", virtual_stages=2), r"virtual_stages=2: only schedule='interleaved'"),
    (dict(schedule="interleaved", virtual_stages=1), r"virtual_stages=1: the interleaved"),
    (dict(params_lead=3), r"params: a leaf of shape \(3, 6(, 6)?\).*virtual_stages = 1"),
    (dict(targets_m=5), r"targets: a leaf of shape \(5, 3, 6\).*M = 4"),
    (dict(widen=True), r"stage_fn maps an input of shape \(3, 6\).*\(3, 7\)"),
])
def test_bad_input_is_named_at_trace_time(call, match):
  m = call.get("m", 4)
  v = call.get("virtual_stages", 1)
  lead = call.get("params_lead", v)
  w = {"w": jnp.ones((2 * lead, D, D)), "b": jnp.ones((2 * lead, D))}
  x, y = jnp.ones((m, 3, D)), jnp.ones((call.get("targets_m", m), 3, D))
  fn = (lambda p, h: jnp.concatenate([h, h[:, :1]], -1)) if call.get("widen") else stage_fn
  mesh = Mesh(np.array(jax.devices()[:2]), ("stage",))
  f = jax.shard_map(lambda w, x, y: jaxcoll.pipeline.run(
      fn, w, x, y, "stage", loss_fn=loss_fn, schedule=call.get("schedule", "1f1b"),
      virtual_stages=v), mesh=mesh, in_specs=(P("stage"), P(), P()),
      out_specs=(P(), P("stage")))
  with pytest.raises((ValueError, TypeError), match=match):
    jax.eval_shape(f, w, x, y)


def test_stack_orders_each_devices_chunks():
  stacked = jaxcoll.pipeline.stack([jnp.full((2,), k) for k in range(6)], 3)
  assert stacked[:, 0].tolist() == [0, 3, 1, 4, 2, 5]
  with pytest.raises(ValueError, match="stage_params holds 5 stages.*num_devices = 2"):
    jaxcoll.pipeline.stack([jnp.ones(2)] * 5, 2)


def test_the_transformer_lm_example_trains_to_the_unpipelined_losses():
  """examples/pipeline_lm.py, run as a user runs it: its own check (final losses equal)."""
  import os
  import subprocess
  import sys
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  done = subprocess.run([sys.executable, os.path.join(root, "examples", "pipeline_lm.py")],
                        capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
  assert "final losses equal" in done.stdout
