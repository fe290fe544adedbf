"""Gradient buckets: a pytree's leaves grouped by dtype, in reverse order, packed flat.

PyTorch DDP's layout: leaves are taken in reverse order (the order backward produces
gradients: last layer first), each dtype in its own stream, and cut into buckets of about
``bucket_bytes`` (the first bucket of each dtype ``first_bucket_bytes``, small, so that its
reduction can start early). A bucket is closed once it holds at least its target; a leaf is
never split. One collective per bucket instead of one per leaf: on the 200-leaf model of
``benchmarks/bench_grad_sync.py`` that is 1 to 3 collectives instead of 200.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Bucket:
  """Leaves packed into one flat buffer: their indices (in pytree leaf order, as packed),
  shapes and the dtype they share."""

  dtype: np.dtype
  leaves: tuple[int, ...]
  shapes: tuple[tuple[int, ...], ...]

  @property
  def sizes(self) -> tuple[int, ...]:
    return tuple(math.prod(s) for s in self.shapes)

  @property
  def nbytes(self) -> int:
    return sum(self.sizes) * self.dtype.itemsize


def assign(leaves, bucket_bytes: int, first_bucket_bytes: int | None = None) -> tuple[Bucket, ...]:
  """Buckets for ``leaves`` (arrays or anything with ``shape`` and ``dtype``), in the order
  their reductions should be issued: the last leaves' bucket first."""
  first = bucket_bytes if first_bucket_bytes is None else first_bucket_bytes
  open_: dict[np.dtype, list[int]] = {}
  done_per_dtype: dict[np.dtype, int] = {}
  out: list[tuple[np.dtype, list[int]]] = []

  def target(dtype):
    return first if done_per_dtype.get(dtype, 0) == 0 else bucket_bytes

  def bytes_of(indices):
    return sum(math.prod(leaves[i].shape) * np.dtype(leaves[i].dtype).itemsize for i in indices)

  for i in reversed(range(len(leaves))):
    dtype = np.dtype(leaves[i].dtype)
    members = open_.setdefault(dtype, [])
    members.append(i)
    if bytes_of(members) >= target(dtype):
      out.append((dtype, members))
      done_per_dtype[dtype] = done_per_dtype.get(dtype, 0) + 1
      del open_[dtype]
  out += [(dtype, members) for dtype, members in open_.items()]
  return tuple(Bucket(dtype, tuple(m), tuple(tuple(leaves[i].shape) for i in m))
               for dtype, m in out)


def pack(bucket: Bucket, leaves) -> jax.Array:
  """The bucket's leaves (from the full leaf list) as one flat array."""
  parts = [jnp.ravel(leaves[i]) for i in bucket.leaves]
  return jnp.concatenate(parts) if len(parts) > 1 else parts[0]


def unpack(bucket: Bucket, flat: jax.Array, out: list) -> None:
  """Writes the bucket's leaves, cut from ``flat`` (any dtype), into ``out`` (by index)."""
  offsets = np.cumsum((0,) + bucket.sizes)
  for i, shape, start, stop in zip(bucket.leaves, bucket.shapes, offsets[:-1], offsets[1:]):
    out[i] = flat[int(start):int(stop)].reshape(shape)
