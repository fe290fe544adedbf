"""Pipelined chain broadcast (NCCL's ring broadcast): the root's buffer flows around the ring.

The buffer is cut into S chunks (``pipeline=S``, default 4). Rank r (counted from the root
along the ring, r = 0..N-2) forwards chunk c to rank r + 1 at step c + r, so every link
carries one chunk per step and the last rank holds everything after N - 2 + S steps.
Cost: N - 2 + S steps, M bytes per rank (every rank but the last sends the whole buffer),
M/S per message: the bandwidth-optimal broadcast for large M, at N + S - 2 latencies.

Each step has a permutation of its own (the window of senders slides), so pricing it takes
N + S - 2 passes; auto weighs it on meshes of at most 4,096 devices (``max_devices``), where
that is a fraction of a second. Beyond, with S <= 16 its N + S - 2 messages of M/S put
N/(2S) times scatter_allgather's bytes through a device in as many steps, so it would not
win there anyway.
"""

from __future__ import annotations

import numpy as np

from jaxcoll._src.schedules.algorithms.common import build
from jaxcoll._src.schedules.algorithms.registry import register
from jaxcoll._src.schedules.schedule import Messages


def formula(n: int, pipeline: int = 4) -> tuple[int, float]:
  return (n - 2 + pipeline, 1.0) if n > 1 else (0, 0.0)


@register("broadcast", "ring", formula=formula, tune={"pipeline": (4, 1, 16)}, max_devices=4096)
def broadcast(n: int, *, pipeline: int = 4):
  if not isinstance(pipeline, int) or pipeline < 1:
    raise ValueError(f"pipeline must be a positive int, got {pipeline!r}")
  rounds = []
  for step in range(n - 2 + pipeline if n > 1 else 0):
    r = np.arange(max(0, step - pipeline + 1), min(step, n - 2) + 1)   # ranks sending
    rounds.append([Messages.of(r, r + 1, step - r, combine="copy")])
  return build("broadcast", "ring", n, pipeline, rounds)
