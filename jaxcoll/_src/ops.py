"""Reduction ops: names, dtype rules and the elementwise combine of two chunks.

The combine of a reduce step computes in float32 for float16 and bfloat16 data
and rounds once to the buffer's dtype, as NCCL does; every other dtype combines
in its own type. ``a op b`` is commutative bit for bit for every op here, which
is why the symmetric exchanges of recursive doubling leave identical bits on
both partners.
"""

from __future__ import annotations

import numpy as np

OPS = ("sum", "prod", "min", "max", "mean")
LOW_PRECISION = ("bfloat16", "float16")   # combine in float32, round once to the dtype


def check_op(op: str, dtype, *, argument: str = "op") -> None:
  """Raises ValueError unless ``op`` is a known op that applies to ``dtype``."""
  if op not in OPS:
    raise ValueError(f"{argument}={op!r} is not a reduction op; expected one of {OPS}")
  kind = np.dtype(dtype).kind
  if op in ("min", "max") and kind == "c":
    raise ValueError(f"{argument}={op!r} is not defined for complex dtype {np.dtype(dtype).name}")


def low_precision(dtype) -> bool:
  """Whether results of ``dtype`` are rounded from float32 (bfloat16, float16)."""
  return np.dtype(dtype).name in LOW_PRECISION


def compute_dtype(dtype) -> np.dtype:
  """The dtype a combine computes in: float32 for float16/bfloat16, else the dtype itself."""
  return np.dtype(np.float32) if low_precision(dtype) else np.dtype(dtype)


def _apply(xp, op: str, a, b):
  if op in ("sum", "mean"):
    return xp.logical_or(a, b) if a.dtype == bool else a + b
  if op == "prod":
    return xp.logical_and(a, b) if a.dtype == bool else a * b
  if op == "min":
    return xp.minimum(a, b)
  if op == "max":
    return xp.maximum(a, b)
  raise ValueError(f"unknown op {op!r}")


def combine(xp, op: str, acc, received):
  """``op(acc, received)`` computed in :func:`compute_dtype`, rounded to ``acc.dtype``."""
  work = compute_dtype(acc.dtype)
  if work == acc.dtype and received.dtype == acc.dtype:
    return _apply(xp, op, acc, received)
  return _apply(xp, op, acc.astype(work), received.astype(work)).astype(acc.dtype)


def combine_numpy(op: str, acc: np.ndarray, received: np.ndarray) -> np.ndarray:
  return combine(np, op, acc, received)


def partial_sum_scale(dtype, accumulate_dtype=None) -> float:
  """How much larger partial sums travel than the data: itemsize(accumulate) / itemsize(x)
  (1 without ``accumulate_dtype``); the cost model scales reduce steps' bytes by it."""
  if accumulate_dtype is None:
    return 1.0
  return np.dtype(accumulate_dtype).itemsize / np.dtype(dtype).itemsize
