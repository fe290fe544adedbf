"""Resolving ``algorithm=`` for one call: "auto", a name, or :class:`Hierarchical`.

Until the cost-model dispatcher lands, "auto" is "native": measured on the
single-process CPU testbed (README, Performance), the jax.lax
collective beat every ppermute schedule at every size, so it is the choice that
is never slow. The rule is a pure function of static information, so every
process of a job picks the same algorithm.
"""

from __future__ import annotations

import dataclasses

from jaxcoll._src.algorithms import HIERARCHICAL, NATIVE, check_algorithm


@dataclasses.dataclass(frozen=True)
class Hierarchical:
  """``algorithm=`` value: the hierarchical algorithm with a flat algorithm per axis.

  ``Hierarchical(("recursive_doubling", "ring"))`` on axis_name ("node", "local")
  runs the node stage with recursive doubling and the local stages with rings;
  ``None`` entries (and ``algorithm="hierarchical"``) use the default, "ring"
  ("direct" for all_to_all).
  """

  per_axis: tuple[str | None, ...] = ()


def resolve(primitive: str, algorithm, *, axis_sizes: tuple[int, ...],
            nbytes: int) -> tuple[str, dict]:
  """The concrete algorithm to run for one call and its schedule options."""
  del nbytes
  per_axis = None
  if isinstance(algorithm, Hierarchical):
    algorithm, per_axis = HIERARCHICAL, tuple(algorithm.per_axis) or None
  if not isinstance(algorithm, str):
    raise ValueError(f"algorithm={algorithm!r}: expected a name or jaxcoll.Hierarchical")
  check_algorithm(primitive, algorithm)
  if algorithm == HIERARCHICAL:
    if len(axis_sizes) < 2:
      raise ValueError(f"algorithm='hierarchical' runs over a tuple of mesh axes "
                       f"(outer, ..., inner); axis_name names one axis of size {axis_sizes[0]}")
    return HIERARCHICAL, {"axis_sizes": axis_sizes, "per_axis": per_axis}
  return (NATIVE if algorithm == "auto" else algorithm), {}
