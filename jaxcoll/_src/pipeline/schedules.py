"""Pipeline schedules as static tick tables: which microbatch each stage runs forward (F),
backward (B) or weight-gradient (W) at each tick, for GPipe, 1F1B, interleaved 1F1B and
zero-bubble (ZB-H1).

One mechanism builds every table: each device has an ordered list of operations (the
schedule's order); at each tick a device runs the first operation of its list whose inputs
have arrived (an activation or cotangent sent at the end of tick t is usable at t+1),
or idles. An operation takes one tick; with v virtual stages a device, one tick is a
chunk's (1/v of a stage's) work, so the formulas below hold with F, B and W of equal cost:

- GPipe and 1F1B: bubble (PP-1) / (M+PP-1); peak live microbatches (forwards whose
  backward has not run) M for GPipe, PP for 1F1B (stage 0's).
- interleaved 1F1B, v chunks a device: (PP-1) / (v M + PP-1).
- zero-bubble ZB-H1 (the backward split into B, the input gradient, and W, the weight
  gradient; a W runs only where no F or B can, filling what would be idle, and a forward
  only while the device holds fewer than PP microbatches whose W has not run: 1F1B's peak
  memory, as ZB-H1 keeps): with F, B and
  W one tick each, (PP-1) / (3M + PP-1): a third of 1F1B's idle time in the same units
  (1F1B's backward, B and W together, two ticks: 3(PP-1) idle of 3M + 3(PP-1)).

The tables are NumPy arrays (:class:`Table`), computed once per (schedule, PP, M, v) and
read by :func:`jaxcoll.pipeline.run`, which runs them as one SPMD program.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from jaxcoll.extend import check_int, check_one_of

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero_bubble")
IDLE, FORWARD, BACKWARD, WEIGHT = 0, 1, 2, 3
_NAMES = {FORWARD: "F", BACKWARD: "B", WEIGHT: "W"}


@dataclasses.dataclass(frozen=True)
class Table:
  """A schedule's tick table for ``stages`` devices, ``microbatches`` microbatches and
  ``virtual`` chunks a device (virtual stage ``r * stages + s`` on device s, chunk r).

  ``kind[t, s]``: IDLE, FORWARD, BACKWARD (with ``split``: the input gradient only) or
  WEIGHT; ``micro[t, s]`` and ``chunk[t, s]``: the operation's microbatch and chunk.
  ``split``: True where the backward is split into B and W (zero-bubble)."""

  schedule: str
  stages: int
  microbatches: int
  virtual: int
  kind: np.ndarray
  micro: np.ndarray
  chunk: np.ndarray
  split: bool

  @property
  def ticks(self) -> int:
    return self.kind.shape[0]

  @property
  def bubble(self) -> float:
    """The fraction of device ticks idle."""
    return float(np.mean(self.kind == IDLE))

  def live(self) -> np.ndarray:
    """``[ticks, stages]``: microbatch chunks forwarded whose backward has not finished
    (the stage inputs a device keeps: until B, or with a split backward until W)."""
    started = np.cumsum(self.kind == FORWARD, axis=0)
    done = np.cumsum(self.kind == (WEIGHT if self.split else BACKWARD), axis=0)
    return started - done

  @property
  def peak_live(self) -> int:
    """The most microbatch chunks any device holds for its backward at once."""
    return int(self.live().max())

  def __str__(self) -> str:
    cells = [[(_NAMES[k] + str(m) + (f".{c}" if self.virtual > 1 else "")) if k else "."
              for k, m, c in zip(kr, mr, cr)]
             for kr, mr, cr in zip(self.kind.T, self.micro.T, self.chunk.T)]
    width = max(len(c) for row in cells for c in row)
    lines = [f"{self.schedule}: {self.stages} stages, {self.microbatches} microbatches"
             + (f", {self.virtual} chunks a device" if self.virtual > 1 else "")
             + f"; {self.ticks} ticks, bubble {self.bubble:.3f}, peak live {self.peak_live}"]
    for s, row in enumerate(cells):
      lines.append(f"stage {s}: " + " ".join(c.rjust(width) for c in row))
    return "\n".join(lines)


def formula_bubble(schedule: str, stages: int, microbatches: int, virtual: int = 1) -> float:
  """The published bubble fraction (module docstring) in this module's tick units."""
  p, m = stages, microbatches
  if schedule in ("gpipe", "1f1b"):
    return (p - 1) / (m + p - 1)
  if schedule == "interleaved":
    return (p - 1) / (virtual * m + p - 1)
  return (p - 1) / (3 * m + p - 1)


def _order(schedule: str, s: int, p: int, m: int, v: int) -> list[tuple[int, int, int]]:
  """Device s's operations in the schedule's order: (kind, microbatch, chunk)."""
  if schedule == "gpipe":
    return [(FORWARD, i, 0) for i in range(m)] + [(BACKWARD, i, 0) for i in range(m)]
  if schedule == "interleaved":   # Megatron's: chunks in groups of p microbatches
    fwd = [(FORWARD, g * p + i, r) for g in range(m // p) for r in range(v) for i in range(p)]
    bwd = [(BACKWARD, g * p + i, r) for g in range(m // p) for r in reversed(range(v))
           for i in range(p)]
    warm = min((p - s - 1) * 2 + (v - 1) * p, len(fwd))
  else:
    fwd = [(FORWARD, i, 0) for i in range(m)]
    bwd = [(BACKWARD, i, 0) for i in range(m)]
    warm = min(p - s - 1, m)
  ops = fwd[:warm]
  for f, b in zip(fwd[warm:], bwd):   # steady: one forward, one backward
    ops += [f, b]
  ops += bwd[len(fwd) - warm:]
  if schedule == "zero_bubble":   # each W right after its B; the scheduler defers it
    out = []
    for op in ops:
      out.append(op)
      if op[0] == BACKWARD:
        out.append((WEIGHT, op[1], op[2]))
    ops = out
  return ops


@functools.lru_cache(maxsize=256)
def table(schedule: str, stages: int, microbatches: int, virtual: int = 1) -> Table:
  """The tick table of ``schedule`` (module docstring).

  Args:
    schedule: "gpipe", "1f1b", "interleaved" or "zero_bubble".
    stages: devices along the pipeline axis (PP), at least 1.
    microbatches: M, at least 1; interleaved needs a multiple of ``stages``.
    virtual: chunks a device (v): above 1 only for "interleaved" (at least 2 there).

  Returns:
    A :class:`Table`.

  Raises:
    ValueError: an unknown schedule, a count out of range, ``microbatches`` not a multiple
      of ``stages`` for "interleaved", ``virtual`` other than 1 for another schedule.

  Example:
    >>> from jaxcoll._src.pipeline.schedules import table
    >>> t = table("1f1b", 2, 4)
    >>> t.bubble, t.peak_live
    (0.2, 2)
  """
  check_one_of(schedule, SCHEDULES, "schedule")
  p = check_int(stages, "stages", least=1)
  m = check_int(microbatches, "microbatches", least=1)
  v = check_int(virtual, "virtual_stages", least=1)
  if schedule == "interleaved":
    if v < 2:
      raise ValueError(f"virtual_stages={v}: the interleaved schedule runs at least 2 "
                       "chunks a device (v >= 2)")
    if m % p:
      raise ValueError(f"microbatches={m}: the interleaved schedule runs them in groups of "
                       f"the stage count; expected a multiple of {p}")
  elif v != 1:
    raise ValueError(f"virtual_stages={v}: only schedule='interleaved' runs more than one "
                     f"chunk a device (schedule={schedule!r})")
  last = v * p - 1   # the last virtual stage, which computes the loss

  def where(k):   # virtual stage -> (device, chunk)
    return k % p, k // p

  pending = [_order(schedule, s, p, m, v) for s in range(p)]
  done: dict = {}   # (kind, micro, virtual stage) -> tick it ran
  held = [0] * p     # zero-bubble: forwards whose W has not run (bounded by PP, 1F1B's peak)
  zero_bubble = schedule == "zero_bubble"

  def ready(op, s, t) -> bool:
    """Whether device s may run ``op`` at tick t: what it reads was made before t."""
    kind, mb, r = op
    k = r * p + s
    if kind == FORWARD:
      return (k == 0 or done.get((FORWARD, mb, k - 1), t) < t) and \
          (not zero_bubble or held[s] < p)
    if kind == BACKWARD:
      return done.get((FORWARD, mb, k), t) < t and (
          k == last or done.get((BACKWARD, mb, k + 1), t) < t)
    return done.get((BACKWARD, mb, k), t) < t

  def pick(s, t) -> int | None:
    """The first operation of device s's list it runs at t: F and B in order (nothing past
    a waiting one); a W when ready and (zero-bubble) no later F or B is."""
    for i, op in enumerate(pending[s]):
      if op[0] != WEIGHT:
        return i if ready(op, s, t) else None
      after = next((o for o in pending[s][i + 1:] if o[0] != WEIGHT), None)
      if ready(op, s, t) and not (zero_bubble and after is not None and ready(after, s, t)):
        return i
    return None

  rows = []
  for t in range(8 * (v * m + p) * 3 + 8):
    if not any(pending):
      break
    row = []
    for s in range(p):
      i = pick(s, t)
      if i is None:
        row.append((IDLE, 0, 0))
        continue
      kind, mb, r = pending[s].pop(i)
      done[kind, mb, r * p + s] = t
      if zero_bubble:
        held[s] += {FORWARD: 1, WEIGHT: -1}.get(kind, 0)
      row.append((kind, mb, r))
    rows.append(row)
  if any(pending):
    raise AssertionError(f"schedule {schedule!r} did not finish: {pending}")
  arr = np.array(rows, dtype=np.int32)   # [ticks, stages, 3]
  return Table(schedule, p, m, v, arr[..., 0], arr[..., 1], arr[..., 2],
               schedule == "zero_bubble")

