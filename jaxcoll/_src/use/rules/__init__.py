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

from jaxcoll._src.per_device_rules import RULES, register_rule, unregister_rule
from jaxcoll._src.use.rules.annotations import _identity, _to_named, asked, laid_out_as_asked
from jaxcoll._src.use.rules.contractions import _arg_reduce, _dot_general, _reduce_sum, _reduce_with
from jaxcoll._src.use.rules.control_flow import BY_FORM, REBUILT
from jaxcoll._src.use.rules.elementwise import (
  ELEMENTWISE,
  Refused,
  _elementwise,
  _replicated_rule,
  fallback,
  keeps_partial,
)
from jaxcoll._src.use.rules.gather_scatter import _gather, _scatter_add
from jaxcoll._src.use.rules.generated import _iota, _random_bits
from jaxcoll._src.use.rules.shapes import (
  _broadcast_in_dim,
  _concatenate,
  _dynamic_slice,
  _dynamic_update_slice,
  _expand_dims,
  _pad,
  _reshape,
  _slice,
  _sort,
  _split,
  _squeeze,
  _stack,
  _tile,
  _transpose,
  _whole_along,
)

_BUILT_IN = {name: _elementwise for name in ELEMENTWISE}
_BUILT_IN.update({
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
})
for _name, _rule in _BUILT_IN.items():
  RULES.add(_name, _rule, built_in=True)


__all__ = ["BY_FORM", "ELEMENTWISE", "REBUILT", "RULES", "Refused", "asked", "fallback",
           "keeps_partial", "laid_out_as_asked", "register_rule", "unregister_rule"]
