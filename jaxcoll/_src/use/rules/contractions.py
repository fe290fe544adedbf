"""``dot_general`` and the reductions (sum, max, min, prod, and/or, argmax/argmin).
(:mod:`jaxcoll._src.use.rules`)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxcoll._src.collective_matmul import (
  all_gather_matmul,
  matmul_all_reduce,
  matmul_reduce_scatter,
)
from jaxcoll._src.collectives import all_reduce
from jaxcoll._src.use.placement import Local, Placement, slicer_of

# ---- dot_general ----

def _where(place: Placement, axis: str):
  """The dimension ``axis`` splits in ``place``, "partial", or None (whole over it)."""
  for d, axes in enumerate(place.dims):
    if axis in axes:
      return d
  return "partial" if axis in place.partial else None


def _move_bytes(cur, target, piece: float, n: int) -> float:
  """What one device receives to move a piece of ``piece`` bytes from ``cur`` to ``target``
  along an axis of n devices (:func:`_where`'s terms): a slice is free, an all-gather
  receives n-1 pieces, an all-to-all (n-1)/n of one, an all-reduce twice that, a
  reduce-scatter once."""
  if cur == target or cur is None:
    return 0.0
  if cur == "partial":
    return (2 if target is None else 1) * piece * (n - 1) / n
  return piece * (n - 1) if target is None else piece * (n - 1) / n


def _one_sided(lhs: Local, rhs: Local, lc, rc, cl, cr, out_piece: float) -> list:
  """Where only one operand is split over an axis, on a contracting dimension, and the other
  is whole over it: the roles jit's partitioner weighs. Beside a whole operand the program
  was given (a parameter laid out by its caller), the split operand is gathered where its
  whole is no larger than the product (each device then holds the product whole), else the
  contraction is split (the product a partial sum, all-reduced: the smaller of the two
  values crosses the wire). Beside a whole operand the program computes, the contraction is
  split: jit's partitioner propagates the split into the equations that make it, dividing
  their work too. Empty elsewhere."""
  for split, other, mine, theirs, whole in ((cl, cr, lc, rc, rhs), (cr, cl, rc, lc, lhs)):
    if isinstance(split, int) and split in mine and other is None:
      pair = (split, theirs[mine.index(split)])
      pair = pair if split == cl else pair[::-1]
      piece = (lhs if whole is rhs else rhs).nbytes
      if whole.given and piece <= out_piece:
        return [(None, None)]
      return [pair, (None, None)]
  return []


def _summed_later(ev, a: str, others, out_bytes: float, involved: int) -> float:
  """What each device receives beyond what it would anyway when a product that is a sum
  over the axes ``others`` (m devices) stays a sum over ``a`` too (n devices): its
  all-reduce then spans m*n devices, each receiving 2 (mn-1)/mn of its piece instead of
  2 (m-1)/m, that is 2 (n-1)/(mn) more. The piece: ``out_bytes`` (the whole product) over
  the ``involved`` devices that do not sum it (each axis splits the product or sums it)."""
  m, n = ev.count(others), ev.sizes[a]
  local = out_bytes * m * n / involved
  return 2 * local * (n - 1) / (m * n)


def _local_bytes(ev, var, place: Placement) -> float:
  return float(np.prod(ev.local_shape(var.aval.shape, place))) * var.aval.dtype.itemsize


def _dot_general(ev, eqn, ins):
  """Each mesh axis either splits a pair of batch dimensions, a pair of contracting ones
  (the result a partial sum over it), a free dimension of one operand (the other whole
  over it), or nothing (both whole; or one operand left a partial sum, the result then
  partial too). As XLA's partitioner does, a role that leaves both operands where they are
  wins (a data-parallel weight gradient stays a partial sum, reduced later with the others
  in buckets); else one that leaves an operand split on a batch or free dimension where it
  is (the result stays split: the work stays divided, where a whole result would have
  every later equation repeated on every device); then whichever moves the fewest bytes
  (:func:`_move_bytes`; a partial result priced as its all-reduce). An FSDP weight beside
  a batch-split activation, split on either of its dimensions, is thus gathered, the
  activation left where it is. Two cases are weighed by size, as jit's partitioner weighs
  them: an operand split over the axis on a contracting dimension beside one whole over it
  is gathered where it is no larger than the product, else contracted in parts
  (:func:`_one_sided`); an operand that is a sum over the axis beside one whole over it is
  reduced first where keeping the product a sum would cost its later all-reduce more
  (:func:`_summed_later`; a sum the size of a batch of activations times a small weight
  stays a sum). An axis neither operand uses leaves the product whole over
  it, as jit's is (splitting it would divide the work, but every reader that needs it
  whole would then gather it); the product carries a slicer instead, so that a reader
  split over the axis computes only its own part (:func:`_dot_piece`)."""
  (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
  lhs, rhs = ins
  L, R = lhs.place, rhs.place
  lvar, rvar, ovar = eqn.invars[0], eqn.invars[1], eqn.outvars[0]
  lshape, rshape = lvar.aval.shape, rvar.aval.shape
  lfree = [d for d in range(L.ndim) if d not in lc and d not in lb]
  rfree = [d for d in range(R.ndim) if d not in rc and d not in rb]
  roles = [*zip(lb, rb), *[(d, None) for d in lfree], *[(None, d) for d in rfree],
           *zip(lc, rc), (None, None)]   # in a tie, no partial result
  order = [a for p in (L, R) for axes in p.dims for a in axes] + sorted(L.partial | R.partial)
  axes = list(dict.fromkeys(order))
  piece_l, piece_r = _local_bytes(ev, lvar, L), _local_bytes(ev, rvar, R)
  involved = ev.count(axes)
  out_piece = float(np.prod(ovar.aval.shape)) * ovar.aval.dtype.itemsize / involved
  ldims, rdims = [[] for _ in lshape], [[] for _ in rshape]
  keep_l, keep_r, summed = set(), set(), set()

  def fits(dims, shape, d, n):
    return d is None or shape[d] % (ev.count(dims[d]) * n) == 0

  one = L.partial and R.partial and ev.one_sum(lhs, rhs)
  for a in axes:
    n = ev.sizes[a]
    cl, cr = _where(L, a), _where(R, a)
    reduce_out = 2 * out_piece * (n - 1) / n
    best = None
    for ld, rd in _one_sided(lhs, rhs, lc, rc, cl, cr, out_piece) or roles:
      if not (fits(ldims, lshape, ld, n) and fits(rdims, rshape, rd, n)):
        continue
      moved = _move_bytes(cl, ld, piece_l, n) + _move_bytes(cr, rd, piece_r, n)
      if (ld, rd) == (None, None) and cl == cr == "partial" and one:   # g @ g.T: reduced once
        moved = _move_bytes("partial", None, max(piece_l, piece_r), n)
      kept = (ld is not None and ld == cl and ld not in lc) or \
          (rd is not None and rd == cr and rd not in rc)   # an operand's row split stays
      options = [((moved > 0, moved > 0 and not kept,
                   moved + (reduce_out if ld in lc and ld is not None else 0)), None)]
      if (ld, rd) == (None, None):   # one operand may stay a sum: so is the product
        for mine, other, piece, side in ((cl, cr, piece_l, "l"), (cr, cl, piece_r, "r")):
          if mine == "partial" and other is None:
            extra = _summed_later(ev, a, summed | keep_l | keep_r, out_piece * involved,
                                  involved)
            now = _move_bytes("partial", None, piece, n)
            if extra <= now:   # the product stays a sum, reduced later with the others
              options.append(((False, False, extra), side))
            else:              # the operand reduced first, as jit's partitioner reduces it
              options = [((False, False, now), None)]
      for cost, keep in options:
        if best is None or cost < best[0]:
          best = (cost, ld, rd, keep)
    _, ld, rd, keep = best
    if ld is not None:
      ldims[ld].append(a)
    if rd is not None:
      rdims[rd].append(a)
    if ld is not None and ld in lc:
      summed.add(a)
    (keep_l if keep == "l" else keep_r if keep == "r" else set()).add(a)
  ldims, rdims = [tuple(x) for x in ldims], [tuple(x) for x in rdims]
  targets = (Placement(tuple(ldims), frozenset(keep_l)), Placement(tuple(rdims), frozenset(keep_r)))
  out_dims = [ldims[d] for d in lb] + [ldims[d] for d in lfree] + [rdims[d] for d in rfree]
  place = Placement(tuple(out_dims), frozenset(keep_l | keep_r | summed))
  value = _gathered_beside(ev, eqn, (lhs, rhs), targets)
  if value is None:
    values = [ev.to(lhs, targets[0]), ev.to(rhs, targets[1])]
    scattered = _scattered_beside(ev, eqn, values, place) if not keep_l | keep_r else None
    if scattered is not None:
      return [Local(*scattered)]
    value = ev.bind(eqn, values)[0]
  out = Local(value, place)
  if not out.place.partial and not L.partial and not R.partial:
    out.slicer = slicer_of(_dot_piece(ev, eqn, (lhs, ldims, lb, lfree), (rhs, rdims, rb, rfree)),
                           ins)
  return [out]


def _gathered_beside(ev, eqn, operands, targets):
  """The product as :func:`jaxcoll.all_gather_matmul` where exactly one operand moves, by a
  gather of one dimension over one axis (its minor one), and ``use`` runs such a gather beside
  the matmul (:meth:`Options.matmul_for`); None otherwise, or where the gathered value is
  at hand already (another reader gathered it). The ring's steps then run beside the
  partial products, which a GPU overlaps (docs/guide/overlap.md); the gathered operand,
  assembled as its chunks pass, is kept for later readers as a gather's result is (the
  backward pass's matmul reads it; where none does, it is dead code and dropped)."""
  if ev.comm.abstract:
    return None
  moving = [k for k, (x, t) in enumerate(zip(operands, targets)) if x.place != t]
  if len(moving) != 1:
    return None
  k = moving[0]
  x, target = operands[k], targets[k]
  changed = [d for d, (a, b) in enumerate(zip(x.place.dims, target.dims)) if a != b]
  if x.place.partial or target.partial or len(changed) != 1:
    return None
  d = changed[0]
  now, then = x.place.dims[d], target.dims[d]
  if now[:-1] != then or ev.moved(x, target) is not None:
    return None
  asked = ev.comm.options.matmul("all_gather", (now[-1],), x.value.dtype,
                                 int(np.size(x.value)))
  if asked is None:
    return None
  ls, rs, out = _subscripts(eqn)
  values = [x.value if i == k else ev.to(v, t)
            for i, (v, t) in enumerate(zip(operands, targets))]
  y, gathered = all_gather_matmul(f"{ls},{rs}->{out}", *values, (now[-1],),
                                  dim=(ls, rs)[k][d], operand=k, return_gathered=True,
                                  **_einsum_params(eqn), **asked)
  ev.keep_moved(x, target, gathered)   # for later readers (the backward pass's matmul)
  return y.astype(eqn.outvars[0].aval.dtype)


def _scattered_beside(ev, eqn, values, place: Placement):
  """The product and its placement where it is a sum over one axis and ``use`` runs its
  reduction beside the matmul (:meth:`Options.matmul_for`): headed
  (:meth:`Evaluator.headed_for`) for a split of one output dimension over that axis, as
  :func:`jaxcoll.matmul_reduce_scatter`; headed whole, as :func:`jaxcoll.matmul_all_reduce`
  along its largest dimension the axis divides (a ring all-reduce pipelined over blocks of
  that dimension: each block's reduce-scatter beside its partial matmuls, the block before
  gathered on the same steps). None otherwise."""
  if ev.comm.abstract or len(place.partial) != 1:
    return None
  (a,) = place.partial
  var = eqn.outvars[0]
  local = ev.local_shape(var.aval.shape, place)
  asked = {p: ev.comm.options.matmul(p, (a,), var.aval.dtype, int(np.prod(local)),
                                     gradient=var in ev.gradients)
           for p in ("reduce_scatter", "all_reduce")}
  if not any(asked.values()):   # the CPU's default: no walk to where the sum is headed
    return None
  target = ev.headed_for(ev.scopes[-1], var, place)
  changed = [d for d, (x, y) in enumerate(zip(place.dims, target.dims)) if x != y]
  whole = target == place.whole()
  if whole:
    fits = [d for d in range(len(local)) if local[d] % ev.sizes[a] == 0]
    changed = [max(fits, key=lambda d: local[d])] if fits else []
  elif target.partial or len(changed) != 1 or \
      target.dims[changed[0]] != place.dims[changed[0]] + (a,) or \
      local[changed[0]] % ev.sizes[a]:
    return None
  options = asked["all_reduce" if whole else "reduce_scatter"]
  if not changed or options is None:
    return None
  ls, rs, out = _subscripts(eqn)
  run = matmul_all_reduce if whole else matmul_reduce_scatter
  y = run(f"{ls},{rs}->{out}", *values, (a,), dim=out[changed[0]], **_einsum_params(eqn),
          **options)
  return y.astype(var.aval.dtype), target


def _subscripts(eqn) -> tuple[str, str, str]:
  """``dot_general``'s dimension numbers as einsum subscripts (lhs, rhs, output)."""
  (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
  nl, nr = len(eqn.invars[0].aval.shape), len(eqn.invars[1].aval.shape)
  letters = iter("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
  ls = [next(letters) for _ in range(nl)]
  rs = [None] * nr
  for a, b in (*zip(lc, rc), *zip(lb, rb)):
    rs[b] = ls[a]
  rs = [c or next(letters) for c in rs]
  out = [ls[a] for a in lb] + [ls[a] for a in range(nl) if a not in lc and a not in lb] + \
      [rs[b] for b in range(nr) if b not in rc and b not in rb]
  return "".join(ls), "".join(rs), "".join(out)


def _einsum_params(eqn) -> dict:
  return {"precision": eqn.params.get("precision"),
          "preferred_element_type": eqn.params.get("preferred_element_type")}


def _dot_piece(ev, eqn, left, right):
  """A product under a finer split of its output: the product of the operands' pieces
  (each sliced from the placement it was multiplied in, or made by its own slicer; no
  collective), so that a product every device computes whole, as jit's does, is computed
  only in part where its reader is split. ``left``, ``right``: each operand, the dims it
  was multiplied in, its batch and free dimensions."""
  (lhs, lused, lb, lfree), (rhs, rused, rb, rfree) = left, right

  def piece(place: Placement):
    ldims, rdims = list(lused), list(rused)
    out = iter(place.dims)
    for dl, dr in zip(lb, rb):
      ldims[dl] = rdims[dr] = next(out)
    for dl in lfree:
      ldims[dl] = next(out)
    for dr in rfree:
      rdims[dr] = next(out)
    return ev.bind(eqn, [ev.to(lhs, Placement(tuple(ldims))),
                         ev.to(rhs, Placement(tuple(rdims)))])[0]
  return piece


# ---- reductions ----

def _reduce_sum(ev, eqn, ins):
  (x,) = ins
  axes = tuple(eqn.params["axes"])
  out = ev.bind(eqn, [x.value])
  return [Local(out[0], x.place.without(axes))]


def _reduce_with(op: str):
  def rule(ev, eqn, ins):
    (x,) = ins
    axes = tuple(eqn.params["axes"])
    value = ev.to(x, x.place.whole())
    split = tuple(a for d in axes for a in x.place.dims[d])
    out = ev.bind(eqn, [value])[0]
    if split:
      wide = out.astype(jnp.int32) if out.dtype == jnp.bool_ else out
      out = ev.comm.run(all_reduce, "all_reduce", wide, split, op=op).astype(out.dtype)
    keep = tuple(a for d, a in enumerate(x.place.dims) if d not in axes)
    return [Local(out, Placement(keep))]
  return rule


def _arg_reduce(best: str):
  """argmax/argmin over a split dimension: each device's best and its global index, then
  the best value over the axes and the least index that holds it."""
  def rule(ev, eqn, ins):
    (x,) = ins
    (d,) = eqn.params["axes"]
    value = ev.to(x, x.place.whole())
    axes = x.place.dims[d]
    index = ev.bind(eqn, [value])[0]
    keep = Placement(tuple(a for i, a in enumerate(x.place.dims) if i != d))
    if not axes:
      return [Local(index, keep)]
    local = jnp.take_along_axis(value, jnp.expand_dims(index, d).astype(jnp.int32), d)
    local = jnp.squeeze(local, d)
    index = index + ev.index(axes).astype(index.dtype) * value.shape[d]
    top = ev.comm.run(all_reduce, "all_reduce", local, axes, op=best)
    mine = jnp.where(local == top, index, jnp.iinfo(index.dtype).max)
    return [Local(ev.comm.run(all_reduce, "all_reduce", mine, axes, op="min"), keep)]
  return rule
