"""Validating axis names inside shard_map."""

from __future__ import annotations

import math

import jax
from jax import lax


def normalize(axis_name) -> tuple[str, ...]:
  """``axis_name`` as a tuple of mesh axis names, checked against the enclosing shard_map."""
  axes = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
  if not axes:
    raise ValueError("axis_name must name at least one mesh axis, got ()")
  if len(set(axes)) != len(axes):
    raise ValueError(f"axis_name {axis_name!r} repeats an axis")
  mesh = jax.sharding.get_abstract_mesh()
  bound = tuple(getattr(mesh, "manual_axes", ()) or ())
  for a in axes:
    try:
      lax.axis_size(a)
    except (NameError, KeyError, ValueError) as e:
      if not bound:
        raise ValueError(
            f"axis_name={a!r}: jaxcoll collectives run inside jax.shard_map over a mesh axis; "
            "no shard_map (manual) axis is bound here") from e
      raise ValueError(f"axis_name={a!r} is not an axis of the enclosing shard_map; "
                       f"bound axes: {bound}") from e
  if len(axes) > 1:
    raise NotImplementedError(f"axis_name={axis_name!r}: collectives over a tuple of axes are "
                              "not supported yet; pass one mesh axis name")
  return axes


def size(axes: tuple[str, ...]) -> int:
  return math.prod(lax.axis_size(a) for a in axes)
