"""Ring algorithms (Patarasuk and Yuan 2009; the NCCL ring).

With N ranks and a message of M bytes:
  reduce_scatter "ring":        N-1 steps, (N-1)/N * M bytes sent per rank.
  all_gather "ring":            N-1 steps, (N-1)/N * M (M = the gathered output).
  all_reduce "ring":            2(N-1) steps, 2(N-1)/N * M (reduce-scatter + all-gather).
  all_reduce "bidirectional_ring": the same steps and bytes, half of the buffer
    on a ring each way, so both directions of every link carry (N-1)/N * M.
Every step has one fixed permutation (r -> r+1), so the executor runs long
rings as a loop.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from jaxcoll._src.schedules.algorithms.common import Repeat, Rounds, build, merge
from jaxcoll._src.schedules.algorithms.registry import register
from jaxcoll._src.schedules.schedule import Messages

ChunksOf = Callable[[np.ndarray], np.ndarray]   # blocks [K] -> chunk rows [K, k]


def _block(b: np.ndarray) -> np.ndarray:
  return b


def _rounds(n: int, chunks: ChunksOf, direction: int, lag: int, combine) -> Rounds:
  """Round s: rank r sends block r - direction * (s + lag) to r + direction."""
  src = np.arange(n, dtype=np.int32)
  dst = (src + direction) % n
  blocks = lambda s: chunks((src - direction * (s + lag)) % n)  # noqa: E731
  return Repeat(n - 1, lambda s: [Messages.of(src, dst, blocks(s), combine=combine)])


def reduce_scatter_rounds(n: int, chunks: ChunksOf = _block, direction: int = 1) -> Rounds:
  """Block b accumulates along the ring and ends complete at rank b."""
  return _rounds(n, chunks, direction, 1, "reduce")


def all_gather_rounds(n: int, chunks: ChunksOf = _block, direction: int = 1) -> Rounds:
  """Rank r starts with block r; in round s it forwards block r - s."""
  return _rounds(n, chunks, direction, 0, "copy")


@register("reduce_scatter", "ring", native_like=True, stage=True)
def reduce_scatter(n: int):
  return build("reduce_scatter", "ring", n, n, reduce_scatter_rounds(n))


@register("all_gather", "ring", native_like=True, fit=True)
def all_gather(n: int):
  return build("all_gather", "ring", n, n, all_gather_rounds(n))


@register("all_reduce", "ring", native_like=True, stage=True, fit=True)
def all_reduce(n: int):
  return build("all_reduce", "ring", n, n, reduce_scatter_rounds(n), all_gather_rounds(n))


@register("all_reduce", "bidirectional_ring", stage=True)
def all_reduce_bidirectional(n: int):
  upper = lambda b: n + b  # noqa: E731
  return build("all_reduce", "bidirectional_ring", n, 2 * n,
               merge(reduce_scatter_rounds(n), reduce_scatter_rounds(n, upper, -1)),
               merge(all_gather_rounds(n), all_gather_rounds(n, upper, -1)))
