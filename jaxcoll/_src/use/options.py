"""What ``jaxcoll.use`` was asked for, and the one place it decides each collective's
algorithm and wire format from it (:class:`Options`)."""

from __future__ import annotations

from collections.abc import Mapping

import jax.numpy as jnp
import numpy as np

from jaxcoll._src.auto.profile import Profile
from jaxcoll._src.compat import target_backend
from jaxcoll._src.schedules.algorithms import algorithms
from jaxcoll._src.spec import PRIMITIVES
from jaxcoll._src.use.gradient_sums import stack, vary
from jaxcoll.extend import (
  SCHEDULE,
  check_axis_names,
  check_choice,
  check_flag,
  compresses,
  native_equivalents,
  offered_algorithm,
  record_where,
  wire_format,
)


class Options:
  """What ``use`` was asked for: the algorithm per primitive, the wire format, the profile."""

  def __init__(self, algorithm, wire_dtype, profile, axes=None, in_shardings=None,
               out_shardings=None, strict: bool = False, collective_matmul=None):
    if isinstance(algorithm, Mapping):
      for p, a in algorithm.items():
        check_choice(p, a, "use(algorithm=...)")
      self.algorithm = dict(algorithm)
    elif isinstance(algorithm, str):
      if algorithm not in ("auto", SCHEDULE) and not any(algorithm in algorithms(p)
                                                         for p in PRIMITIVES):
        raise ValueError(f"use(algorithm={algorithm!r}): no collective offers it; expected "
                         f"'auto', {SCHEDULE!r}, a mapping {{primitive: algorithm}} or a "
                         "name from jaxcoll.algorithms(primitive)")
      self.algorithm = algorithm
    else:
      raise ValueError(f"use(algorithm={algorithm!r}): expected 'auto', a name or a mapping "
                       "{primitive: algorithm}")
    self.wire = None if wire_dtype is None else wire_format(wire_dtype, np.float32)
    self.profile = None if profile is None else Profile.resolve(profile, "use(profile=...)")
    self.axes = None if axes is None else check_axis_names(axes, "use(axes=...)") if axes \
        else ()
    self.in_shardings, self.out_shardings = in_shardings, out_shardings
    self.in_flat = None   # the arguments' own shardings, flat (concrete arrays: rewrite)
    self.memory = None    # output leaf -> declared host-memory sharding (rewrite fills it)
    self.strict = check_flag(strict, "use(strict=...)")
    self.collective_matmul = None if collective_matmul is None else check_flag(
        collective_matmul, "use(collective_matmul=...)")
    self.casts = True   # pvary as jaxcoll's vary (False inside a global program's shard_map)

  def algorithm_for(self, primitive: str, axes: tuple[str, ...]):
    """The algorithm a ``primitive`` over ``axes`` runs: a mapping's entry (else "auto"), or
    the one name, where the primitive offers it (:func:`jaxcoll.extend.offered_algorithm`:
    else "auto" for "auto" and "native", "schedule" for a schedule's name)."""
    if isinstance(self.algorithm, dict):
      return self.algorithm.get(primitive, "auto")
    return offered_algorithm(primitive, self.algorithm, len(axes))

  def matmul_for(self, primitive: str, axes: tuple[str, ...], dtype, size: int,
                 gradient: bool = True) -> dict | None:
    """The keyword arguments of the collective matmul (:func:`jaxcoll.all_gather_matmul`,
    :func:`jaxcoll.matmul_reduce_scatter`) where ``use`` runs a matmul and the
    ``primitive`` over ``axes`` together ("all_gather" of an operand, "reduce_scatter" or
    "all_reduce" of the product; ``dtype``, ``size`` values), None where it runs them apart:
    asked so (``collective_matmul``), or by default on a backend whose collectives are
    synchronous (the CPU: no start/done pair, nothing runs beside a transfer, so N-1 partial
    matmuls would only cost); never where the collective travels on a lossy wire (the
    collective matmul's steps are exact) or where the primitive was asked for an algorithm
    other than auto or the one NCCL runs for it (``native_like``: the ring, whose traffic the
    collective matmul has; its loop's steps are single permutes, which XLA's scheduler puts
    beside the partial products). An all_reduce runs so (its reduce-scatter half beside the
    matmul, then an all_gather) only where a schedule was asked: under auto it stays XLA's
    own, which XLA's scheduler hides beside the rest of the step. The one place ``use``
    decides it."""
    on = self.collective_matmul
    if on is None:
      on = target_backend() != "cpu"
    rings = (SCHEDULE, *native_equivalents(primitive))
    if primitive != "all_reduce":   # auto keeps XLA's all-reduce: hidden whole, not half
      rings += ("auto",)
    if not on or self.algorithm_for(primitive, axes) not in rings or \
        self.wire_for(primitive, dtype, size=size, gradient=gradient):
      return None
    return {"algorithm": "native"}   # the ring is the loop's: each step one permute

  def wire_for(self, primitive: str, dtype, op: str = "sum", size: int | None = None,
               gradient: bool = True) -> dict:
    """``wire_dtype=`` where ``use`` sends a collective compressed: the sums
    (all_reduce, reduce_scatter) and gathers of data the format compresses. Never a max or
    a min (it selects a value: a rounded maximum matches no device's own, and argmax over a
    split dimension reads that match), nor an all_to_all, nor a value of ``size`` the
    format does not gain on (``compresses(wire, dtype, size)``: a single value, as a loss
    or a metric is, travels exact; in a bucket of sums each leaf is decided so), nor a sum
    of a global program that autodiff's backward pass did not make (``gradient``
    False, :mod:`backward`: the loss, a metric, tensor parallelism's forward sums); the rest
    travel as they are. The one place ``use`` decides it, for shard_map programs and global
    ones alike.

    Raises:
      ValueError: a float64 value to compress: a block-scaled or bfloat16 wire encodes in
        float32, where a float64 value beyond its range has no home (it would arrive inf or
        NaN); the error names the equation and its source line.
    """
    wanted = primitive in ("all_reduce", "reduce_scatter", "all_gather") and op == "sum" and \
        gradient
    if not (wanted and compresses(self.wire, dtype, size)):
      return {}
    if jnp.dtype(dtype).itemsize > 4:
      equation, line = record_where()
      wire = getattr(self.wire, "name", self.wire)
      raise ValueError(
          f"use(wire_dtype={wire!r}): the {primitive} of a {jnp.dtype(dtype)} value "
          f"({equation} at {line}) would be encoded in float32, where a float64 value "
          f"has no home beyond float32's range; cast it to float32 in the step, or pass "
          f"wire_dtype=None")
    return {"wire_dtype": self.wire}

  def vary(self, x, axes: tuple[str, ...]):
    """:func:`gradient_sums.vary` with this rewrite's algorithm and wire for its sum."""
    return vary(x, axes, *self._sum_options(x, axes))

  def stack(self, x, mesh, axes: tuple[str, ...], spec):
    """:func:`gradient_sums.stack` with this rewrite's algorithm and wire for its sum."""
    return stack(x, mesh, axes, spec, *self._sum_options(x, axes))

  def _sum_options(self, x, axes) -> tuple:
    """The algorithm and wire (None: uncompressed) of the gradient sum of ``x``, decided
    here as for every other sum; a float64 ``x`` is refused where its gradient is summed
    (:func:`gradient_sums.vary`), if ever: not every program is differentiated."""
    wide = jnp.issubdtype(x.dtype, jnp.floating) and jnp.dtype(x.dtype).itemsize > 4
    return (self.algorithm_for("all_reduce", axes),
            self.wire_for("all_reduce", jnp.float32 if wide else x.dtype,
                          size=jnp.size(x)).get("wire_dtype"))
