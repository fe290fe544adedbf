"""Whether a traced program is a global one (computing on sharded values outside any
shard_map, as plain ``jax.jit`` over sharded arrays does) and, if so, the mesh axes ``use``
runs it per device over and the layouts of its inputs and outputs
(:func:`global_program`)."""

from __future__ import annotations

from jaxcoll._src.interpreter import form_of
from jaxcoll._src.use import evaluator as spmd
from jaxcoll._src.use.jit_arguments import (
  flat_shardings,
  jit_layouts,
  leaf_names,
  merge,
  typed_layouts,
)
from jaxcoll._src.use.options import Options
from jaxcoll._src.use.placement import from_spec
from jaxcoll.extend import ReportLine, axes_in_mesh, record_note


def global_program(opts: Options, closed, flat, in_tree, dynamic, out_tree):
  """``(mesh, manual axes, input placements, output placements or None, output shardings
  or None, the nested jaxprs' laid-out constants)`` when ``closed`` is a global program to
  run per device (:mod:`spmd`): it computes on sharded values outside any shard_map; None
  for a program of shard_maps (rewritten in place).

  ``flat``: the argument leaves that are arrays, at ``dynamic`` among ``in_tree``'s.
  Input layouts: ``use(in_shardings=)``, else a jitted function's own ``in_shardings``
  (``use(jax.jit(step, in_shardings=...))``), else the arguments' (concrete arrays', or
  Explicit-mode types'); output layouts: ``use(out_shardings=)``, else the jitted
  function's, else as plain ``jit`` lays them out."""
  if opts.axes == ():
    return None
  jit_in, jit_out = jit_layouts(closed.jaxpr)
  given_in = flat_shardings(opts.in_shardings, in_tree, "in_shardings")
  given_in = [given_in[i] for i in dynamic] if given_in else merge(jit_in, opts.in_flat)
  mesh = spmd.mesh_of(flat, given_in, leaf_names(in_tree, dynamic))
  if mesh is None:
    return None
  names = tuple(mesh.axis_names)
  islands = shard_map_axes(closed.jaxpr)
  nested = spmd.laid_out_consts(closed.jaxpr)
  consts = [*closed.consts, *nested]   # split constants split the program too
  if opts.axes is None:
    if not computes_outside_shard_map(closed.jaxpr):
      return None
    places = spmd.input_places([*flat, *consts], names, [*(given_in or [None] * len(flat)),
                                                         *[None] * len(consts)])
    split = {a for p in places for a in p.sharded if mesh.shape[a] > 1}   # 1: nothing to say
    manual = tuple(a for a in names if a in split or a in islands)
    if not manual:
      return None
  else:
    axes_in_mesh(opts.axes, mesh, "use(axes=...)")
    manual = tuple(a for a in names if a in opts.axes)
    if not islands <= set(manual):
      raise ValueError(f"use(axes={opts.axes!r}): the program holds a shard_map over "
                       f"{tuple(a for a in names if a in islands)}, whose axes use runs per "
                       f"device; expected axes naming {sorted(islands - set(manual))} too, "
                       "or axes=None (every axis the inputs and shard_maps use)")
    left = sorted({a for p in spmd.input_places(flat, names, given_in) for a in p.sharded}
                  - set(manual))
    if left:
      record_note(ReportLine.XLA, "partitioner", "inputs split over mesh axes use(axes=...) does "
                  "not take: XLA's partitioner communicates over them", left)
  places = spmd.input_places(flat, manual, given_in)
  given_out = merge(flat_shardings(opts.out_shardings, out_tree, "out_shardings") or jit_out,
                     typed_layouts(closed.jaxpr.outvars, manual))
  out_places = None if given_out is None else [
      from_spec(spmd.spec_of(s), len(v.aval.shape), manual) if s is not None else None
      for s, v in zip(given_out, closed.jaxpr.outvars)]
  return mesh, manual, places, out_places, given_out, nested


def computes_outside_shard_map(jaxpr) -> bool:
  """Whether a top-level equation (through nested jit) is anything but a shard_map."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in ("pjit", "jit"):
      if computes_outside_shard_map(form_of(eqn).body.jaxpr):
        return True
    elif eqn.primitive.name != "shard_map":
      return True
  return False


def shard_map_axes(jaxpr) -> set:
  """The axes of the shard_maps in ``jaxpr`` and its bodies (a shard_map's own body
  aside)."""
  out = set()
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "shard_map":
      out |= set(eqn.params["newly_manual_axes"])
      continue
    form = form_of(eqn)
    for body, _ in () if form is None else form.bodies:
      out |= shard_map_axes(body.jaxpr)
  return out
