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

import numpy as np

from jaxcoll._src.algorithms.common import Fold, Rounds, block_rows, build
from jaxcoll._src.algorithms.registry import register
from jaxcoll._src.schedule import Messages


def _exchange_rounds(fold: Fold, held: np.ndarray, combine) -> Rounds:
  """Virtual rank v exchanges the chunks it holds (``held``: [P, C] bools) with v ^ mask."""
  v = np.arange(fold.p)
  rounds: Rounds = []
  mask = 1
  while mask < fold.p:
    src, dst = fold.partners(mask)
    rounds.append(Messages.ragged(src, dst, block_rows(held), combine=combine))
    if combine == "copy":
      held = held | held[v ^ mask]
    mask <<= 1
  return rounds


@register("all_reduce", "recursive_doubling", stage=True, fit=True)
def all_reduce(n: int):
  fold = Fold(n)
  rounds = _exchange_rounds(fold, np.ones((fold.p, 1), bool), "reduce")
  pre = fold.pre([[0]]) if fold.extra else []
  post = fold.post([[0]]) if fold.extra else []
  return build("all_reduce", "recursive_doubling", n, 1, pre, rounds, post)


@register("all_gather", "recursive_doubling")
def all_gather(n: int):
  fold = Fold(n)
  held = np.zeros((fold.p, n), bool)                 # block b starts at its owner
  held[fold.virtual[fold.owner(np.arange(n))], np.arange(n)] = True
  rounds = _exchange_rounds(fold, held, "copy")
  pre = fold.pre(np.arange(n), "copy") if fold.extra else []
  post = fold.post(np.arange(n)[None]) if fold.extra else []
  return build("all_gather", "recursive_doubling", n, n, pre, rounds, post)
