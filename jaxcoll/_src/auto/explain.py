"""``jaxcoll.explain``: every algorithm of a collective priced on a profile, auto's pick marked."""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np

from jaxcoll._src import checks
from jaxcoll._src.auto import cost, dispatch
from jaxcoll._src.auto.profile import Profile
from jaxcoll._src.schedules.algorithms import NATIVE
from jaxcoll._src.spec import spec
from jaxcoll._src.table import Table
from jaxcoll._src.units import format_seconds, format_size
from jaxcoll._src.wire import formats as wire_lib


@dataclasses.dataclass(frozen=True)
class ExplainRow:
  """One algorithm: steps, most bytes a device sends per axis, predicted seconds."""

  algorithm: str
  steps: int | None
  bytes: dict | None
  predicted_s: float
  chosen: bool


@dataclasses.dataclass(frozen=True)
class Explanation:
  """What ``algorithm="auto"`` would run for one call, and why. Prints as a table."""

  primitive: str
  axis_names: tuple[str, ...]
  axis_sizes: tuple[int, ...]
  nbytes: int
  profile: str
  chosen: str
  overridden: bool
  rows: tuple[ExplainRow, ...]
  wire_dtype: str | None = None
  trusted: bool = True
  links: str = "process"
  not_weighed: tuple[str, ...] = ()

  @property
  def predicted_s(self) -> float:
    """Predicted seconds of what auto runs (the chosen row)."""
    return next(r.predicted_s for r in self.rows if r.chosen)

  def table(self) -> Table:
    shape = "x".join(map(str, self.axis_sizes))
    why = ("overridden by config / JAXCOLL_ALGORITHM" if self.overridden else
           "profile not measured on this backend: native kept" if not self.trusted else
           f"min predicted time; native unless {dispatch.NATIVE_MARGIN:g}x slower")
    wire = f", wire {self.wire_dtype}" if self.wire_dtype else ""
    title = (f"{self.primitive} of {format_size(self.nbytes)}{wire} over {self.axis_names} "
             f"({shape}; links {self.links}), "
             f"profile {self.profile or 'custom'}: auto -> {self.chosen} ({why})")
    if self.not_weighed:
      title += (f"; not weighed on {math.prod(self.axis_sizes)} devices: "
                f"{', '.join(self.not_weighed)}")
    headers = ("algorithm", "steps", *(f"bytes over {a}" for a in self.axis_names),
               "predicted", "")
    rows = []
    for r in sorted(self.rows, key=lambda r: r.predicted_s):
      per_axis = [format_size(r.bytes[a]) if r.bytes else "-" for a in self.axis_names]
      rows.append((r.algorithm, "-" if r.steps is None else r.steps, *per_axis,
                   format_seconds(r.predicted_s), "<- auto" if r.chosen else ""))
    return Table.of(title, headers, rows)

  def __str__(self) -> str:
    return str(self.table())

  def __rich__(self):
    return self.table().__rich__()


@dataclasses.dataclass(frozen=True)
class Explanations:
  """:func:`explain` of a pytree: one :class:`Explanation` per leaf, as the collective runs
  them (one call per leaf), keyed by the leaf's path. Prints as one table."""

  leaves: tuple[tuple[str, Explanation], ...]

  @property
  def predicted_s(self) -> float:
    """Predicted seconds of every leaf's call, one after another."""
    return sum(e.predicted_s for _, e in self.leaves)

  @property
  def chosen(self) -> dict:
    """``{leaf path: what auto runs}``."""
    return {path: e.chosen for path, e in self.leaves}

  def table(self) -> Table:
    first = self.leaves[0][1] if self.leaves else None
    title = (f"{first.primitive} of {len(self.leaves)} leaves over {first.axis_names}: "
             f"predicted {format_seconds(self.predicted_s)}" if first else "no leaves")
    native = lambda e: next(r.predicted_s for r in e.rows if r.algorithm == NATIVE)
    rows = [(path, format_size(e.nbytes), e.chosen, format_seconds(e.predicted_s),
             format_seconds(native(e))) for path, e in self.leaves]
    return Table.of(title, ("leaf", "M", "auto", "predicted", "native"), rows)

  def __str__(self) -> str:
    return str(self.table())

  def __rich__(self):
    return self.table().__rich__()


def explain(primitive: str, x, mesh, axis_name, profile: Profile | str | None = None, *,
            accumulate_dtype=None, wire_dtype=None) -> Explanation | Explanations:
  """Prices every algorithm of ``primitive`` for ``x`` on ``mesh``'s ``axis_name``.

  Args:
    primitive: one of ``PRIMITIVES``.
    x: the per-device input as the collective sees it inside shard_map: an array
      or anything with ``.shape`` and ``.dtype`` (``jax.ShapeDtypeStruct``), or a pytree
      of them (each leaf priced as the collective runs it: one call per leaf).
      For all_gather, M is the gathered output (N times x).
    mesh: a ``jax.sharding.Mesh`` (or abstract mesh) with the axes, or a mapping
      ``{axis name: size}``. Links are priced by class (:mod:`jaxcoll._src.auto.topology`) as
      auto finds them at trace time: from the mesh given to ``jaxcoll.config(mesh=...)``,
      else from this job's processes in the standard device order.
    axis_name: a mesh axis or a tuple of them.
    profile: the profile (or a preset's name, or a profile JSON's path:
      :meth:`Profile.resolve`) to price with (default: the one "auto" uses).
    accumulate_dtype: as the collective's argument (float32 partial sums).
    wire_dtype: as the collective's argument: every schedule is priced on the compressed
      bytes (``WireFormat.ratio``), and native, which cannot compress, is listed but never
      chosen.

  Returns:
    An :class:`Explanation` for an array; ``.chosen`` is what "auto" runs (including
    ``jaxcoll.config`` / ``JAXCOLL_ALGORITHM`` overrides), ``.rows`` every
    algorithm with its steps, bytes per axis and predicted seconds. For a pytree,
    :class:`Explanations`: one per leaf.

  Raises:
    ValueError: a primitive that is not a collective, an axis not in ``mesh``, an option the
      primitive does not take (``wire_dtype`` for broadcast), a profile that is not one.
    TypeError: ``x`` (or a leaf of it) without ``.shape`` and ``.dtype``.

  Example:
    >>> import jax, jaxcoll
    >>> why = jaxcoll.explain("all_reduce", jax.ShapeDtypeStruct((1 << 20,), "float32"),
    ...                       {"x": 8}, "x", profile="cpu", wire_dtype="int8")
    >>> why.chosen, why.wire_dtype
    ('halving_doubling', 'int8')
  """
  facts = spec(primitive)
  if x is None:
    raise TypeError("x=None: expected an array, a jax.ShapeDtypeStruct or a pytree of them")
  if not _is_leaf(x):
    leaves = jax.tree_util.tree_flatten_with_path(x, is_leaf=_is_leaf)[0]
    for path, leaf in leaves:
      if not _is_leaf(leaf):
        raise TypeError(f"x{jax.tree_util.keystr(path)}={leaf!r}: expected an array or a "
                        "jax.ShapeDtypeStruct (anything with .shape and .dtype)")
    return Explanations(tuple(
        (jax.tree_util.keystr(path), explain(primitive, leaf, mesh, axis_name, profile,
                                             accumulate_dtype=accumulate_dtype,
                                             wire_dtype=wire_dtype))
        for path, leaf in leaves))
  axes, sizes = checks.axes_in_mesh(axis_name, mesh, mapping=True)
  shape_of = checks.mesh_shape(mesh, mapping=True)
  n = math.prod(sizes)
  dtype = np.dtype(x.dtype)
  nbytes = int(facts.message_bytes(int(math.prod(x.shape)) * dtype.itemsize, n))
  acc = checks.accumulate(accumulate_dtype, dtype) if facts.reduces else \
      _not_taken(primitive, "accumulate_dtype", accumulate_dtype)
  fmt = wire_lib.wire_format(wire_dtype, dtype) if facts.wire else \
      _not_taken(primitive, "wire_dtype", wire_dtype)
  call = dispatch.Call.of(primitive, axes, sizes, nbytes, dtype, accumulate=acc, wire=fmt)
  pricing = dispatch.Pricing.of(axes, sizes, profile=profile, mesh_shape=dict(shape_of))
  decision = dispatch.decide(call, pricing=pricing, weigh=True)
  rows = []
  for c in decision.candidates:
    if c.algorithm == NATIVE:
      steps, per_axis = None, None
    else:
      traffic = c.schedule.traffic(call.priced_bytes, sizes,
                                   partial_sum_scale=call.partial_sum_scale)
      steps, per_axis = c.schedule.num_steps, {a: t.bytes for a, t in zip(axes, traffic)}
    rows.append(ExplainRow(c.label, steps, per_axis, c.predicted_s, c.label == decision.label))
  return Explanation(primitive, axes, sizes, nbytes, pricing.profile.name, decision.label,
                     decision.overridden, tuple(rows), fmt.name if fmt else None,
                     pricing.trusted, pricing.topology.label, cost.not_weighed(primitive, sizes))


def _is_leaf(x) -> bool:
  return hasattr(x, "shape") and hasattr(x, "dtype")


def _not_taken(primitive: str, argument: str, value) -> None:
  """None for an option ``primitive`` does not take, which must not be given."""
  if value is not None:
    raise ValueError(f"{argument}={value!r} does not apply to {primitive}")
