"""Direct (pairwise) exchanges: every rank talks to every other in N-1 steps.

In step s = 1..N-1 rank r exchanges with r + s (mod N).
  reduce_scatter "direct": rank r sends block r + s to its owner, which reduces
    it: N-1 steps, (N-1)/N * M bytes per rank.
  all_gather "direct": rank r sends its block to r + s: N-1 steps, (N-1)/N * M.
  all_to_all "direct" (pairwise exchange): rank r sends its input block r + s
    to rank r + s, which stores it as output block r: N-1 steps, (N-1)/N * M.
The permutation changes every step, so the executor unrolls it.

shift "direct" is one step: rank r sends its input to r + offset (mod N with
wrap, else only when that rank exists): 1 step, M bytes.
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


@register("all_to_all", "direct")
def all_to_all(n: int):
  rounds = [[Message(r, (r + s) % n, ((r + s) % n,), (n + r,), "copy") for r in range(n)]
            for s in range(1, n)]
  return build("all_to_all", "direct", n, 2 * n, rounds)


@register("shift", "direct")
def shift(n: int, *, offset: int = 1, wrap: bool = True):
  """Rank r's input (row 0) goes to row 1 of rank r + offset."""
  dst = {r: (r + offset) % n if wrap else r + offset for r in range(n)}
  return build("shift", "direct", n, 2,
               [[Message(r, d, (0,), (1,), "copy") for r, d in dst.items() if 0 <= d < n]])
