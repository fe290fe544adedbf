"""One :class:`CollectiveSpec` per primitive: the facts every layer reads about a collective.

Which lax collective it equals, whether it reduces, has a root, leaves every rank the same
result, owns a block per rank, takes a compressed wire format, what its message size M
counts, and its nccl-tests bus-bandwidth factor. Schedules, the executor, the layout, the
cost model, calibrate, explain and the benchmarks read these instead of keeping lists of
their own (the MSCCLang ``Collective`` idea). Nothing here imports JAX.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Literal


@dataclasses.dataclass(frozen=True)
class CollectiveSpec:
  """What is true of one collective whatever the algorithm.

  Attributes:
    name: the primitive, e.g. "all_reduce".
    lax: the ``jax.lax`` function it equals ("psum", ...; broadcast and reduce have none
      and are built from ``psum``).
    reduces: combines values with ``op=``.
    rooted: has a ``root=`` rank (broadcast, reduce).
    replicated: every rank ends with the same result, bit for bit (all_reduce,
      all_gather); a compressed wire needs one more encode/decode pass to keep that.
    blocked: rank r owns block r of the buffer (reduce_scatter's output, all_gather's
      input), each block padded on its own.
    wire: accepts ``wire_dtype=`` (compressed messages).
    message: what M, the message size of the cost formulas, counts: "input" (x's bytes)
      or "output" (all_gather: the gathered result, N times x).
    layout: how a flat buffer maps onto a schedule's rows (:mod:`jaxcoll._src.layout`):
      "whole" (the buffer in C rows), "scatter" (N input blocks, keep one), "gather" (one
      input block, N out), "exchange" (N blocks in, N out: all_to_all), "pair" (one row
      in, one out: shift).
    bus_factor: nccl-tests' bus bandwidth over algorithm bandwidth at N ranks; None for a
      point-to-point primitive (shift), which is neither benchmarked as a collective nor
      calibrated.
  """

  name: str
  lax: str
  reduces: bool = False
  rooted: bool = False
  replicated: bool = False
  blocked: bool = False
  wire: bool = False
  message: Literal["input", "output"] = "input"
  layout: Literal["whole", "scatter", "gather", "exchange", "pair"] = "whole"
  bus_factor: Callable[[int], float] | None = dataclasses.field(default=None, compare=False,
                                                                repr=False)

  def message_bytes(self, input_bytes: float, axis_size: int) -> float:
    """M for an input of ``input_bytes`` per device."""
    return input_bytes * axis_size if self.message == "output" else input_bytes

  def input_bytes(self, message_bytes: float, axis_size: int) -> float:
    """The input per device whose M is ``message_bytes``."""
    return message_bytes / axis_size if self.message == "output" else message_bytes


_ring_fraction = lambda n: (n - 1) / n   # noqa: E731

SPECS: dict[str, CollectiveSpec] = {s.name: s for s in (
    CollectiveSpec("all_reduce", "psum", reduces=True, replicated=True, wire=True,
                   bus_factor=lambda n: 2 * _ring_fraction(n)),
    CollectiveSpec("reduce_scatter", "psum_scatter", reduces=True, blocked=True, wire=True,
                   layout="scatter", bus_factor=_ring_fraction),
    CollectiveSpec("all_gather", "all_gather", replicated=True, blocked=True, wire=True,
                   message="output", layout="gather", bus_factor=_ring_fraction),
    CollectiveSpec("broadcast", "psum", rooted=True, bus_factor=lambda n: 1.0),
    CollectiveSpec("reduce", "psum", reduces=True, rooted=True, bus_factor=lambda n: 1.0),
    CollectiveSpec("all_to_all", "all_to_all", wire=True, layout="exchange",
                   bus_factor=_ring_fraction),
    CollectiveSpec("shift", "ppermute", layout="pair"),
)}
PRIMITIVES = tuple(SPECS)


def spec(primitive: str, *, argument: str = "primitive") -> CollectiveSpec:
  """The spec of ``primitive``; ValueError naming ``argument`` for anything else."""
  try:
    return SPECS[primitive]
  except (KeyError, TypeError):
    raise ValueError(f"{argument}={primitive!r} is not a collective; expected one of "
                     f"{PRIMITIVES}") from None


def primitives(**facts) -> tuple[str, ...]:
  """The primitives whose spec has every given fact, e.g. ``primitives(wire=True)``;
  ``timed=True``: those with a bus factor (benchmarked and calibrated)."""
  timed = facts.pop("timed", None)
  return tuple(p for p, s in SPECS.items()
               if all(getattr(s, k) == v for k, v in facts.items())
               and (timed is None or (s.bus_factor is not None) == timed))
