"""Moving one device's piece of a value from one :class:`Placement` to another, with jaxcoll.

Inside the shard_map of :mod:`spmd`: a partial sum becomes whole by ``all_reduce``, or whole
and split by ``reduce_scatter``; a split dimension becomes whole by ``all_gather``; an axis
moves from one dimension to another by ``all_to_all``; a whole dimension is split (a local
slice at the device's block) and a whole value becomes a partial sum (device 0 of the axes
keeps it, the others zero) without communication. :func:`reduce_many` reduces many partial
sums at once, in buckets (``jaxcoll.sync_gradients``'s for all-reduces; reduce-scatters
packed the same way), never one collective per value.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax.numpy as jnp
from jax import lax

from jaxcoll._src.collectives import all_gather, all_reduce, all_to_all, reduce_scatter
from jaxcoll._src.integrations.placement import Axes, Placement
from jaxcoll._src.integrations.sync import BUCKET_BYTES, sync_gradients
from jaxcoll.extend import axis_size


@dataclasses.dataclass(frozen=True)
class Comm:
  """How the collectives run: ``options(primitive, axes, dtype)`` gives their keyword
  arguments (algorithm, wire format); ``order``: the mesh's axes, outer first."""

  options: Callable[[str, Axes, object], dict]
  order: Axes = ()

  def ordered(self, axes) -> Axes:
    """``axes`` in the mesh's order (outer first: a hierarchical all-reduce crosses the
    outer axis with the smallest pieces)."""
    return tuple(a for a in self.order if a in axes) + tuple(
        sorted(a for a in axes if a not in self.order))

  def run(self, fn, primitive: str, x, axes: Axes, **kwargs):
    if primitive == "all_reduce":   # a sum's axes in any order: the mesh's
      axes = self.ordered(axes)
    return fn(x, axes, **kwargs, **self.options(primitive, axes, x.dtype))


def _ordered(axes, order: Axes) -> Axes:
  return tuple(a for a in order if a in axes)


def _slice(x, d: int, axes: Axes):
  """This device's block of dimension d, split over ``axes`` (major first)."""
  size = axis_size(axes)
  block = x.shape[d] // size
  return lax.dynamic_slice_in_dim(x, lax.axis_index(axes) * block, block, d)


def _to_partial(x, axes: Axes):
  """A whole value as a sum over ``axes``: device 0 of them keeps it, the others zero."""
  return jnp.where(lax.axis_index(axes) == 0, x, jnp.zeros_like(x))


def _scatter_dim(src: Placement, dst: Placement, reduced: frozenset) -> int | None:
  """The dimension a reduce-scatter over ``reduced`` lands the sum on: the one dimension
  ``dst`` splits by ``src``'s axes then exactly ``reduced``, all others as in ``src``."""
  changed = [d for d in range(src.ndim) if src.dims[d] != dst.dims[d]]
  if len(changed) != 1:
    return None
  d = changed[0]
  head, tail = dst.dims[d][:len(src.dims[d])], dst.dims[d][len(src.dims[d]):]
  return d if head == src.dims[d] and set(tail) == reduced else None


def redistribute(x, src: Placement, dst: Placement, comm: Comm):
  """``x`` (this device's piece in ``src``) as its piece in ``dst``."""
  if src == dst:
    return x
  reduced = src.partial - dst.partial
  if reduced:
    d = _scatter_dim(src, dst, reduced)
    if d is not None:
      axes = dst.dims[d][len(src.dims[d]):]
      return comm.run(reduce_scatter, "reduce_scatter", x, axes, scatter_dimension=d,
                      tiled=True)
    x = comm.run(all_reduce, "all_reduce", x, tuple(reduced))
    src = Placement(src.dims, src.partial - reduced)
  added = dst.partial - src.partial
  dims = list(src.dims)
  moved = _moved_axis(src, dst)
  if moved is not None:   # one axis from dimension d1 to d2: all_to_all
    a, d1, d2 = moved
    x = comm.run(all_to_all, "all_to_all", x, (a,), split_axis=d2, concat_axis=d1, tiled=True)
    dims[d1], dims[d2] = dst.dims[d1], dst.dims[d2]
  for d in range(len(dims)):   # gather what dst does not keep as a prefix
    if dims[d] != dst.dims[d] and dst.dims[d][:len(dims[d])] != dims[d]:
      x = comm.run(all_gather, "all_gather", x, dims[d], axis=d, tiled=True)
      dims[d] = ()
  for d in range(len(dims)):   # split by what dst adds
    extra = dst.dims[d][len(dims[d]):]
    if extra:
      x = _slice(x, d, extra)
      dims[d] = dst.dims[d]
  if added:
    x = _to_partial(x, comm.ordered(added))
  return x


def _moved_axis(src: Placement, dst: Placement):
  """``(axis, d1, d2)`` when the only change is one axis leaving the end of dimension d1's
  axes for the end of d2's, nothing partial changing; else None."""
  if src.partial != dst.partial:
    return None
  changed = [d for d in range(src.ndim) if src.dims[d] != dst.dims[d]]
  if len(changed) != 2:
    return None
  for d1, d2 in (changed, changed[::-1]):
    s1, t1, s2, t2 = src.dims[d1], dst.dims[d1], src.dims[d2], dst.dims[d2]
    if s1 and s1[:-1] == t1 and t2 == s2 + (s1[-1],):
      return s1[-1], d1, d2
  return None


def reduce_many(items: Sequence[tuple[object, Placement, Placement]], comm: Comm,
                bucket_bytes: int = BUCKET_BYTES) -> list:
  """Every ``(x, src, dst)`` (``src`` partial) moved to ``dst``, the sums together: values
  reduced over the same axes to the same dims go through ``jaxcoll.sync_gradients`` (buckets
  per dtype), those reduce-scattered over the same axes onto one dimension are packed into
  buckets of one reduce-scatter each; the rest one by one."""
  out = [None] * len(items)
  summed: dict[tuple, list[int]] = {}
  scattered: dict[tuple, list[int]] = {}
  for i, (x, src, dst) in enumerate(items):
    reduced = src.partial - dst.partial
    d = _scatter_dim(src, dst, reduced) if reduced else None
    if reduced and src.dims == dst.dims and not dst.partial - src.partial:
      summed.setdefault((comm.ordered(reduced),), []).append(i)
    elif d is not None and src.dims[d] == () and not dst.partial - src.partial:
      scattered.setdefault((dst.dims[d], jnp.dtype(x.dtype)), []).append(i)
    else:
      out[i] = redistribute(x, src, dst, comm)
  for (axes,), members in summed.items():
    values = [items[i][0] for i in members]
    options = comm.options("all_reduce", axes, values[0].dtype)
    synced = sync_gradients(values, axes, op="sum", bucket_bytes=bucket_bytes, **options)
    for i, v in zip(members, synced):
      out[i] = v
  for (axes, _), members in scattered.items():
    for bucket in _buckets(members, items, bucket_bytes):
      for i, v in zip(bucket, _scatter_together([items[i] for i in bucket], axes, comm)):
        out[i] = v
  return out


def _buckets(members, items, bucket_bytes) -> list[list[int]]:
  out, size = [[]], 0
  for i in reversed(members):   # the last values first, as sync_gradients
    nbytes = int(items[i][0].size) * items[i][0].dtype.itemsize
    if out[-1] and size + nbytes > bucket_bytes:
      out.append([])
      size = 0
    out[-1].append(i)
    size += nbytes
  return out


def _scatter_together(items, axes: Axes, comm: Comm) -> list:
  """One reduce-scatter over ``axes`` of every value's scattered dimension: each value with
  that dimension first, as ``[n, -1]`` (n the devices of ``axes``), concatenated along the
  second dimension; this device's row is split back."""
  n = axis_size(axes)
  rows, shapes = [], []
  for x, src, dst in items:
    d = _scatter_dim(src, dst, src.partial - dst.partial)
    moved = jnp.moveaxis(x, d, 0)
    shapes.append((d, moved.shape))
    rows.append(moved.reshape(n, -1))
  packed = jnp.concatenate(rows, axis=1)
  mine = comm.run(reduce_scatter, "reduce_scatter", packed, axes, scatter_dimension=0,
                  tiled=True)[0]
  out, start = [], 0
  for (d, shape), row in zip(shapes, rows):
    width = row.shape[1]
    local = mine[start:start + width].reshape((shape[0] // n,) + shape[1:])
    out.append(jnp.moveaxis(local, 0, d))
    start += width
  return out
