"""Shape equations: broadcast, reshape, transpose, squeeze, slices, pads, concatenation, stack,
tile, dynamic slices, sort, split, and the ops that read a whole dimension (reverse, cumulative
ops, top_k). (:mod:`jaxcoll._src.use.rules`)."""

from __future__ import annotations

import jax

from jaxcoll._src.use.placement import Local, Placement, replicated, slicer_of
from jaxcoll._src.use.rules.elementwise import _join_dims, _ndim, _whole_dims

# ---- shapes ----

def _broadcast_in_dim(ev, eqn, ins):
  """Each operand dimension keeps its split where it maps to an output dimension of its size
  (a size-1 dimension broadcast wider is whole); new dimensions are whole."""
  x, *dyn = ins
  shape, bdims = eqn.params["shape"], eqn.params["broadcast_dimensions"]
  kept = tuple(a if eqn.invars[0].aval.shape[i] == shape[bdims[i]] else ()
               for i, a in enumerate(x.place.dims))
  dims = [()] * len(shape)
  for i, o in enumerate(bdims):
    dims[o] = kept[i]
  place = Placement(tuple(dims), x.place.partial)
  out = ev.bind(eqn, [ev.to(x, Placement(kept, x.place.partial)),
                      *[ev.to(v, replicated(0)) for v in dyn]],
                shape=ev.local_shape(shape, place))
  local = Local(out[0], place)
  if not dyn and not x.place.partial:   # a piece: the operand's piece broadcast to it
    def piece(target: Placement):
      own = tuple(target.dims[bdims[i]] if eqn.invars[0].aval.shape[i] == shape[bdims[i]]
                  else () for i in range(len(bdims)))
      return ev.bind(eqn, [ev.to(x, Placement(own))], shape=ev.local_shape(shape, target))[0]
    local.slicer = slicer_of(piece, [x])
  return [local]


def _reshape(ev, eqn, ins):
  (x,) = ins[:1]
  src_shape, dst_shape = eqn.invars[0].aval.shape, tuple(eqn.params["new_sizes"])
  groups = _reshape_groups(src_shape, dst_shape)
  src_dims = list(x.place.dims)
  dims = [()] * len(dst_shape)
  for (i0, i1), (o0, o1) in groups:
    major_i = next((i for i in range(i0, i1) if src_shape[i] != 1), i0)   # size 1 aside
    major_o = next((o for o in range(o0, o1) if dst_shape[o] != 1), o0)
    for i in range(i0, i1):
      axes = src_dims[i]
      if not axes:
        continue
      spread = _spread(ev, axes, dst_shape, major_o, o1) if i == major_i else None
      if spread is not None and not any(dims[o] for o in spread):
        for o, part in spread.items():   # the major block of the group stays a block
          dims[o] = part
      else:
        src_dims[i] = ()     # split elsewhere in its group: gathered first
  value = ev.to(x, Placement(tuple(src_dims), x.place.partial))
  place = Placement(tuple(dims), x.place.partial)
  out = ev.bind(eqn, [value], new_sizes=ev.local_shape(dst_shape, place), dimensions=None)
  return [Local(out[0], place)]


def _spread(ev, axes, dst_shape, o0: int, o1: int) -> dict | None:
  """How the axes splitting a major dimension split the dimensions ``o0:o1`` it becomes
  (``{dimension: axes}``), each device's block staying its block: the major axes, as many
  as there are whole indices of a dimension, take one index each of it, and the rest
  split the next; None where no such split exists (the dimension is gathered first)."""
  out, o = {}, o0
  while axes and o < o1:
    if dst_shape[o] % ev.count(axes) == 0:
      out[o] = axes
      return out
    k = next((k for k in range(len(axes) - 1, 0, -1)
              if ev.count(axes[:k]) == dst_shape[o]), None)
    if k is None:
      return None
    out[o], axes, o = axes[:k], axes[k:], o + 1
  return None


def _reshape_groups(src, dst):
  """Pairs of index ranges ``((i0, i1), (o0, o1))`` of ``src`` and ``dst`` dimensions with
  equal products, as small as possible (size-1 dimensions join the next group)."""
  groups, i, o = [], 0, 0
  while i < len(src) or o < len(dst):
    i0, o0 = i, o
    a = src[i] if i < len(src) else 1
    b = dst[o] if o < len(dst) else 1
    i, o = i + (i < len(src)), o + (o < len(dst))
    while a != b:
      if a < b and i < len(src):
        a *= src[i]
        i += 1
      elif o < len(dst):
        b *= dst[o]
        o += 1
      else:
        break
    groups.append(((i0, i), (o0, o)))
  return groups


def _transpose(ev, eqn, ins):
  (x,) = ins
  perm = eqn.params["permutation"]
  out = ev.bind(eqn, [x.value])
  return [Local(out[0], Placement(tuple(x.place.dims[p] for p in perm), x.place.partial))]


def _squeeze(ev, eqn, ins):
  (x,) = ins
  gone = set(eqn.params["dimensions"])
  out = ev.bind(eqn, [x.value])
  return [Local(out[0], Placement(tuple(a for d, a in enumerate(x.place.dims)
                                        if d not in gone), x.place.partial))]


def _expand_dims(ev, eqn, ins):
  (x,) = ins
  dims = list(x.place.dims)
  for d in sorted(eqn.params["dimensions"]):
    dims.insert(d, ())
  out = ev.bind(eqn, [x.value])
  return [Local(out[0], Placement(tuple(dims), x.place.partial))]


def _whole_along(params_dims, linear: bool):
  """An equation that runs locally once ``params_dims(eqn)`` of its first operand are whole
  (it cuts, reverses or scans across them); partial sums pass when ``linear``. A result
  shaped as the operand is split back as the operand was (a local slice), as jit keeps it."""
  def rule(ev, eqn, ins):
    x, *rest = ins
    dims = params_dims(eqn)
    target = _whole_dims(x.place, dims)
    if linear:
      target = Placement(target.dims, x.place.partial)
    values = [ev.to(x, target)] + [ev.to(r, replicated(r.place.ndim)) for r in rest]
    out = ev.bind(eqn, values)
    same = Placement(x.place.dims, target.partial)   # a result shaped as x: split back
    return [Local(ev.to(Local(o, target), same), same)
            if v.aval.shape == eqn.invars[0].aval.shape and same != target else
            Local(o, target if _ndim(o) == target.ndim else replicated(_ndim(o)))
            for o, v in zip(out, eqn.outvars)]
  return rule


def _slice(ev, eqn, ins):
  (x,) = ins
  shape = eqn.invars[0].aval.shape
  starts, limits = eqn.params["start_indices"], eqn.params["limit_indices"]
  strides = eqn.params["strides"] or (1,) * len(shape)
  full = [s == 0 and e == n and st == 1 for s, e, st, n in zip(starts, limits, strides, shape)]
  target = Placement(tuple(a if full[d] else () for d, a in enumerate(x.place.dims)),
                     x.place.partial)
  local = ev.local_shape(shape, target)
  out = ev.bind(eqn, [ev.to(x, target)],
                start_indices=tuple(0 if target.dims[d] else s for d, s in enumerate(starts)),
                limit_indices=tuple(local[d] if target.dims[d] else e
                                    for d, e in enumerate(limits)))
  return [Local(out[0], target)]


def _pad(ev, eqn, ins):
  x, value = ins
  config = eqn.params["padding_config"]
  target = Placement(tuple(a if c == (0, 0, 0) else () for a, c in zip(x.place.dims, config)))
  zero = isinstance(eqn.invars[1], jax.extend.core.Literal) and eqn.invars[1].val == 0
  if zero:
    target = Placement(target.dims, x.place.partial)
  out = ev.bind(eqn, [ev.to(x, target), ev.to(value, replicated(0))])
  return [Local(out[0], target)]


def _concatenate(ev, eqn, ins):
  d = eqn.params["dimension"]
  shape = eqn.outvars[0].aval.shape
  partials = {x.place.partial for x in ins}
  keep = partials.pop() if len(partials) == 1 else frozenset()
  dims = list(_join_dims(ev, [x.place for x in ins],
                         [n if i != d else 0 for i, n in enumerate(shape)], keep))
  dims[d] = ()
  target = Placement(tuple(dims), keep)
  out = ev.bind(eqn, [ev.to(x, target) for x in ins])
  return [Local(out[0], target)]


def _stack(ev, eqn, ins):
  """``jnp.stack`` (one primitive on jax >= 0.10): the operands joined on the splits they
  share; the new dimension whole."""
  axis = eqn.params["axis"]
  dims = _join_dims(ev, [x.place for x in ins], eqn.invars[0].aval.shape)
  target = Placement(dims)
  out = ev.bind(eqn, [ev.to(x, target) for x in ins])
  return [Local(out[0], Placement(dims[:axis] + ((),) + dims[axis:]))]


def _tile(ev, eqn, ins):
  """``jnp.tile``: a repeated dimension whole (a device's block repeated is not its block
  of the repetition), the others split as they are."""
  (x,) = ins
  reps = eqn.params["reps"]
  target = Placement(tuple(a if r == 1 else () for a, r in zip(x.place.dims, reps)))
  out = ev.bind(eqn, [ev.to(x, target)])
  return [Local(out[0], target)]


def _dynamic_slice(ev, eqn, ins):
  x, *index = ins
  shape, sizes = eqn.invars[0].aval.shape, eqn.params["slice_sizes"]
  target = Placement(tuple(a if sizes[d] == shape[d] else () for d, a in enumerate(x.place.dims)),
                     x.place.partial)
  out = ev.bind(eqn, [ev.to(x, target), *[ev.to(i, replicated(0)) for i in index]],
                slice_sizes=ev.local_shape(sizes, target))
  return [Local(out[0], target)]


def _dynamic_update_slice(ev, eqn, ins):
  x, update, *index = ins
  shape, ushape = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape
  keep = x.place.partial if x.place.partial == update.place.partial else frozenset()
  dims = _join_dims(ev, [x.place, update.place], shape, keep)
  dims = tuple(a if ushape[d] == shape[d] else () for d, a in enumerate(dims))
  target = Placement(dims, keep)
  out = ev.bind(eqn, [ev.to(x, target), ev.to(update, target),
                      *[ev.to(i, replicated(0)) for i in index]])
  return [Local(out[0], target)]


def _sort(ev, eqn, ins):
  d = eqn.params["dimension"]
  shape = eqn.invars[0].aval.shape
  dims = list(_join_dims(ev, [x.place for x in ins], shape))
  dims[d] = ()
  target = Placement(tuple(dims))
  out = ev.bind(eqn, [ev.to(x, target) for x in ins])
  return [Local(o, target) for o in out]


def _split(ev, eqn, ins):
  (x,) = ins
  d = eqn.params["axis"]
  target = _whole_dims(x.place, [d])
  target = Placement(target.dims, x.place.partial)
  return [Local(o, target) for o in ev.bind(eqn, [ev.to(x, target)])]
