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

import jax
import jax.numpy as jnp
from jax import lax

from jaxcoll._src.collectives import all_gather, all_reduce, all_to_all, reduce_scatter
from jaxcoll._src.training.buckets import assign
from jaxcoll._src.training.gradient_sync import BUCKET_BYTES, sync_gradients
from jaxcoll._src.use.placement import Axes, Placement
from jaxcoll.extend import axis_index, axis_size


@dataclasses.dataclass(frozen=True)
class Comm:
  """How the collectives run: ``options(primitive, axes, dtype, op, size)`` gives their
  keyword arguments (algorithm, wire format; ``size``: the values of the one operand, None
  for a bucket, whose leaves are decided each); ``order``: the mesh's axes, outer first.
  ``abstract``: a run whose values are never computed (only their placements are read):
  each collective is the lax one of the same shapes, which costs no schedule to build."""

  options: Callable[..., dict]
  order: Axes = ()
  abstract: bool = False
  index: Callable[[Axes], object] = axis_index   # this device's block over axes

  def ordered(self, axes) -> Axes:
    """``axes`` in the mesh's order (outer first: a hierarchical all-reduce crosses the
    outer axis with the smallest pieces)."""
    return tuple(a for a in self.order if a in axes) + tuple(
        sorted(a for a in axes if a not in self.order))

  def run(self, fn, primitive: str, x, axes: Axes, bucket=None, gradient: bool = True,
          **kwargs):
    """``fn`` (a jaxcoll collective) on ``x`` over ``axes`` with ``use``'s options; ``x`` a
    packed ``bucket`` (:class:`buckets.Bucket`) travels on the wire decided for it; a sum
    that is not a ``gradient`` travels exact."""
    if primitive == "all_reduce":   # a sum's axes in any order: the mesh's
      axes = self.ordered(axes)
    if self.abstract:
      return _LAX[primitive](x, axes, **kwargs)
    options = self.options(primitive, axes, x.dtype, kwargs.get("op", "sum"),
                           None if bucket is not None else jnp.size(x), gradient)
    if bucket is not None:
      options.pop("wire_dtype", None)
      options.update({} if bucket.wire is None else {"wire_dtype": bucket.wire})
    return fn(x, axes, **kwargs, **options)


def _lax_all_reduce(x, axes, op="sum"):
  return {"sum": lax.psum, "max": lax.pmax, "min": lax.pmin}[op](x, axes)


# the lax collective of each primitive, with jaxcoll's arguments (abstract runs)
_LAX = {
    "all_reduce": _lax_all_reduce,
    "reduce_scatter": lambda x, axes, scatter_dimension, tiled: lax.psum_scatter(
        x, axes, scatter_dimension=scatter_dimension, tiled=tiled),
    "all_gather": lambda x, axes, axis, tiled: lax.all_gather(x, axes, axis=axis, tiled=tiled),
    "all_to_all": lambda x, axes, split_axis, concat_axis, tiled: lax.all_to_all(
        x, axes, split_axis, concat_axis, tiled=tiled),
}


def _ordered(axes, order: Axes) -> Axes:
  return tuple(a for a in order if a in axes)


def _slice(x, d: int, axes: Axes, comm: Comm):
  """This device's block of dimension d, split over ``axes`` (major first)."""
  size = axis_size(axes)
  block = x.shape[d] // size
  return lax.dynamic_slice_in_dim(x, comm.index(axes) * block, block, d,
                                  allow_negative_indices=False)   # in range: no clamp


def _to_partial(x, axes: Axes, comm: Comm):
  """A whole value as a sum over ``axes``: device 0 of them keeps it, the others zero."""
  return jnp.where(comm.index(axes) == 0, x, jnp.zeros_like(x))


def _scatter(src: Placement, dst: Placement) -> tuple[int, Axes] | None:
  """Where a sum leaving ``src`` for ``dst`` is reduce-scattered: ``(d, axes)``, the first
  dimension that ``dst`` splits by ``src``'s axes then by some of the axes summed over
  (``axes``, the longest such run); the rest of the sum is all-reduced on the scattered
  piece, and anything else ``dst`` splits is sliced after. None where no dimension does."""
  reduced = src.partial - dst.partial
  for d in range(src.ndim):
    have, want = src.dims[d], dst.dims[d]
    if want[:len(have)] != have:
      continue
    tail = []
    for a in want[len(have):]:
      if a not in reduced:
        break
      tail.append(a)
    if tail:
      return d, tuple(tail)
  return None


def _scattered(src: Placement, d: int, axes: Axes) -> Placement:
  """``src`` after a reduce-scatter over ``axes`` onto dimension d."""
  dims = list(src.dims)
  dims[d] = dims[d] + axes
  return Placement(tuple(dims), src.partial - set(axes))


def redistribute(x, src: Placement, dst: Placement, comm: Comm):
  """``x`` (this device's piece in ``src``) as its piece in ``dst``."""
  if src == dst:
    return x
  plan = _scatter(src, dst)
  if plan is not None:
    d, axes = plan
    x = comm.run(reduce_scatter, "reduce_scatter", x, axes, scatter_dimension=d, tiled=True)
    src = _scattered(src, d, axes)
  reduced = src.partial - dst.partial
  if reduced:
    x = comm.run(all_reduce, "all_reduce", x, tuple(reduced))
    src = Placement(src.dims, src.partial - reduced)
  if src == dst:
    return x
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
      x = _slice(x, d, extra, comm)
      dims[d] = dst.dims[d]
  if added:
    x = _to_partial(x, comm.ordered(added), comm)
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
                bucket_bytes: int = BUCKET_BYTES, gradient: Sequence[bool] | None = None) -> list:
  """Every ``(x, src, dst)`` (``src`` partial) moved to ``dst``, the sums together, in
  three passes: the reduce-scatters (:func:`_scatter`) of values whole on the scattered
  dimension, over the same axes and of one dtype, packed into buckets of one reduce-scatter
  each; then the all-reduces of what stays summed, over the same axes, through
  ``jaxcoll.sync_gradients`` (buckets per dtype); then each value's own moves (slices, a
  gather), which send no sum. ``gradient[i]``: whether item i is a sum autodiff's backward
  pass made (:mod:`backward`); only those travel on a lossy wire (default: all)."""
  values = [x for x, _, _ in items]
  places = [src for _, src, _ in items]
  gradient = [True] * len(items) if gradient is None else list(gradient)
  if comm.abstract:   # placements only: each sum alone
    return [redistribute(x, src, dst, comm) for x, src, dst in items]
  scattered: dict[tuple, list[int]] = {}
  for i, (x, src, dst) in enumerate(items):
    plan = _scatter(src, dst)
    if plan is None:
      continue
    d, axes = plan
    if src.dims[d] == ():
      scattered.setdefault((axes, jnp.dtype(x.dtype), gradient[i]), []).append(i)
    else:
      values[i] = comm.run(reduce_scatter, "reduce_scatter", x, axes, gradient=gradient[i],
                           scatter_dimension=d, tiled=True)
      places[i] = _scattered(src, d, axes)
  for (axes, dtype, grads), members in scattered.items():
    wire = comm.options("reduce_scatter", axes, dtype, gradient=grads).get("wire_dtype")
    for packed in assign([_row(values[i], axes) for i in members],   # as sync_gradients
                         bucket_bytes // axis_size(axes), wire=wire):
      bucket = [members[j] for j in packed.leaves]
      ds = [_scatter(items[i][1], items[i][2])[0] for i in bucket]
      for i, d, v in zip(bucket, ds, _scatter_together([values[i] for i in bucket], ds, axes,
                                                       comm, packed)):
        values[i], places[i] = v, _scattered(places[i], d, axes)
  summed: dict[tuple, list[int]] = {}
  for i, (_, _, dst) in enumerate(items):
    rest = places[i].partial - dst.partial
    if rest:
      summed.setdefault((comm.ordered(rest), gradient[i]), []).append(i)
  for (axes, grads), members in summed.items():
    options = comm.options("all_reduce", axes, values[members[0]].dtype, gradient=grads)
    synced = sync_gradients([values[i] for i in members], axes, op="sum",
                            bucket_bytes=bucket_bytes, **options)
    for i, v in zip(members, synced):
      values[i], places[i] = v, Placement(places[i].dims, places[i].partial - set(axes))
  return [redistribute(v, p, dst, comm) for v, p, (_, _, dst) in zip(values, places, items)]


def _row(x, axes: Axes):
  """A sum as the piece each device of ``axes`` keeps once it is reduce-scattered (what a
  bucket of them packs per device)."""
  return jax.ShapeDtypeStruct((x.size // axis_size(axes),), x.dtype)


def _scatter_together(values, dims: Sequence[int], axes: Axes, comm: Comm, bucket) -> list:
  """One reduce-scatter over ``axes`` of every value's dimension ``dims[i]``: each value with
  that dimension first, as ``[n, -1]`` (n the devices of ``axes``), its row padded to its
  slot in ``bucket`` (whole blocks of its own on a compressed wire), concatenated along the
  second dimension; this device's row is split back."""
  n = axis_size(axes)
  rows, shapes = [], []
  for x, d, slot in zip(values, dims, bucket.slots):
    moved = jnp.moveaxis(x, d, 0)
    shapes.append((d, moved.shape))
    row = moved.reshape(n, -1)
    rows.append(jnp.pad(row, ((0, 0), (0, slot - row.shape[1]))))
  packed = jnp.concatenate(rows, axis=1)
  mine = comm.run(reduce_scatter, "reduce_scatter", packed, axes, bucket=bucket,
                  scatter_dimension=0, tiled=True)[0]
  out, start = [], 0
  for (d, shape), size, slot in zip(shapes, bucket.sizes, bucket.slots):
    local = mine[start:start + size].reshape((shape[0] // n,) + shape[1:])
    out.append(jnp.moveaxis(local, 0, d))
    start += slot
  return out
