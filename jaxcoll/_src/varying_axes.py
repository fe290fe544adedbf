"""Which values of a per-device program differ between the devices of a mesh axis.

:func:`jaxcoll.data_parallel` runs a step written for one device under
``shard_map(check_vma=False)``, as ``pmap`` did: nothing types a value as the same on every
device or not. A parameter the step returns is the same on every device only if it was
computed from replicated inputs, or from per-device data through a reduction over the axis
(the gradient sync). :func:`varying` follows that through the step's jaxpr, the way JAX's
own vma typing does under ``check_vma=True``, but for values instead of types: each value
gets the set of axes it may differ over.

- Sources: inputs that differ per device (the batch, :class:`jaxcoll.PerDevice` state) and
  ``axis_index``; ``ppermute``, ``all_to_all`` and ``reduce_scatter`` (``psum_scatter``)
  give each device a result of its own.
- Reductions give every device the same result, so their outputs stop varying over the
  axes they reduce over: ``psum`` (``pmean``), ``pmax``, ``pmin``, ``psum_invariant``,
  ``all_gather``, ``all_gather_invariant``, and jaxcoll's replicated results (all_reduce,
  broadcast, all_gather: :data:`jaxcoll._src.invariant.REPLICATED_PRIMITIVES`).
- Every other equation varies over whatever any of its inputs varies over. Higher-order
  equations (jit, scan, while, cond, checkpoint, custom_jvp/custom_vjp, shard_map) are
  followed into their sub-jaxprs, loops to a fixed point, and a cond's (or a while loop's)
  outputs also vary with its predicate. An equation with sub-jaxprs of a shape not known
  here varies over what any of its inputs varies over: a value may be reported varying that
  is not, never the reverse.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

from jaxcoll._src import checks
from jaxcoll._src.interpreter import (
  Body,
  Call,
  Cond,
  Scan,
  While,
  evaluate,
  fixed_point,
  form_of,
)
from jaxcoll._src.invariant import REPLICATED_PRIMITIVES

Vary = frozenset   # the axes a value may differ over
NONE: Vary = frozenset()

_REDUCE = {"psum": "axes", "pmax": "axes", "pmin": "axes", "psum_invariant": "axes",
           "all_gather": "axis_name", "all_gather_invariant": "axis_name",
           **{name: "axes" for name in REPLICATED_PRIMITIVES}}
_PER_DEVICE = {"axis_index": "axis_name", "ppermute": "axis_name", "all_to_all": "axis_name",
               "reduce_scatter": "axis_name"}


def _axes(params, key: str) -> Vary:
  return frozenset(checks.as_axes(params.get(key, ())))


def varying(jaxpr, consts_vary: Sequence[Vary], in_vary: Sequence[Vary]) -> list[Vary]:
  """For an open jaxpr whose constvars vary over ``consts_vary`` and inputs over
  ``in_vary`` (frozensets of mesh axis names): the axes each output may vary over (module
  docstring)."""
  return evaluate(jaxpr, consts_vary, in_vary, _equation, literal=lambda v: NONE)


def _union(values) -> Vary:
  return frozenset().union(*values)


def _sub(body: Body, ins: Sequence[Vary]) -> list[Vary]:
  return varying(body.jaxpr, [NONE] * len(body.consts), ins)


def _equation(eqn, ins: list[Vary]) -> list[Vary]:
  name, params, n_out = eqn.primitive.name, eqn.params, len(eqn.outvars)
  every = _union(ins)
  if name in _REDUCE and params.get("axis_index_groups") is None:
    cut = _axes(params, _REDUCE[name])
    return [v - cut for v in ins] if len(ins) == n_out else [every - cut] * n_out
  if name in _PER_DEVICE:
    return [every | _axes(params, _PER_DEVICE[name])] * n_out
  form = form_of(eqn)
  if isinstance(form, Cond):
    branches = [_sub(b, ins[1:]) for b in form.branches]
    return [_union(outs) | ins[0] for outs in zip(*branches)]
  if isinstance(form, Scan):
    c, init, xs = form.split(ins)
    carry, outs = fixed_point(lambda carry: _sub(form.body, [*c, *carry, *xs]), init,
                              operator.or_)
    return [*carry, *outs[form.carry:]]
  if isinstance(form, While):
    cc, bc, init = form.split(ins)

    def step(carry):   # a predicate that varies runs the loop a different number of times
      (pred,) = _sub(form.cond, [*cc, *carry])
      return [v | pred for v in _sub(form.body, [*bc, *carry])]
    return fixed_point(step, init, operator.or_)[0]
  if isinstance(form, Call):   # jit, checkpoint, custom_jvp/vjp, shard_map
    return _sub(form.body, ins)
  return [every] * n_out
