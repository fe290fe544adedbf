"""Which values of a program JAX's backward pass makes: the sums a lossy wire may round.

``jaxcoll.use(step, wire_dtype="int8")`` compresses the gradient sums of a training step,
and nothing else: a loss, a metric, the forward pass's partial products (tensor
parallelism's sums of activations) travel exact, so the loss a user logs and the function
the model computes are jit's. A value is a gradient where JAX's autodiff made it: an
equation that ``jax.grad``/``jax.vjp`` transposed (its name stack reads ``transpose(...)``,
:func:`compat.in_backward`), anything inside a call so transposed, and everything computed
from such values (an optimizer's moments of a gradient, a gradient accumulated over
microbatches). :func:`backward_values` follows that through a jaxpr and its bodies (loops
to a fixed point), one pass for a whole program.
"""

from __future__ import annotations

import jax

from jaxcoll._src import compat
from jaxcoll._src.interpreter import Call, Cond, Scan, While, evaluate, fixed_point, form_of


def backward_values(jaxpr) -> frozenset:
  """The variables of ``jaxpr`` (an open jaxpr) and of the jaxprs nested in it whose values
  JAX's backward pass made or were computed from such values (module docstring)."""
  found: set = set()

  def run(sub, ins: list[bool], backward: bool) -> list[bool]:
    for var, flag in zip(sub.invars, ins):
      if flag:
        found.add(var)

    def apply(eqn, flags):
      outs = _equation(eqn, flags, backward or compat.in_backward(eqn), run)
      found.update(v for v, flag in zip(eqn.outvars, outs)
                   if flag and not isinstance(v, jax.extend.core.DropVar))
      return outs
    return evaluate(sub, [False] * len(sub.constvars), ins, apply, literal=lambda v: False)

  run(jaxpr, [False] * len(jaxpr.invars), False)
  return frozenset(found)


def _equation(eqn, ins: list[bool], backward: bool, run) -> list[bool]:
  n = len(eqn.outvars)
  form = form_of(eqn)
  if isinstance(form, Call):
    return run(form.body.jaxpr, ins, backward)
  if isinstance(form, Scan):
    c, init, xs = form.split(ins)
    carry, outs = fixed_point(lambda carry: run(form.body.jaxpr, [*c, *carry, *xs], backward),
                              init, bool.__or__)
    return [*carry, *outs[form.carry:]]
  if isinstance(form, While):
    cc, bc, init = form.split(ins)
    return fixed_point(lambda carry: run(form.body.jaxpr, [*bc, *carry], backward), init,
                       bool.__or__)[0]
  if isinstance(form, Cond):
    branches = [run(b.jaxpr, ins[1:], backward) for b in form.branches]
    return [any(flags) for flags in zip(*branches)]
  return [backward or any(ins)] * n   # a first-order equation, or bodies of a shape not known
