"""Sharding annotations (``sharding_constraint``, ``reshard``, ``mesh_cast``), equations that pass
their inputs through, and the layout an equation asks for its outputs.
(:mod:`jaxcoll._src.use.rules`)."""

from __future__ import annotations

from jaxcoll._src import compat
from jaxcoll._src.use.placement import Local, Placement, explicit, from_spec, replicated

ANNOTATIONS = frozenset({"sharding_constraint", "reshard", "mesh_cast"})

# ---- sharding annotations ----

def _sharding_param(eqn):
  for key in ("sharding", "dst_sharding", "out_sharding"):
    if eqn.params.get(key) is not None:
      return eqn.params[key]
  return None


def asked(ev, eqn) -> Placement | None:
  """The placement a sharding annotation moves its operand to (over the manual axes), or
  None where it moves nothing: no sharding, or a cast into Auto axes (a ``reshard``/
  ``mesh_cast`` leaving an ``explicit_axes`` function: the type no longer says where the
  value is, and it stays where it is). A split that does not divide the value is whole."""
  if eqn.primitive.name not in ANNOTATIONS:
    return None
  sharding = _sharding_param(eqn)
  mesh = getattr(sharding, "mesh", None)
  if mesh is not None and not set(ev.manual) & set(mesh.axis_names):
    raise ValueError(
        f"use: {eqn.primitive.name} at {compat.source_line(eqn)} moves a value to a mesh of "
        f"axes {tuple(mesh.axis_names)} (jax.sharding.use_abstract_mesh), while use runs the "
        f"program per device over {ev.manual}; expected one mesh for the whole program "
        "(run this one under jax.jit)")
  if sharding is None or (eqn.primitive.name != "sharding_constraint" and
                          not explicit(mesh, ev.manual)):
    return None
  shape = eqn.invars[0].aval.shape
  target = from_spec(getattr(sharding, "spec", None), len(shape), ev.manual)
  return target if ev.splits(shape, target) else replicated(len(shape))


def _to_named(ev, eqn, ins):
  """A sharding annotation: the value moved to the placement it names (:func:`asked`), or
  as it is where it names none."""
  (x,) = ins[:1]
  target = asked(ev, eqn)
  return [x] if target is None else [Local(ev.to(x, target), target)]


def laid_out_as_asked(ev, eqn, outs: list) -> list:
  """An equation's result moved where its ``out_sharding`` puts it (Explicit mode: a
  contraction over a split dimension asked for split), when it names one; the rules compute
  without it. A partial sum asked whole is left partial (reduced when read, in buckets)."""
  sharding = eqn.params.get("out_sharding")
  mesh = getattr(sharding, "mesh", None)
  if len(outs) != 1 or mesh is None or not explicit(mesh, ev.manual):
    return outs   # Auto axes: a type's spec says nothing about where values must be
  spec = sharding.spec
  (x,) = outs
  target = from_spec(spec, x.place.ndim, ev.manual)
  if not ev.splits(eqn.outvars[0].aval.shape, target) or target.dims == x.place.dims:
    return outs   # a partial sum asked whole stays partial: reduced later, with the others
  return [Local(ev.to(x, target), target)]


def _identity(ev, eqn, ins):
  """An equation whose outputs are its inputs (a name for a remat policy, a barrier, a
  placement on a device): each output the same value as its input, split as it is (a
  partial sum stays one, the same one: :mod:`partials`)."""
  outs = ev.bind(eqn, [x.value for x in ins])
  return [Local(o, x.place, origin=x.origin, key=x.key) for o, x in zip(outs, ins)]
