"""Side-by-side timing, the way every jaxcoll measurement is taken.

Machines shared by many device threads are noisy (on the 2-core CPU testbed a gloo
message's latency is bimodal; measured: docs/measurements.md#multi-process-cpu-jobs),
so programs that are compared are timed in rounds: each round runs every program once,
in an order rotated from round to round, and a program's figure is its median over rounds.
Cheap programs get more rounds: at least ``reps``, and more until the rounds
have taken ``min_seconds`` (at most ``max_reps``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence


def agree(value: int) -> int:
  """``value`` as process 0 has it, on every process (each process times for itself, but all
  must run the same programs the same number of times, or the collectives deadlock)."""
  import jax
  if jax.process_count() == 1:
    return value
  import numpy as np
  from jax.experimental import multihost_utils
  return int(multihost_utils.broadcast_one_to_all(np.int32(value)))


def interleaved(calls: Sequence[Callable[[], object]], *, reps: int = 5,
                min_seconds: float = 0.0, max_reps: int = 200, warmup: int = 1,
                on_round: Callable[[int, int], None] | None = None) -> list[list[float]]:
  """Seconds of every round of every call (each call runs to completion, e.g. it blocks).

  Args:
    calls: zero-argument functions that run the programs to compare.
    reps: the fewest rounds.
    min_seconds: more rounds until they have taken about this long.
    max_reps: the most rounds.
    warmup: untimed calls of each first (the first compiles).
    on_round: called with (rounds done, rounds in all) after each round.

  After the warm-up every call runs once more to time a round, which sets how many
  rounds ``min_seconds`` needs.
  """
  if reps < 1:
    raise ValueError(f"reps={reps} must be >= 1")
  for call in calls:
    for _ in range(max(warmup, 1)):
      call()
  start = time.perf_counter()
  for call in calls:
    call()
  round_s = time.perf_counter() - start
  rounds = agree(min(max(reps, math.ceil(min_seconds / max(round_s, 1e-9))), max(reps, max_reps)))
  times: list[list[float]] = [[] for _ in calls]
  order = list(range(len(calls)))
  for r in range(rounds):
    shift = r % max(len(order), 1)
    for i in order[shift:] + order[:shift]:
      t0 = time.perf_counter()
      calls[i]()
      times[i].append(time.perf_counter() - t0)
    if on_round is not None:
      on_round(r + 1, rounds)
  return times
