"""How a value of a global program lies on the devices of some mesh axes: a :class:`Placement`.

``jaxcoll.use`` runs a program written for global arrays (``jax.jit`` over sharded arrays)
per device inside one shard_map (:mod:`spmd`). Every value there is one device's piece of a
global value, and its placement says which piece, per manual mesh axis, as PyTorch's DTensor
does (Shard, Replicate, Partial):

- sharded: the axis splits one dimension of the value; the device holds its block;
- partial: every device holds a term of a sum over the axis (the global value is the sum);
- replicated: every device holds the whole value along the axis.

A dimension may be split by several axes (major first, as in a ``PartitionSpec`` entry
``("data", "model")``), so the block of device (i, j) is ``i * size(model) + j``, the order
``lax.axis_index(("data", "model"))`` numbers. Pure data: no collective runs here
(:mod:`redistribute` moves values between placements).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Mapping, Sequence

from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from jaxcoll.extend import as_axes

Axes = tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Placement:
  """``dims[d]``: the axes splitting dimension d (major first); ``partial``: the axes over
  which the value is a sum of the devices' terms (JAX's ``unreduced``). Every axis at most
  once. ``reduced``: axes over which a whole value is typed ``reduced`` in JAX's explicit
  sharding (its data as whole; kept only for the type of an input or output, and not
  compared)."""

  dims: tuple[Axes, ...]
  partial: frozenset = frozenset()
  reduced: frozenset = dataclasses.field(default=frozenset(), compare=False)

  def __post_init__(self):
    used = [a for axes in self.dims for a in axes] + sorted(self.partial)
    if len(used) != len(set(used)):
      raise ValueError(f"placement {self} names an axis twice")

  @property
  def ndim(self) -> int:
    return len(self.dims)

  @property
  def sharded(self) -> frozenset:
    """The axes that split some dimension."""
    return frozenset(a for axes in self.dims for a in axes)

  @property
  def used(self) -> frozenset:
    return self.sharded | self.partial

  def local_shape(self, shape: Sequence[int], sizes: Mapping[str, int]) -> tuple[int, ...]:
    """One device's block of a value of global ``shape``."""
    return tuple(n // math.prod(sizes[a] for a in axes) for n, axes in zip(shape, self.dims))

  def spec(self) -> P:
    """The PartitionSpec (``in_specs``/``out_specs``): partial axes as ``unreduced``."""
    entries = [axes[0] if len(axes) == 1 else (axes or None) for axes in self.dims]
    while entries and entries[-1] is None:
      entries.pop()
    return P(*entries, unreduced=self.partial, reduced=self.reduced - self.partial)

  def whole(self) -> Placement:
    """The same dims, nothing partial (what a sum over the partial axes gives)."""
    return Placement(self.dims)

  def without(self, dims: Sequence[int]) -> Placement:
    """``dims`` removed (a reduction over them); the axes that split them become partial."""
    gone = frozenset(a for d in dims for a in self.dims[d])
    return Placement(tuple(a for d, a in enumerate(self.dims) if d not in dims),
                     self.partial | gone)

  def __str__(self) -> str:
    dims = ", ".join("+".join(a) if a else "-" for a in self.dims)
    return f"[{dims}]" + (f" partial({','.join(sorted(self.partial))})" if self.partial else "")


_keys = itertools.count()


@dataclasses.dataclass
class Local:
  """One device's piece of a value and its placement; ``var``: the jaxpr variable it is
  the value of (None for literals and temporaries). ``key`` names the logical value (the
  same in every scope it is bound in); ``origin``: how a partial sum was made from other
  partial sums (:class:`partials.Origin`), None for a source or a value that is no sum.
  ``slicer``: for a value computed whole that can be computed piece by piece (random bits,
  an iota, a broadcast, elementwise functions of those), ``slicer(placement)`` makes this
  device's piece under a finer split directly, so that a value every device would compute
  whole (and XLA then drops) is drawn or computed only where it is needed. ``carried``: a
  loop carry the body only adds to (:func:`partials.accumulators`), as the body reads it:
  a sum added to it keeps it a sum, reduced once after the loop instead of once per
  iteration, and no flush of other sums reduces it. ``kept``: where the value falls as an
  output nothing declares, where that is not whole (:meth:`spmd.Evaluator.kept`).
  ``given``: an input of the program (or a constant it closes over), laid out as the caller
  laid it out; every other value is computed in the program, where its layout is jaxcoll's
  to choose (as jit's partitioner propagates a layout into the equations that make it)."""

  value: object
  place: Placement
  var: object = None
  origin: object = None
  key: int = dataclasses.field(default_factory=lambda: next(_keys))
  slicer: object = None
  carried: bool = False
  kept: object = None
  given: bool = False

  @property
  def nbytes(self) -> int:
    """The bytes of this device's piece."""
    return math.prod(self.value.shape) * self.value.dtype.itemsize

  def bound_to(self, var) -> Local:
    """The same value (key, origin, slicer, carried, kept) bound to ``var``."""
    return dataclasses.replace(self, var=var)

  def finer(self, place: Placement) -> bool:
    """Whether ``place`` splits this value further, nothing partial on either side (each
    dimension's axes begin with this value's)."""
    return not self.place.partial and not place.partial and all(
        b[:len(a)] == a for a, b in zip(self.place.dims, place.dims))


SLICER_DEPTH = 16


def slicer_of(piece, inputs: Sequence[Local]):
  """``piece`` as the slicer of a value computed from ``inputs`` (:attr:`Local.slicer`), or
  None where the chain of slicers it calls would grow longer than :data:`SLICER_DEPTH`: a
  piece is made by calling its inputs' slicers, recursively, so a long chain of elementwise
  equations would recurse as deep (past it, a piece is a slice of the whole value)."""
  depth = 1 + max((getattr(x.slicer, "depth", 0) for x in inputs if x.slicer is not None),
                  default=0)
  if depth > SLICER_DEPTH:
    return None
  piece.depth = depth
  return piece


def explicit(mesh, axes) -> bool:
  """Whether every one of ``axes`` is Explicit on ``mesh`` (JAX's explicit sharding: a
  value's type says where it is)."""
  types = dict(zip(getattr(mesh, "axis_names", ()), getattr(mesh, "axis_types", ())))
  return all(types.get(a) == AxisType.Explicit for a in axes)


def replicated(ndim: int) -> Placement:
  return Placement(((),) * ndim)


def entries(spec) -> tuple:
  """A PartitionSpec's per-dimension entries (``spec.partitions``: indexing a spec with an
  ``unreduced`` or ``reduced`` set is an error in jax)."""
  return tuple(getattr(spec, "partitions", spec)) if spec is not None else ()


def with_leading(spec, axes) -> P:
  """``spec`` with a new leading dimension split over ``axes`` (one copy per device: a
  ``reduced`` axis among them is split now); its other unreduced and reduced axes kept."""
  return P(axes, *entries(spec), unreduced=getattr(spec, "unreduced", frozenset()),
           reduced=frozenset(getattr(spec, "reduced", ())) - set(as_axes(axes)))


def from_spec(spec, ndim: int, manual: Sequence[str]) -> Placement:
  """The placement of a value laid out as ``spec`` (a PartitionSpec), over the ``manual``
  axes only (the others are left to XLA). An axis in the spec's ``unreduced`` set (JAX's
  explicit sharding: a sum not yet taken) makes the value partial over it; one in its
  ``reduced`` set leaves it whole there (a whole value whose gradient is a sum)."""
  parts = entries(spec)
  dims = [tuple(a for a in as_axes(parts[d] if d < len(parts) else None) if a in manual)
          for d in range(ndim)]
  partial = frozenset(getattr(spec, "unreduced", ()) or ()) & frozenset(manual)
  reduced = frozenset(getattr(spec, "reduced", ()) or ()) & frozenset(manual)
  return Placement(tuple(dims), partial, reduced)
