"""Direct (pairwise) exchanges: every rank talks to every other in N-1 steps.

In step s = 1..N-1 rank r exchanges with r + s (mod N).
  reduce_scatter "direct": rank r sends block r + s to its owner, which reduces
    it: N-1 steps, (N-1)/N * M bytes per rank.
  all_gather "direct": rank r sends its block to r + s: N-1 steps, (N-1)/N * M.
The permutation changes every step, so the executor unrolls it.
"""

from __future__ import annotations

from jaxcoll._src.algorithms import register
from jaxcoll._src.algorithms.common import build
from jaxcoll._src.schedule import Message


@register("reduce_scatter", "direct")
def reduce_scatter(n: int):
  rounds = [[Message(r, (r + s) % n, ((r + s) % n,), ((r + s) % n,), "reduce") for r in range(n)]
            for s in range(1, n)]
  return build("reduce_scatter", "direct", n, n, rounds)


@register("all_gather", "direct")
def all_gather(n: int):
  rounds = [[Message(r, (r + s) % n, (r,), (r,), "copy") for r in range(n)] for s in range(1, n)]
  return build("all_gather", "direct", n, n, rounds)
