"""Argument checks: one function per kind of check, shared by every public entry point.

Each raises at trace time (before anything runs) a ``ValueError`` (``TypeError`` for a value
of the wrong kind) that starts with the argument as the user wrote it and its value, then
what was expected: ``axis_name='y' is not an axis of the mesh; its axes: ('x',)``. Callers
pass ``where``, the argument's name as the user wrote it.

The kinds: axis names (:func:`axis_tuple`), meshes and axes in them (:func:`mesh_shape`,
:func:`axes_in_mesh`), accumulation dtypes (:func:`accumulate`), integers and numbers in a
range (:func:`integer`, :func:`number`), flags (:func:`flag`), one of a few values
(:func:`choice`) and dtypes (:func:`dtype`, :func:`floating`). Wire format names are checked
by :func:`jaxcoll._src.wire.formats.wire_format`, op names by
:func:`jaxcoll._src.ops.check_op`, primitives by :func:`jaxcoll._src.spec.spec`, algorithms
by the registry's ``check_algorithm``.
Nothing here imports jaxcoll's runtime (executor, collectives).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import jax
import ml_dtypes
import numpy as np


def as_axes(names) -> tuple:
  """One mesh axis name, a tuple or list of them, or None (no axis) as a tuple, unchecked:
  how jaxpr parameters and PartitionSpec entries name axes."""
  if names is None:
    return ()
  return tuple(names) if isinstance(names, (tuple, list)) else (names,)


def axis_tuple(axis_name, where: str = "axis_name") -> tuple:
  """``axis_name`` (a mesh axis name, or a tuple or list of them) as a tuple: not empty,
  no repeats, every name a string."""
  axes = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
  if not axes:
    raise ValueError(f"{where}={axis_name!r}: expected at least one mesh axis name")
  for a in axes:
    if not isinstance(a, str):
      raise TypeError(f"{where}={axis_name!r}: expected a mesh axis name (a str) or a tuple "
                      f"of them; {a!r} is a {type(a).__name__}")
  if len(set(axes)) != len(axes):
    raise ValueError(f"{where}={axis_name!r} repeats an axis")
  return axes


def mesh_shape(mesh, where: str = "mesh", *, mapping: bool = False) -> dict:
  """``{axis name: size}`` of ``mesh``: a ``jax.sharding.Mesh`` or ``AbstractMesh`` (with
  ``mapping``, also a ``{axis name: size}`` mapping)."""
  if mapping and isinstance(mesh, Mapping):
    shape = dict(mesh)
    for a, s in shape.items():
      if not isinstance(a, str) or isinstance(s, bool) or not isinstance(s, (int, np.integer)) \
          or s < 1:
        raise ValueError(f"{where}={mesh!r}: expected {{axis name: positive int}}")
    return {a: int(s) for a, s in shape.items()}
  if not (hasattr(mesh, "axis_names") and hasattr(mesh, "shape")):
    forms = "a jax.sharding.Mesh" + (" or {axis name: size}" if mapping else "")
    raise TypeError(f"{where}={mesh!r}: expected {forms}")
  return {a: int(s) for a, s in dict(mesh.shape).items()}


def axes_in_mesh(axis_name, mesh, where: str = "axis_name", *, mesh_where: str = "mesh",
                 mapping: bool = False) -> tuple[tuple, tuple[int, ...]]:
  """``(axes, their sizes)``: ``axis_name`` as a tuple (:func:`axis_tuple`), every axis one of
  ``mesh``'s (:func:`mesh_shape`)."""
  shape = mesh_shape(mesh, mesh_where, mapping=mapping)
  axes = axis_tuple(axis_name, where)
  for a in axes:
    if a not in shape:
      raise ValueError(f"{where}={a!r} is not an axis of the mesh; its axes: {tuple(shape)}")
  return axes, tuple(shape[a] for a in axes)


def dtype(value, where: str) -> np.dtype:
  """``value`` (a dtype, a dtype's name, a scalar type) as a numpy dtype."""
  try:
    return np.dtype(getattr(ml_dtypes, value, value) if isinstance(value, str) else value)
  except (TypeError, ValueError, SyntaxError, AssertionError):   # numpy's parse errors vary
    raise TypeError(f"{where}={value!r}: expected a dtype (e.g. 'float32')") from None


def is_floating(d) -> bool:
  """Whether ``d`` (a numpy dtype, ml_dtypes' included) is a real floating type."""
  d = np.dtype(d)
  return d.kind == "f" or d.name == "bfloat16" or d.name.startswith("float8")


def floating(value, where: str) -> np.dtype | None:
  """``value`` as a real floating dtype (None stays None)."""
  if value is None:
    return None
  d = dtype(value, where)
  if not is_floating(d):
    raise ValueError(f"{where}={d.name}: expected a floating dtype such as 'float32'")
  return d


def accumulate(value, data_dtype, where: str = "accumulate_dtype") -> np.dtype | None:
  """The accumulation dtype for data of ``data_dtype``, None where it changes nothing (None,
  or the data's own dtype). It must be floating, for floating data, and hold every value
  of the data's dtype at least as precisely: no fewer mantissa bits, no smaller range."""
  acc, data = floating(value, where), np.dtype(data_dtype)
  if acc is None:
    return None
  if acc.itemsize == 8 and not jax.config.jax_enable_x64:
    raise ValueError(f"{where}={acc.name} needs 64-bit types, which JAX computes as 32-bit "
                     "unless x64 is on (JAX_ENABLE_X64=1 / jax.config.update('jax_enable_x64', "
                     "True))")
  if not is_floating(data):
    raise ValueError(f"{where}={acc.name} applies to real floating data; x has dtype "
                     f"{data.name}")
  a, d = ml_dtypes.finfo(acc), ml_dtypes.finfo(data)
  if a.nmant < d.nmant or a.maxexp < d.maxexp or a.minexp > d.minexp:
    raise ValueError(f"{where}={acc.name} is narrower than the data's dtype {data.name} (fewer "
                     "mantissa bits or a smaller range: partial sums would lose what the data "
                     f"holds); expected {data.name} or wider, e.g. 'float32'")
  return None if acc == data else acc


def integer(value, where: str, *, least: int | None = None, most: int | None = None) -> int:
  """``value`` as an int in ``[least, most]`` (bools are not integers here)."""
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise TypeError(f"{where}={value!r}: expected an int{_range(least, most)}")
  if (least is not None and value < least) or (most is not None and value > most):
    raise ValueError(f"{where}={value!r}: expected an int{_range(least, most)}")
  return int(value)


def number(value, where: str, *, least: float | None = None, above: float | None = None) -> float:
  """``value`` as a finite float, at least ``least`` or strictly above ``above``."""
  if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
    raise TypeError(f"{where}={value!r}: expected a number{_bound(least, above)}")
  v = float(value)
  if not math.isfinite(v) or (least is not None and v < least) or \
      (above is not None and v <= above):
    raise ValueError(f"{where}={value!r}: expected a finite number{_bound(least, above)}")
  return v


def flag(value, where: str) -> bool:
  """``value`` as a bool: True or False only (not 0/1, not a string)."""
  if not isinstance(value, (bool, np.bool_)):
    raise TypeError(f"{where}={value!r}: expected True or False")
  return bool(value)


def choice(value, options: tuple, where: str):
  """``value`` if it is one of ``options``."""
  try:
    ok = value in options
  except TypeError:   # unhashable or incomparable
    ok = False
  if not ok:
    raise ValueError(f"{where}={value!r}: expected one of {options}")
  return value


def _range(least, most) -> str:
  if least is not None and most is not None:
    return f" in [{least}, {most}]"
  if least is not None:
    return {0: " >= 0", 1: " >= 1 (positive)"}.get(least, f" >= {least}")
  return f" <= {most}" if most is not None else ""


def _bound(least, above) -> str:
  return f" >= {least}" if least is not None else f" > {above}" if above is not None else ""

