"""A schedule as the executor runs it: phases of steps of one structure, and per-rank tables.

NumPy only (no JAX): the executor (:mod:`jaxcoll._src.schedules.executor`) compiles each
phase into one loop body or unrolled steps, and the cost model reads which steps run unrolled.

Consecutive steps with the same structure (same permutations, chunk counts and combines;
only the chunk indices differ, as in every ring) form a phase. Each transfer of a phase has
one table per direction: ``[T, N]`` start rows where every rank's rows are a run, else
``[T, N, rows]`` row indices. Ranks outside a transfer's permutation get any valid rows
(the executor writes their old rows back).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import numpy as np

from jaxcoll._src.schedules.schedule import Schedule, Step, per_array

LOOP_MIN_STEPS = 2


@dataclasses.dataclass(frozen=True)
class TransferPlan:
  """What the executor's code for one transfer depends on (equal plans: one loop body)."""

  perm: tuple[tuple[int, int], ...]
  rows: int
  combine: str
  send_contiguous: bool
  recv_contiguous: bool
  sent_rows_reduced_into: bool = False   # a sender combines into rows it sent (see plan)
  receivers: tuple[bool, ...] | None = None   # who receives, where not every rank does
  senders: tuple[bool, ...] | None = None     # who sends, where not every rank does


@dataclasses.dataclass(frozen=True)
class Phase:
  """Consecutive steps of one structure, with each rank's chunk indices per step."""

  transfers: tuple[TransferPlan, ...]
  send: tuple[np.ndarray, ...]   # per transfer: [T, N] starts or [T, N, rows] indices
  recv: tuple[np.ndarray, ...]

  @property
  def num_steps(self) -> int:
    return self.send[0].shape[0] if self.send else 0


def _is_run(chunks: np.ndarray) -> bool:
  """Every row of ``chunks`` ([K, k]) is a run of consecutive indices."""
  return bool((np.diff(chunks, axis=1) == 1).all())


@functools.lru_cache(maxsize=1024)
def plan(schedule: Schedule) -> tuple[Phase, ...]:
  """Groups the schedule's steps into phases with per-rank index tables."""
  n = schedule.axis_size
  phases: list[tuple[tuple[TransferPlan, ...], list, list]] = []
  reduced_into = sent_rows_reduced_into(schedule)
  for step, reused in zip(schedule.checked_steps(), reduced_into):
    sends, recvs, plans = [], [], []
    for t, again in zip(step.transfers, reused):
      k = t.chunks_per_message
      send = np.zeros((n, k), np.int32)
      recv = np.tile(np.arange(k, dtype=np.int32), (n, 1))   # non-receivers: any valid rows
      send[t.src] = t.send_chunks
      recv[t.dst] = t.recv_chunks
      plans.append(TransferPlan(t.perm, k, t.combine, _is_run(t.send_chunks),
                                _is_run(t.recv_chunks), again, _members(t.dst, n),
                                _members(t.src, n)))
      sends.append(send)
      recvs.append(recv)
    key = tuple(plans)
    if phases and phases[-1][0] == key:
      phases[-1][1].append(sends)
      phases[-1][2].append(recvs)
    else:
      phases.append((key, [sends], [recvs]))
  out = []
  for key, sends, recvs in phases:
    def stack(tables, contiguous, j):
      arr = np.stack([s[j] for s in tables])
      return arr[..., 0] if contiguous else arr
    out.append(Phase(key,
                     tuple(stack(sends, p.send_contiguous, j) for j, p in enumerate(key)),
                     tuple(stack(recvs, p.recv_contiguous, j) for j, p in enumerate(key))))
  return tuple(out)


def phase_keys(steps: Sequence[Step]) -> list[tuple]:
  """A key per step, equal for consecutive steps that :func:`plan` puts in one phase (the
  same permutations, chunks per message and combines), read without the chunk rows (a run's
  steps keep their rows' contiguity, :class:`~jaxcoll._src.schedules.schedule.Run`), so the
  cost model finds the executor's loops in a schedule of thousands of ranks."""
  ranks = per_array(lambda a: a.tobytes())
  return [tuple((ranks(t.src), ranks(t.dst), t.chunks_per_message, t.combine)
                for t in step.transfers) for step in steps]


def _members(ranks: np.ndarray, n: int) -> tuple[bool, ...] | None:
  """Which of the N ranks are in ``ranks``; None when all are."""
  return None if len(ranks) == n else tuple(np.isin(np.arange(n), ranks).tolist())


def sent_rows_reduced_into(schedule: Schedule) -> list[list[bool]]:
  """Per step and transfer: whether some sender, after this send, next combines a received
  message into a row it sent (before a copy overwrites it).

  That is when a compressed send must leave its decoded value in the sender's rows: in a
  symmetric exchange (recursive doubling) both partners then compute q(a) + q(b). Elsewhere
  (every ring, tree and halving step) a sent row is next overwritten, sent again (which
  encodes the same value) or final, and the executor's last pass settles final rows.
  """
  n, c = schedule.axis_size, schedule.num_chunks
  reduced_next = np.zeros((n, c), bool)    # walking backwards: the next event is a reduce
  out = []
  for step in reversed(schedule.steps):
    for t in step.transfers:              # receives come after the step's sends
      reduced_next[t.dst[:, None], t.recv_chunks] = t.combine == "reduce"
    out.append([bool(reduced_next[t.src[:, None], t.send_chunks].any())
                for t in step.transfers])
  return out[::-1]
