"""Recursive halving and doubling (Rabenseifner 2004; Thakur, Rabenseifner, Gropp 2005).

P = 2^floor(log2 N), p = log2 P, e = N - P. For N not a power of two, the fold
(:class:`~jaxcoll._src.schedules.algorithms.common.Fold`) adds one step before (e ranks
hand over their whole buffer) and one after.
  reduce_scatter: p steps, (P-1)/P * M per rank when N = P. Otherwise p + 2
    steps; the e folded ranks send M, so the most any rank sends is
    max(M, (sum of its halving sends) + its one block back).
  all_reduce: 2p steps, 2(P-1)/P * M when N = P; otherwise 2p + 2 steps and
    2(P-1)/P * M + M (a partner also returns the whole result).
Partners are paired nearest first (distance 1, 2, 4, ...), so the biggest
exchange is between neighbouring ranks: on a mesh whose slow axis is the
outer one, the big halves stay on the fast links.
"""

from __future__ import annotations

import numpy as np

from jaxcoll._src.schedules.algorithms.common import Fold, Rounds, build, by_key
from jaxcoll._src.schedules.algorithms.registry import register
from jaxcoll._src.schedules.schedule import Messages, Rows


def _span(lo: np.ndarray, hi: np.ndarray) -> Rows:
  """[P, hi - lo] chunk rows of equal-length intervals [lo, hi), made when read."""
  width = int(hi[0] - lo[0])
  return Rows.lazy(len(lo), width, lambda: lo[:, None] + np.arange(width))


def _halving_rounds(fold: Fold) -> tuple[Rounds, Rounds]:
  """Contiguous halving over P chunks, and the mirrored doubling: (reduce-scatter rounds,
  all-gather rounds)."""
  v = np.arange(fold.p)
  lo, hi = np.zeros(fold.p, np.int64), np.full(fold.p, fold.p)
  rs: Rounds = []
  masks = []
  mask = 1
  while mask < fold.p:
    mid = (lo + hi) // 2
    upper = (v & mask) != 0           # keeps the upper half, gives the lower
    give_lo, give_hi = np.where(upper, lo, mid), np.where(upper, mid, hi)
    src, dst = fold.partners(mask)
    rs.append([Messages.of(src, dst, _span(give_lo, give_hi), combine="reduce")])
    lo, hi = np.where(upper, mid, lo), np.where(upper, hi, mid)
    masks.append(mask)
    mask <<= 1
  ag: Rounds = []
  for mask in reversed(masks):
    src, dst = fold.partners(mask)
    ag.append([Messages.of(src, dst, _span(lo, hi), combine="copy")])
    lo, hi = np.minimum(lo, lo[v ^ mask]), np.maximum(hi, hi[v ^ mask])
  return rs, ag


@register("all_reduce", "halving_doubling", stage=True, fit=True)
def all_reduce(n: int):
  fold = Fold(n)
  everything = np.arange(fold.p)[None]
  rs, ag = _halving_rounds(fold)
  pre = fold.pre(everything) if fold.extra else []
  post = fold.post(everything) if fold.extra else []
  return build("all_reduce", "halving_doubling", n, fold.p, pre, rs, ag, post)


@register("reduce_scatter", "halving_doubling", stage=True)
def reduce_scatter(n: int):
  """Halving over the N blocks, each block routed towards the virtual rank that keeps it."""
  fold = Fold(n)
  v = np.arange(fold.p)
  dest = fold.virtual[fold.owner(np.arange(n))]              # [N] virtual rank of block b
  rounds: Rounds = []
  mask = 1
  while mask < fold.p:   # v still reduces the blocks b with dest[b] = v mod mask
    src, dst = fold.partners(mask)   # and gives those of them whose bit ``mask`` differs
    rounds.append(by_key(src, dst, dest % (2 * mask), (v ^ mask) % (2 * mask), "reduce"))
    mask <<= 1
  pre = fold.pre(np.arange(n)[None]) if fold.extra else []
  post = ([[Messages.of(fold.excluded + 1, fold.excluded, fold.excluded, combine="copy")]]
          if fold.extra else [])
  return build("reduce_scatter", "halving_doubling", n, n, pre, rounds, post)
