"""Higher-order equations: calls run inline, ``scan``/``while``/``cond`` run their bodies per
device (the carries' placements found by :func:`interpreter.fixed_point`), a ``shard_map``
inside the program runs as an island. (:mod:`jaxcoll._src.use.rules`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxcoll._src import compat
from jaxcoll._src.interpreter import Call, Cond, Scan, While, fixed_point
from jaxcoll._src.use.partial_sums import accumulators
from jaxcoll._src.use.placement import Local, Placement, from_spec, replicated
from jaxcoll._src.use.rules.elementwise import Refused, _ndim, fallback
from jaxcoll.extend import record_paused, record_repeated

# ---- higher-order ----

def _call(ev, eqn, form: Call, ins):
  """A call run inline (nested jit, checkpoint, custom_jvp/vjp: the primal): its body in this
  trace, its reductions the caller's; a primitive that only looks like a call
  (:attr:`Call.inline` False) has no rule (:func:`fallback`)."""
  if not form.inline:
    return fallback(ev, eqn, ins)
  return ev.run_jaxpr(form.body.jaxpr, [ev.const(c) for c in form.body.consts], ins,
                      inline=True)


def _jit(ev, eqn, form: Call, ins):
  """A nested jitted function, run inline; the shardings it declares (``in_shardings``,
  ``out_shardings``: NamedShardings) place its inputs and outputs, as they constrain them
  under ``jax.jit``."""
  p = eqn.params
  ins = [_constrained(ev, x, s, v) for x, s, v in zip(ins, p.get("in_shardings", ()), eqn.invars)]
  outs = _call(ev, eqn, form, ins)
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
  return fixed_point(places_of, carry, join_carry, rounds=rounds,
                     widest=lambda cs: [replicated(c.ndim) for c in cs])


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


def _scan(ev, eqn, form: Scan, ins):
  nc, ncarry = form.consts, form.carry
  body, body_consts = form.body.jaxpr, form.body.consts
  consts, init, xs = form.split(ins)
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

  with record_repeated(form.length):
    carry_out, ys_out = lax.scan(step, init_values, xs_values, length=form.length,
                                 reverse=form.reverse, unroll=form.unroll)
  return ([Local(v, t) for v, t in zip(carry_out, carry)]
          + [Local(v, Placement(((),) + t.dims, t.partial)) for v, t in zip(ys_out, ys)])


def _while(ev, eqn, form: While, ins):
  nc, nb = form.cond_consts, form.body_consts
  cond, cond_consts = form.cond.jaxpr, form.cond.consts
  body, body_consts = form.body.jaxpr, form.body.consts
  cc, bc, init = form.split(ins)
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


def _cond(ev, eqn, form: Cond, ins):
  index, *ops = ins
  ops = _summed(ev, ops)
  branches = [(b.jaxpr, b.consts) for b in form.branches]
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


def _shard_map(ev, eqn, form: Call, ins):
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
  outs = ev.rewrite_island(form.body, values)
  return [Local(o, from_spec(spec, _ndim(o), island)) for o, spec in zip(outs, p["out_specs"])]


# Higher-order equations, by form (:mod:`jaxcoll._src.interpreter`): calls run inline, loops
# and branches per device; nested jit (its shardings) and shard_map (an island) by name.
BY_FORM = {Call: _call, Scan: _scan, While: _while, Cond: _cond}
REBUILT = {"pjit": _jit, "jit": _jit, "shard_map": _shard_map}
