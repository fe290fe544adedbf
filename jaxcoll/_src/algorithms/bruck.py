"""Bruck's all-gather (Bruck et al. 1997): ceil(log2 N) steps for any N.

In step k (2^k < N) rank r sends the min(2^k, N - 2^k) blocks it holds,
r, r+1, ... (mod N), to rank r - 2^k, which stores them at the same block
indices, so no final rotation is needed. Cost: ceil(log2 N) steps and
(N-1)/N * M bytes per rank (M = the gathered output).
"""

from __future__ import annotations

from jaxcoll._src.algorithms import register
from jaxcoll._src.algorithms.common import build
from jaxcoll._src.schedule import Message


@register("all_gather", "bruck")
def all_gather(n: int):
  rounds, dist = [], 1
  while dist < n:
    count = min(dist, n - dist)
    rounds.append([Message(r, (r - dist) % n, blocks, blocks, "copy")
                   for r in range(n) for blocks in [tuple((r + j) % n for j in range(count))]])
    dist <<= 1
  return build("all_gather", "bruck", n, n, rounds)
