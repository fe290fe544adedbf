"""Small pieces the algorithm families share: rounds of messages and the fold."""

from __future__ import annotations

from collections.abc import Sequence

from jaxcoll._src.schedule import Message, Schedule, Step

Rounds = list[list[Message]]


def build(primitive: str, algorithm: str, n: int, num_chunks: int, *rounds: Rounds,
          **fields) -> Schedule:
  """A schedule from consecutive lists of rounds (empty rounds dropped); ``fields`` are
  further :class:`Schedule` fields (``axis_sizes``, ``workspace_chunks``)."""
  steps = tuple(Step.of(r) for part in rounds for r in part if r)
  return Schedule(primitive, algorithm, n, num_chunks, steps, **fields)


def merge(*parts: Rounds) -> Rounds:
  """Runs several round lists side by side: round i of each in one step."""
  depth = max((len(p) for p in parts), default=0)
  return [[m for p in parts if i < len(p) for m in p[i]] for i in range(depth)]


def log2_floor(n: int) -> int:
  return n.bit_length() - 1


def log2_ceil(n: int) -> int:
  return (n - 1).bit_length()


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
    self.excluded = tuple(range(0, 2 * self.extra, 2))
    self.active = tuple(r for r in range(n) if r >= 2 * self.extra or r % 2)
    self.virtual = {r: v for v, r in enumerate(self.active)}

  def owner(self, r: int) -> int:
    """The active rank that stands for rank r."""
    return r + 1 if r in self.excluded else r

  def pre(self, chunks_of: Sequence[Sequence[int]] | None = None, combine="reduce") -> Rounds:
    """Excluded ranks send their data (all chunks, or ``chunks_of[r]``) to their partner."""
    msgs = [Message(r, r + 1, tuple(chunks_of[r]), tuple(chunks_of[r]), combine)
            for r in self.excluded]
    return [msgs]

  def post(self, chunks: Sequence[int]) -> Rounds:
    """Partners send the finished ``chunks`` back to the excluded ranks."""
    return [[Message(r + 1, r, tuple(chunks), tuple(chunks), "copy") for r in self.excluded]]
