"""Marking a result that a schedule proved replicated as invariant over its axes.

``jax.lax.psum`` returns a value that is *invariant* over the reduced axes (it
may leave ``shard_map`` with ``out_specs=P()``), but every ``ppermute`` result
is *varying*, and JAX has no public varying-to-invariant cast. This module
defines the one private primitive jaxcoll needs for that: ``mark_invariant``,
the identity on values, whose abstract evaluation drops the axes from the
aval's varying set. Where nothing is typed (``check_vma=False``) a second one,
``replicated``, only marks the value for jaxpr readers.

Its transpose sends the (invariant) cotangent to rank 0 of the axes and zeros
elsewhere. For y = cast(S(x)) where the schedule S leaves every rank with the
same h(x), S's transpose sums the per-rank cotangents, so this gives exactly
h^T(ct): the cotangent of the lax collective, bit for bit.

It relies on jax internals (``jax.extend.core.Primitive``, ``aval.mat``,
``ad.deflinear2``, ``batching.primitive_batchers``, ``mlir.register_lowering``);
``tests/test_replicated.py`` fails loudly when a JAX release changes them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from jaxcoll._src import axes as axes_lib

mark_invariant_p = Primitive("jaxcoll_mark_invariant")
replicated_p = Primitive("jaxcoll_replicated")
REPLICATED_PRIMITIVES = (mark_invariant_p.name, replicated_p.name)


def mark_invariant(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
  """Returns x, typed invariant over ``axes`` (the caller guarantees equal values)."""
  varying = jax.typeof(x).mat.varying
  axes = tuple(a for a in axes if a in varying)
  return mark_invariant_p.bind(x, axes=axes) if axes else x


def replicated(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
  """x, marked as a value a schedule proved equal on every device of ``axes`` where nothing
  types it (``shard_map(check_vma=False)``): the identity in value, type, gradient and
  lowering, which the jaxpr walk of :mod:`jaxcoll._src.varying_axes` reads (what
  ``jaxcoll.data_parallel`` checks a step's outputs with)."""
  return replicated_p.bind(x, axes=tuple(axes))


def as_replicated(y, axes: tuple[str, ...], *, typed: bool = True):
  """y, which a schedule left equal on every device of ``axes``: typed invariant inside
  ``shard_map(check_vma=True)`` (unless ``typed`` is False: all_gather's ``to="varying"``),
  else marked for jaxpr readers (:func:`replicated`)."""
  if check_vma_enabled(axes):
    return mark_invariant(y, axes) if typed else y
  return replicated(y, axes)


def check_vma_enabled(axes: tuple[str, ...]) -> bool:
  """True inside ``shard_map(check_vma=True)``: there ``axis_index`` is typed varying."""
  return bool(axes) and axes[0] in jax.typeof(lax.axis_index(axes[0])).mat.varying


def varying_axes(*trees) -> tuple[str, ...]:
  """The mesh axes any leaf of ``trees`` is typed varying over (none outside a typed
  shard_map), sorted."""
  return tuple(sorted({a for leaf in jax.tree.leaves(trees)
                       for a in jax.typeof(leaf).mat.varying}))


def make_varying(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
  """``lax.pcast(x, ..., to='varying')`` over the axes of ``axes`` x is not yet varying in."""
  missing = tuple(a for a in axes if a not in jax.typeof(x).mat.varying)
  return lax.pcast(x, missing, to="varying") if missing else x


def _abstract_eval(aval, *, axes):
  return aval.update(manual_axis_type=aval.mat.update(varying=aval.mat.varying - set(axes)))


def _transpose(ct, x, *, axes):
  del x
  ct = make_varying(ct, axes)
  return (jnp.where(axes_lib.index(axes) == 0, ct, jnp.zeros_like(ct)),)


def _batch(vals, dims, *, axes):
  (x,), (d,) = vals, dims
  return mark_invariant_p.bind(x, axes=axes), d


mark_invariant_p.def_abstract_eval(_abstract_eval)
mark_invariant_p.def_impl(lambda x, *, axes: x)
mlir.register_lowering(mark_invariant_p, lambda ctx, x, *, axes: [x])
ad.deflinear2(mark_invariant_p, _transpose)
batching.primitive_batchers[mark_invariant_p] = _batch

replicated_p.def_abstract_eval(lambda aval, *, axes: aval)
replicated_p.def_impl(lambda x, *, axes: x)
mlir.register_lowering(replicated_p, lambda ctx, x, *, axes: [x])
ad.deflinear2(replicated_p, lambda ct, x, *, axes: (ct,))
batching.primitive_batchers[replicated_p] = (
    lambda vals, dims, *, axes: (replicated_p.bind(vals[0], axes=axes), dims[0]))
