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

from jaxcoll._src.schedules.algorithms.common import Fold, build, by_key
from jaxcoll._src.schedules.algorithms.registry import register
from jaxcoll._src.schedules.schedule import Messages


def _masks(fold: Fold) -> list[int]:
  return [1 << k for k in range(fold.p.bit_length() - 1)]


@register("all_reduce", "recursive_doubling", stage=True, fit=True)
def all_reduce(n: int):
  """Virtual rank v and v ^ mask exchange the whole buffer (one chunk) and reduce."""
  fold = Fold(n)
  rounds = [[Messages.of(*fold.partners(mask), [[0]], combine="reduce")] for mask in _masks(fold)]
  pre = fold.pre([[0]]) if fold.extra else []
  post = fold.post([[0]]) if fold.extra else []
  return build("all_reduce", "recursive_doubling", n, 1, pre, rounds, post)


@register("all_gather", "recursive_doubling")
def all_gather(n: int):
  fold = Fold(n)
  v = np.arange(fold.p)
  dest = fold.virtual[fold.owner(np.arange(n))]      # block b starts at its owner
  rounds = [by_key(*fold.partners(mask), dest // mask, v // mask, "copy")   # v holds the blocks
            for mask in _masks(fold)]                # whose dest agrees with v above mask
  pre = fold.pre(np.arange(n), "copy") if fold.extra else []
  post = fold.post(np.arange(n)[None]) if fold.extra else []
  return build("all_gather", "recursive_doubling", n, n, pre, rounds, post)
