"""Recursive doubling: the latency-optimal exchange (Thakur, Rabenseifner, Gropp 2005).

P = 2^floor(log2 N), p = log2 P.
  all_reduce: p steps of the whole buffer, p * M bytes per rank when N = P;
    otherwise p + 2 steps and (p + 1) * M (fold in, exchange, hand back).
    Partners combine the same two operands (a op b == b op a bit for bit), so
    every rank ends with identical bits.
  all_gather: p steps, (P-1)/P * M when N = P; otherwise p + 2 steps, the
    folded ranks' blocks are carried by their partners and the partners send
    the whole result M back at the end.
"""

from __future__ import annotations

from jaxcoll._src.algorithms import register
from jaxcoll._src.algorithms.common import Fold, Rounds, build
from jaxcoll._src.schedule import Message


def _exchange_rounds(fold: Fold, held: list[tuple[int, ...]], combine) -> Rounds:
  rounds: Rounds = []
  mask = 1
  while mask < fold.p:
    rounds.append([Message(fold.active[v], fold.active[v ^ mask], held[v], held[v], combine)
                   for v in range(fold.p)])
    if combine == "copy":
      held = [tuple(sorted(held[v] + held[v ^ mask])) for v in range(fold.p)]
    mask <<= 1
  return rounds


@register("all_reduce", "recursive_doubling")
def all_reduce(n: int):
  fold = Fold(n)
  rounds = _exchange_rounds(fold, [(0,)] * fold.p, "reduce")
  pre = fold.pre([(0,)] * n) if fold.extra else []
  post = fold.post((0,)) if fold.extra else []
  return build("all_reduce", "recursive_doubling", n, 1, pre, rounds, post)


@register("all_gather", "recursive_doubling")
def all_gather(n: int):
  fold = Fold(n)
  held = [tuple(sorted([r] + [x for x in fold.excluded if fold.owner(x) == r]))
          for r in fold.active]
  rounds = _exchange_rounds(fold, held, "copy")
  pre = fold.pre([(r,) for r in range(n)], "copy") if fold.extra else []
  post = fold.post(tuple(range(n))) if fold.extra else []
  return build("all_gather", "recursive_doubling", n, n, pre, rounds, post)
