"""``jaxcoll.calibrate``: a :class:`Profile` measured on the live mesh.

Per mesh axis, chains of k = 1 and 4 ring steps (every device sends M bytes to
its neighbour along that axis with ``jaxcoll.shift``, the executor's own
ppermute path) are timed over a size sweep, and ``t = c + k (alpha + beta M)``
is fitted by least squares weighted by 1/t (relative error), giving the axis's
alpha and beta and the per-call overhead c. gamma is the slope of a local
combine (one elementwise multiply-add of M bytes; XLA would fuse a chain) in
``t = c + gamma M``. Then every jax.lax collective jaxcoll calls "native" is
timed at every size, over the whole tuple of axes and over each axis alone.

Every time is the median of ``reps`` calls after one warm-up. In a
multi-process job every process runs the same programs and takes process 0's
numbers, so all processes hold the same profile and auto picks the same
algorithm everywhere (different picks would deadlock).
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcoll._src.profile import Link, NativeTimes, Profile

DEFAULT_SIZES = (4 << 10, 64 << 10, 1 << 20, 16 << 20)
NATIVE_PRIMITIVES = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast",
                     "reduce")
CHAIN = (1, 4)


def _median_time(fn, x, reps: int) -> float:
  fn(x).block_until_ready()
  times = []
  for _ in range(reps):
    start = time.perf_counter()
    fn(x).block_until_ready()
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def _fit(rows: Sequence[Sequence[float]], times: Sequence[float]) -> np.ndarray:
  a, t = np.asarray(rows, float), np.asarray(times, float)
  w = 1.0 / t
  coef, *_ = np.linalg.lstsq(a * w[:, None], t * w, rcond=None)
  return np.maximum(coef, 0.0)


def _native_call(primitive: str, axes):
  import jaxcoll
  if primitive == "all_to_all":
    return lambda v: jaxcoll.all_to_all(v, axes, 0, 0, tiled=True, algorithm="native")
  if primitive in ("reduce_scatter", "all_gather"):
    return lambda v: getattr(jaxcoll, primitive)(v, axes, tiled=True, algorithm="native")
  return lambda v: getattr(jaxcoll, primitive)(v, axes, algorithm="native")


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
  import jaxcoll
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
  inputs = {s: jax.device_put(np.zeros((devices, s // 4), np.float32), sharding) for s in sizes}
  groups = [axes] + ([(a,) for a in axes] if len(axes) > 1 else [])
  bar = _Progress(len(sizes) * (len(CHAIN) * len(axes) + 1 + len(groups) * len(primitives)),
                  progress)

  def program(body, out_spec=spec):
    return jax.jit(jax.shard_map(lambda v: body(v[0])[None], mesh=mesh, in_specs=spec,
                                 out_specs=out_spec))

  def chain(step, k):
    def body(v):
      for _ in range(k):
        v = step(v)
      return v
    return body

  measured = []   # flat list, so multi-process jobs can agree on process 0's numbers
  for a in [*axes, None]:
    for k in (CHAIN if a else (1,)):
      step = (lambda v, a=a: jaxcoll.shift(v, a, 1, algorithm="direct")) if a else \
          (lambda v: v * 0.999 + v)
      fn = program(chain(step, k))
      for s in sizes:
        measured.append(_median_time(fn, inputs[s], reps))
        bar.step(f"{a or 'combine'} k={k} {s} B")
  for group in groups:
    for primitive in primitives:
      fn = program(_native_call(primitive, group if len(group) > 1 else group[0]))
      for s in sizes:
        per_device = s // devices if primitive == "all_gather" else s
        x = jax.device_put(np.zeros((devices, per_device // 4), np.float32), sharding)
        measured.append(_median_time(fn, x, reps))
        bar.step(f"native {primitive} over {group} {s} B")
  bar.close()
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils
    measured = list(np.asarray(multihost_utils.broadcast_one_to_all(np.asarray(measured))))

  it = iter(measured)
  links, overheads, gamma = {}, [], 0.0
  for a in [*axes, None]:
    rows, times = [], []
    for k in (CHAIN if a else (1,)):
      for s in sizes:
        rows.append([1.0, k, k * s] if a else [1.0, k * s])
        times.append(next(it))
    coef = _fit(rows, times)
    if a:
      overheads.append(coef[0])
      links[a] = Link(alpha=float(coef[1]), beta=float(coef[2]))
    else:
      gamma = float(coef[1])
  native = []
  shape = dict(mesh.shape)
  for group in groups:
    for primitive in primitives:
      times = tuple(float(next(it)) for _ in sizes)
      native.append(NativeTimes(primitive, tuple(shape[a] for a in group), sizes, times))
  return Profile(links=links, gamma=gamma, overhead=float(min(overheads)), native=tuple(native),
                 name=name)
