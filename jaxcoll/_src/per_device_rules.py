"""The table of ``use``'s per-device rules for the equations of a global program, by
primitive (:mod:`jaxcoll._src.use.rules` fills it with jaxcoll's own), and the one way to add
one from outside (:func:`register_rule`). A module of its own, importing nothing of
jaxcoll's but the table, so that ``jaxcoll.extend`` can offer it."""

from __future__ import annotations

from collections.abc import Callable

from jaxcoll._src.declarations import Declarations

RULES: Declarations = Declarations("per-device rule of primitive")


def register_rule(primitive: str, rule: Callable | str) -> None:
  """Declares how ``jaxcoll.use`` runs ``primitive`` per device in a global program: by the
  rule of the built-in primitive named ``rule`` ("sin" for an elementwise primitive,
  "optimization_barrier" for one that passes its inputs through, ...), or by ``rule(ev,
  eqn, ins)`` (the evaluator, the equation, its inputs' pieces; returns its outputs' pieces:
  jaxcoll's own rules' interface, not stable). A partial sum entering an outside primitive
  is reduced first: only jaxcoll's own linear primitives keep one partial.

  Raises:
    ValueError: a primitive that has a rule already; a ``rule`` naming a primitive with none.

  Example:
    >>> from jaxcoll.extend import register_spmd_rule, unregister_spmd_rule
    >>> register_spmd_rule("my_scale", "sin")
    >>> unregister_spmd_rule("my_scale")
  """
  if isinstance(rule, str) and rule not in RULES:
    raise ValueError(f"rule={rule!r}: no built-in primitive of that name has a rule; expected "
                     "e.g. 'sin' or 'optimization_barrier', or a function")
  RULES.add(primitive, RULES[rule] if isinstance(rule, str) else rule)


def unregister_rule(primitive: str) -> None:
  """Removes a rule :func:`register_rule` declared (not a built-in one)."""
  RULES.remove(primitive)
