"""``jaxcoll.register``: an algorithm added from outside the package, checked as jaxcoll's own.

A builder ``builder(axis_size, **options) -> Schedule`` (root 0) registered here runs
through every collective call that names it, through "auto" (priced by the cost model
like every schedule), :func:`jaxcoll.explain`, ``jaxcoll-bench`` and the simulator. At
registration it is held to what every built-in schedule is tested for: the simulator's
result equals the collective's NumPy reference (:meth:`Schedule.check`) on every axis size
of ``check_sizes`` and every root, and, with a ``formula``, its steps and bytes equal it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping

from jaxcoll._src.auto import cost
from jaxcoll._src.schedules.algorithms import registry
from jaxcoll._src.schedules.schedule import Schedule
from jaxcoll._src.spec import spec

RESERVED = ("auto", registry.NATIVE, registry.SCHEDULE)


def register(primitive: str, name: str, *, num_axes: int = 1,
             tune: Mapping[str, tuple] | None = None, stage: bool = False,
             formula: Callable[[int], tuple[int, float]] | None = None,
             max_devices: int | None = None, replace: bool = False,
             check_sizes: Iterable[int] = range(1, 9)) -> Callable:
  """Decorator: adds ``builder(axis_size, **options) -> Schedule`` as algorithm ``name``.

  Args:
    primitive: the collective it implements, one of ``jaxcoll.PRIMITIVES``.
    name: its name, as ``algorithm=`` takes it (not "auto", "native" or "schedule").
    num_axes: the mesh axes it needs (more than one: it also gets ``axis_sizes=``).
    tune: options auto weighs, ``{option: (default, other, ...)}``.
    stage: it may run as one axis's stage of ``jaxcoll.Hierarchical``.
    formula: ``formula(N) -> (steps, bytes per rank / M)``, its cost formula, checked.
    max_devices: auto weighs it only on meshes of at most this many devices.
    replace: replace an algorithm of that name (else registering it again is an error).
    check_sizes: the axis sizes it is checked on (simulated against the reference).

  Returns:
    The decorator; it returns the builder unchanged.

  Raises:
    ValueError: a bad argument, named; or a schedule that fails its check (the message
      says which size, root and rank), in which case nothing stays registered.

  Example:
    >>> import numpy as np, jaxcoll
    >>> @jaxcoll.register("all_reduce", "chain_then_broadcast", check_sizes=range(1, 5))
    ... def chain(n):
    ...   step = lambda src, dst, combine: jaxcoll.Step((jaxcoll.Transfer(
    ...       np.array([src]), np.array([dst]), [[0]], [[0]], combine),))
    ...   down = [step(r, r - 1, "reduce") for r in range(n - 1, 0, -1)]
    ...   up = [step(r, r + 1, "copy") for r in range(n - 1)]
    ...   return jaxcoll.Schedule("all_reduce", "chain_then_broadcast", n, 1, down + up)
    >>> "chain_then_broadcast" in jaxcoll.algorithms("all_reduce")
    True
    >>> jaxcoll.tools.unregister("all_reduce", "chain_then_broadcast")
  """
  facts = spec(primitive)
  if not isinstance(name, str) or not name.isidentifier() or name in RESERVED:
    raise ValueError(f"name={name!r}: expected an identifier other than {RESERVED}")
  if _registered(primitive, name) is not None and not replace:
    raise ValueError(f"name={name!r}: {primitive} already has an algorithm of that name; "
                     "pass replace=True to replace it")
  if not isinstance(num_axes, int) or num_axes < 1:
    raise ValueError(f"num_axes={num_axes!r}: expected an int >= 1")
  if tune is not None and not (isinstance(tune, Mapping) and all(
      isinstance(v, tuple) and v for v in tune.values())):
    raise ValueError(f"tune={tune!r}: expected {{option: (default, other, ...)}}")
  if formula is not None and not callable(formula):
    raise ValueError(f"formula={formula!r}: expected formula(N) -> (steps, bytes / M)")
  sizes = tuple(check_sizes)
  if not sizes or not all(isinstance(n, int) and n >= 1 for n in sizes):
    raise ValueError(f"check_sizes={check_sizes!r}: expected positive ints")

  def wrap(builder):
    if not callable(builder):
      raise ValueError(f"register({primitive!r}, {name!r}) decorates a builder "
                       f"builder(axis_size, **options) -> Schedule, not {builder!r}")
    before = _registered(primitive, name)
    registry.register(primitive, name, num_axes=num_axes, tune=dict(tune or {}), stage=stage,
                      formula=formula, max_devices=max_devices)(builder)
    cost.clear_caches()
    try:
      for n in sizes:
        _check(primitive, name, n, num_axes, formula, facts.rooted)
    except Exception:
      unregister(primitive, name)
      if before is not None:
        registry.register(primitive, name, **_metadata(before))(before.build)
      raise
    return builder
  return wrap


def _check(primitive: str, name: str, n: int, num_axes: int, formula, rooted: bool) -> None:
  options = {"axis_sizes": (n,) + (1,) * (num_axes - 1)} if num_axes > 1 else {}
  for root in range(n) if rooted else (0,):
    sched = registry.schedule(primitive, name, n, root=root, **options)
    if not isinstance(sched, Schedule) or (sched.primitive, sched.axis_size) != (primitive, n):
      raise ValueError(f"register({primitive!r}, {name!r}): the builder returned {sched!r} for "
                       f"axis_size={n}; expected a jaxcoll.Schedule of {primitive} on {n} ranks")
    sched.check(op="sum")
    sched.check(op="max")
  if formula is not None and n > 1:
    steps, fraction = formula(n)
    got = (sched.num_steps, sched.bytes_per_rank(1.0))
    if got[0] != steps or not math.isclose(got[1], fraction, rel_tol=1e-9, abs_tol=1e-12):
      raise ValueError(f"register({primitive!r}, {name!r}): on {n} ranks the schedule takes "
                       f"{got[0]} steps and sends {got[1]:g} M per rank; formula says "
                       f"{steps} and {fraction:g}")


def _registered(primitive: str, name: str) -> registry.Algorithm | None:
  return next((a for a in registry.entries(primitive) if a.name == name), None)


def _metadata(algo: registry.Algorithm) -> dict:
  """What :func:`registry.register` takes to register ``algo`` again: every field but the
  three it is called with."""
  return {f.name: getattr(algo, f.name) for f in dataclasses.fields(algo)
          if f.name not in ("primitive", "name", "build")}


def unregister(primitive: str, name: str) -> None:
  """Removes algorithm ``name`` of ``primitive`` that :func:`register` added.

  Raises:
    ValueError: no such algorithm.
  """
  registry.unregister(primitive, name)
  cost.clear_caches()
