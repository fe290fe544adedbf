"""``gather`` and ``scatter-add``: embedding lookups, picked labels and their gradients.
(:mod:`jaxcoll._src.use.rules`)."""

from __future__ import annotations

from jaxcoll._src.use.placement import Local, Placement

# ---- gather, scatter-add ----

def _gather(ev, eqn, ins):
  operand, indices = ins
  dn = eqn.params["dimension_numbers"]
  slice_sizes = eqn.params["slice_sizes"]
  oshape, ishape = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape
  collapsed = set(dn.collapsed_slice_dims) | set(dn.operand_batching_dims)
  indexed = set(dn.start_index_map) | collapsed
  offset = [d for d in range(len(oshape)) if d not in collapsed]
  odims = [() if d in indexed or slice_sizes[d] != oshape[d] else a
           for d, a in enumerate(operand.place.dims)]
  used = {a for axes in odims for a in axes} | set(operand.place.partial)   # no axis twice
  paired = _batching_pairs(ev, operand.place, indices.place, oshape, used,
                           dn.operand_batching_dims, dn.start_indices_batching_dims)
  for od, _, axes in paired:   # row i of the operand is read by row i of the indices
    odims[od] = axes
  batch = [d for d in range(len(ishape) - 1)]   # the last dimension is the index vector
  own = {idim: axes for _, idim, axes in paired}
  idims = [own[d] if d in own else () if d in dn.start_indices_batching_dims or used & set(a)
           else a for d, a in enumerate(indices.place.dims[:-1])] + [()]
  op_target = Placement(tuple(odims), operand.place.partial)
  ix_target = Placement(tuple(idims))
  values = [ev.to(operand, op_target), ev.to(indices, ix_target)]
  out_ndim = len(eqn.outvars[0].aval.shape)
  out_dims = [()] * out_ndim
  for o, d in zip(dn.offset_dims, offset):
    out_dims[o] = odims[d]
  rest = [o for o in range(out_ndim) if o not in dn.offset_dims]
  for o, d in zip(rest, batch):
    out_dims[o] = idims[d]
  out = ev.bind(eqn, values, slice_sizes=tuple(   # a batching dimension's slice stays 1
      s // ev.count(odims[d])
      if odims[d] and d not in dn.operand_batching_dims else s
      for d, s in enumerate(slice_sizes)))
  return [Local(out[0], Placement(tuple(out_dims), operand.place.partial))]


def _batching_pairs(ev, op: Placement, ix: Placement, oshape, used: set, op_dims, ix_dims):
  """``(operand dim, indices dim, axes)`` for each pair of batching dimensions (a gather's or
  scatter's row i of the operand goes with row i of the indices: take_along_axis, a
  cross-entropy's label lookup) split alike, by either side's axes that no other dimension
  uses and that divide it; adds them to ``used``."""
  out = []
  for od, idim in zip(op_dims, ix_dims):
    axes = op.dims[od] or ix.dims[idim]
    if axes and not used & set(axes) and oshape[od] % ev.count(axes) == 0:
      out.append((od, idim, axes))
      used |= set(axes)
  return out


def _scatter_add(ev, eqn, ins):
  operand, indices, updates = ins
  dn = eqn.params["dimension_numbers"]
  oshape = eqn.invars[0].aval.shape
  ushape = eqn.invars[2].aval.shape
  indexed = set(dn.scatter_dims_to_operand_dims) | set(dn.inserted_window_dims)
  window_operand = [d for d in range(len(oshape)) if d not in dn.inserted_window_dims
                    and d not in dn.operand_batching_dims]
  # updates: window dims follow the operand's; scatter (batch) dims follow the indices'
  udims = [()] * len(ushape)
  odims = [()] * len(oshape)
  for u, d in zip(dn.update_window_dims, window_operand):
    if d not in indexed and ushape[u] == oshape[d]:
      axes = operand.place.dims[d] or updates.place.dims[u]
      udims[u] = odims[d] = axes
  used = {a for axes in odims for a in axes}
  scatter_dims = [u for u in range(len(ushape)) if u not in dn.update_window_dims]
  idims = [()] * len(eqn.invars[1].aval.shape)
  paired = _batching_pairs(ev, operand.place, indices.place, oshape, used,
                           dn.operand_batching_dims, dn.scatter_indices_batching_dims)
  for od, k, axes in paired:   # each device writes its own rows: nothing summed across
    odims[od] = idims[k] = udims[scatter_dims[k]] = axes
  for k, u in enumerate(scatter_dims):
    if k in dn.scatter_indices_batching_dims:
      continue
    axes = updates.place.dims[u] or (indices.place.dims[k] if k < len(idims) - 1 else ())
    if axes and not used & set(axes):
      udims[u] = axes
      if k < len(idims) - 1:
        idims[k] = axes
      used |= set(axes)
  summed = frozenset(a for u in scatter_dims for a in udims[u])
  partial = (operand.place.partial | updates.place.partial | summed) - \
      {a for axes in odims for a in axes}
  op_target = Placement(tuple(odims), partial)   # a whole operand becomes a partial sum
  up_target = Placement(tuple(udims), updates.place.partial & partial)
  values = [ev.to(operand, op_target), ev.to(indices, Placement(tuple(idims))),
            ev.to(updates, up_target)]
  out = ev.bind(eqn, values)
  return [Local(out[0], op_target)]
