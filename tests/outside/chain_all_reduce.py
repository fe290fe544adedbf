"""An all_reduce algorithm written outside the package, as a user would add one.

"chain_then_broadcast": rank N-1 sends its buffer down the chain to rank 0, each rank adding
its own on the way (N-1 steps), then rank 0's total travels back up (N-1 steps). Cost:
2(N-1) steps; ranks 1..N-2 send the whole buffer twice, the ends once: 2 M per rank for
N >= 3, M for N = 2. Built only from the public API: ``jaxcoll.Schedule``, ``Step``,
``Transfer`` and ``jaxcoll.register``.
"""

from __future__ import annotations

import numpy as np

import jaxcoll

NAME = "chain_then_broadcast"


def formula(n: int) -> tuple[int, float]:
  return 2 * (n - 1), (2.0 if n >= 3 else 1.0 if n == 2 else 0.0)


def _step(src: int, dst: int, combine: str) -> jaxcoll.Step:
  return jaxcoll.Step((jaxcoll.Transfer(np.array([src]), np.array([dst]), [[0]], [[0]],
                                        combine),))


def chain_then_broadcast(n: int) -> jaxcoll.Schedule:
  down = [_step(r, r - 1, "reduce") for r in range(n - 1, 0, -1)]
  up = [_step(r, r + 1, "copy") for r in range(n - 1)]
  return jaxcoll.Schedule("all_reduce", NAME, n, 1, down + up)


def install() -> None:
  jaxcoll.register("all_reduce", NAME, stage=True, formula=formula)(chain_then_broadcast)
