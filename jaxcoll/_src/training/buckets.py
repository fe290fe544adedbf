"""Gradient buckets: a pytree's leaves grouped by dtype, in reverse order, packed flat.

PyTorch DDP's layout: leaves are taken in reverse order (the order backward produces
gradients: last layer first), each dtype in its own stream, and cut into buckets of about
``bucket_bytes`` (the first bucket of each dtype ``first_bucket_bytes``, small, so that its
reduction can start early). A bucket is closed once it holds at least its target; a leaf is
never split. One collective per bucket instead of one per leaf: on the 200-leaf model of
``benchmarks/bench_grad_sync.py`` that is 1 to 3 collectives instead of 200.

On a compressed wire (``wire``) the leaves it compresses (``compresses(wire, dtype, size)``:
not a single value, not one too small to gain) form streams of their own, and each of their
leaves starts a block of its own (padded to whole blocks): a block's scale follows the
values of one leaf, so a loss or a large gradient never coarsens a small one beside it.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxcoll.extend import compresses


@dataclasses.dataclass(frozen=True)
class Bucket:
  """Leaves packed into one flat buffer: their indices (in pytree leaf order, as packed),
  shapes and the dtype they share; ``wire``: the compressed format it travels on (None:
  as it is); each leaf starts at a multiple of ``align`` values (its own blocks)."""

  dtype: np.dtype
  leaves: tuple[int, ...]
  shapes: tuple[tuple[int, ...], ...]
  wire: object = None
  align: int = 1

  @property
  def sizes(self) -> tuple[int, ...]:
    return tuple(math.prod(s) for s in self.shapes)

  @property
  def slots(self) -> tuple[int, ...]:
    """Values each leaf takes in the buffer (its size, padded to ``align``)."""
    return tuple(-(-n // self.align) * self.align for n in self.sizes)

  @property
  def nbytes(self) -> int:
    return sum(self.sizes) * self.dtype.itemsize


def assign(leaves, bucket_bytes: int, first_bucket_bytes: int | None = None,
           wire=None) -> tuple[Bucket, ...]:
  """Buckets for ``leaves`` (arrays or anything with ``shape`` and ``dtype``), in the order
  their reductions should be issued: the last leaves' bucket first. ``wire`` (a
  ``jaxcoll.WireFormat`` or None): the leaves it compresses go in streams of their own,
  aligned to its blocks."""
  first = bucket_bytes if first_bucket_bytes is None else first_bucket_bytes
  open_: dict[tuple, list[int]] = {}
  done_per_stream: dict[tuple, int] = {}
  out: list[tuple[tuple, list[int]]] = []

  def stream_of(i):
    dtype = np.dtype(leaves[i].dtype)
    return dtype, compresses(wire, dtype, math.prod(leaves[i].shape))

  def target(stream):
    return first if done_per_stream.get(stream, 0) == 0 else bucket_bytes

  def bytes_of(indices):
    return sum(math.prod(leaves[i].shape) * np.dtype(leaves[i].dtype).itemsize for i in indices)

  for i in reversed(range(len(leaves))):
    stream = stream_of(i)
    members = open_.setdefault(stream, [])
    members.append(i)
    if bytes_of(members) >= target(stream):
      out.append((stream, members))
      done_per_stream[stream] = done_per_stream.get(stream, 0) + 1
      del open_[stream]
  out += [(stream, members) for stream, members in open_.items()]
  aligned = wire.block_size if wire is not None and wire.scaled else 1
  return tuple(Bucket(dtype, tuple(m), tuple(tuple(leaves[i].shape) for i in m),
                      wire if packed else None, aligned if packed else 1)
               for (dtype, packed), m in out)


def pack(bucket: Bucket, leaves) -> jax.Array:
  """The bucket's leaves (from the full leaf list) as one flat array, each padded with
  zeros to its slot."""
  parts = [jnp.pad(jnp.ravel(leaves[i]), (0, slot - size))
           for i, size, slot in zip(bucket.leaves, bucket.sizes, bucket.slots)]
  return jnp.concatenate(parts) if len(parts) > 1 else parts[0]


def unpack(bucket: Bucket, flat: jax.Array, out: list) -> None:
  """Writes the bucket's leaves, cut from ``flat`` (any dtype), into ``out`` (by index)."""
  offsets = np.cumsum((0,) + bucket.slots)
  for i, shape, start, size in zip(bucket.leaves, bucket.shapes, offsets[:-1], bucket.sizes):
    out[i] = flat[int(start):int(start) + size].reshape(shape)
