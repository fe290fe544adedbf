"""The alpha-beta cost model, read from the schedules themselves.

A schedule on mesh axes of sizes ``axis_sizes`` (names ``axis_names``),
message M bytes, profile p, costs

  T = p.overhead + sum over steps s of [ max over axes a used in s of
        (alpha_a + beta_a * B_{s,a})  +  gamma * (L_s + U_s)  +  delta * W ]

where B_{s,a} is the most bytes any device sends over axis a in step s (a
message is charged to the outermost axis its two devices differ in, as in
:meth:`Schedule.traffic`), L_s the most bytes any device touches locally in
step s (the chunks it copies out to send, those it writes back on receipt, and
those it combines), and U_s the whole buffer's bytes when the executor unrolls
step s (outside a ``fori_loop`` XLA copies the buffer between steps; measured
in ``bench_collectives.py --hlo``), else 0. gamma is the local cost of touching
a byte; delta the per-step cost of the whole buffer of W bytes (loop carries,
fresh pages: on the CPU testbed a step at 64 MiB costs far more than its
messages), fitted by :func:`jaxcoll.calibrate`.
Transfers of one step run concurrently, so the step takes as long as its
slowest axis. Reduce transfers carry ``partial_sum_scale`` times the bytes
(float32 partial sums of bfloat16 data).

Worked example (the design notes'): ring all_reduce, N = 8, M = 500 MB of
float16, alpha = 5 us, beta = 1 / 50 GB/s: 14 steps of M/8 bytes = 70 us +
875 MB / 50 GB/s = 17.5 ms, total 17.57 ms, 99.6% of it the bandwidth term.

"native" (the jax.lax collective) is priced from the profile's measured times
of it when it has them (:func:`jaxcoll.calibrate` records them), else as what
NCCL would run on the same links: the cheaper of its ring and tree for
all_reduce, its ring for reduce_scatter and all_gather, pairwise exchange for
all_to_all, a tree for broadcast and reduce, all over the flattened axes.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence

import numpy as np

from jaxcoll._src.algorithms import HIERARCHICAL, NATIVE, algorithms, schedule
from jaxcoll._src.executor import LOOP_MIN_STEPS, plan
from jaxcoll._src.profile import Profile
from jaxcoll._src.schedule import Schedule

NATIVE_EQUIVALENT = {
    "all_reduce": ("ring", "double_binary_tree"),
    "reduce_scatter": ("ring",),
    "all_gather": ("ring",),
    "all_to_all": ("direct",),
    "broadcast": ("binomial_tree",),
    "reduce": ("binomial_tree",),
    "shift": ("direct",),
}


def unrolled_steps(sched: Schedule) -> np.ndarray:
  """``[S]`` bools: the steps the executor runs outside a loop."""
  flags = [phase.num_steps < LOOP_MIN_STEPS for phase in plan(sched)
           for _ in range(phase.num_steps)]
  return np.asarray(flags, bool)


@functools.lru_cache(maxsize=1024)
def step_loads(sched: Schedule, axis_sizes: tuple[int, ...]):
  """Per step: chunks each rank sends over each axis (reduce and copy apart, ``[S, A, N]``
  each) and the chunks a rank touches locally: the most any rank sends + receives +
  combines, plus the whole buffer where the step is unrolled (``[S]``)."""
  n, k = sched.axis_size, len(axis_sizes)
  coords = np.stack(np.unravel_index(np.arange(n), axis_sizes), axis=1)
  reduce_load = np.zeros((sched.num_steps, k, n))
  copy_load = np.zeros((sched.num_steps, k, n))
  touched = np.zeros(sched.num_steps)
  for s, step in enumerate(sched.steps):
    local = np.zeros(n)
    for t in step.transfers:
      src, dst = np.asarray(t.src), np.asarray(t.dst)
      differ = coords[src] != coords[dst]
      moving = differ.any(1)
      axis = differ.argmax(1)
      load = reduce_load if t.combine == "reduce" else copy_load
      np.add.at(load[s], (axis[moving], src[moving]), t.chunks_per_message)
      k = t.chunks_per_message
      np.add.at(local, src[moving], k)
      np.add.at(local, dst[moving], 2 * k if t.combine == "reduce" else k)
    touched[s] = local.max(initial=0)
  touched += unrolled_steps(sched) * (sched.num_chunks + sched.scratch_rows)
  return reduce_load, copy_load, touched


def predict(sched: Schedule, profile: Profile, axis_names: Sequence[str],
            axis_sizes: Sequence[int], nbytes: float, *, partial_sum_scale: float = 1.0) -> float:
  """Predicted seconds of ``sched`` for an M = ``nbytes`` message (module docstring)."""
  axis_sizes = tuple(axis_sizes)
  reduce_load, copy_load, touched = step_loads(sched, axis_sizes)
  chunk = nbytes / sched.message_chunks
  links = [profile.link(a) for a in axis_names]
  alpha = np.array([link.alpha for link in links])
  beta = np.array([link.beta for link in links])
  sent = (reduce_load * partial_sum_scale + copy_load).max(axis=2) * chunk   # [S, A]
  used = sent > 0
  per_axis = np.where(used, alpha + beta * sent, 0.0)
  wire = per_axis.max(axis=1, initial=0.0)
  local = profile.gamma * touched * chunk
  buffer = profile.delta * (sched.num_chunks + sched.scratch_rows) * chunk * used.any(axis=1)
  return float(profile.overhead + wire.sum() + local.sum() + buffer.sum())


def predict_native(primitive: str, profile: Profile, axis_names: Sequence[str],
                   axis_sizes: Sequence[int], nbytes: float) -> float:
  """Predicted seconds of the jax.lax collective (module docstring)."""
  measured = profile.native_times(primitive, axis_sizes)
  if measured is not None:
    return measured.time(nbytes)
  n = math.prod(axis_sizes)
  return min(predict(schedule(primitive, a, n), profile, axis_names, axis_sizes, nbytes)
             for a in NATIVE_EQUIVALENT[primitive])


def stage_candidates(primitive: str, num_axes: int) -> list[tuple[str, ...]]:
  """The per-axis algorithm choices auto considers for a hierarchical schedule."""
  if primitive == "all_to_all":
    per_axis = [("direct", "bruck")] * num_axes
  else:
    inner = ("ring", "direct", "halving_doubling")
    top = tuple(a for a in algorithms("all_reduce", num_axes=1) if a != NATIVE) \
        if primitive == "all_reduce" else inner
    per_axis = [top] + [inner] * (num_axes - 1)
  return list(itertools.product(*per_axis))


def candidate_schedules(primitive: str, axis_sizes: Sequence[int]):
  """(label, algorithm, schedule options, schedule) for every scheduled choice auto weighs."""
  n, shape = math.prod(axis_sizes), tuple(axis_sizes)
  out = []
  for algo in algorithms(primitive, num_axes=len(shape)):
    if algo == NATIVE:
      continue
    if algo != HIERARCHICAL:
      out.append((algo, algo, {}, schedule(primitive, algo, n)))
      continue
    for per_axis in stage_candidates(primitive, len(shape)):
      options = {"axis_sizes": shape, "per_axis": per_axis}
      try:
        sched = schedule(primitive, algo, n, **options)
      except ValueError:   # e.g. halving_doubling has no reduce_scatter stage for that size
        continue
      out.append((f"{algo}({','.join(per_axis)})", algo, options, sched))
  return out
