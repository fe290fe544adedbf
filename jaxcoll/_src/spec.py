"""One :class:`CollectiveSpec` per primitive: the facts every layer reads about a collective.

Which lax collective it equals, whether it reduces, has a root, leaves every rank the same
result, owns a block per rank, takes a compressed wire format, what its message size M
counts, and its nccl-tests bus-bandwidth factor. Schedules, the executor, the layout, the
cost model, calibrate, explain and the benchmarks read these instead of keeping lists of
their own, and each keeps its expected result in NumPy (the MSCCLang ``Collective`` idea,
with its ``check``). Nothing here imports JAX.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Literal

import numpy as np

_REDUCERS = {"sum": np.sum, "prod": np.prod, "min": np.min, "max": np.max}


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
    reference: ``reference(inputs, root, op) -> outputs``: what every rank ends with, in
      plain NumPy (:meth:`expected`); :meth:`Schedule.check` holds a schedule to it.
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
  reference: Callable[..., list] | None = dataclasses.field(default=None, compare=False,
                                                            repr=False)

  def expected(self, inputs: Sequence[np.ndarray], root: int = 0,
               op: str = "sum") -> list[np.ndarray]:
    """Every rank's result of this collective, in plain NumPy.

    Args:
      inputs: one flat array per rank, as :meth:`Schedule.simulate` takes them (all_gather:
        the rank's piece).
      root: the root rank (broadcast, reduce).
      op: "sum", "prod", "min" or "max" (reducing collectives).

    Returns:
      One flat array per rank, as :meth:`Schedule.simulate` returns them: the reduction
      (all_reduce), the rank's block of it (reduce_scatter), every piece (all_gather), the
      root's buffer (broadcast), the reduction at the root and zeros elsewhere (reduce),
      block r of every rank (all_to_all), the previous rank's input (shift).

    Raises:
      ValueError: ``op`` is not one of the four.

    Example:
      >>> import numpy as np, jaxcoll
      >>> [a.tolist() for a in jaxcoll.spec("reduce_scatter").expected(
      ...     [np.array([1, 2]), np.array([10, 20])])]
      [[11], [22]]
    """
    if op not in _REDUCERS:
      raise ValueError(f"op={op!r}: expected one of {tuple(_REDUCERS)}")
    flat = [np.asarray(x).reshape(-1) for x in inputs]
    return self.reference(flat, root, op)

  def message_bytes(self, input_bytes: float, axis_size: int) -> float:
    """M for an input of ``input_bytes`` per device."""
    return input_bytes * axis_size if self.message == "output" else input_bytes

  def input_bytes(self, message_bytes: float, axis_size: int) -> float:
    """The input per device whose M is ``message_bytes``."""
    return message_bytes / axis_size if self.message == "output" else message_bytes


_ring_fraction = lambda n: (n - 1) / n   # noqa: E731


def _reduced(xs, op):
  return _REDUCERS[op](np.stack(xs), axis=0)


def _all_reduce(xs, root, op):
  return [_reduced(xs, op)] * len(xs)


def _reduce_scatter(xs, root, op):
  return list(_reduced(xs, op).reshape(len(xs), -1))


def _all_gather(xs, root, op):
  return [np.concatenate(xs)] * len(xs)


def _broadcast(xs, root, op):
  return [xs[root]] * len(xs)


def _reduce(xs, root, op):
  total = _reduced(xs, op)
  return [total if r == root else np.zeros_like(total) for r in range(len(xs))]


def _all_to_all(xs, root, op):
  n = len(xs)
  return [np.concatenate([x.reshape(n, -1)[r] for x in xs]) for r in range(n)]


def _shift(xs, root, op):
  return [xs[(r - 1) % len(xs)] for r in range(len(xs))]


SPECS: dict[str, CollectiveSpec] = {s.name: s for s in (
    CollectiveSpec("all_reduce", "psum", reduces=True, replicated=True, wire=True,
                   bus_factor=lambda n: 2 * _ring_fraction(n), reference=_all_reduce),
    CollectiveSpec("reduce_scatter", "psum_scatter", reduces=True, blocked=True, wire=True,
                   layout="scatter", bus_factor=_ring_fraction, reference=_reduce_scatter),
    CollectiveSpec("all_gather", "all_gather", replicated=True, blocked=True, wire=True,
                   message="output", layout="gather", bus_factor=_ring_fraction,
                   reference=_all_gather),
    CollectiveSpec("broadcast", "psum", rooted=True, bus_factor=lambda n: 1.0,
                   reference=_broadcast),
    CollectiveSpec("reduce", "psum", reduces=True, rooted=True, bus_factor=lambda n: 1.0,
                   reference=_reduce),
    CollectiveSpec("all_to_all", "all_to_all", wire=True, layout="exchange",
                   bus_factor=_ring_fraction, reference=_all_to_all),
    CollectiveSpec("shift", "ppermute", layout="pair", reference=_shift),
)}
PRIMITIVES = tuple(SPECS)


def spec(primitive: str, *, argument: str = "primitive") -> CollectiveSpec:
  """The spec of ``primitive``; ValueError naming ``argument`` for anything else.

  Args:
    primitive: one of ``jaxcoll.PRIMITIVES``.
    argument: the argument's name in the error.

  Returns:
    The primitive's :class:`CollectiveSpec`.

  Raises:
    ValueError: ``primitive`` is not a collective (the message names ``argument``).

  Example:
    >>> import jaxcoll
    >>> s = jaxcoll.spec("all_gather")
    >>> s.lax, s.message, s.message_bytes(1024, 8)
    ('all_gather', 'output', 8192)
  """
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
