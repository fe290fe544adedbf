"""``jaxcoll.calibrate``: a :class:`Profile` measured on the live mesh.

The cost model (:mod:`jaxcoll._src.cost`) is linear in its parameters once a
schedule's per-step loads are known: a step whose outermost crossed axis is a
costs alpha_a + beta_a * B, plus gamma per byte touched locally, plus one
overhead per call. So calibration times the schedules the dispatcher chooses
among (all_reduce by ring, recursive doubling, halving-doubling, binomial tree,
and hierarchical over several axes) at every size, and fits overhead, alpha_a
and beta_a to those times by least squares weighted by 1/t (relative error).
Fitting to whole schedules, not to one lone ppermute, folds in what a step
really costs in this runtime (its loop, its slices, the transport: in a
multi-process CPU job every pair goes through gloo). gamma is the slope of a
local combine (one elementwise multiply-add of M bytes) in ``t = c + gamma M``.
Then every jax.lax collective jaxcoll calls "native" is timed at every size,
over the whole tuple of axes and over each axis alone.

Every time is the median of ``reps`` calls after one warm-up; the programs
of one size run in turn, their order rotated each repetition (as the
benchmarks time), so none is measured on buffers left warm by its own
previous call (fresh-page faults dominate large CPU timings). In a
multi-process job every process runs the same programs and takes process 0's
numbers, so all processes hold the same profile and auto picks the same
algorithm everywhere (different picks would deadlock).
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcoll._src import cost
from jaxcoll._src.algorithms import schedule
from jaxcoll._src.profile import Link, NativeTimes, Profile

DEFAULT_SIZES = (4 << 10, 64 << 10, 1 << 20, 16 << 20)
NATIVE_PRIMITIVES = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast",
                     "reduce")
FIT_ALGORITHMS = (("all_reduce", "ring"), ("all_reduce", "recursive_doubling"),
                  ("all_reduce", "halving_doubling"), ("all_reduce", "binomial_tree"),
                  ("all_gather", "ring"), ("all_to_all", "direct"), ("all_to_all", "bruck"))


def _fit(rows: Sequence[Sequence[float]], times: Sequence[float],
         scale: Sequence[float] | None = None) -> np.ndarray:
  """Least squares of rows @ coef = times, each row weighted by 1 / its scale (default: its
  time), so every point counts by its relative error; coefficients clipped at 0."""
  a, t = np.asarray(rows, float), np.asarray(times, float)
  w = 1.0 / np.asarray(t if scale is None else scale, float)
  coef, *_ = np.linalg.lstsq(a * w[:, None], t * w, rcond=None)
  return np.maximum(coef, 0.0)


class _Progress:
  """rich progress on stderr when available (else tqdm, else nothing)."""

  def __init__(self, total: int, enabled: bool):
    self.bar = None
    if not enabled:
      return
    try:
      from tqdm import tqdm
      self.bar = tqdm(total=total, desc="calibrate", file=sys.stderr, leave=False)
    except ImportError:
      self.bar = None

  def step(self, label: str):
    if self.bar is not None:
      self.bar.set_postfix_str(label, refresh=False)
      self.bar.update()

  def close(self):
    if self.bar is not None:
      self.bar.close()


def calibrate(mesh, axes: Sequence[str] | None = None, sizes: Sequence[int] = DEFAULT_SIZES, *,
              reps: int = 5, primitives: Sequence[str] = NATIVE_PRIMITIVES,
              progress: bool = True, name: str = "calibrated") -> Profile:
  """Measures alpha, beta per axis, gamma, the call overhead and the native collectives.

  Args:
    mesh: the ``jax.sharding.Mesh`` to measure (all its devices take part).
    axes: the axes to measure (default: all of the mesh's).
    sizes: per-device message sizes M in bytes (multiples of 4 * devices).
    reps: timed calls per measurement (median).
    primitives: the native collectives to time.
    progress: show a progress bar on stderr (tqdm, when installed).
    name: the profile's name.

  Runs programs on the mesh, so it must be called outside jit / shard_map.
  """
  from jax._src import core
  if not core.trace_state_clean():
    raise RuntimeError("calibrate() runs programs on the mesh; call it outside jit, shard_map "
                       "and other transformations, then pass the profile to jaxcoll.config")
  axes = tuple(axes or mesh.axis_names)
  for a in axes:
    if a not in mesh.axis_names:
      raise ValueError(f"axes: {a!r} is not an axis of the mesh {mesh.axis_names}")
  sizes = tuple(int(s) for s in sizes)
  devices = mesh.devices.size
  for s in sizes:
    if s % (4 * devices) or s <= 0:
      raise ValueError(f"sizes: {s} must be a positive multiple of 4 * {devices} bytes")
  spec = P(mesh.axis_names)
  sharding = NamedSharding(mesh, spec)
  _input_for = lambda primitive, s: s // devices if primitive == "all_gather" else s
  groups = [axes] + ([(a,) for a in axes] if len(axes) > 1 else [])
  fit_algorithms = FIT_ALGORITHMS + ((("all_reduce", "hierarchical"),) if len(axes) > 1 else ())
  bar = _Progress(len(sizes) * (len(fit_algorithms) + 1 + len(groups) * len(primitives)),
                  progress)

  def program(body, out_spec=spec):
    return jax.jit(jax.shard_map(lambda v: body(v[0])[None], mesh=mesh, in_specs=spec,
                                 out_specs=out_spec))

  axis_arg = axes if len(axes) > 1 else axes[0]
  programs = []   # (label, size, fn, x) in the order of ``measured``
  for primitive, algo in fit_algorithms:
    fn = program(lambda v, p=primitive, a=algo: _call(p, v, axis_arg, a))
    programs += [(f"{primitive} {algo}", s, _input_for(primitive, s), fn) for s in sizes]
  fn = program(lambda v: v * 0.999 + v)
  programs += [("combine", s, _input_for("all_reduce", s), fn) for s in sizes]
  for group in groups:
    for primitive in primitives:
      fn = program(lambda v, p=primitive, g=group: _call(p, v, g if len(g) > 1 else g[0],
                                                        "native"))
      programs += [(f"native {primitive} over {group}", s, _input_for(primitive, s), fn)
                   for s in sizes]
  measured = [0.0] * len(programs)   # flat, so multi-process jobs can agree on process 0's
  for s in sizes:   # every program of a size in turn, order rotated per rep, like real use
    mine = [i for i, p in enumerate(programs) if p[1] == s]
    args = {i: jax.device_put(np.zeros((devices, programs[i][2] // 4), np.float32), sharding)
            for i in mine}
    for i in mine:
      programs[i][3](args[i]).block_until_ready()
    times = {i: [] for i in mine}
    for rep in range(reps):
      for i in mine[rep % len(mine):] + mine[:rep % len(mine)]:
        start = time.perf_counter()
        programs[i][3](args[i]).block_until_ready()
        times[i].append(time.perf_counter() - start)
    for i in mine:
      measured[i] = statistics.median(times[i])
      bar.step(f"{programs[i][0]} {s} B")
  bar.close()
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils
    measured = list(np.asarray(multihost_utils.broadcast_one_to_all(np.asarray(measured))))

  it = iter(measured)
  shape = dict(mesh.shape)
  axis_sizes = tuple(shape[a] for a in axes)
  n = math.prod(axis_sizes)
  schedule_times = {(p, a, s): next(it) for p, a in fit_algorithms for s in sizes}
  gamma = float(_fit([[1.0, s] for s in sizes], [next(it) for _ in sizes])[1])
  rows, times = [], []
  for (primitive, algo, s), t in schedule_times.items():
    options = {"axis_sizes": axis_sizes} if algo == "hierarchical" else {}
    rows.append(_features(schedule(primitive, algo, n, **options), axis_sizes, s))
    times.append(t - gamma * rows[-1].pop())
  coef = _fit(rows, times, scale=list(schedule_times.values()))
  links = {a: Link(alpha=float(coef[1 + 2 * i]), beta=float(coef[2 + 2 * i]))
           for i, a in enumerate(axes)}
  overhead, delta = float(coef[0]), float(coef[-1])
  native = []
  for group in groups:
    for primitive in primitives:
      times = tuple(float(next(it)) for _ in sizes)
      native.append(NativeTimes(primitive, tuple(shape[a] for a in group), sizes, times))
  return Profile(links=links, gamma=gamma, overhead=overhead, delta=delta, native=tuple(native),
                 name=name)


def _features(sched, axis_sizes, nbytes) -> list[float]:
  """The model's linear features of one schedule: [1, (steps, bytes) per axis ..., buffer
  bytes x steps, touched bytes]. Each step is charged to the outermost axis it crosses."""
  reduce_load, copy_load, touched = cost.step_loads(sched, axis_sizes)
  chunk = nbytes / sched.message_chunks
  sent = (reduce_load + copy_load).max(axis=2) * chunk   # [S, A]
  row = [1.0] + [0.0] * (2 * len(axis_sizes)) + [0.0]
  buffer = (sched.num_chunks + sched.scratch_rows) * chunk
  for step in sent:
    used = np.flatnonzero(step > 0)
    if used.size:
      a = int(used[0])
      row[1 + 2 * a] += 1.0
      row[2 + 2 * a] += float(step[a])
      row[-1] += buffer
  return row + [float(touched.sum() * chunk)]


def _call(primitive: str, v, axes, algorithm):
  import jaxcoll
  if primitive == "all_to_all":
    return jaxcoll.all_to_all(v, axes, 0, 0, tiled=True, algorithm=algorithm)
  if primitive in ("reduce_scatter", "all_gather"):
    return getattr(jaxcoll, primitive)(v, axes, tiled=True, algorithm=algorithm)
  return getattr(jaxcoll, primitive)(v, axes, algorithm=algorithm)
