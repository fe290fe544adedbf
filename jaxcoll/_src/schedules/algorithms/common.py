"""Small pieces the algorithm families share: rounds of messages and the fold.

Builders work on NumPy arrays of ranks and chunks (:class:`Messages`), never on one Python
object per message, so every schedule builds at thousands of ranks in seconds.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence

import numpy as np

from jaxcoll._src.schedules.schedule import Messages, Rows, Run, Schedule, Step

Rounds = Sequence[list[Messages] | Step]   # per step: its message groups, or the step packed


class Repeat(Sequence):
  """``count`` rounds of one structure (the same ranks, chunks per message and combines;
  only which chunks move differs, as in a ring), round i made by ``make(i)`` when read.
  Builders that index rounds see a sequence; :func:`build` keeps it a :class:`Run`, so
  pricing a ring of thousands of ranks makes one of its steps."""

  def __init__(self, count: int, make: Callable[[int], list[Messages]]):
    self.count, self.make = count, make

  def __len__(self) -> int:
    return self.count

  def __getitem__(self, i):
    if isinstance(i, slice):
      return [self[j] for j in range(*i.indices(self.count))]
    i = operator.index(i) + (self.count if i < 0 else 0)
    if not 0 <= i < self.count:
      raise IndexError(f"round {i} of {self.count}")
    return self.make(i)


def build(primitive: str, algorithm: str, n: int, num_chunks: int, *rounds: Rounds,
          **fields) -> Schedule:
  """A schedule from consecutive lists of rounds (empty rounds dropped; a :class:`Repeat`
  becomes a :class:`Run`); ``fields`` are further :class:`Schedule` fields (``axis_sizes``,
  ``workspace_chunks``)."""
  steps = []
  for part in rounds:
    if isinstance(part, Repeat):
      steps.append(Run(part.count, lambda i, make=part.make: _step(make(i))))
    else:
      steps += (_step(r) for r in part if isinstance(r, Step) or any(len(g.src) for g in r))
  return Schedule(primitive, algorithm, n, num_chunks, steps, **fields)


def _step(round_: list[Messages] | Step) -> Step:
  return round_ if isinstance(round_, Step) else Step.of(round_)   # a round may come packed


def merge(*parts: Rounds) -> Rounds:
  """Runs several round lists side by side: round i of each in one step (repeats of one
  length stay a repeat)."""
  depth = max((len(p) for p in parts), default=0)
  if parts and all(isinstance(p, Repeat) and len(p) == depth for p in parts):
    return Repeat(depth, lambda i: [g for p in parts for g in p.make(i)])
  return [[g for p in parts if i < len(p) for g in p[i]] for i in range(depth)]


def log2_floor(n: int) -> int:
  return n.bit_length() - 1


def log2_ceil(n: int) -> int:
  return (n - 1).bit_length()


def by_key(src: np.ndarray, dst: np.ndarray, chunk_keys: np.ndarray, keys: np.ndarray,
           combine) -> list[Messages]:
  """Message i sends every chunk c with ``chunk_keys[c] == keys[i]``, in increasing order,
  received into the same rows: one group per chunk count, in order of first use (as
  :meth:`Messages.ragged`). O(K + C) to build (the counts); the rows are made when read."""
  chunk_keys, keys = np.asarray(chunk_keys), np.asarray(keys)
  per_key = np.bincount(chunk_keys, minlength=int(keys.max(initial=0)) + 1)
  starts = np.cumsum(per_key) - per_key
  by_chunk = np.argsort(chunk_keys, kind="stable")   # chunks of one key are a run, in order
  counts = per_key[keys]
  out = []
  for count in dict.fromkeys(counts.tolist()):   # in order of first use
    idx = np.flatnonzero(counts == count)
    if count:
      rows = Rows.lazy(len(idx), count, lambda idx=idx, count=count:
                       by_chunk[starts[keys[idx]][:, None] + np.arange(count)])
      out.append(Messages.of(src[idx], dst[idx], rows, combine=combine))
  return out


class Fold:
  """The standard reduction of N ranks to P = 2^floor(log2 N) for power-of-two algorithms.

  With e = N - P, each even rank r < 2e hands its data to r + 1 and sits out;
  the P remaining ranks take virtual ranks 0..P-1 in order (Rabenseifner,
  MPICH). ``pre``/``post`` are the extra steps (absent when N is a power of two).
  """

  def __init__(self, n: int):
    self.n = n
    self.p = 1 << log2_floor(n)
    self.extra = n - self.p
    self.excluded = np.arange(0, 2 * self.extra, 2)
    ranks = np.arange(n)
    self.active = ranks[(ranks >= 2 * self.extra) | (ranks % 2 == 1)]
    self.virtual = np.full(n, -1)
    self.virtual[self.active] = np.arange(self.p)

  def owner(self, r: np.ndarray) -> np.ndarray:
    """The active rank that stands for rank(s) r."""
    return np.where((r < 2 * self.extra) & (r % 2 == 0), r + 1, r)

  def partners(self, mask: int) -> tuple[np.ndarray, np.ndarray]:
    """(src, dst) of the exchange between virtual ranks v and v ^ mask, in order of v."""
    v = np.arange(self.p)
    return self.active, self.active[v ^ mask]

  def pre(self, chunks, combine="reduce") -> Rounds:
    """Excluded ranks send their data to their partner: ``chunks`` is one row for every rank
    ([1, k]) or a row per rank ([N, k] / [N])."""
    chunks = np.asarray(chunks)
    mine = chunks if chunks.ndim == 2 and len(chunks) == 1 else chunks[self.excluded]
    return [[Messages.of(self.excluded, self.excluded + 1, mine, combine=combine)]]

  def post(self, chunks) -> Rounds:
    """Partners send the finished ``chunks`` (one row, [1, k]) back to the excluded ranks."""
    return [[Messages.of(self.excluded + 1, self.excluded, chunks, combine="copy")]]
