"""Direct (pairwise) exchanges: every rank talks to every other in N-1 steps.

In step s = 1..N-1 rank r exchanges with r + s (mod N).
  reduce_scatter "direct": rank r sends block r + s to its owner, which reduces
    it: N-1 steps, (N-1)/N * M bytes per rank.
  all_gather "direct": rank r sends its block to r + s: N-1 steps, (N-1)/N * M.
  all_to_all "direct" (pairwise exchange): rank r sends its input block r + s
    to rank r + s, which stores it as output block r: N-1 steps, (N-1)/N * M.
The permutation changes every step, so the executor unrolls it, and the cost model reads
N - 1 permutations: auto weighs these on meshes of at most ``PRICED_UP_TO`` (1,024) devices
(``max_devices``), where pricing them takes milliseconds; a call that names "direct" runs
it at any size.

shift "direct" is one step: rank r sends its input to r + offset (mod N with
wrap, else only when that rank exists): 1 step, M bytes.
"""

from __future__ import annotations

import numpy as np

from jaxcoll._src.schedules.algorithms.common import build
from jaxcoll._src.schedules.algorithms.registry import register
from jaxcoll._src.schedules.schedule import Messages


def _pairwise(n: int, send, recv, combine):
  """Round s = 1..N-1: rank r sends ``send(r, s)`` to r + s, stored at ``recv(r, s)``."""
  r = np.arange(n, dtype=np.int32)
  return [[Messages.of(r, (r + s) % n, send(r, s), recv(r, s), combine)] for s in range(1, n)]


PRICED_UP_TO = 1024   # max_devices: N - 1 permutations of N messages each to price


@register("reduce_scatter", "direct", stage=True, max_devices=PRICED_UP_TO)
def reduce_scatter(n: int):
  to = lambda r, s: (r + s) % n  # noqa: E731
  return build("reduce_scatter", "direct", n, n, _pairwise(n, to, to, "reduce"))


@register("all_gather", "direct", max_devices=PRICED_UP_TO)
def all_gather(n: int):
  own = lambda r, s: r  # noqa: E731
  return build("all_gather", "direct", n, n, _pairwise(n, own, own, "copy"))


@register("all_to_all", "direct", native_like=True, stage=True, fit=True,
          max_devices=PRICED_UP_TO)
def all_to_all(n: int):
  return build("all_to_all", "direct", n, 2 * n,
               _pairwise(n, lambda r, s: (r + s) % n, lambda r, s: n + r, "copy"))


@register("shift", "direct", native_like=True)
def shift(n: int, *, offset: int = 1, wrap: bool = True):
  """Rank r's input (row 0) goes to row 1 of rank r + offset."""
  src = np.arange(n)
  dst = src + offset
  if wrap:
    dst %= n
  keep = (dst >= 0) & (dst < n)
  return build("shift", "direct", n, 2, [[Messages.of(src[keep], dst[keep], [[0]], [[1]], "copy")]])
