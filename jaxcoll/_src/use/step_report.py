"""``jaxcoll.explain_step``: every collective of a compiled step, and what runs it.

A step under ``jaxcoll.use`` is lowered and compiled as its call would run it, with
:mod:`record` collecting a line for each jaxcoll collective traced (which collective, over
which axes, how many bytes, the algorithm that runs it, the user's equation and source line
that needed it), each equation run on whole inputs for want of a per-device rule, and each
lax collective or mesh axis left to XLA (and why). The compiled HLO's collective
instructions are counted beside: after ``use`` with a schedule algorithm, the only ones
should be ``collective-permute`` (the schedules' steps); any other is XLA's, and the lines
say where it came from (a "native" pick of auto, an "xla" line).
"""

from __future__ import annotations

import dataclasses

from jaxcoll._src.table import Table
from jaxcoll.extend import Overlap, ReportLine, format_size, overlap, recording


@dataclasses.dataclass(frozen=True)
class StepReport:
  """What a step's communication runs as.

  ``lines``: :class:`ReportLine` s in trace order; ``compiled``: how many collectives of
  each kind the compiled step holds (:meth:`Overlap.counts`); ``flops``: the
  compiled step's floating-point operations per device (XLA's cost analysis; None where
  the backend gives none); ``overlap``: what each transfer of the compiled, scheduled step
  runs beside (:func:`jaxcoll.tools.overlap`; on a CPU compile every collective is
  synchronous, so only a GPU or TPU compile, one for compile-only devices included, shows
  an overlap)."""

  lines: tuple[ReportLine, ...]
  compiled: dict
  flops: float | None = None
  overlap: Overlap | None = None

  @property
  def collectives(self) -> tuple[ReportLine, ...]:
    """The jaxcoll collectives (``algorithm`` "native" runs the lax collective)."""
    return tuple(x for x in self.lines if x.kind == ReportLine.COLLECTIVE)

  def bytes_by_kind(self) -> dict[str, int]:
    """Bytes each kind of jaxcoll collective carries in one call of the step (a line's
    operand bytes times how many times the call runs it)."""
    out: dict[str, int] = {}
    for x in self.collectives:
      out[x.what] = out.get(x.what, 0) + x.nbytes * x.count
    return out

  @property
  def whole(self) -> tuple[ReportLine, ...]:
    """Equations run on whole inputs (no per-device rule for their layouts)."""
    return tuple(x for x in self.lines if x.kind == ReportLine.WHOLE)

  @property
  def left_to_xla(self) -> tuple[ReportLine, ...]:
    """What XLA communicates for: lax collectives left as they are, axes not taken over,
    and jaxcoll collectives auto ran as the lax collective ("native")."""
    return tuple(x for x in self.lines if x.kind == ReportLine.XLA or x.algorithm == "native")

  @property
  def xla_collectives(self) -> int:
    """Collective instructions of the compiled step other than collective-permute."""
    return sum(n for k, n in self.compiled.items() if k != "collective-permute")

  def table(self) -> Table:
    rows = [(x.kind, x.what, ",".join(x.axes) or "-",
             (format_size(x.nbytes) + (f" x{x.count}" if x.count > 1 else ""))
             if x.kind == ReportLine.COLLECTIVE else "-",
             x.algorithm or "-", x.equation, x.where, x.detail) for x in self.lines]
    counts = ", ".join(f"{n} {k}" for k, n in self.compiled.items() if n) or "none"
    flops = "" if self.flops is None else f"; {self.flops:.4g} flops per device"
    return Table.of(f"compiled step's collectives: {counts}{flops}",
                    ("kind", "what", "axes", "bytes", "algorithm", "for", "at", "detail"),
                    rows)

  def __str__(self) -> str:
    if self.overlap is None or not self.overlap.transfers:
      return str(self.table())
    return f"{self.table()}\n\n{self.overlap.table()}"


def explain_step(step, *args, **kwargs) -> StepReport:
  """Compiles ``step(*args, **kwargs)`` as it would run, and says what runs every collective.

  Args:
    step: a function made by :func:`jaxcoll.use` (a pjit-style step over sharded arrays, a
      shard_map program, or both).
    *args: its arguments, as it will be called (arrays laid out on their mesh, or
      ``jax.ShapeDtypeStruct`` s with ``sharding=``).
    **kwargs: its keyword arguments, likewise.

  Returns:
    A :class:`StepReport`: a line per jaxcoll collective (algorithm, bytes, the equation and
    source line that needed it), per equation run whole, per thing left to XLA; the
    compiled HLO's collective instructions by kind, its flops per device, and what each of
    its transfers runs beside (``overlap``).

  Raises:
    TypeError: ``step`` was not made by ``jaxcoll.use``.

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np, jaxcoll
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("data",))
    >>> step = jax.jit(lambda w, x: w - 0.1 * jax.grad(lambda w: jnp.mean((x @ w) ** 2))(w))
    >>> w = jax.device_put(jnp.ones((8, 2)), NamedSharding(mesh, P()))
    >>> x = jax.device_put(jnp.ones((16, 8)), NamedSharding(mesh, P("data")))
    >>> report = jaxcoll.explain_step(jaxcoll.use(step, algorithm="ring"), w, x)
    >>> report.xla_collectives
    0
  """
  if not callable(getattr(step, "lower", None)) or not getattr(step, "_jaxcoll_use", False):
    raise TypeError(f"explain_step(step={step!r}): expected a function made by jaxcoll.use "
                    "(e.g. jaxcoll.use(train_step, algorithm='ring'))")
  with recording() as lines:
    lowered = step.lower(*args, **kwargs)
  compiled = lowered.compile()
  found = overlap(compiled)
  return StepReport(tuple(lines), found.counts(), flops_of(compiled), found)


def flops_of(compiled) -> float | None:
  """A compiled program's floating-point operations per device (None where unknown)."""
  try:
    cost = compiled.cost_analysis()
  except Exception:   # noqa: BLE001 (backends without a cost model raise their own kinds)
    return None
  if isinstance(cost, (list, tuple)):
    cost = cost[0] if cost else {}
  flops = (cost or {}).get("flops")
  return None if flops is None else float(flops)
