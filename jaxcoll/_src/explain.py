"""``jaxcoll.explain``: every algorithm of a collective priced on a profile, auto's pick marked."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import numpy as np

from jaxcoll._src import config as config_lib
from jaxcoll._src import dispatch
from jaxcoll._src import wire as wire_lib
from jaxcoll._src.algorithms import NATIVE
from jaxcoll._src.profile import Profile
from jaxcoll._src.schedule import PRIMITIVES
from jaxcoll._src.table import Table


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
    title = (f"{self.primitive} of {fmt_bytes(self.nbytes)}{wire} over {self.axis_names} "
             f"({shape}), "
             f"profile {self.profile or 'custom'}: auto -> {self.chosen} ({why})")
    headers = ("algorithm", "steps", *(f"bytes over {a}" for a in self.axis_names),
               "predicted", "")
    rows = []
    for r in sorted(self.rows, key=lambda r: r.predicted_s):
      per_axis = [fmt_bytes(r.bytes[a]) if r.bytes else "-" for a in self.axis_names]
      rows.append((r.algorithm, "-" if r.steps is None else r.steps, *per_axis,
                   fmt_seconds(r.predicted_s), "<- auto" if r.chosen else ""))
    return Table.of(title, headers, rows)

  def __str__(self) -> str:
    return str(self.table())

  def __rich__(self):
    return self.table().__rich__()


def explain(primitive: str, x, mesh, axis_name, profile: Profile | str | None = None, *,
            accumulate_dtype=None, wire_dtype=None) -> Explanation:
  """Prices every algorithm of ``primitive`` for ``x`` on ``mesh``'s ``axis_name``.

  Args:
    primitive: one of ``PRIMITIVES``.
    x: the per-device input as the collective sees it inside shard_map: an array
      or anything with ``.shape`` and ``.dtype`` (``jax.ShapeDtypeStruct``).
      For all_gather, M is the gathered output (N times x).
    mesh: a ``jax.sharding.Mesh`` (or abstract mesh) with the axes, or a mapping
      ``{axis name: size}``.
    axis_name: a mesh axis or a tuple of them.
    profile: the profile (or a preset's name) to price with (default: the one "auto"
      uses).
    accumulate_dtype: as the collective's argument (float32 partial sums).
    wire_dtype: as the collective's argument: every schedule is priced on the compressed
      bytes (``WireFormat.ratio``), and native, which cannot compress, is listed but never
      chosen.

  Returns:
    An :class:`Explanation`; ``.chosen`` is what "auto" runs (including
    ``jaxcoll.config`` / ``JAXCOLL_ALGORITHM`` overrides), ``.rows`` every
    algorithm with its steps, bytes per axis and predicted seconds.
  """
  if primitive not in PRIMITIVES:
    raise ValueError(f"primitive={primitive!r} is not a collective; expected one of {PRIMITIVES}")
  axes = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
  shape_of = mesh_shape(mesh)
  for a in axes:
    if a not in shape_of:
      raise ValueError(f"axis_name={a!r} is not an axis of the mesh; its axes: {tuple(shape_of)}")
  sizes = tuple(int(shape_of[a]) for a in axes)
  n = math.prod(sizes)
  dtype = np.dtype(x.dtype)
  nbytes = int(math.prod(x.shape)) * dtype.itemsize * (n if primitive == "all_gather" else 1)
  scale = 1.0 if accumulate_dtype is None else np.dtype(accumulate_dtype).itemsize / dtype.itemsize
  fmt = wire_lib.wire_format(wire_dtype, dtype)
  priced = nbytes * (fmt.ratio(dtype) if fmt else 1.0)
  profile = dispatch.profile_in_use(profile)
  candidates = dispatch.candidates(primitive, axes, sizes, priced, profile,
                                   partial_sum_scale=scale)
  chosen = dispatch.auto_label(primitive, axes, sizes, priced, profile, weighed=candidates,
                               native_allowed=fmt is None)
  override = config_lib.override(primitive)
  rows = []
  for c in candidates:
    if c.algorithm == NATIVE:
      steps, per_axis = None, None
    else:
      traffic = c.schedule.traffic(priced, sizes, partial_sum_scale=scale)
      steps, per_axis = c.schedule.num_steps, {a: t.bytes for a, t in zip(axes, traffic)}
    rows.append(ExplainRow(c.label, steps, per_axis, c.predicted_s, c.label == chosen))
  return Explanation(primitive, axes, sizes, nbytes, profile.name, chosen, override is not None,
                     tuple(rows), fmt.name if fmt else None, dispatch.trusted(profile))


def mesh_shape(mesh) -> dict:
  """``{axis name: size}`` of a ``Mesh``, an abstract mesh, or such a mapping itself."""
  return dict(mesh) if isinstance(mesh, Mapping) else dict(mesh.shape)


def fmt_bytes(b: float) -> str:
  for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
    if b >= size:
      return f"{b / size:.3g} {unit}"
  return f"{b:.0f} B"


def fmt_seconds(s: float) -> str:
  for unit, size in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
    if s >= size:
      return f"{s / size:.3g} {unit}"
  return f"{s * 1e9:.3g} ns"
