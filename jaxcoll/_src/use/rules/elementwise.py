"""Elementwise equations, the rule of a primitive with none (:func:`fallback`), and what a rule may
raise (:class:`Refused`). (:mod:`jaxcoll._src.use.rules`)."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from jaxcoll._src.interpreter import bodies
from jaxcoll._src.use.placement import Local, Placement, replicated, slicer_of


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
  arrays = [x for x in ins if x.place.ndim == len(shape)]   # a size-1 dimension is whole
  keep = _partial_kept(eqn, ins)
  keep -= _reduced_first(ev, eqn, keep, ins, arrays)
  dims = _join_dims(ev, [x.place for x in arrays], shape, keep)
  values = []
  for x, v in zip(ins, eqn.invars):
    if x.place.ndim != len(shape):     # a scalar beside arrays: a sum the result keeps stays
      values.append(ev.to(x, Placement(replicated(x.place.ndim).dims, x.place.partial & keep)))
      continue
    own = tuple(a if v.aval.shape[d] == shape[d] else () for d, a in enumerate(dims))
    joins = x.carried and not x.place.partial   # a whole carry joins its sum on one device
    values.append(ev.to(x, Placement(own, keep if joins else x.place.partial & keep)))
  out = Local(ev.bind(eqn, values)[0], Placement(dims, keep))
  if not keep:   # a sum among the inputs is whole by now: its pieces are slices of it
    out.slicer = slicer_of(_elementwise_piece(ev, eqn, ins, shape), ins)
  return [out]


def _reduced_first(ev, eqn, keep, ins, arrays) -> frozenset:
  """The axes of ``keep`` over which the sum is better reduced now than kept. A sum
  broadcast to a larger result (a scalar times an array) is reduced, as jit reduces it: kept,
  the larger result would cross the wire later. A sum beside an input split over the axis:
  keeping it gathers that input (its piece from every other device), reducing it sends the
  partial inputs once (reduce-scattered to that split); a scalar sum beside a split array
  (``x * jnp.sum(x)``) is reduced, a sum as large as the split input is kept, reduced later
  (often after a contraction has made it smaller)."""
  out = set()
  size = math.prod(eqn.outvars[0].aval.shape)
  for a in keep:
    partial = [(x, v) for x, v in zip(ins, eqn.invars) if a in x.place.partial]
    if all(math.prod(v.aval.shape) < size for _, v in partial):
      out.add(a)
      continue
    split = [x for x in arrays if a in x.place.sharded]
    if not split:
      continue
    n = ev.sizes[a]
    gather = sum(x.nbytes for x in split) * (n - 1)
    scatter = sum(x.nbytes for x, _ in partial) * (n - 1) / n
    if scatter < gather:
      out.add(a)
  return frozenset(out)


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
  if bodies(eqn):
    reason = "a higher-order primitive with no per-device rule"
  else:
    reason = "no per-device rule: its inputs are gathered whole"
  if any(x.place.used for x in ins):
    ev.note_fallback(eqn, reason)
  return _replicated_rule(ev, eqn, ins)
