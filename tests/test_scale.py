"""Schedules at scale: runs of steps, chunk rows made only when read, and pricing meshes of
16,384 devices, checked against the same schedules with every step and row made."""

from __future__ import annotations

import dataclasses
import math
import re
import sys
import tracemalloc

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import jaxcoll
from jaxcoll._src import compat
from jaxcoll._src.auto import cost, dispatch
from jaxcoll._src.auto.profile import Profile
from jaxcoll._src.auto.topology import Topology
from jaxcoll._src.schedules.algorithms import entries, schedule
from jaxcoll._src.schedules.algorithms.common import by_key
from jaxcoll._src.schedules.plan import LOOP_MIN_STEPS, plan
from jaxcoll._src.schedules.schedule import Run, Steps, crossing_axis

SHAPES = [(n,) for n in range(1, 9)] + [(2, 2), (2, 3), (3, 2), (2, 4), (4, 2), (2, 2, 2)]


def every_schedule():
  """(primitive, label, shape, schedule) of every variant auto weighs on SHAPES."""
  out = []
  for primitive in jaxcoll.PRIMITIVES:
    for shape in SHAPES:
      for algo in entries(primitive, num_axes=len(shape)):
        for label, options in algo.choices(shape):
          try:
            sched = schedule(primitive, algo.name, math.prod(shape), **options)
          except ValueError:
            continue
          out.append(pytest.param(primitive, shape, sched, id=f"{primitive}-{label}-{shape}"))
  return out


SCHEDULES = every_schedule()


def made(sched: jaxcoll.Schedule) -> jaxcoll.Schedule:
  """The same schedule with every step made and held: no runs, every row read."""
  steps = tuple(sched.steps)
  for step in steps:
    for t in step.transfers:
      t.send_chunks, t.recv_chunks   # noqa: B018
  return dataclasses.replace(sched, steps=steps)


def step_ranges(sched):
  """[start, end) of every part of the schedule's steps (a run: its count)."""
  ends = np.cumsum([count for _, count in sched.steps.runs()])
  return list(zip(ends - [count for _, count in sched.steps.runs()], ends))


@pytest.mark.parametrize("primitive,shape,sched", SCHEDULES)
def test_a_run_is_one_structure_the_executor_loops_over(primitive, shape, sched):
  """Every run lies inside one phase of the executor's plan (same permutations, chunk
  counts, combines and row contiguity), as :class:`Run` promises and pricing assumes."""
  phase_ends = set(np.cumsum([p.num_steps for p in plan(sched)]).tolist())
  for (start, end), part in zip(step_ranges(sched), sched.steps.parts):
    if isinstance(part, Run):
      assert not phase_ends & set(range(start + 1, end)), (start, end)


@pytest.fixture
def copy_rule(monkeypatch):
  """Sets whether XLA copies the buffer after unrolled steps (jax 0.10.2: it does), with the
  cost model's per-process cache of loads cleared before and after."""
  def set_rule(copies: bool):
    monkeypatch.setattr(compat, "BARRIERS_KEEP_UPDATES_IN_PLACE", not copies)
    cost.loads.cache_clear()
  yield set_rule
  cost.loads.cache_clear()


@pytest.mark.parametrize("primitive,shape,sched", SCHEDULES)
def test_unrolled_steps_are_the_executors_short_phases(primitive, shape, sched, copy_rule):
  copy_rule(True)
  want = [p.num_steps < LOOP_MIN_STEPS for p in plan(sched) for _ in range(p.num_steps)]
  got = [flag for (_, count), flag in zip(sched.steps.runs(), cost.unrolled_steps(sched))
         for _ in range(count)]
  assert got == want


@pytest.mark.parametrize("primitive,shape,sched", SCHEDULES)
@pytest.mark.parametrize("copies", [True, False])
def test_pricing_a_run_once_equals_pricing_every_step(primitive, shape, sched, copies,
                                                      copy_rule):
  """predict, features, traffic and bytes per rank read a run's first step for all of them:
  the same figures as the schedule with every step made, on both jax versions' copy rule
  and a topology of several processes and hosts."""
  copy_rule(copies)
  n = sched.axis_size
  names = tuple("abc"[:len(shape)])
  process = np.arange(n)[:, None] * 3 // n          # 3 processes (fewer when n < 3), 2 hosts
  topo = Topology(process, np.arange(n)[:, None] * 2 // n)
  prof = Profile.preset("cpu")
  every = made(sched)
  for nbytes in (1 << 10, 1 << 26):
    assert cost.predict(sched, prof, names, shape, nbytes, partial_sum_scale=2.0,
                        topology=topo) == pytest.approx(cost.predict(
                            every, prof, names, shape, nbytes, partial_sum_scale=2.0,
                            topology=topo), rel=1e-12)
    np.testing.assert_allclose(cost.features(sched, shape, nbytes, 1 << 20, topo),
                               cost.features(every, shape, nbytes, 1 << 20, topo), rtol=1e-12)
    assert sched.traffic(nbytes, partial_sum_scale=2.0) == every.traffic(
        nbytes, partial_sum_scale=2.0)
  assert sched.bytes_per_rank(1.0) == every.bytes_per_rank(1.0)
  np.testing.assert_array_equal(sched.chunks_sent, every.chunks_sent)


def test_steps_are_a_sequence_made_on_demand():
  ring = jaxcoll.schedule("all_reduce", "ring", 6)
  assert isinstance(ring.steps, Steps) and [c for _, c in ring.steps.runs()] == [5, 5]
  every = tuple(ring.steps)
  assert len(ring.steps) == ring.num_steps == len(every) == 10
  for i in (0, 4, 5, 9, -1, -10):
    assert ring.steps[i].transfers[0].perm == every[i].transfers[0].perm
    np.testing.assert_array_equal(ring.steps[i].transfers[0].send_chunks,
                                  every[i].transfers[0].send_chunks)
  assert [s.transfers[0].send_chunks.tolist() for s in ring.steps[3:7]] == [
      s.transfers[0].send_chunks.tolist() for s in every[3:7]]
  with pytest.raises(IndexError):
    ring.steps[10]
  relabelled = ring.relabel(2)
  assert [c for _, c in relabelled.steps.runs()] == [5, 5]   # runs stay runs
  assert relabelled.steps[7].transfers[0].perm == tuple(
      ((s + 2) % 6, (d + 2) % 6) for s, d in every[7].transfers[0].perm)


@given(shape=st.lists(st.integers(1, 5), min_size=1, max_size=3),
       pairs=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 10**6)), min_size=1,
                      max_size=20))
def test_crossing_axis_is_the_outermost_differing_coordinate(shape, pairs):
  n = math.prod(shape)
  src, dst = (np.array([p[i] % n for p in pairs]) for i in (0, 1))
  coords = np.stack(np.unravel_index(np.arange(n), shape), axis=1)
  differ = coords[src] != coords[dst]
  want = np.where(differ.any(1), differ.argmax(1), -1)
  np.testing.assert_array_equal(crossing_axis(tuple(shape), src, dst), want)


@given(chunk_keys=st.lists(st.integers(0, 4), min_size=1, max_size=24),
       keys=st.lists(st.integers(0, 4), min_size=1, max_size=8))
def test_by_key_sends_the_chunks_of_each_messages_key_in_order(chunk_keys, keys):
  src = np.arange(len(keys))
  groups = by_key(src, src + 1, np.array(chunk_keys), np.array(keys), "copy")
  got = {}
  for g in groups:
    for s, rows in zip(g.src.tolist(), g.send.array.tolist()):
      got[s] = rows
  want = {i: [c for c, k in enumerate(chunk_keys) if k == key] for i, key in enumerate(keys)}
  assert got == {i: rows for i, rows in want.items() if rows}
  counts = [len(want[i]) for i in range(len(keys)) if want[i]]
  assert [g.send.width for g in groups] == list(dict.fromkeys(counts))   # first use first


def cold_candidates(primitive, shape, prof):
  """Auto's whole decision, nothing cached: the candidates weighed, and how many Python
  functions (and builtins) it called, counted with ``sys.setprofile``."""
  dispatch.clear_caches()
  names = tuple("ab"[:len(shape)])
  calls = 0

  def count(frame, event, arg):
    nonlocal calls
    calls += event in ("call", "c_call")

  sys.setprofile(count)
  try:
    weighed = dispatch.candidates(primitive, names, shape, 1 << 24, prof)
    dispatch.pick(weighed, trusted=True)
  finally:
    sys.setprofile(None)
  return calls, weighed


@pytest.mark.parametrize("shape,small", [((16384,), (1024,)), ((64, 256), (16, 64))])
@pytest.mark.parametrize("primitive", ["all_reduce", "reduce_scatter", "all_gather"])
def test_prices_16384_devices_without_per_device_python(primitive, shape, small):
  """Auto's whole decision (every candidate built and priced, nothing cached) on 16,384
  devices in 256 MB, and in no more Python calls than twice those on 1,024 devices with the
  same number of axes: pricing reads ranks and chunk counts as arrays, never chunk rows (a
  flat ring's rows alone are 2 GB at this size), and a run of steps once. Calls are counted,
  not timed, so the test does not depend on the machine; the seconds are
  ``benchmarks/bench_schedule_scale.py``'s table (docs/guide/schedules.md)."""
  prof = Profile.preset("cpu")
  tracemalloc.start()
  calls, weighed = cold_candidates(primitive, shape, prof)
  peak = tracemalloc.get_traced_memory()[1]
  tracemalloc.stop()
  assert peak < 256 << 20
  for c in weighed:   # every row a builder left to be made is still unmade
    if c.schedule is not None:
      for step, _ in c.schedule.steps.runs():
        for t in step.transfers:
          for rows in (t.send, t.recv):
            assert rows.make is None or "array" not in rows.__dict__, c.label
  small_calls, _ = cold_candidates(primitive, small, prof)
  assert calls <= 2 * small_calls, (calls, small_calls)


LIMITED = [(p, a.name, a.max_devices, a.num_axes) for p in jaxcoll.PRIMITIVES for a in entries(p)
           if a.max_devices]


def labels(primitive, shape):
  return {c.label for c in dispatch.candidates(primitive, tuple("ab"[:len(shape)]), shape,
                                               1 << 20, Profile.preset("cpu"))}


def weighed(primitive, shape):
  return {label.split("(")[0] for label in labels(primitive, shape)}


@pytest.mark.parametrize("primitive,algorithm,limit,num_axes", LIMITED)
def test_an_algorithm_is_weighed_up_to_its_max_devices(primitive, algorithm, limit, num_axes):
  """Pairwise exchange (N - 1 permutations of N messages, O(N^2) to price), the chain
  broadcast (N + S - 2 permutations) and the hierarchical all_to_all (built rank by rank)
  are left out beyond their ``max_devices``, and explain says so; a call that names them
  still gets them."""
  shape = lambda n: (n,) if num_axes == 1 else (2, n // 2)  # noqa: E731
  assert algorithm in weighed(primitive, shape(limit))
  assert algorithm not in weighed(primitive, shape(2 * limit))
  assert algorithm in cost.not_weighed(primitive, shape(2 * limit))
  assert algorithm not in cost.not_weighed(primitive, shape(limit))
  mesh = dict(zip("ab", shape(2 * limit)))
  why = str(jaxcoll.explain(primitive, np.zeros(2 * limit * 4, np.float32), mesh, tuple(mesh)))
  assert f"not weighed on {2 * limit} devices: " in why and algorithm in why
  options = {"axis_sizes": shape(2 * limit)} if num_axes > 1 else {}
  assert jaxcoll.schedule(primitive, algorithm, 2 * limit, **options).num_steps >= 1


@pytest.mark.parametrize("primitive", ["all_reduce", "reduce_scatter", "all_gather"])
def test_pairwise_exchange_is_left_out_as_a_stage_beyond_1024_devices(primitive):
  stage = re.compile(r"\bdirect\b")   # not bidirectional_ring
  assert any(stage.search(label) for label in labels(primitive, (2, 512)))
  assert not any(stage.search(label) for label in labels(primitive, (2, 1024)))
  assert "direct (as a stage)" in cost.not_weighed(primitive, (2, 1024))
