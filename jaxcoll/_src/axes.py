"""Axis names inside shard_map: validation, sizes, and the rank order of a tuple of axes.

Over a tuple of axes jaxcoll numbers ranks as ``lax.axis_index(axes)`` does:
row-major over the tuple in the order given (``('z', 'y')``: z major). On
jax 0.10.2 ``lax.ppermute`` reads its ``perm`` over the same tuple in *mesh*
order instead (the axes sorted as the mesh lists them), so the executor maps
every pair through :func:`ppermute_index`; ``tests/test_axes.py`` pins both.
"""

from __future__ import annotations

import functools
import math

import jax
import numpy as np
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
  return axes


def sizes(axes: tuple[str, ...]) -> tuple[int, ...]:
  return tuple(lax.axis_size(a) for a in axes)


def size(axes: tuple[str, ...]) -> int:
  return math.prod(sizes(axes))


def ppermute_index(axes: tuple[str, ...]) -> np.ndarray | None:
  """``index[r]``: the number ``lax.ppermute`` gives the device of rank r (the
  ``lax.axis_index(axes)`` numbering); None where the two agree."""
  names = tuple(jax.sharding.get_abstract_mesh().axis_names)
  if len(axes) < 2 or not set(axes) <= set(names):
    return None
  return _ppermute_index(axes, sizes(axes), names)


def ppermute_perm(axes: tuple[str, ...], perm) -> tuple[tuple[int, int], ...]:
  """``perm`` (pairs of ranks in ``lax.axis_index`` numbering) as ``lax.ppermute`` reads it."""
  index = ppermute_index(axes)
  if index is None:
    return tuple(perm)
  return tuple((int(index[s]), int(index[d])) for s, d in perm)


@functools.lru_cache(maxsize=256)
def _ppermute_index(axes, shape, mesh_names) -> np.ndarray | None:
  order = sorted(range(len(axes)), key=lambda t: mesh_names.index(axes[t]))
  if order == list(range(len(axes))):
    return None
  coords = np.unravel_index(np.arange(math.prod(shape)), shape)
  return np.ravel_multi_index([coords[t] for t in order], [shape[t] for t in order])
