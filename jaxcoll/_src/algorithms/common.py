"""Small pieces the algorithm families share: rounds of messages and the fold.

Builders work on NumPy arrays of ranks and chunks (:class:`Messages`), never on one Python
object per message, so every schedule builds at thousands of ranks in seconds.
"""

from __future__ import annotations

import numpy as np

from jaxcoll._src.schedule import Messages, Schedule, Step

Rounds = list[list[Messages]]   # one list of message groups per step


def build(primitive: str, algorithm: str, n: int, num_chunks: int, *rounds: Rounds,
          **fields) -> Schedule:
  """A schedule from consecutive lists of rounds (empty rounds dropped); ``fields`` are
  further :class:`Schedule` fields (``axis_sizes``, ``workspace_chunks``)."""
  steps = tuple(Step.of(r) for part in rounds for r in part if any(len(g.src) for g in r))
  return Schedule(primitive, algorithm, n, num_chunks, steps, **fields)


def merge(*parts: Rounds) -> Rounds:
  """Runs several round lists side by side: round i of each in one step."""
  depth = max((len(p) for p in parts), default=0)
  return [[g for p in parts if i < len(p) for g in p[i]] for i in range(depth)]


def log2_floor(n: int) -> int:
  return n.bit_length() - 1


def log2_ceil(n: int) -> int:
  return (n - 1).bit_length()


def block_rows(mask: np.ndarray) -> list[np.ndarray]:
  """The chunk indices set in each row of a boolean ``[K, C]`` mask."""
  rows, cols = np.nonzero(mask)
  return np.split(cols, np.cumsum(np.bincount(rows, minlength=len(mask)))[:-1])


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
