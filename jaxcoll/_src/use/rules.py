"""Per-device rules for the equations of a global program (:mod:`spmd`).

A rule takes the :class:`~spmd.Evaluator`, the equation and its inputs' pieces
(:class:`~spmd.Local`: value and placement), moves each input to the placement it needs
(``ev.to``: collectives where the placement changes), runs the primitive on the pieces with
its shape parameters made local, and returns the outputs' pieces with their placements.

- Elementwise equations take the inputs' split dimensions as they find them (a whole input
  is sliced to the others' blocks, no data moves). Linear ones keep a partial sum partial
  (a sum of terms: ``add`` of two sums, ``mul`` of a sum by a whole value, a negation, a
  widening cast); the others need it whole.
- ``dot_general`` splits as its operands are split: a contraction split on both sides gives a
  partial sum over those axes (where one side is whole it is sliced to match); batch and free
  dimensions keep their splits; an axis that would split two dimensions of the result is
  taken off the smaller operand.
- Reductions over a split dimension: a sum becomes partial; max, min, prod, and/or, argmax
  and argmin reduce locally, then all-reduce over the axes at once.
- Shape equations (broadcast, reshape, transpose, squeeze, slice, pad, concatenate, dynamic
  slices, reverse, cumulative ops, sort) map the splits through, and need whole the
  dimensions they cut, reverse or scan across.
- ``gather`` and ``scatter-add`` (embedding lookups and their gradients, picking labels):
  the operand whole along the dimensions indexed, the indices' batch split carried to the
  result; a scatter-add of split updates is a partial sum.
- Random numbers, ``iota`` and anything reading a key: on whole inputs, every device
  computing the whole value (the same draws as plain ``jit``; each device pays the whole
  draw).
- Higher-order equations: nested ``jit``, ``checkpoint``, ``custom_jvp``/``custom_vjp``
  calls run inline; ``scan``, ``while`` and ``cond`` run their bodies per device, the
  carries' placements found by iterating the body abstractly until they stop changing; a
  ``shard_map`` inside the program runs its body on the pieces its specs name, its
  collectives rewritten as ``use`` rewrites them.
- Sharding annotations (``sharding_constraint``, ``reshard``, ``mesh_cast``) move the value to
  the placement they name.
- Any other equation: :func:`fallback`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.random import threefry2x32_p

from jaxcoll._src import compat
from jaxcoll._src.collectives import all_reduce
from jaxcoll._src.use.partial_sums import accumulators
from jaxcoll._src.use.placement import Local, Placement, explicit, from_spec, replicated
from jaxcoll.extend import record_paused, record_repeated


class Refused(ValueError):
  """``use(..., strict=True)`` met an equation it has no rule for, or the program holds one
  ``use`` cannot run per device."""

ELEMENTWISE = frozenset({
    "abs", "acos", "acosh", "add", "add_any", "and", "asin", "asinh", "atan", "atan2", "atanh",
    "cbrt", "ceil", "clamp", "clz", "conj", "convert_element_type", "copy", "copy_p", "cos",
    "cosh", "digamma", "div", "eq", "erf", "erf_inv", "erfc", "exp", "exp2", "expm1", "floor",
    "ge", "gt", "igamma", "igammac", "imag", "integer_pow", "is_finite", "le", "lgamma", "log",
    "log1p", "logistic", "lt", "max", "min", "mul", "ne", "neg", "nextafter", "not",
    "one_minus_square", "or", "polygamma", "population_count", "pow", "real", "reduce_precision",
    "rem", "round", "rsqrt", "select_n", "shift_left", "shift_right_arithmetic",
    "shift_right_logical", "sign", "sin", "sinh", "sqrt", "square", "sub", "tan", "tanh", "xor",
    "zeta", "random_gamma_grad", "bessel_i0e", "bessel_i1e", "regularized_incomplete_beta",
    "stop_gradient", "bitcast_convert_type",
})
_SUMS = frozenset({"add", "sub", "add_any"})             # linear in all operands together
_UNARY_LINEAR = frozenset({"neg", "copy", "copy_p", "real", "imag", "conj", "stop_gradient"})


def _ndim(x) -> int:
  return len(getattr(x, "shape", ()))


def _widening(eqn) -> bool:
  """A cast that keeps every value (float to a float at least as wide): linear on sums."""
  new, old = np.dtype(eqn.params["new_dtype"]), np.dtype(eqn.invars[0].aval.dtype)
  floating = lambda d: jnp.issubdtype(d, jnp.floating)   # noqa: E731
  return floating(new) and floating(old) and new.itemsize >= old.itemsize


def keeps_partial(eqn) -> bool:
  """Whether ``eqn`` keeps a partial sum in its first operand partial without anything
  else partial (a scale, a negation, a widening cast, a sum with another sum)."""
  name = eqn.primitive.name
  return name in _UNARY_LINEAR or name in _SUMS or name in ("mul", "div") or (
      name == "convert_element_type" and _widening(eqn)) or _power_one(eqn)


def _power_one(eqn) -> bool:
  """``x ** 1`` (optax's first moment is ``g ** 1``): the identity."""
  return eqn.primitive.name == "integer_pow" and eqn.params["y"] == 1


def _partial_kept(eqn, ins: list[Local]) -> frozenset:
  """The partial axes an elementwise equation's result keeps (:func:`keeps_partial`);
  the inputs' other partial sums must be reduced."""
  name = eqn.primitive.name
  partials = [x.place.partial for x in ins]
  arrays = [x for x in ins if _ndim(x.value)]
  if name in _UNARY_LINEAR or (name == "convert_element_type" and _widening(eqn)) or \
      _power_one(eqn):
    return partials[0]
  if name in _SUMS:
    first = partials[0]
    if all(p == first for p in partials) and len(arrays) == len(ins):
      return first
    summed = {p for p in partials if p}   # a loop accumulator: its carry joins the sum
    accumulates = len(summed) == 1 and len(arrays) == len(ins) and all(
        x.place.partial or x.carried for x in ins)
    return summed.pop() if accumulates else frozenset()
  if name == "mul":
    summed = [p for p in partials if p]
    return summed[0] if len(summed) == 1 else frozenset()
  if name == "div":
    return partials[0] if not any(partials[1:]) else frozenset()
  if name == "select_n":
    cases = partials[1:]
    return cases[0] if not partials[0] and all(c == cases[0] for c in cases) else frozenset()
  return frozenset()


def _join_dims(ev, places, shape, taken=frozenset()) -> tuple:
  """Per dimension, a split among ``places`` whose axes no earlier dimension (and none of
  ``taken``) uses, and that divides the dimension evenly: the first, or a finer one that
  begins with it (the coarser inputs are then sliced to it for free, where taking the
  coarser would gather the finer)."""
  dims, used = [], set(taken)
  for d, n in enumerate(shape):
    fits = [p.dims[d] for p in places if d < p.ndim and p.dims[d] and
            not used & set(p.dims[d]) and n % ev.count(p.dims[d]) == 0]
    chosen = fits[0] if fits else ()
    for axes in fits[1:]:
      if axes[:len(chosen)] == chosen:
        chosen = axes
    used |= set(chosen)
    dims.append(chosen)
  return tuple(dims)


def _elementwise(ev, eqn, ins):
  """Inputs of the result's shape, or of size 1 along dimensions it broadcasts (lax's
  binary ops broadcast those), or scalars."""
  shape = eqn.outvars[0].aval.shape
  keep = _partial_kept(eqn, ins)
  arrays = [x for x in ins if x.place.ndim == len(shape)]   # a size-1 dimension is whole
  dims = _join_dims(ev, [x.place for x in arrays], shape, keep)
  values = []
  for x, v in zip(ins, eqn.invars):
    if x.place.ndim != len(shape):     # a scalar beside arrays
      values.append(ev.to(x, replicated(x.place.ndim)))
      continue
    own = tuple(a if v.aval.shape[d] == shape[d] else () for d, a in enumerate(dims))
    joins = x.carried and not x.place.partial   # a whole carry joins its sum on one device
    values.append(ev.to(x, Placement(own, keep if joins else x.place.partial & keep)))
  out = Local(ev.bind(eqn, values)[0], Placement(dims, keep))
  if not keep and any(x.slicer is not None for x in ins) and \
      not any(x.place.partial for x in ins):
    out.slicer = _elementwise_piece(ev, eqn, ins, shape)
  return [out]


def _elementwise_piece(ev, eqn, ins, shape):
  """An elementwise equation's result under a finer split: the equation on its inputs'
  pieces (each made by its own slicer where it has one)."""
  def piece(place: Placement):
    values = []
    for x, v in zip(ins, eqn.invars):
      if x.place.ndim != len(shape):
        values.append(ev.to(x, replicated(x.place.ndim)))
      else:
        own = tuple(a if v.aval.shape[d] == shape[d] else () for d, a in enumerate(place.dims))
        values.append(ev.to(x, Placement(own)))
    return ev.bind(eqn, values)[0]
  return piece


def _whole_dims(place: Placement, dims) -> Placement:
  """``place`` with ``dims`` unsplit and nothing partial."""
  return Placement(tuple(() if d in dims else a for d, a in enumerate(place.dims)))


def _replicated_rule(ev, eqn, ins):
  """Every input whole; every device computes the whole result (keys, random bits, iota)."""
  values = [ev.to(x, replicated(x.place.ndim)) for x in ins]
  return [Local(o, replicated(_ndim(o))) for o in ev.bind(eqn, values)]


def fallback(ev, eqn, ins):
  """An equation without a rule: its inputs whole, run as written (correct; reported, or
  refused under ``strict``)."""
  if compat.sub_jaxprs(eqn.params) and eqn.primitive.name not in ("pjit", "jit"):
    reason = "a higher-order primitive with no per-device rule"
  else:
    reason = "no per-device rule: its inputs are gathered whole"
  if any(x.place.used for x in ins):
    ev.note_fallback(eqn, reason)
  return _replicated_rule(ev, eqn, ins)


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
  activation left where it is. An axis neither operand uses splits the product too (a
  batch dimension, else the left operand's rows, else the right's columns: a free slice),
  so that its devices divide the work rather than each repeat it."""
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

  for a in axes:
    n = ev.sizes[a]
    cl, cr = _where(L, a), _where(R, a)
    reduce_out = 2 * out_piece * (n - 1) / n
    best = None
    for ld, rd in roles:
      if not (fits(ldims, lshape, ld, n) and fits(rdims, rshape, rd, n)):
        continue
      moved = _move_bytes(cl, ld, piece_l, n) + _move_bytes(cr, rd, piece_r, n)
      kept = (ld is not None and ld == cl and ld not in lc) or \
          (rd is not None and rd == cr and rd not in rc)   # an operand's row split stays
      options = [((moved > 0, moved > 0 and not kept,
                   moved + (reduce_out if ld in lc and ld is not None else 0)), None)]
      if (ld, rd) == (None, None):   # one operand may stay a sum: so is the product
        if cl == "partial" and cr is None:
          options.append(((False, False, reduce_out), "l"))
        if cr == "partial" and cl is None:
          options.append(((False, False, reduce_out), "r"))
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
  for a in ev.manual:   # an axis neither operand uses: split the product rather than repeat it
    if a in axes:
      continue
    for ld, rd in roles[:len(lb) + len(lfree) + len(rfree)]:   # batch, then rows, then columns
      if fits(ldims, lshape, ld, ev.sizes[a]) and fits(rdims, rshape, rd, ev.sizes[a]):
        (ldims[ld] if ld is not None else rdims[rd]).append(a)
        if ld is not None and rd is not None:
          rdims[rd].append(a)
        break
  ldims, rdims = [tuple(x) for x in ldims], [tuple(x) for x in rdims]
  values = [ev.to(lhs, Placement(tuple(ldims), frozenset(keep_l))),
            ev.to(rhs, Placement(tuple(rdims), frozenset(keep_r)))]
  out_dims = [ldims[d] for d in lb] + [ldims[d] for d in lfree] + [rdims[d] for d in rfree]
  out = ev.bind(eqn, values)
  return [Local(out[0], Placement(tuple(out_dims), frozenset(keep_l | keep_r | summed)))]


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
    local.slicer = piece
  return [local]


def _iota(ev, eqn, ins):
  """Every device computes the whole iota; a piece of it is its own iota plus the piece's
  offset along the counting dimension."""
  (out,) = _replicated_rule(ev, eqn, ins)
  p = eqn.params
  d = p["dimension"]

  def piece(place: Placement):
    local = ev.local_shape(p["shape"], place)
    value = ev.bind(eqn, [], shape=local)[0]
    axes = place.dims[d]
    if not axes:
      return value
    return value + (ev.index(axes) * local[d]).astype(value.dtype)
  out.slicer = piece
  return [out]


def _random_bits(ev, eqn, ins):
  """Random bits as ``jax.jit`` draws them: with ``jax_threefry_partitionable`` (the
  default) bit i of a threefry key's draw hashes the key with i's position in the whole
  array, so a device draws its own block alone (``threefry2x32`` of its positions, as
  jax's own ``_threefry_random_bits_partitionable`` computes the whole); otherwise, or for
  another generator, every device draws the whole array."""
  (out,) = _replicated_rule(ev, eqn, ins)
  (key,) = ins
  shape, width = tuple(eqn.params["shape"]), eqn.params["bit_width"]
  if compat.threefry_partitionable(eqn) and width in (8, 16, 32) and \
      key.place.ndim == 0 and math.prod(shape) < 2 ** 32 and \
      str(jax.random.key_impl(key.value)) == "threefry2x32":
    out.slicer = lambda place: _threefry_block(ev, key.value, shape, width, place)
  return [out]


def _threefry_block(ev, key, shape, width, place: Placement):
  """This device's block of ``random_bits(key, width, shape)`` under ``place``."""
  local = ev.local_shape(shape, place)
  strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
  count = jnp.zeros(local, jnp.uint32)
  for d, n in enumerate(local):
    position = lax.broadcasted_iota(jnp.uint32, local, d)
    if place.dims[d]:
      position = position + (ev.index(place.dims[d]) * n).astype(jnp.uint32)
    count = count + position * np.uint32(strides[d])
  k1, k2 = jax.random.key_data(key)
  bits1, bits2 = threefry2x32_p.bind(k1, k2, jnp.zeros(local, jnp.uint32), count)
  bits = bits1 ^ bits2
  return bits if width == 32 else bits.astype({8: jnp.uint8, 16: jnp.uint16}[width])


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
  used = {a for axes in odims for a in axes}
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


# ---- sharding annotations ----

def _sharding_param(eqn):
  for key in ("sharding", "dst_sharding", "out_sharding"):
    if eqn.params.get(key) is not None:
      return eqn.params[key]
  return None


def _to_named(ev, eqn, ins):
  """A sharding annotation: the value moved to the placement it names (over the manual
  axes); an annotation without one is the identity, and so is a cast into Auto axes (a
  ``reshard``/``mesh_cast`` leaving an ``explicit_axes`` function: the type no longer
  says where the value is, and it stays where it is)."""
  (x,) = ins[:1]
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
    return [x]
  target = from_spec(getattr(sharding, "spec", None), x.place.ndim, ev.manual)
  if not ev.splits(eqn.invars[0].aval.shape, target):
    target = replicated(x.place.ndim)
  return [Local(ev.to(x, target), target)]


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


# ---- higher-order ----

def _inline(key: str):
  def rule(ev, eqn, ins):
    jaxpr, consts = compat.open_jaxpr(eqn.params[key])
    return ev.run_jaxpr(jaxpr, [ev.const(c) for c in consts], ins,
                        inline=True)
  return rule


def _jit(ev, eqn, ins):
  """A nested jitted function, run inline; the shardings it declares (``in_shardings``,
  ``out_shardings``: NamedShardings) place its inputs and outputs, as they constrain them
  under ``jax.jit``."""
  p = eqn.params
  ins = [_constrained(ev, x, s, v) for x, s, v in zip(ins, p.get("in_shardings", ()), eqn.invars)]
  outs = _inline("jaxpr")(ev, eqn, ins)
  return [_constrained(ev, x, s, v) for x, s, v in zip(outs, p.get("out_shardings", ()),
                                                       eqn.outvars)]


def _constrained(ev, x: Local, sharding, var) -> Local:
  """``x`` moved where a declared NamedSharding puts it (over the manual axes; where it
  splits the value evenly); as it is for any other sharding (unspecified)."""
  if not isinstance(sharding, jax.sharding.NamedSharding):
    return x
  target = from_spec(sharding.spec, x.place.ndim, ev.manual)
  if target == x.place or not ev.splits(var.aval.shape, target):
    return x
  return Local(ev.to(x, target), target)


def join(a: Placement, b: Placement, partial: frozenset) -> Placement:
  """What two placements of one value agree on: the splits they share, partial over
  ``partial`` (less any axis that splits a shared dimension)."""
  dims = tuple(x if x == y else () for x, y in zip(a.dims, b.dims))
  split = {ax for axes in dims for ax in axes}
  return Placement(dims, partial - split)


def join_branches(a: Placement, b: Placement) -> Placement:
  """Two branches' placements of one output: partial only over the axes both leave partial
  (a branch that made it whole does not hand back a sum to be reduced again)."""
  return a if a == b else join(a, b, a.partial & b.partial)


def join_carry(init: Placement, out: Placement) -> Placement:
  """A loop carry: split as the body leaves it where the initial value is whole or split
  alike (a whole value is sliced to any split for free), and partial over the axes the body
  leaves it partial (an accumulator of sums is reduced once, after the loop); a partial
  initial value the body makes whole is reduced before the loop, not in every iteration."""
  if init == out:
    return init
  dims = tuple(o if not i or i == o else () for i, o in zip(init.dims, out.dims))
  split = {a for axes in dims for a in axes}
  return Placement(dims, out.partial - split)


def abstract_places(ev, jaxpr, consts, places, carried=()) -> list[Placement]:
  """The placements a jaxpr's outputs get from inputs placed as ``places``: the jaxpr run
  abstractly (``jax.eval_shape``) by an evaluator of its own, with lax collectives; nothing
  is recorded. ``carried``: the positions of a loop's carries. Each (jaxpr, placements) is
  run once per program (``ev.known``)."""
  key = (id(jaxpr), tuple(places), tuple(carried))
  if key in ev.known:
    return ev.known[key][1]
  found = {}

  def run(*values):
    sub = ev.fresh()
    outs = sub.run_jaxpr(jaxpr, [ev.const(c) for c in consts],
                         [Local(v, p, carried=i in carried)
                          for i, (v, p) in enumerate(zip(values, places))])
    found["places"] = [o.place for o in outs]
    return [o.value for o in outs]

  with record_paused():
    jax.eval_shape(run, *[jax.ShapeDtypeStruct(ev.local_shape(v.aval.shape, p), v.aval.dtype)
                          for v, p in zip(jaxpr.invars, places)])
  ev.known[key] = (jaxpr, found["places"])   # the jaxpr kept: its id stays its own
  return found["places"]


def _fixed_carry(places_of, carry: list[Placement], rounds: int = 6):
  """Carry placements that a loop body maps to themselves (joined until stable; whole if
  they never settle), and the body's output placements for them."""
  for _ in range(rounds):
    out = places_of(carry)
    joined = [join_carry(c, o) for c, o in zip(carry, out)]
    if joined == carry:
      return carry, out
    carry = joined
  carry = [replicated(c.ndim) for c in carry]
  return carry, places_of(carry)


def _run_body(ev, jaxpr, consts, args: list[Local], targets: list[Placement]) -> list:
  """A loop or branch body on per-device ``args``, its outputs moved to ``targets``."""
  return ev.run_jaxpr(jaxpr, [ev.const(c) for c in consts], args,
                      targets)


def _summed(ev, ins: list[Local]) -> list[Local]:
  """``ins`` with their partial sums made whole (together, in buckets): what a loop or
  branch body reads besides its carries, so that no body reduces a value of the caller's
  (once per iteration, or again beside the caller's own reduction)."""
  return [Local(ev.to(x, x.place.whole()), x.place.whole()) if x.place.partial else x
          for x in ins]


def _scan(ev, eqn, ins):
  p = eqn.params
  nc, ncarry = compat.scan_counts(p)
  body, body_consts = compat.open_jaxpr(p["jaxpr"])
  consts, init, xs = ins[:nc], ins[nc:nc + ncarry], ins[nc + ncarry:]
  consts, xs = _summed(ev, consts), _summed(ev, xs)
  xs_places = [Placement(((),) + x.place.dims[1:]) for x in xs]
  xs_values = [ev.to(x, t) for x, t in zip(xs, xs_places)]
  elem = [Placement(t.dims[1:], t.partial) for t in xs_places]
  cplaces = [c.place for c in consts]
  carried = [nc + i for i in accumulators(body, range(nc, nc + ncarry), range(ncarry))]
  carry, outs = _fixed_carry(lambda cs: abstract_places(ev, body, body_consts,
                                                        cplaces + cs + elem, carried),
                             [x.place for x in init])
  ys = outs[ncarry:]
  init_values = [ev.to(x, t) for x, t in zip(init, carry)]
  const_values = [c.value for c in consts]

  def step(carry_values, x_values):
    args = ([Local(v, c.place) for v, c in zip(const_values, consts)]
            + [Local(v, t, carried=nc + i in carried)
               for i, (v, t) in enumerate(zip(carry_values, carry))]
            + [Local(v, t) for v, t in zip(x_values, elem)])
    outs = _run_body(ev, body, body_consts, args, carry + ys)
    return outs[:ncarry], outs[ncarry:]

  with record_repeated(p["length"]):
    carry_out, ys_out = lax.scan(step, init_values, xs_values, length=p["length"],
                                 reverse=p["reverse"], unroll=p["unroll"])
  return ([Local(v, t) for v, t in zip(carry_out, carry)]
          + [Local(v, Placement(((),) + t.dims, t.partial)) for v, t in zip(ys_out, ys)])


def _while(ev, eqn, ins):
  p = eqn.params
  nc, nb = p["cond_nconsts"], p["body_nconsts"]
  cond, cond_consts = compat.open_jaxpr(p["cond_jaxpr"])
  body, body_consts = compat.open_jaxpr(p["body_jaxpr"])
  cc, bc, init = ins[:nc], ins[nc:nc + nb], ins[nc + nb:]
  bc = _summed(ev, bc)
  bplaces = [c.place for c in bc]
  read = {v for v in [*(w for e in cond.eqns for w in e.invars), *cond.outvars]
          if not hasattr(v, "val")}
  carried = [nb + i for i in accumulators(body, range(nb, nb + len(init)), range(len(init)))
             if cond.invars[nc + i] not in read]
  carry, _ = _fixed_carry(lambda cs: abstract_places(ev, body, body_consts, bplaces + cs,
                                                     carried), [x.place for x in init])
  cc_values = [ev.to(c, replicated(c.place.ndim)) for c in cc]
  bc_values = [c.value for c in bc]

  def cond_fn(values):
    args = ([Local(v, replicated(jnp.ndim(v))) for v in cc_values]
            + [Local(v, t) for v, t in zip(values, carry)])
    return _run_body(ev, cond, cond_consts, args, [replicated(0)])[0]

  def body_fn(values):
    args = ([Local(v, c.place) for v, c in zip(bc_values, bc)]
            + [Local(v, t, carried=nb + i in carried)
               for i, (v, t) in enumerate(zip(values, carry))])
    return tuple(_run_body(ev, body, body_consts, args, carry))

  out = lax.while_loop(cond_fn, body_fn, tuple(ev.to(x, t) for x, t in zip(init, carry)))
  return [Local(v, t) for v, t in zip(out, carry)]


def _cond(ev, eqn, ins):
  index, *ops = ins
  ops = _summed(ev, ops)
  branches = [compat.open_jaxpr(b) for b in eqn.params["branches"]]
  places = [x.place for x in ops]
  outs = [abstract_places(ev, jaxpr, consts, places) for jaxpr, consts in branches]
  joined = outs[0]
  for other in outs[1:]:
    joined = [join_branches(a, b) for a, b in zip(joined, other)]
  op_values = [x.value for x in ops]

  def branch(jaxpr, consts):
    return lambda *values: tuple(_run_body(ev, jaxpr, consts, [
        Local(v, pl) for v, pl in zip(values, places)], joined))

  out = lax.switch(ev.to(index, replicated(0)), [branch(*b) for b in branches], *op_values)
  return [Local(v, t) for v, t in zip(out, joined)]


def _shard_map(ev, eqn, ins):
  """A shard_map inside the program: its body on the pieces its specs name (per device
  over its axes, whole over the others), its collectives rewritten as ``use`` rewrites
  them; its outputs placed as its out_specs say."""
  p = eqn.params
  island = tuple(p["newly_manual_axes"])
  if not set(island) <= set(ev.manual) or ev.rewrite_island is None:
    where = compat.source_line(eqn)
    raise Refused(f"a shard_map over {island} at {where} inside a program use() runs per "
                  f"device over {ev.manual}: pass use(..., axes=...) naming its axes too")
  places = [from_spec(spec, x.place.ndim, island) for spec, x in zip(p["in_specs"], ins)]
  values = [ev.to(x, t) for x, t in zip(ins, places)]
  outs = ev.rewrite_island(p["jaxpr"], values)
  return [Local(o, from_spec(spec, _ndim(o), island)) for o, spec in zip(outs, p["out_specs"])]


# Rules that evaluate a sub-jaxpr: their outputs are the sub-evaluation's values (a call run
# inline) or new values of a trace of their own (loops, branches, shard_map islands), never
# derived from their inputs by re-running the equation (:mod:`partials`).
CALLS = frozenset({"pjit", "jit", "closed_call", "core_call", "checkpoint", "remat2",
                   "custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr", "scan",
                   "while", "cond", "shard_map"})

RULES = {name: _elementwise for name in ELEMENTWISE}
RULES.update({
    "dot_general": _dot_general,
    "reduce_sum": _reduce_sum,
    "reduce_max": _reduce_with("max"), "reduce_min": _reduce_with("min"),
    "reduce_prod": _reduce_with("prod"), "reduce_and": _reduce_with("min"),
    "reduce_or": _reduce_with("max"),
    "argmax": _arg_reduce("max"), "argmin": _arg_reduce("min"),
    "broadcast_in_dim": _broadcast_in_dim, "reshape": _reshape, "transpose": _transpose,
    "squeeze": _squeeze, "expand_dims": _expand_dims, "slice": _slice, "pad": _pad,
    "concatenate": _concatenate, "stack": _stack, "tile": _tile,
    "dynamic_slice": _dynamic_slice,
    "dynamic_update_slice": _dynamic_update_slice, "sort": _sort, "split": _split,
    "rev": _whole_along(lambda e: e.params["dimensions"], linear=True),
    "cumsum": _whole_along(lambda e: [e.params["axis"]], linear=True),
    "cumprod": _whole_along(lambda e: [e.params["axis"]], linear=False),
    "cummax": _whole_along(lambda e: [e.params["axis"]], linear=False),
    "cummin": _whole_along(lambda e: [e.params["axis"]], linear=False),
    "cumlogsumexp": _whole_along(lambda e: [e.params["axis"]], linear=False),
    "top_k": _whole_along(lambda e: [len(e.invars[0].aval.shape) - 1], linear=False),
    "gather": _gather, "scatter-add": _scatter_add, "scatter_add": _scatter_add,
    "sharding_constraint": _to_named, "reshard": _to_named, "mesh_cast": _to_named,
    "device_put": _identity, "optimization_barrier": _identity, "name": _identity,
    "iota": _iota, "random_seed": _replicated_rule, "random_bits": _random_bits,
    "random_split": _replicated_rule, "random_fold_in": _replicated_rule,
    "random_wrap": _replicated_rule, "random_unwrap": _replicated_rule,
    "threefry2x32": _replicated_rule, "rng_bit_generator": _replicated_rule,
    "rng_uniform": _replicated_rule,
    "pjit": _jit, "jit": _jit, "closed_call": _inline("call_jaxpr"),
    "core_call": _inline("call_jaxpr"), "checkpoint": _inline("jaxpr"),
    "remat2": _inline("jaxpr"), "custom_jvp_call": _inline("call_jaxpr"),
    "custom_vjp_call": _inline("call_jaxpr"), "custom_vjp_call_jaxpr": _inline("fun_jaxpr"),
    "scan": _scan, "while": _while, "cond": _cond, "shard_map": _shard_map,
})
