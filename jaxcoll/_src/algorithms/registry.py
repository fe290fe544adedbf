"""The algorithm registry: ``schedule(primitive, algorithm, axis_size)`` and ``register``.

Each module of this package builds the schedules of one family and registers them with
:func:`register`; the package imports them all. An algorithm is a pure function of the axis
size (and options such as the pipeline depth) returning a
:class:`~jaxcoll._src.schedule.Schedule` for root 0; schedules are cached, and those of
rooted primitives are relabelled for other roots.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from jaxcoll._src.schedule import PRIMITIVES, Schedule

NATIVE = "native"
HIERARCHICAL = "hierarchical"   # runs over a tuple of axes; needs axis_sizes=
ROOTED = ("broadcast", "reduce")
_BUILDERS: dict[str, dict[str, Callable[..., Schedule]]] = {p: {} for p in PRIMITIVES}


def register(primitive: str, name: str):
  """Decorator: registers ``builder(axis_size, **options) -> Schedule``."""
  def wrap(builder):
    _BUILDERS[primitive][name] = builder
    return builder
  return wrap


def algorithms(primitive: str, num_axes: int | None = None) -> tuple[str, ...]:
  """The algorithm names valid for ``primitive``, ``"native"`` (the jax.lax collective) last.

  With ``num_axes``, only those that run over that many mesh axes ("hierarchical"
  needs a tuple of at least two; every other algorithm runs over any number).
  """
  _check_primitive(primitive)
  names = (*_BUILDERS[primitive], NATIVE)
  if num_axes is not None and num_axes < 2:
    names = tuple(a for a in names if a != HIERARCHICAL)
  return names


def _check_primitive(primitive: str) -> None:
  if primitive not in _BUILDERS:
    raise ValueError(f"primitive={primitive!r} is not a collective; expected one of {PRIMITIVES}")


def check_algorithm(primitive: str, algorithm: str, *, argument: str = "algorithm") -> None:
  """Raises ValueError unless ``algorithm`` is ``"auto"`` or in ``algorithms(primitive)``."""
  if algorithm != "auto" and algorithm not in algorithms(primitive):
    raise ValueError(f"{argument}={algorithm!r} does not apply to {primitive}; expected 'auto' "
                     f"or one of {algorithms(primitive)}")


@functools.lru_cache(maxsize=4096)
def schedule(primitive: str, algorithm: str, axis_size: int, *, root: int = 0,
             **options) -> Schedule:
  """The schedule of ``algorithm`` for ``primitive`` over ``axis_size`` ranks.

  Args:
    primitive: "all_reduce", "reduce_scatter", "all_gather", "broadcast" or "reduce".
    algorithm: a name from :func:`algorithms`, except "native" (the jax.lax
      collective has no schedule of ours).
    axis_size: N >= 1.
    root: the root rank (broadcast, reduce).
    **options: algorithm options: ``pipeline=`` for "double_binary_tree";
      ``offset=``, ``wrap=`` for shift; ``axis_sizes=`` (outermost first) and
      ``per_axis=`` (one flat algorithm per axis) for "hierarchical".
  """
  check_algorithm(primitive, algorithm)
  if algorithm in ("auto", NATIVE):
    raise ValueError(f"algorithm={algorithm!r} has no schedule; name a concrete algorithm")
  if not isinstance(axis_size, int) or axis_size < 1:
    raise ValueError(f"axis_size must be a positive int, got {axis_size!r}")
  if root and primitive not in ROOTED:
    raise ValueError(f"root={root}: only {ROOTED} have a root")
  if not 0 <= root < axis_size:
    raise ValueError(f"root={root} is out of range for an axis of size {axis_size}")
  built = _BUILDERS[primitive][algorithm](axis_size, **options)
  return built.relabel(root) if root else built
