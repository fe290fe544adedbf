"""One jaxpr interpreter: the loop over equations, the shape of every higher-order primitive,
and the fixed point of a loop's carries, for every reader of jaxprs in jaxcoll.

Four things read jaxprs: ``use``'s rewrite of shard_map programs (:mod:`jaxcoll._src.use.rewrite`),
its per-device evaluation of global programs (:mod:`jaxcoll._src.use.evaluator`), the
analysis of which values vary over which axes (:mod:`jaxcoll._src.varying_axes`) and the
traffic count (:mod:`jaxcoll._src.traffic`). Each supplies what a value is (a tracer, a
placed piece, a set of axes) and what one first-order equation does to it; this module
holds what they share:

- :func:`evaluate`: the environment of a jaxpr's variables, literals and dropped outputs;
- :func:`form_of`: what a higher-order equation is, read from its params once, in
  :data:`FORMS` (one entry a primitive): a :class:`Call` (a body whose inputs and outputs
  are the equation's, one to one: jit, checkpoint, custom_jvp/vjp, shard_map), a
  :class:`Scan`, a :class:`While` or a :class:`Cond`. A reader dispatches on the form, not
  on the primitive, so a new higher-order primitive is one entry here (:func:`register_form`)
  and every reader handles it;
- :func:`live`: which equations reach an output;
- :func:`walk`: every equation of a jaxpr and of its bodies, with how often it runs;
- :func:`fixed_point`: a loop's carries joined with what the body makes of them until they
  stop changing.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterator, Sequence

import jax

from jaxcoll._src import compat
from jaxcoll._src.declarations import Declarations


@dataclasses.dataclass(frozen=True)
class Body:
  """A sub-jaxpr, open, with the constants it closes over (jax 0.10 keeps them beside it)."""

  jaxpr: object
  consts: tuple

  @classmethod
  def of(cls, sub) -> Body:
    jaxpr, consts = compat.open_jaxpr(sub)
    return cls(jaxpr, tuple(consts))


@dataclasses.dataclass(frozen=True)
class Call:
  """A body run once on the equation's inputs, giving its outputs (one to one). ``inline``:
  the primitive is its body (every name in :data:`FORMS`); False for a primitive
  :data:`FORMS` does not name that only looks like a call (analyses read through it,
  rewrites bind it as it is)."""

  body: Body
  inline: bool = True

  @property
  def bodies(self) -> tuple[tuple[Body, int], ...]:
    return ((self.body, 1),)


@dataclasses.dataclass(frozen=True)
class Scan:
  """``lax.scan``: inputs ``consts, carry, xs``; outputs ``carry, ys``."""

  body: Body
  consts: int
  carry: int
  length: int
  reverse: bool
  unroll: object

  def split(self, ins: Sequence) -> tuple[list, list, list]:
    c, n = self.consts, self.carry
    return list(ins[:c]), list(ins[c:c + n]), list(ins[c + n:])

  @property
  def bodies(self) -> tuple[tuple[Body, int], ...]:
    return ((self.body, self.length),)


@dataclasses.dataclass(frozen=True)
class While:
  """``lax.while_loop``: inputs ``cond consts, body consts, carry``; outputs the carry."""

  cond: Body
  body: Body
  cond_consts: int
  body_consts: int

  def split(self, ins: Sequence) -> tuple[list, list, list]:
    c, b = self.cond_consts, self.body_consts
    return list(ins[:c]), list(ins[c:c + b]), list(ins[c + b:])

  @property
  def bodies(self) -> tuple[tuple[Body, int], ...]:
    return ((self.cond, 1), (self.body, 1))   # iterations unknown: counted once


@dataclasses.dataclass(frozen=True)
class Cond:
  """``lax.cond``/``lax.switch``: inputs ``index, operands``; one branch runs."""

  branches: tuple[Body, ...]

  @property
  def bodies(self) -> tuple[tuple[Body, int], ...]:
    return tuple((b, 1) for b in self.branches)


Form = Call | Scan | While | Cond


def _call(key: str) -> Callable[[dict], Call]:
  return lambda params: Call(Body.of(params[key]))


def _scan(params) -> Scan:
  consts, carry = compat.scan_counts(params)
  return Scan(Body.of(params["jaxpr"]), consts, carry, params["length"], params["reverse"],
              params["unroll"])


def _while(params) -> While:
  return While(Body.of(params["cond_jaxpr"]), Body.of(params["body_jaxpr"]),
               params["cond_nconsts"], params["body_nconsts"])


def _cond(params) -> Cond:
  return Cond(tuple(Body.of(b) for b in params["branches"]))


FORMS: Declarations = Declarations("higher-order primitive")


def register_form(primitive: str, form: Callable[[dict], Form], *,
                  built_in: bool = False) -> None:
  """Declares a higher-order primitive: ``form(params)`` reads its body (or bodies) as one of
  the forms; every jaxpr reader then handles it."""
  FORMS.add(primitive, form, built_in=built_in)


for _name, _form in {
    "pjit": _call("jaxpr"), "jit": _call("jaxpr"), "closed_call": _call("call_jaxpr"),
    "core_call": _call("call_jaxpr"), "checkpoint": _call("jaxpr"), "remat2": _call("jaxpr"),
    "custom_jvp_call": _call("call_jaxpr"), "custom_vjp_call": _call("call_jaxpr"),
    "custom_vjp_call_jaxpr": _call("fun_jaxpr"), "shard_map": _call("jaxpr"),
    "scan": _scan, "while": _while, "cond": _cond}.items():
  register_form(_name, _form, built_in=True)


def form_of(eqn) -> Form | None:
  """What the higher-order equation ``eqn`` is (:data:`FORMS`); a primitive not named there
  whose one sub-jaxpr takes the equation's inputs and gives its outputs is a :class:`Call`;
  None for a first-order equation."""
  read = FORMS.get(eqn.primitive.name)
  if read is not None:
    return read(eqn.params)
  subs = [Body.of(s) for s in compat.sub_jaxprs(eqn.params)]
  if len(subs) == 1 and len(subs[0].jaxpr.invars) == len(eqn.invars) \
      and len(subs[0].jaxpr.outvars) == len(eqn.outvars):
    return Call(subs[0], inline=False)
  return None


def evaluate(jaxpr, consts: Sequence, args: Sequence, apply: Callable[[object, list], list],
             literal: Callable = lambda v: v.val) -> list:
  """``jaxpr``'s outputs: ``apply(eqn, inputs)`` gives each equation's outputs from its
  inputs' values, ``literal(var)`` a literal's value (jax.core.eval_jaxpr's loop, for any
  kind of value)."""
  env = {}

  def read(v):
    return literal(v) if isinstance(v, jax.extend.core.Literal) else env[v]

  env.update(zip(jaxpr.constvars, consts))
  env.update(zip(jaxpr.invars, args))
  for eqn in jaxpr.eqns:
    for var, val in zip(eqn.outvars, apply(eqn, [read(v) for v in eqn.invars])):
      if not isinstance(var, jax.extend.core.DropVar):
        env[var] = val
  return [read(v) for v in jaxpr.outvars]


def live(jaxpr) -> list[bool]:
  """Per equation of ``jaxpr``: whether it has effects or some output of it reaches the
  jaxpr's outputs (XLA drops the rest, and an evaluator need not run them: a sum only a dead
  equation reads is never reduced)."""
  needed = {v for v in jaxpr.outvars if not isinstance(v, jax.extend.core.Literal)}
  out = [False] * len(jaxpr.eqns)
  for i in reversed(range(len(jaxpr.eqns))):
    eqn = jaxpr.eqns[i]
    if eqn.effects or any(v in needed for v in eqn.outvars
                          if not isinstance(v, jax.extend.core.DropVar)):
      out[i] = True
      needed.update(v for v in eqn.invars if not isinstance(v, jax.extend.core.Literal))
  return out


def _timed_bodies(eqn) -> tuple[tuple[Body, int], ...]:
  """``eqn``'s bodies with how many times each runs per run of ``eqn``: its form's, else
  every sub-jaxpr of a primitive ``FORMS`` does not know, once each."""
  form = form_of(eqn)
  if form is not None:
    return form.bodies
  return tuple((Body.of(s), 1) for s in compat.sub_jaxprs(eqn.params))


def bodies(eqn) -> list[Body]:
  """Every sub-jaxpr of ``eqn`` (its form's bodies; any other primitive's too), each once."""
  return [b for b, _ in _timed_bodies(eqn)]


def walk(jaxpr, times: int = 1) -> Iterator[tuple[object, int]]:
  """Every equation of ``jaxpr`` and of the bodies of its higher-order equations, with how
  many times it runs per run of ``jaxpr`` (a scan body's: its length; a while body's and a
  branch's: once)."""
  for eqn in jaxpr.eqns:
    yield eqn, times
    for body, repeat in _timed_bodies(eqn):
      yield from walk(body.jaxpr, times * repeat)


def fixed_point(step: Callable[[list], list], carry: list, join: Callable, *,
                rounds: int | None = None, widest: Callable | None = None) -> tuple[list, list]:
  """``(carry, step(carry))`` for carries a loop body maps to themselves: ``carry`` joined
  with the first ``len(carry)`` of ``step(carry)`` (``join(old, new)``) until it stops
  changing; after ``rounds`` without settling, ``widest(carry)`` (each carry as general as it
  can be)."""
  for _ in itertools.count() if rounds is None else range(rounds):
    out = step(carry)
    joined = [join(c, o) for c, o in zip(carry, out)]
    if joined == carry:
      return carry, out
    carry = joined
  carry = widest(carry)
  return carry, step(carry)
