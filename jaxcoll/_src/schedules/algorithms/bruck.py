"""Bruck's algorithms (Bruck et al. 1997): ceil(log2 N) steps for any N.

all_gather: in step k (2^k < N) rank r sends the min(2^k, N - 2^k) blocks it
holds, r, r+1, ... (mod N), to rank r - 2^k, which stores them at the same
block indices, so no final rotation is needed. Cost: ceil(log2 N) steps and
(N-1)/N * M bytes per rank (M = the gathered output).

all_to_all: the block from rank o bound for rank o + i travels "at distance
i": in step k every rank sends all the blocks whose distance has bit k set to
rank r + 2^k, so a block makes one hop per set bit. Bruck's local rotations
are folded into the chunk indices: a block in flight at rank r sits in input
row (r + i) mod N (the row its sender just freed), and lands in output row
o on its last hop. Cost: ceil(log2 N) steps, sum_k |{0 < i < N : bit k of i}|
blocks = about (N/2) log2 N * M/N bytes per rank: fewer steps than the
pairwise exchange, more bytes (the small-message all-to-all).
"""

from __future__ import annotations

import numpy as np

from jaxcoll._src.schedules.algorithms.common import build, log2_ceil
from jaxcoll._src.schedules.algorithms.registry import register
from jaxcoll._src.schedules.schedule import Messages, Rows


@register("all_gather", "bruck")
def all_gather(n: int):
  r = np.arange(n)
  rounds, dist = [], 1
  while dist < n:
    width = min(dist, n - dist)
    blocks = Rows.lazy(n, width, lambda width=width: (r[:, None] + np.arange(width)) % n)
    rounds.append([Messages.of(r, (r - dist) % n, blocks, combine="copy")])
    dist <<= 1
  return build("all_gather", "bruck", n, n, rounds)


@register("all_to_all", "bruck", stage=True, fit=True)
def all_to_all(n: int):
  r = np.arange(n)
  rounds = []
  for k in range(log2_ceil(n)):
    dist = 1 << k
    moving = np.array([i for i in range(1, n) if i & dist])
    dst = (r + dist) % n
    last = moving >> (k + 1) == 0   # the block's last hop: into the output row of its origin
    send = Rows.lazy(n, len(moving), lambda moving=moving: (r[:, None] + moving) % n)
    recv = Rows.lazy(n, len(moving), lambda dst=dst, moving=moving, last=last: np.where(
        last, n + (dst[:, None] - moving) % n, (dst[:, None] + moving) % n))
    rounds.append([Messages.of(r, dst, send, recv, "copy")])
  return build("all_to_all", "bruck", n, 2 * n, rounds)
