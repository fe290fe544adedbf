"""Axis names inside shard_map: validation, sizes, and the rank order of a tuple of axes.

Over a tuple of axes jaxcoll numbers ranks as ``lax.axis_index(axes)`` does:
row-major over the tuple in the order given (``('z', 'y')``: z major). ``lax.ppermute``
over a tuple reads its ``perm`` in *mesh* order (the axes sorted as the mesh lists them):
jax 0.10.2 does so whatever order the tuple is given in, jax 0.12 accepts only a tuple in
mesh order. :func:`ppermute_args` gives the tuple in mesh order and every pair renumbered;
``tests/test_multi_axis.py::test_axis_index_and_ppermute_number_a_tuple_differently`` pins
both versions' behaviour.
"""

from __future__ import annotations

import functools
import math

import jax
import numpy as np
from jax import lax

from jaxcoll._src import checks


def normalize(axis_name) -> tuple[str, ...]:
  """``axis_name`` as a tuple of mesh axis names, checked against the enclosing shard_map."""
  axes = checks.axis_tuple(axis_name)
  mesh = jax.sharding.get_abstract_mesh()
  bound = tuple(getattr(mesh, "manual_axes", ()) or ())
  for a in axes:
    if a in bound:
      continue
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
  """The sizes of ``axes``: a manual mesh axis's from the mesh traced now (no equation),
  any other (vmap's, pmap's) from ``lax.axis_size``."""
  mesh = jax.sharding.get_abstract_mesh()
  manual = set(getattr(mesh, "manual_axes", ()) or ())
  shape = dict(zip(mesh.axis_names, mesh.axis_sizes)) if manual else {}
  return tuple(shape[a] if a in manual else lax.axis_size(a) for a in axes)


def size(axes: tuple[str, ...]) -> int:
  return math.prod(sizes(axes))


def index(axes) -> jax.Array:
  """``lax.axis_index(axes)`` (the first axis major), built from one ``axis_index`` per axis
  and integer arithmetic: a tuple's ``lax.axis_index`` traces many more equations, and
  integrations take it for every slice and every collective."""
  axes = checks.as_axes(axes)
  out = None
  for a, n in zip(axes, sizes(axes)):
    i = lax.axis_index(a)
    out = i if out is None else out * n + i
  return out


Perm = tuple[tuple[int, int], ...]


def ppermute_args(axes: tuple[str, ...], perm) -> tuple[tuple[str, ...], Perm]:
  """``(axis_name, perm)`` to pass ``lax.ppermute`` for ``perm``, pairs of ranks numbered as
  ``lax.axis_index(axes)`` numbers them.

  The tuple goes to ppermute in mesh order, the one form every supported jax reads the same
  way (jax 0.12 rejects any other order; 0.10.2 reads ``perm`` in mesh order whatever order
  the tuple has), and every pair is renumbered into that order.
  """
  names = tuple(jax.sharding.get_abstract_mesh().axis_names)
  perm = tuple((int(s), int(d)) for s, d in perm)
  if len(axes) < 2 or not set(axes) <= set(names):
    return axes, perm
  ordered, index = _mesh_order(axes, sizes(axes), names)
  if index is None:
    return axes, perm
  return ordered, tuple((int(index[s]), int(index[d])) for s, d in perm)


@functools.lru_cache(maxsize=256)
def _mesh_order(axes, shape, mesh_names) -> tuple[tuple[str, ...], np.ndarray | None]:
  """The axes in mesh order, and ``index[r]``: rank r's number in that order (None when the
  two numberings agree)."""
  order = sorted(range(len(axes)), key=lambda t: mesh_names.index(axes[t]))
  ordered = tuple(axes[t] for t in order)
  if order == list(range(len(axes))):
    return ordered, None
  coords = np.unravel_index(np.arange(math.prod(shape)), shape)
  return ordered, np.ravel_multi_index([coords[t] for t in order], [shape[t] for t in order])
