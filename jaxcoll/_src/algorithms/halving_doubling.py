"""Recursive halving and doubling (Rabenseifner 2004; Thakur, Rabenseifner, Gropp 2005).

P = 2^floor(log2 N), p = log2 P, e = N - P. For N not a power of two, the fold
(:class:`~jaxcoll._src.algorithms.common.Fold`) adds one step before (e ranks
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

from jaxcoll._src.algorithms import register
from jaxcoll._src.algorithms.common import Fold, Rounds, build
from jaxcoll._src.schedule import Message


def _halving_rounds(fold: Fold) -> tuple[Rounds, Rounds, list[tuple[int, int]]]:
  """Contiguous halving over P chunks, and the mirrored doubling.

  Returns (reduce-scatter rounds, all-gather rounds, final interval of each
  virtual rank).
  """
  intervals = [(0, fold.p)] * fold.p
  rs: Rounds = []
  history = []
  mask = 1
  while mask < fold.p:
    msgs, nxt = [], []
    for v, (lo, hi) in enumerate(intervals):
      mid = (lo + hi) // 2
      keep, give = ((lo, mid), (mid, hi)) if not v & mask else ((mid, hi), (lo, mid))
      msgs.append(Message(fold.active[v], fold.active[v ^ mask], tuple(range(*give)),
                          tuple(range(*give)), "reduce"))
      nxt.append(keep)
    rs.append(msgs)
    history.append(mask)
    intervals = nxt
    mask <<= 1
  ag: Rounds = []
  for mask in reversed(history):
    ag.append([Message(fold.active[v], fold.active[v ^ mask], tuple(range(*intervals[v])),
                       tuple(range(*intervals[v])), "copy") for v in range(fold.p)])
    intervals = [(min(a[0], b[0]), max(a[1], b[1]))
                 for a, b in ((intervals[v], intervals[v ^ mask]) for v in range(fold.p))]
  return rs, ag, intervals


@register("all_reduce", "halving_doubling")
def all_reduce(n: int):
  fold = Fold(n)
  everything = tuple(range(fold.p))
  rs, ag, _ = _halving_rounds(fold)
  pre = fold.pre([everything] * n) if fold.extra else []
  post = fold.post(everything) if fold.extra else []
  return build("all_reduce", "halving_doubling", n, fold.p, pre, rs, ag, post)


@register("reduce_scatter", "halving_doubling")
def reduce_scatter(n: int):
  """Halving over the N blocks, each block routed towards the virtual rank that keeps it."""
  fold = Fold(n)
  dest = [fold.virtual[fold.owner(b)] for b in range(n)]
  held = [tuple(range(n))] * fold.p
  rounds: Rounds = []
  mask = 1
  while mask < fold.p:
    msgs, nxt = [], []
    for v, blocks in enumerate(held):
      give = tuple(b for b in blocks if (dest[b] & mask) != (v & mask))
      msgs.append(Message(fold.active[v], fold.active[v ^ mask], give, give, "reduce"))
      nxt.append(tuple(b for b in blocks if (dest[b] & mask) == (v & mask)))
    rounds.append(msgs)
    held = nxt
    mask <<= 1
  pre = fold.pre([tuple(range(n))] * n) if fold.extra else []
  post = [[Message(r + 1, r, (r,), (r,), "copy") for r in fold.excluded]] if fold.extra else []
  return build("reduce_scatter", "halving_doubling", n, n, pre, rounds, post)
