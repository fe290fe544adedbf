"""``use``'s rules for the lax collectives of a shard_map program: each becomes the jaxcoll
collective with the same semantics (:data:`COLLECTIVES`), or stays with XLA (a rule gives
None: ``axis_index_groups``, axes that are no manual shard_map axes, a ppermute that is no
shift). JAX's casts between varying, unreduced and reduced types are :data:`CASTS`."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcoll._src.collectives import all_gather, all_reduce, all_to_all, reduce_scatter, shift
from jaxcoll.extend import as_axes


def _manual(params, key: str = "axis_name") -> tuple[str, ...] | None:
  """The equation's axes (``params[key]``) as a tuple when every one is a manual
  (shard_map) axis here and no ``axis_index_groups`` are given, else None."""
  axes = as_axes(params[key])
  manual = set(getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ()) or ())
  if not axes or not set(axes) <= manual or params.get("axis_index_groups") is not None:
    return None
  return axes


def left_because(params) -> str:
  """Why a lax collective stays with XLA (:func:`_manual` gave None)."""
  if params.get("axis_index_groups") is not None:
    return "axis_index_groups has no jaxcoll equivalent"
  if "perm" in params and _manual(params) is not None:
    return "a permutation that is not a shift"
  return "its axes are not manual shard_map axes here (vmap or pmap names)"


# ---- lax collective -> jaxcoll collective (None: leave the equation as it is) ----

def _reduce(op: str):
  def rule(opts, invals, params):
    axes = _manual(params, "axes")
    if axes is None:
      return None
    return [all_reduce(x, axes, op=op,
                       **opts.wire_for("all_reduce", x.dtype, op, jnp.size(x)),
                       algorithm=opts.algorithm_for("all_reduce", axes))
            for x in invals]
  return rule


def _all_gather(to: str):
  def rule(opts, invals, params):
    axes = _manual(params)
    if axes is None:
      return None
    (x,) = invals
    return [all_gather(x, axes, axis=params["all_gather_dimension"], tiled=params["tiled"],
                       to=to, **opts.wire_for("all_gather", x.dtype, size=jnp.size(x)),
                       algorithm=opts.algorithm_for("all_gather", axes))]
  return rule


def _reduce_scatter(opts, invals, params):
  axes = _manual(params)
  if axes is None:
    return None
  (x,) = invals
  return [reduce_scatter(x, axes, scatter_dimension=params["scatter_dimension"],
                         tiled=params["tiled"],
                         **opts.wire_for("reduce_scatter", x.dtype, size=jnp.size(x)),
                         algorithm=opts.algorithm_for("reduce_scatter", axes))]


def _all_to_all(opts, invals, params):
  """The primitive splits ``split_axis`` into N blocks and concatenates them along
  ``concat_axis`` whatever its ``tiled`` flag (lax.all_to_all reshapes around it)."""
  axes = _manual(params)
  if axes is None:
    return None
  (x,) = invals
  return [all_to_all(x, axes, params["split_axis"], params["concat_axis"],
                     tiled=True, algorithm=opts.algorithm_for("all_to_all", axes))]


def shift_of(perm, n: int) -> tuple[int, bool] | None:
  """``(offset, wrap)`` when ``perm`` sends every rank i to i + offset (mod n with wrap;
  without wrap, every rank whose destination exists), else None."""
  perm = sorted((int(s), int(d)) for s, d in perm)
  if not perm:
    return None
  offset = perm[0][1] - perm[0][0]
  if perm == [(i, (i + offset) % n) for i in range(n)]:
    return offset % n, True
  if perm == [(i, i + offset) for i in range(n) if 0 <= i + offset < n]:
    return offset, False
  return None


def _ppermute(opts, invals, params):
  axes = _manual(params)
  if axes is None:
    return None
  names = tuple(jax.sharding.get_abstract_mesh().axis_names)
  axes = tuple(sorted(axes, key=names.index))   # ppermute reads perm in mesh order
  found = shift_of(params["perm"], int(np.prod([lax.axis_size(a) for a in axes])))
  if found is None:
    return None
  offset, wrap = found
  (x,) = invals
  return [shift(x, axes, offset, wrap=wrap, algorithm=opts.algorithm_for("shift", axes))]


def _pvary(opts, invals, params):
  """JAX's invariant-to-varying cast, as :func:`varying.vary`: its transpose (the gradient sum
  of a replicated value) runs as jaxcoll's all_reduce. Inside a global program run per
  device (:mod:`spmd`, nothing typed) the cast is the identity."""
  axes = _manual(params, "axes")
  if axes is None:
    return None
  return [opts.vary(x, axes) if opts.casts else x for x in invals]


def _untyped(rule: Callable) -> Callable:
  """A collective over JAX's ``unreduced``/``reduced`` types, rewritten inside a global
  program run per device (nothing typed there: it is the plain collective); elsewhere left
  to XLA, its result typed as jax types it."""
  def wrapped(opts, invals, params):
    return None if opts.casts else rule(opts, invals, params)
  return wrapped


COLLECTIVES: dict[str, Callable] = {
    "pvary": _pvary,
    "psum": _reduce("sum"), "psum_invariant": _reduce("sum"),
    "pmax": _reduce("max"), "pmin": _reduce("min"),
    "all_gather": _all_gather("varying"), "all_gather_invariant": _all_gather("invarying"),
    "reduce_scatter": _reduce_scatter, "all_to_all": _all_to_all, "ppermute": _ppermute,
    "unreduced_psum": _untyped(_reduce("sum")),
    "unreduced_reduce_scatter": _untyped(_reduce_scatter),
    "all_gather_reduced": _untyped(_all_gather("varying")),
}

# JAX's casts between varying, unreduced and reduced types: no data moves (the names carry a
# "_p" on jax 0.10). Inside a global program run per device they are the identity.
CASTS = frozenset({"vary_unreduced_cast", "vary_unreduced_cast_p", "reduced_vary_cast",
                   "reduced_vary_cast_p", "preduced"})
