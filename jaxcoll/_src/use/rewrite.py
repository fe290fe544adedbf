"""``jaxcoll.use``'s work: trace ``fun`` to a jaxpr, then run it as jaxcoll collectives.

A function transformation in the style of jax's own. :func:`rewrite` traces ``fun`` on the
caller's values (or tracers) and asks :mod:`global_programs` what the program is:

- A global program (it computes on sharded values outside any shard_map, as plain
  ``jax.jit`` over sharded arrays does, where XLA's partitioner would insert the
  collectives): it runs per device in one shard_map (:mod:`evaluator`), each layout change
  a jaxcoll collective.
- A program of shard_maps: the jaxpr is evaluated equation by equation
  (:func:`eval_jaxpr`, on :func:`interpreter.evaluate`). Each lax collective over
  shard_map axes becomes the jaxcoll collective with the same semantics
  (:data:`collective_rules.COLLECTIVES`); each higher-order primitive is rebuilt with
  jax's public API around an evaluation of its body, by its form (``BY_FORM``: scan, while,
  cond, calls) or, where it carries more than its body, by name (``REBUILT``: shard_map,
  jit, checkpoint with the user's policy, custom_jvp/custom_vjp with their rules). Every
  other equation is bound as it was.

Because the evaluation runs on the caller's tracers, ``jax.grad(use(f))``,
``use(jax.grad(f))``, ``jax.jit(use(f))`` and ``jax.vmap`` compose as usual; the gradient
sums JAX makes for replicated values when it transposes (``pvary``'s, and a
``check_vma=False`` shard_map's own) run as jaxcoll all_reduces (:mod:`gradient_sums`).

Left to XLA (reported by ``jaxcoll.explain_step``): collectives with ``axis_index_groups``,
collectives over axes that are not manual shard_map axes (``vmap``/``pmap`` axis names),
ppermutes that are not a shift, and mesh axes ``use(axes=...)`` leaves out.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from jaxcoll._src import compat
from jaxcoll._src.config import config
from jaxcoll._src.interpreter import Body, Call, Cond, Scan, While, evaluate, form_of
from jaxcoll._src.use import ahead
from jaxcoll._src.use import evaluator as spmd
from jaxcoll._src.use.collective_rules import CASTS, COLLECTIVES, left_because
from jaxcoll._src.use.global_programs import global_program
from jaxcoll._src.use.jit_arguments import arguments, in_memory, laid_out, static_key, type_key
from jaxcoll._src.use.options import Options
from jaxcoll._src.use.placement import entries, from_spec, with_leading
from jaxcoll.extend import (
  ReportLine,
  record_at,
  record_in_use,
  record_note,
  record_repeated,
)

# ---- higher-order primitives, rebuilt with jax's public API around eval_jaxpr ----

def _shard_map(opts, eqn, form: Call, invals):
  """The body rewritten, with the gradient sums JAX would make for replicated values on
  jaxcoll too (:mod:`varying`): under ``check_vma=True`` every ``pvary`` equation of the body
  becomes ``vary`` (``_pvary``); under ``check_vma=False`` every input left replicated over
  some manual axes enters stacked over them (``stack``), so shard_map's own transpose has
  nothing to sum. Values and gradients are the program's."""
  p = eqn.params
  manual = tuple(p["newly_manual_axes"])
  body = _evaluator(opts, form.body)
  in_specs, out_specs = list(p["in_specs"]), tuple(p["out_specs"])
  stacked = [False] * len(invals)
  if not p["check_vma"]:
    names = tuple(p["mesh"].axis_names)
    batched = compat.vmap_spmd_axes()   # a vmap's batch splits them: no copies to sum
    for i, (x, spec) in enumerate(zip(invals, in_specs)):
      named = from_spec(spec, len(entries(spec)), manual).used
      missing = tuple(a for a in names if a in manual and a not in named and a not in batched)
      if missing:
        invals[i] = opts.stack(x, p["mesh"], missing, entries(spec))
        in_specs[i], stacked[i] = with_leading(spec, missing), True

  def run(*args):
    return tuple(body(*[a[0] if s else a for a, s in zip(args, stacked)]))

  return jax.shard_map(run, mesh=p["mesh"], in_specs=tuple(in_specs), out_specs=out_specs,
                       check_vma=p["check_vma"], axis_names=set(manual))(*invals)


def _jit(opts, eqn, form: Call, invals):
  """The body rewritten, under a jit with the equation's donations and declared shardings
  (those that are shardings: a declared output layout is kept, as jit keeps it)."""
  p = eqn.params
  body = _evaluator(opts, form.body)
  declared = lambda ss: [s if isinstance(s, jax.sharding.Sharding) else None  # noqa: E731
                         for s in ss]
  ins, outs = declared(p["in_shardings"]), declared(p["out_shardings"])

  def fn(*args):
    args = [a if s is None else jax.lax.with_sharding_constraint(a, s)
            for a, s in zip(args, ins)]
    return tuple(body(*args))

  fn.__name__ = p.get("name", "jit")
  donate = tuple(i for i, d in enumerate(p.get("donated_invars", ())) if d)
  return jax.jit(fn, donate_argnums=donate, keep_unused=p.get("keep_unused", False),
                 out_shardings=tuple(outs))(*invals)   # None: unconstrained


def _scan(opts, eqn, form: Scan, invals):
  body = _evaluator(opts, form.body)
  c, init, xs = form.split(invals)

  def step(carry_in, x):
    out = body(*c, *carry_in, *x)
    return tuple(out[:form.carry]), tuple(out[form.carry:])

  with record_repeated(form.length):
    carry_out, ys = lax.scan(step, tuple(init), tuple(xs), length=form.length,
                             reverse=form.reverse, unroll=form.unroll)
  return [*carry_out, *ys]


def _while(opts, eqn, form: While, invals):
  cond, body = _evaluator(opts, form.cond), _evaluator(opts, form.body)
  cc, bc, init = form.split(invals)
  return list(lax.while_loop(lambda v: cond(*cc, *v)[0], lambda v: tuple(body(*bc, *v)),
                             tuple(init)))


def _cond(opts, eqn, form: Cond, invals):
  branches = [_evaluator(opts, b) for b in form.branches]
  index, *ops = invals
  return list(lax.switch(index, [lambda *a, b=b: tuple(b(*a)) for b in branches], *ops))


def _call(opts, eqn, form: Call, invals):
  """A call whose result is its body's (closed_call, core_call): the body rewritten, in this
  trace; a primitive that only looks like one (:attr:`Call.inline` False) bound as it was."""
  return _evaluator(opts, form.body)(*invals) if form.inline else None


def _checkpoint(opts, eqn, form: Call, invals):
  p = eqn.params
  body = _evaluator(opts, form.body)
  return list(jax.checkpoint(lambda *a: tuple(body(*a)), prevent_cse=p["prevent_cse"],
                             policy=p["policy"])(*invals))


def _custom_jvp(opts, eqn, form: Call, invals):
  """The primal is the rewritten body; the tangent the user's rule (its jaxpr,
  :func:`compat.custom_jvp_rule`), rewritten too."""
  body = _evaluator(opts, form.body)
  consts = eqn.params["num_consts"]

  @jax.custom_jvp
  def fn(*args):
    return tuple(body(*args))

  @fn.defjvp
  def _(primals, tangents):
    jaxpr, rule_consts, out_zeros = compat.custom_jvp_rule(eqn.params)
    out = eval_jaxpr(opts, jaxpr, rule_consts, [*primals[consts:], *tangents[consts:]])
    out_primals, nonzero = out[:len(out_zeros)], iter(out[len(out_zeros):])
    return tuple(out_primals), tuple(jnp.zeros_like(p) if zero else next(nonzero)
                                     for p, zero in zip(out_primals, out_zeros))

  return list(fn(*invals))


def _custom_vjp(opts, eqn, form: Call, invals):
  """The primal is the rewritten body; forward and backward are jax.vjp of the original
  equation (the user's fwd and bwd), each rewritten."""
  body, original = _evaluator(opts, form.body), _bound(eqn)

  @jax.custom_vjp
  def fn(*args):
    return tuple(body(*args))

  def fwd(*args):
    return rewrite(lambda *a: jax.vjp(original, *a), opts)(*args)

  def bwd(vjp_fn, cts):
    return tuple(rewrite(vjp_fn, opts)(cts))

  fn.defvjp(fwd, bwd)
  return list(fn(*invals))


# Higher-order equations, by form (:mod:`jaxcoll._src.interpreter`); the calls that carry
# more than their body (shardings, donations, a remat policy, custom derivatives, a mesh) are
# rebuilt with their own jax API (REBUILT, by primitive).
BY_FORM: dict[type, Callable] = {Scan: _scan, While: _while, Cond: _cond, Call: _call}
REBUILT: dict[str, Callable] = {
    "shard_map": _shard_map, "jit": _jit, "pjit": _jit, "checkpoint": _checkpoint,
    "remat2": _checkpoint, "custom_jvp_call": _custom_jvp, "custom_vjp_call": _custom_vjp,
    "custom_vjp_call_jaxpr": _custom_vjp,
}


# ---- the evaluator ----

def _bind(eqn, invals):
  out = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))
  return list(out) if eqn.primitive.multiple_results else [out]


def _bound(eqn):
  """The equation as a function of its inputs, exactly as it was (a tuple of outputs)."""
  return lambda *args: tuple(_bind(eqn, args))


def eval_jaxpr(opts: Options, jaxpr, consts, args) -> list:
  """Evaluates ``jaxpr`` on ``args`` with the rewrite rules (:func:`interpreter.evaluate`)."""
  def apply(eqn, invals):
    name = eqn.primitive.name
    out = None
    with eqn.ctx.manager:
      if name in CASTS and not opts.casts:
        out = invals
      elif name in COLLECTIVES:
        with record_at(name, compat.source_line(eqn)):
          out = COLLECTIVES[name](opts, invals, eqn.params)
          if out is None and name != "pvary":
            record_note(ReportLine.XLA, name, left_because(eqn.params))
      elif (form := form_of(eqn)) is not None:
        out = REBUILT.get(name, BY_FORM[type(form)])(opts, eqn, form, invals)
      if out is None:
        out = _bind(eqn, invals)
    return out
  return evaluate(jaxpr, consts, args, apply)


def _evaluator(opts: Options, body: Body) -> Callable:
  """A body as a function of its inputs."""
  return lambda *args: eval_jaxpr(opts, body.jaxpr, body.consts, args)


def rewrite(fun: Callable, opts: Options) -> Callable:
  """``fun`` traced to a jaxpr and evaluated with the rewrite rules; same pytrees in and out.

  Called with concrete arrays laid out on a mesh, the rewritten function is compiled once
  per layout (``jax.jit``, keyed by the arguments' shapes, dtypes and shardings), the
  layouts becoming its ``in_shardings``: a global program needs them to run per device.
  ``.lower(*args, **kwargs)`` lowers it as that call would run (a fresh trace)."""
  compiled: dict = {}

  def split(args, kwargs):
    """The argument leaves, their tree, the positions of the arrays among them, the layouts
    (:func:`_laid_out`) and the cache key."""
    flat, in_tree, dynamic, donated = arguments(fun, args, kwargs)
    arrays = [flat[i] for i in dynamic]
    layouts = laid_out(arrays) if opts.in_shardings is None and opts.axes != () else None
    key = (in_tree, layouts, tuple(type_key(x) if i in dynamic else static_key(x)
                                   for i, x in enumerate(flat)))
    return flat, in_tree, dynamic, donated, layouts, key

  def jitted(flat, in_tree, dynamic, donated, layouts):
    given = copy.copy(opts)
    given.in_flat = None if layouts is None else list(layouts)
    given.memory = {}   # output leaf -> a declared sharding in host memory (filled at trace)
    traced = _traced(fun, given)
    static = [None if i in dynamic else x for i, x in enumerate(flat)]   # no array kept

    def call(*arrays):
      full = list(static)
      for i, x in zip(dynamic, arrays):
        full[i] = x
      a, k = jax.tree.unflatten(in_tree, full)
      return traced(*a, **k)
    run = jax.jit(call, donate_argnums=tuple(k for k, i in enumerate(dynamic) if i in donated))

    def finish(out):   # host memory a device_put inside jit leaves unset (unpinned_host)
      leaves, tree = jax.tree.flatten(out)
      return jax.tree.unflatten(tree, [jax.device_put(x, given.memory[i]) if i in given.memory
                                       and x.sharding != given.memory[i] else x
                                       for i, x in enumerate(leaves)])
    return run, finish

  @functools.wraps(fun)
  def wrapped(*args, **kwargs):
    flat, in_tree, dynamic, donated, layouts, key = split(args, kwargs)
    if layouts is None:
      return _traced(fun, opts)(*args, **kwargs)
    if key not in compiled:
      compiled[key] = jitted(flat, in_tree, dynamic, donated, layouts)
    run, finish = compiled[key]
    return finish(run(*[flat[i] for i in dynamic]))

  def lower(*args, **kwargs):
    """Lowered as the call would run, from arrays or their ``jax.ShapeDtypeStruct``s."""
    flat, in_tree, dynamic, donated, layouts, key = split(args, kwargs)
    run, finish = jitted(flat, in_tree, dynamic, donated, layouts)

    def arrays(args, kwargs):   # a call of the executable: the arguments lowered with
      got = split(args, kwargs)
      if (got[1], got[5][2]) != (in_tree, key[2]):
        raise TypeError("use(...).lower(...).compile() called with arguments of other "
                        f"structure, types or static values than lowered with: {in_tree} "
                        f"and {got[1]}")
      return [got[0][i] for i in got[2]]
    return ahead.Lowered(run.lower(*[flat[i] for i in dynamic]), arrays, finish)

  wrapped.lower = lower
  wrapped._jaxcoll_use = True   # for jaxcoll.explain_step
  return wrapped


def _traced(fun: Callable, opts: Options) -> Callable:
  """``fun`` traced to a jaxpr on the caller's values and evaluated: a global program per
  device (:mod:`spmd`), anything else with the rewrite rules."""
  def run(*args, **kwargs):
    flat, in_tree, dynamic, _ = arguments(fun, args, kwargs)
    leaves = [flat[i] for i in dynamic]

    def flat_fun(*values):   # leaves that are no array pass as they are (jit's static args)
      full = list(flat)
      for i, x in zip(dynamic, values):
        full[i] = x
      a, k = jax.tree.unflatten(in_tree, full)
      return fun(*a, **k)

    closed, out_shape = jax.make_jaxpr(flat_fun, return_shape=True)(*leaves)
    out_tree = jax.tree.structure(out_shape)
    with config() if opts.profile is None else config(profile=opts.profile), record_in_use():
      program = global_program(opts, closed, leaves, in_tree, dynamic, out_tree)
      if program is None:
        out = eval_jaxpr(opts, closed.jaxpr, closed.consts, leaves)
      else:
        mesh, manual, places, out_places, given_out, nested = program
        out = spmd.run(closed, leaves, mesh, manual, places, spmd.options_for(opts),
                       opts.strict, out_places, island(opts), opts.stack, nested)
        out = [in_memory(o, s) for o, s in zip(out, given_out or [None] * len(out))]
        if opts.memory is not None:
          opts.memory.update({i: s for i, s in enumerate(given_out or ())
                              if getattr(s, "memory_kind", None) not in (None, "device")})
    return jax.tree.unflatten(out_tree, out)
  return run


def island(opts: Options):
  """How a shard_map inside a global program runs: its body on the pieces, collectives
  rewritten, JAX's casts the identity (nothing is typed there)."""
  inside = copy.copy(opts)
  inside.casts = False

  def run(body: Body, values):
    return eval_jaxpr(inside, body.jaxpr, body.consts, values)
  return run
