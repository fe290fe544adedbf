"""Resolving ``algorithm="auto"``.

Until the cost-model dispatcher lands, "auto" is "native": measured on the
single-process CPU testbed (README, Performance), the jax.lax
collective beat every ppermute schedule at every size, so it is the choice that
is never slow. The rule is a pure function of static information, so every
process of a job picks the same algorithm.
"""

from __future__ import annotations

from jaxcoll._src.algorithms import NATIVE, check_algorithm


def resolve(primitive: str, algorithm: str, *, axis_size: int, nbytes: int) -> str:
  """The concrete algorithm to run for one call."""
  del axis_size, nbytes
  check_algorithm(primitive, algorithm)
  return NATIVE if algorithm == "auto" else algorithm
