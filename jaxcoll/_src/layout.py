"""How a flat message maps onto a schedule's rows of chunks (NumPy or jax.numpy).

Each primitive's spec names its layout (:attr:`CollectiveSpec.layout`). "whole"
(all_reduce, broadcast, reduce) pads the flat buffer of ``size`` elements to
``C * ceil(size / C)`` and views it as ``C`` rows. "scatter" and "gather"
(reduce_scatter, all_gather) keep rank r's block in rows ``[r*b, (r+1)*b)``
(``b = C / N``), each block padded on its own, so padding never moves data across a
block boundary. "exchange" (all_to_all) keeps the N input blocks in the first ``N*b``
rows and the output blocks in the last ``N*b``; "pair" (shift) has one row of input and
one of output. ``xp`` is ``numpy`` or ``jax.numpy``; the
rank is a Python int (the NumPy simulator) or ``None`` (the executor, which
places and extracts the block itself with dynamic slices).
"""

from __future__ import annotations

import math


def row_length(schedule, size: int, multiple: int = 1) -> int:
  """Elements per chunk for a message of ``size`` elements (the piece, for all_gather),
  rounded up to a multiple of ``multiple`` (the block of a compressed wire format)."""
  b, kind = schedule.blocks_per_rank, schedule.layout
  if kind in ("scatter", "exchange"):
    length = math.ceil(size // schedule.axis_size / b)
  elif kind == "pair":
    length = size
  elif kind == "gather":
    length = math.ceil(size / b)
  else:
    length = math.ceil(size / schedule.num_chunks)
  return -(-length // multiple) * multiple


def pad_to(xp, flat, length: int):
  return flat if flat.shape[-1] == length else xp.pad(
      flat, [(0, 0)] * (flat.ndim - 1) + [(0, length - flat.shape[-1])])


def block(xp, flat, schedule, length: int):
  """A rank's own piece as its ``b`` rows (all_gather input)."""
  b = schedule.blocks_per_rank
  return pad_to(xp, flat, b * length).reshape(b, length)


def blocked_rows(xp, flat, schedule, length: int):
  """The N equal blocks of ``flat``, each padded to its ``b`` rows: ``[N*b, L]``."""
  n, b = schedule.axis_size, schedule.blocks_per_rank
  size = flat.shape[0]
  if size % n:
    raise ValueError(f"{schedule.primitive} needs a size divisible by {n}, got {size}")
  return pad_to(xp, flat.reshape(n, size // n), b * length).reshape(n * b, length)


def output_start(schedule) -> int:
  """all_to_all: the first row of the output region (N blocks, block j from rank j)."""
  return schedule.num_chunks - schedule.axis_size * schedule.blocks_per_rank


def to_rows(xp, flat, schedule, rank: int | None = None, multiple: int = 1):
  """The ``[C, L]`` starting buffer of one rank.

  all_gather and all_to_all also start with the rank's own block in its place
  (all_gather: its piece in block r; all_to_all: input block r copied to output
  block r); with ``rank=None`` (the executor, where the rank is traced) the
  caller puts it there.
  """
  c = schedule.num_chunks
  size = flat.shape[0]
  length, kind = row_length(schedule, size, multiple), schedule.layout
  if kind == "gather":
    own = block(xp, flat, schedule, length)
    if rank is None:   # every row is received later: start from the data, not from zeros
      return xp.broadcast_to(own[:1], (c, length))
    rows = xp.zeros((c, length), flat.dtype)
    b = schedule.blocks_per_rank
    rows[rank * b:(rank + 1) * b] = own
    return rows
  if kind == "exchange":
    inputs = blocked_rows(xp, flat, schedule, length)
    rows = xp.concatenate([inputs, xp.zeros((c - inputs.shape[0], length), flat.dtype)])
    if rank is not None:
      b, out = schedule.blocks_per_rank, output_start(schedule)
      rows[out + rank * b:out + (rank + 1) * b] = rows[rank * b:(rank + 1) * b]
    return rows
  if kind == "scatter":
    return blocked_rows(xp, flat, schedule, length).reshape(c, length)
  if kind == "pair":
    return xp.stack([flat, xp.zeros_like(flat)])
  return pad_to(xp, flat, c * length).reshape(c, length)


def from_rows(xp, rows, schedule, size: int, rank: int | None = None):
  """The flat result of one rank from its final ``[C, L]`` buffer.

  For reduce_scatter with ``rank=None`` the caller passes the rank's own ``b``
  rows (already sliced out) instead of the whole buffer.
  """
  n, kind = schedule.axis_size, schedule.layout
  if kind == "gather":
    return rows.reshape(n, -1)[:, :size].reshape(-1)
  if kind == "exchange":
    return rows[output_start(schedule):].reshape(n, -1)[:, :size // n].reshape(-1)
  if kind == "pair":
    return rows[1]
  if kind == "scatter":
    b = schedule.blocks_per_rank
    mine = rows if rank is None else rows[rank * b:(rank + 1) * b]
    return mine.reshape(-1)[:size // n]
  return rows.reshape(-1)[:size]


def place_own(xp, rows, flat, schedule, rank):
  """The executor's starting rows with the rank's own block in place (``rank`` traced):
  "gather" puts its piece in block r, "exchange" copies input block r to output block r;
  the rest start as :func:`to_rows` left them. ``xp`` is jax.numpy; the slices are lax's."""
  from jax import lax  # the one jax-only hook: NumPy callers pass a concrete rank instead
  b, kind = schedule.blocks_per_rank, schedule.layout
  if kind == "gather":
    piece = block(xp, flat, schedule, rows.shape[1])
    return lax.dynamic_update_slice_in_dim(rows, piece, rank * b, axis=0)
  if kind == "exchange":
    own = lax.dynamic_slice_in_dim(rows, rank * b, b, axis=0)
    return lax.dynamic_update_slice_in_dim(rows, own, output_start(schedule) + rank * b, 0)
  return rows
