"""``jaxcoll.use``: an existing function's lax collectives, run as jaxcoll collectives.

A function transformation in the style of jax's own: trace ``fun`` to a jaxpr, then
evaluate the jaxpr equation by equation on the caller's values (or tracers). Each lax
collective over shard_map axes is replaced by the jaxcoll collective with the same
semantics (``COLLECTIVES``); each higher-order primitive is rebuilt with jax's public API
around an evaluation of its sub-jaxpr (``HIGHER_ORDER``), so the rewrite reaches into
shard_map bodies, nested jit, scan, while, cond, checkpoint (with the user's policy) and
custom_jvp/custom_vjp functions (their rules too). Every other equation is bound as it
was. Because the evaluation runs on the caller's tracers, ``jax.grad(use(f))``,
``use(jax.grad(f))``, ``jax.jit(use(f))`` and ``jax.vmap`` compose as usual; the gradient
sums JAX makes for replicated values when it transposes (``pvary``'s, and a
``check_vma=False`` shard_map's own) run as jaxcoll all_reduces (:mod:`varying`).

What a jaxpr cannot show: collectives that XLA's SPMD partitioner inserts by itself for a
``jax.jit`` over sharded arrays (sharding propagation, no shard_map) exist only after
compilation, so ``use`` cannot see them. Write the step under ``jax.shard_map`` (explicit
collectives) to put them in the jaxpr.

Left untouched: collectives with ``axis_index_groups``, collectives over axes that are not
manual shard_map axes (``vmap``/``pmap`` axis names), and ppermutes that are not a shift.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxcoll._src import compat
from jaxcoll._src.auto.profile import Profile
from jaxcoll._src.collectives import all_gather, all_reduce, all_to_all, reduce_scatter, shift
from jaxcoll._src.config import config
from jaxcoll._src.schedules.algorithms import algorithms
from jaxcoll._src.spec import PRIMITIVES
from jaxcoll._src.use import evaluator as spmd
from jaxcoll._src.use.gradient_sums import stack, vary
from jaxcoll._src.use.placement import entries, explicit, from_spec, with_leading
from jaxcoll.extend import (
  NATIVE,
  SCHEDULE,
  ReportLine,
  as_axes,
  axes_in_mesh,
  check_axis_names,
  check_choice,
  check_flag,
  compresses,
  record_at,
  record_in_use,
  record_note,
  record_repeated,
  record_where,
  wire_format,
)


class _Options:
  """What ``use`` was asked for: the algorithm per primitive, the wire format, the profile."""

  def __init__(self, algorithm, wire_dtype, profile, axes=None, in_shardings=None,
               out_shardings=None, strict: bool = False):
    if isinstance(algorithm, Mapping):
      for p, a in algorithm.items():
        check_choice(p, a, "use(algorithm=...)")
      self.algorithm = dict(algorithm)
    elif isinstance(algorithm, str):
      if algorithm not in ("auto", SCHEDULE) and not any(algorithm in algorithms(p)
                                                         for p in PRIMITIVES):
        raise ValueError(f"use(algorithm={algorithm!r}): no collective offers it; expected "
                         f"'auto', {SCHEDULE!r}, a mapping {{primitive: algorithm}} or a "
                         "name from jaxcoll.algorithms(primitive)")
      self.algorithm = algorithm
    else:
      raise ValueError(f"use(algorithm={algorithm!r}): expected 'auto', a name or a mapping "
                       "{primitive: algorithm}")
    self.wire = None if wire_dtype is None else wire_format(wire_dtype, np.float32)
    self.profile = None if profile is None else Profile.resolve(profile, "use(profile=...)")
    self.axes = None if axes is None else check_axis_names(axes, "use(axes=...)") if axes \
        else ()
    self.in_shardings, self.out_shardings = in_shardings, out_shardings
    self.in_flat = None   # the arguments' own shardings, flat (concrete arrays: rewrite)
    self.memory = None    # output leaf -> declared host-memory sharding (rewrite fills it)
    self.strict = check_flag(strict, "use(strict=...)")
    self.casts = True   # pvary as jaxcoll's vary (False inside a global program's shard_map)

  def algorithm_for(self, primitive: str, axes: tuple[str, ...]):
    """A name applies to each primitive that offers it (hierarchical: over two axes or more);
    every other primitive gets "auto", or, when the name is a schedule's, "schedule" (auto
    among the schedules: forcing a schedule keeps every collective off the lax one)."""
    if isinstance(self.algorithm, dict):
      return self.algorithm.get(primitive, "auto")
    name = self.algorithm
    if name not in algorithms(primitive, num_axes=len(axes)):
      return "auto" if name in ("auto", NATIVE) else SCHEDULE
    return name

  def wire_for(self, primitive: str, dtype, op: str = "sum") -> dict:
    """``wire_dtype=`` where ``use`` sends a collective compressed: the sums
    (all_reduce, reduce_scatter) and gathers of data the format compresses. Never a max or
    a min (it selects a value: a rounded maximum matches no device's own, and argmax over a
    split dimension reads that match), nor an all_to_all; the rest travel as they are. The
    one place ``use`` decides it, for shard_map programs and global ones alike.

    Raises:
      ValueError: a float64 value to compress: a block-scaled or bfloat16 wire encodes in
        float32, where a float64 value beyond its range has no home (it would arrive inf or
        NaN); the error names the equation and its source line.
    """
    wanted = primitive in ("all_reduce", "reduce_scatter", "all_gather") and op == "sum"
    if not (wanted and compresses(self.wire, dtype)):
      return {}
    if jnp.dtype(dtype).itemsize > 4:
      equation, line = record_where()
      wire = getattr(self.wire, "name", self.wire)
      raise ValueError(
          f"use(wire_dtype={wire!r}): the {primitive} of a {jnp.dtype(dtype)} value "
          f"({equation} at {line}) would be encoded in float32, where a float64 value "
          f"has no home beyond float32's range; cast it to float32 in the step, or pass "
          f"wire_dtype=None")
    return {"wire_dtype": self.wire}

  def vary(self, x, axes: tuple[str, ...]):
    """:func:`varying.vary` with this rewrite's algorithm and wire format for its sum."""
    return vary(x, axes, *self._sum_options(axes))

  def stack(self, x, mesh, axes: tuple[str, ...], spec):
    """:func:`varying.stack` with this rewrite's algorithm and wire format for its sum."""
    return stack(x, mesh, axes, spec, *self._sum_options(axes))

  def _sum_options(self, axes) -> tuple:
    return self.algorithm_for("all_reduce", axes), self.wire


def _manual(params, key: str = "axis_name") -> tuple[str, ...] | None:
  """The equation's axes (``params[key]``) as a tuple when every one is a manual
  (shard_map) axis here and no ``axis_index_groups`` are given, else None."""
  axes = as_axes(params[key])
  manual = set(getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ()) or ())
  if not axes or not set(axes) <= manual or params.get("axis_index_groups") is not None:
    return None
  return axes


def _left_because(params) -> str:
  """Why a lax collective stays with XLA (:func:`_manual` gave None)."""
  if params.get("axis_index_groups") is not None:
    return "axis_index_groups has no jaxcoll equivalent"
  if "perm" in params and _manual(params) is not None:
    return "a permutation that is not a shift"
  return "its axes are not manual shard_map axes here (vmap or pmap names)"


# ---- lax collective -> jaxcoll collective (None: leave the equation as it is) ----

def _reduce(op: str):
  def rule(opts, invals, params):
    axes = _manual(params, "axes")
    if axes is None:
      return None
    return [all_reduce(x, axes, op=op, **opts.wire_for("all_reduce", x.dtype, op),
                       algorithm=opts.algorithm_for("all_reduce", axes))
            for x in invals]
  return rule


def _all_gather(to: str):
  def rule(opts, invals, params):
    axes = _manual(params)
    if axes is None:
      return None
    (x,) = invals
    return [all_gather(x, axes, axis=params["all_gather_dimension"],
                       tiled=params["tiled"], to=to, **opts.wire_for("all_gather", x.dtype),
                       algorithm=opts.algorithm_for("all_gather", axes))]
  return rule


def _reduce_scatter(opts, invals, params):
  axes = _manual(params)
  if axes is None:
    return None
  (x,) = invals
  return [reduce_scatter(x, axes, scatter_dimension=params["scatter_dimension"],
                         tiled=params["tiled"], **opts.wire_for("reduce_scatter", x.dtype),
                         algorithm=opts.algorithm_for("reduce_scatter", axes))]


def _all_to_all(opts, invals, params):
  """The primitive splits ``split_axis`` into N blocks and concatenates them along
  ``concat_axis`` whatever its ``tiled`` flag (lax.all_to_all reshapes around it)."""
  axes = _manual(params)
  if axes is None:
    return None
  (x,) = invals
  return [all_to_all(x, axes, params["split_axis"], params["concat_axis"],
                     tiled=True, algorithm=opts.algorithm_for("all_to_all", axes))]


def shift_of(perm, n: int) -> tuple[int, bool] | None:
  """``(offset, wrap)`` when ``perm`` sends every rank i to i + offset (mod n with wrap;
  without wrap, every rank whose destination exists), else None."""
  perm = sorted((int(s), int(d)) for s, d in perm)
  if not perm:
    return None
  offset = perm[0][1] - perm[0][0]
  if perm == [(i, (i + offset) % n) for i in range(n)]:
    return offset % n, True
  if perm == [(i, i + offset) for i in range(n) if 0 <= i + offset < n]:
    return offset, False
  return None


def _ppermute(opts, invals, params):
  axes = _manual(params)
  if axes is None:
    return None
  names = tuple(jax.sharding.get_abstract_mesh().axis_names)
  axes = tuple(sorted(axes, key=names.index))   # ppermute reads perm in mesh order
  found = shift_of(params["perm"], int(np.prod([lax.axis_size(a) for a in axes])))
  if found is None:
    return None
  offset, wrap = found
  (x,) = invals
  return [shift(x, axes, offset, wrap=wrap, algorithm=opts.algorithm_for("shift", axes))]


def _pvary(opts, invals, params):
  """JAX's invariant-to-varying cast, as :func:`varying.vary`: its transpose (the gradient sum
  of a replicated value) runs as jaxcoll's all_reduce. Inside a global program run per
  device (:mod:`spmd`, nothing typed) the cast is the identity."""
  axes = _manual(params, "axes")
  if axes is None:
    return None
  return [opts.vary(x, axes) if opts.casts else x for x in invals]


def _untyped(rule: Callable) -> Callable:
  """A collective over JAX's ``unreduced``/``reduced`` types, rewritten inside a global
  program run per device (nothing typed there: it is the plain collective); elsewhere left
  to XLA, its result typed as jax types it."""
  def wrapped(opts, invals, params):
    return None if opts.casts else rule(opts, invals, params)
  return wrapped


COLLECTIVES: dict[str, Callable] = {
    "pvary": _pvary,
    "psum": _reduce("sum"), "psum_invariant": _reduce("sum"),
    "pmax": _reduce("max"), "pmin": _reduce("min"),
    "all_gather": _all_gather("varying"), "all_gather_invariant": _all_gather("invarying"),
    "reduce_scatter": _reduce_scatter, "all_to_all": _all_to_all, "ppermute": _ppermute,
    "unreduced_psum": _untyped(_reduce("sum")),
    "unreduced_reduce_scatter": _untyped(_reduce_scatter),
    "all_gather_reduced": _untyped(_all_gather("varying")),
}

# JAX's casts between varying, unreduced and reduced types: no data moves (the names carry a
# "_p" on jax 0.10). Inside a global program run per device they are the identity.
CASTS = frozenset({"vary_unreduced_cast", "vary_unreduced_cast_p", "reduced_vary_cast",
                   "reduced_vary_cast_p", "preduced"})


# ---- higher-order primitives, rebuilt with jax's public API around eval_jaxpr ----

def _shard_map(opts, eqn, invals):
  """The body rewritten, with the gradient sums JAX would make for replicated values on
  jaxcoll too (:mod:`varying`): under ``check_vma=True`` every ``pvary`` equation of the body
  becomes ``vary`` (``_pvary``); under ``check_vma=False`` every input left replicated over
  some manual axes enters stacked over them (``stack``), so shard_map's own transpose has
  nothing to sum. Values and gradients are the program's."""
  p = eqn.params
  manual = tuple(p["newly_manual_axes"])
  body = _evaluator(opts, p["jaxpr"])
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


def _jit(opts, eqn, invals):
  """The body rewritten, under a jit with the equation's donations and declared shardings
  (those that are shardings: a declared output layout is kept, as jit keeps it)."""
  p = eqn.params
  body = _evaluator(opts, p["jaxpr"])
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


def _scan(opts, eqn, invals):
  p = eqn.params
  consts, carry = compat.scan_counts(p)
  body = _evaluator(opts, p["jaxpr"])
  c, init, xs = invals[:consts], invals[consts:consts + carry], invals[consts + carry:]

  def step(carry_in, x):
    out = body(*c, *carry_in, *x)
    return tuple(out[:carry]), tuple(out[carry:])

  with record_repeated(p["length"]):
    carry_out, ys = lax.scan(step, tuple(init), tuple(xs), length=p["length"],
                             reverse=p["reverse"], unroll=p["unroll"])
  return [*carry_out, *ys]


def _while(opts, eqn, invals):
  p = eqn.params
  nc, nb = p["cond_nconsts"], p["body_nconsts"]
  cond, body = _evaluator(opts, p["cond_jaxpr"]), _evaluator(opts, p["body_jaxpr"])
  cc, bc, init = invals[:nc], invals[nc:nc + nb], invals[nc + nb:]
  return list(lax.while_loop(lambda v: cond(*cc, *v)[0], lambda v: tuple(body(*bc, *v)),
                             tuple(init)))


def _cond(opts, eqn, invals):
  branches = [_evaluator(opts, b) for b in eqn.params["branches"]]
  index, *ops = invals
  return list(lax.switch(index, [lambda *a, b=b: tuple(b(*a)) for b in branches], *ops))


def _checkpoint(opts, eqn, invals):
  p = eqn.params
  body = _evaluator(opts, p["jaxpr"])
  return list(jax.checkpoint(lambda *a: tuple(body(*a)), prevent_cse=p["prevent_cse"],
                             policy=p["policy"])(*invals))


def _custom_jvp(opts, eqn, invals):
  """The primal is the rewritten body; the tangent the user's rule (its jaxpr,
  :func:`compat.custom_jvp_rule`), rewritten too."""
  body = _evaluator(opts, eqn.params["call_jaxpr"])
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


def _custom_vjp(opts, eqn, invals):
  """The primal is the rewritten body; forward and backward are jax.vjp of the original
  equation (the user's fwd and bwd), each rewritten."""
  body, original = _evaluator(opts, eqn.params["call_jaxpr"]), _bound(eqn)

  @jax.custom_vjp
  def fn(*args):
    return tuple(body(*args))

  def fwd(*args):
    return rewrite(lambda *a: jax.vjp(original, *a), opts)(*args)

  def bwd(vjp_fn, cts):
    return tuple(rewrite(vjp_fn, opts)(cts))

  fn.defvjp(fwd, bwd)
  return list(fn(*invals))


HIGHER_ORDER: dict[str, Callable] = {
    "shard_map": _shard_map, "jit": _jit, "pjit": _jit, "scan": _scan, "while": _while,
    "cond": _cond, "checkpoint": _checkpoint, "remat2": _checkpoint,
    "custom_jvp_call": _custom_jvp, "custom_vjp_call": _custom_vjp,
    "custom_vjp_call_jaxpr": _custom_vjp,
}


# ---- the evaluator ----

def _bind(eqn, invals):
  out = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))
  return list(out) if eqn.primitive.multiple_results else [out]


def _bound(eqn):
  """The equation as a function of its inputs, exactly as it was (a tuple of outputs)."""
  return lambda *args: tuple(_bind(eqn, args))


def eval_jaxpr(opts: _Options, jaxpr, consts, args) -> list:
  """Evaluates ``jaxpr`` on ``args`` with the rewrite rules (jax.core.eval_jaxpr's loop)."""
  env = {}

  def read(v):
    return v.val if isinstance(v, jax.extend.core.Literal) else env[v]

  for var, val in zip(jaxpr.constvars, consts):
    env[var] = val
  for var, val in zip(jaxpr.invars, args):
    env[var] = val
  for eqn in jaxpr.eqns:
    invals = [read(v) for v in eqn.invars]
    name = eqn.primitive.name
    out = None
    with eqn.ctx.manager:
      if name in CASTS and not opts.casts:
        out = invals
      elif name in COLLECTIVES:
        with record_at(name, compat.source_line(eqn)):
          out = COLLECTIVES[name](opts, invals, eqn.params)
          if out is None and name != "pvary":
            record_note(ReportLine.XLA, name, _left_because(eqn.params))
      elif name in HIGHER_ORDER:
        out = HIGHER_ORDER[name](opts, eqn, invals)
      if out is None:
        out = _bind(eqn, invals)
    for var, val in zip(eqn.outvars, out):
      if not isinstance(var, jax.extend.core.DropVar):
        env[var] = val
  return [read(v) for v in jaxpr.outvars]


def _evaluator(opts: _Options, sub) -> Callable:
  """A sub-jaxpr (closed on jax 0.10, open on 0.12) as a function of its inputs."""
  jaxpr, consts = compat.open_jaxpr(sub)
  return lambda *args: eval_jaxpr(opts, jaxpr, consts, args)


def rewrite(fun: Callable, opts: _Options) -> Callable:
  """``fun`` traced to a jaxpr and evaluated with the rewrite rules; same pytrees in and out.

  Called with concrete arrays laid out on a mesh, the rewritten function is compiled once
  per layout (``jax.jit``, keyed by the arguments' shapes, dtypes and shardings), the
  layouts becoming its ``in_shardings``: a global program needs them to run per device.
  ``.lower(*args, **kwargs)`` lowers it as that call would run (a fresh trace)."""
  compiled: dict = {}

  def split(args, kwargs):
    """The argument leaves, their tree, the positions of the arrays among them, the layouts
    (:func:`_laid_out`) and the cache key."""
    flat, in_tree, dynamic, donated = _arguments(fun, args, kwargs)
    arrays = [flat[i] for i in dynamic]
    layouts = _laid_out(arrays) if opts.in_shardings is None and opts.axes != () else None
    key = (in_tree, layouts, tuple(_type_key(x) if i in dynamic else _static_key(x)
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

    def moved(*arrays):   # host memory a device_put inside jit leaves unset (unpinned_host)
      leaves, tree = jax.tree.flatten(run(*arrays))
      return jax.tree.unflatten(tree, [jax.device_put(x, given.memory[i]) if i in given.memory
                                       and x.sharding != given.memory[i] else x
                                       for i, x in enumerate(leaves)])
    moved.lower = run.lower
    return moved

  @functools.wraps(fun)
  def wrapped(*args, **kwargs):
    flat, in_tree, dynamic, donated, layouts, key = split(args, kwargs)
    if layouts is None:
      return _traced(fun, opts)(*args, **kwargs)
    if key not in compiled:
      compiled[key] = jitted(flat, in_tree, dynamic, donated, layouts)
    return compiled[key](*[flat[i] for i in dynamic])

  def lower(*args, **kwargs):
    flat, in_tree, dynamic, donated, layouts, _ = split(args, kwargs)
    return jitted(flat, in_tree, dynamic, donated, layouts).lower(*[flat[i] for i in dynamic])

  wrapped.lower = lower
  wrapped._jaxcoll_use = True   # for jaxcoll.explain_step
  return wrapped


def _traced(fun: Callable, opts: _Options) -> Callable:
  """``fun`` traced to a jaxpr on the caller's values and evaluated: a global program per
  device (:mod:`spmd`), anything else with the rewrite rules."""
  def run(*args, **kwargs):
    flat, in_tree, dynamic, _ = _arguments(fun, args, kwargs)
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
      global_program = _global_program(opts, closed, leaves, in_tree, dynamic, out_tree)
      if global_program is None:
        out = eval_jaxpr(opts, closed.jaxpr, closed.consts, leaves)
      else:
        mesh, manual, places, out_places, given_out, nested = global_program
        out = spmd.run(closed, leaves, mesh, manual, places, spmd.options_for(opts),
                       opts.strict, out_places, _island(opts), opts.stack, nested)
        out = [_in_memory(o, s) for o, s in zip(out, given_out or [None] * len(out))]
        if opts.memory is not None:
          opts.memory.update({i: s for i, s in enumerate(given_out or ())
                              if getattr(s, "memory_kind", None) not in (None, "device")})
    return jax.tree.unflatten(out_tree, out)
  return run


def _arguments(fun, args, kwargs) -> tuple[list, object, list[int], set[int]]:
  """``(leaves, tree, dynamic, donated)``: the argument leaves of ``(args, kwargs)``, the
  positions of those traced (``dynamic``) and of those donated.

  Traced: arrays and tracers; for a function ``jax.jit`` wrapped, also Python numbers
  outside its static arguments (weakly typed, as jit traces them: a new learning rate is
  no new program), and its donated arguments are donated. Any other leaf (a function, a
  config field, a Python number given to a plain function) passes to the function as it
  is, as jit passes its static arguments."""
  flat, tree = jax.tree_util.tree_flatten_with_path((args, kwargs))
  jitted = compat.jit_arguments(fun)
  static, static_names, donate, donate_names = jitted or ((),) * 4

  def where(path):   # ("pos", index) or ("name", keyword) of the argument a leaf is in
    top, arg = path[0].idx, path[1]
    return ("pos", arg.idx) if top == 0 else ("name", arg.key)

  dynamic, donated = [], set()
  for i, (path, x) in enumerate(flat):
    kind, arg = where(path)
    is_static = arg in (static if kind == "pos" else static_names)
    if isinstance(x, (jax.Array, np.ndarray, np.generic, jax.core.Tracer)) or (
        jitted is not None and not is_static and isinstance(x, (bool, int, float, complex))):
      dynamic.append(i)
      if arg in (donate if kind == "pos" else donate_names):
        donated.add(i)
  return [x for _, x in flat], tree, dynamic, donated


def _type_key(x):
  """What a traced argument's program depends on: its shape, dtype and weak type."""
  return jnp.shape(x), jnp.result_type(x), jax.typeof(x).weak_type


def _static_key(x):
  try:
    hash(x)
    return ("static", type(x), x)
  except TypeError:
    return ("static", id(x))


def _global_program(opts: _Options, closed, flat, in_tree, dynamic, out_tree):
  """``(mesh, manual axes, input placements, output placements or None, output shardings
  or None, the nested jaxprs' laid-out constants)`` when ``closed`` is a global program to
  run per device (:mod:`spmd`): it computes on sharded values outside any shard_map; None
  for a program of shard_maps (rewritten in place).

  ``flat``: the argument leaves that are arrays, at ``dynamic`` among ``in_tree``'s.
  Input layouts: ``use(in_shardings=)``, else a jitted function's own ``in_shardings``
  (``use(jax.jit(step, in_shardings=...))``), else the arguments' (concrete arrays', or
  Explicit-mode types'); output layouts: ``use(out_shardings=)``, else the jitted
  function's, else as plain ``jit`` lays them out."""
  if opts.axes == ():
    return None
  jit_in, jit_out = _jit_layouts(closed.jaxpr)
  given_in = _flat_shardings(opts.in_shardings, in_tree, "in_shardings")
  given_in = [given_in[i] for i in dynamic] if given_in else _merge(jit_in, opts.in_flat)
  mesh = spmd.mesh_of(flat, given_in, _leaf_names(in_tree, dynamic))
  if mesh is None:
    return None
  names = tuple(mesh.axis_names)
  islands = _shard_map_axes(closed.jaxpr)
  nested = spmd.laid_out_consts(closed.jaxpr)
  consts = [*closed.consts, *nested]   # split constants split the program too
  if opts.axes is None:
    if not _computes_outside_shard_map(closed.jaxpr):
      return None
    places = spmd.input_places([*flat, *consts], names, [*(given_in or [None] * len(flat)),
                                                         *[None] * len(consts)])
    split = {a for p in places for a in p.sharded if mesh.shape[a] > 1}   # 1: nothing to say
    manual = tuple(a for a in names if a in split or a in islands)
    if not manual:
      return None
  else:
    axes_in_mesh(opts.axes, mesh, "use(axes=...)")
    manual = tuple(a for a in names if a in opts.axes)
    if not islands <= set(manual):
      raise ValueError(f"use(axes={opts.axes!r}): the program holds a shard_map over "
                       f"{tuple(a for a in names if a in islands)}, whose axes use runs per "
                       f"device; expected axes naming {sorted(islands - set(manual))} too, "
                       "or axes=None (every axis the inputs and shard_maps use)")
    left = sorted({a for p in spmd.input_places(flat, names, given_in) for a in p.sharded}
                  - set(manual))
    if left:
      record_note(ReportLine.XLA, "partitioner", "inputs split over mesh axes use(axes=...) does "
                  "not take: XLA's partitioner communicates over them", left)
  places = spmd.input_places(flat, manual, given_in)
  given_out = _merge(_flat_shardings(opts.out_shardings, out_tree, "out_shardings") or jit_out,
                     _typed(closed.jaxpr.outvars, manual))
  out_places = None if given_out is None else [
      from_spec(spmd.spec_of(s), len(v.aval.shape), manual) if s is not None else None
      for s, v in zip(given_out, closed.jaxpr.outvars)]
  return mesh, manual, places, out_places, given_out, nested


def _in_memory(x, sharding):
  """``x`` moved to the memory a declared output sharding names (``memory_kind``, e.g.
  "pinned_host"), as jit's ``out_shardings`` moves it; as it is for device memory."""
  kind = getattr(sharding, "memory_kind", None)
  if kind is None or kind == "device":
    return x
  return jax.device_put(x, sharding)


def _leaf_names(in_tree, dynamic) -> list[str]:
  """The names of the array arguments, as ``jax.jit``'s errors write them
  (``args[0]['w']``)."""
  tree = jax.tree.unflatten(in_tree, list(range(in_tree.num_leaves)))
  paths = {i: jax.tree_util.keystr(path) for path, i in
           jax.tree_util.tree_flatten_with_path(tree)[0]}
  return ["args" + paths[i][3:] if paths[i].startswith("[0]") else "kwargs" + paths[i][3:]
          for i in dynamic]


def _merge(first, second):
  """Per leaf, ``first``'s sharding where it has one, else ``second``'s."""
  if first is None or second is None:
    return first or second
  return [a if a is not None else b for a, b in zip(first, second)]


def _jit_layouts(jaxpr) -> tuple[list | None, list | None]:
  """A program that is one jitted function: the NamedShardings its ``in_shardings`` and
  ``out_shardings`` give the program's inputs and outputs (None where unspecified)."""
  if len(jaxpr.eqns) != 1 or jaxpr.eqns[0].primitive.name not in ("pjit", "jit"):
    return None, None
  eqn = jaxpr.eqns[0]

  def named(s):
    return s if isinstance(s, jax.sharding.NamedSharding) else None

  is_var = lambda v: not isinstance(v, jax.extend.core.Literal)   # noqa: E731
  ins = [None] * len(jaxpr.invars)
  position = {v: i for i, v in enumerate(jaxpr.invars)}
  for v, s in zip(eqn.invars, eqn.params["in_shardings"]):
    if is_var(v) and v in position and named(s) is not None:
      ins[position[v]] = named(s)
  made = dict(zip(eqn.outvars, eqn.params["out_shardings"]))
  outs = [named(made.get(v)) if is_var(v) else None for v in jaxpr.outvars]
  return (ins if any(ins) else None), (outs if any(outs) else None)


def _typed(outvars, manual) -> list | None:
  """The layouts the outputs' types give where the manual axes are Explicit (JAX's
  explicit sharding: a type's spec is where jit puts the value); None elsewhere."""
  def typed(v):
    sharding = getattr(v.aval, "sharding", None)
    return sharding if manual and explicit(getattr(sharding, "mesh", None), manual) else None
  out = [typed(v) for v in outvars]
  return out if any(s is not None for s in out) else None


def _flat_shardings(given, tree, argument: str):
  """``given`` (NamedSharding or PartitionSpec leaves: one for all, or a pytree prefix of the
  positional arguments, as ``jax.jit``'s ``in_shardings``, or of the outputs) flattened to
  ``tree``'s leaves (``(args, kwargs)`` or the outputs'); None if not given."""
  if given is None:
    return None
  is_leaf = lambda x: x is None or isinstance(x, (P, jax.sharding.Sharding))  # noqa: E731
  if argument == "in_shardings" and not is_leaf(given):
    given = (tuple(given) if isinstance(given, (tuple, list)) else (given,), None)
  try:
    if is_leaf(given):
      return [given] * tree.num_leaves
    example = jax.tree.unflatten(tree, list(range(tree.num_leaves)))
    out = [None] * tree.num_leaves

    def fill(s, sub):
      for i in jax.tree.leaves(sub):
        out[i] = s
    jax.tree.map(fill, given, example, is_leaf=is_leaf)
    return out
  except ValueError as e:
    raise ValueError(f"use({argument}=...): expected a pytree prefix of the "
                     f"{'arguments (args, kwargs)' if argument == 'in_shardings' else 'outputs'}"
                     f" with NamedSharding or PartitionSpec leaves ({e})") from None


def _laid_out(flat) -> tuple | None:
  """The arguments' shardings (None for a NumPy array or a Python number) when none is
  traced and some is laid out over a mesh (split, unreduced or reduced); else None."""
  if not flat or any(isinstance(x, jax.core.Tracer) for x in flat):
    return None
  shardings = tuple(x.sharding if isinstance(x, jax.Array) else None for x in flat)
  if not any(isinstance(s, jax.sharding.NamedSharding) and (
      any(entries(s.spec)) or s.spec.unreduced or s.spec.reduced) for s in shardings):
    return None
  return shardings


def _computes_outside_shard_map(jaxpr) -> bool:
  """Whether a top-level equation (through nested jit) is anything but a shard_map."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in ("pjit", "jit"):
      if _computes_outside_shard_map(compat.open_jaxpr(eqn.params["jaxpr"])[0]):
        return True
    elif eqn.primitive.name != "shard_map":
      return True
  return False


def _shard_map_axes(jaxpr) -> set:
  out = set()
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "shard_map":
      out |= set(eqn.params["newly_manual_axes"])
    for sub in compat.sub_jaxprs(eqn.params):
      if eqn.primitive.name != "shard_map":
        out |= _shard_map_axes(compat.open_jaxpr(sub)[0])
  return out


def _island(opts: _Options):
  """How a shard_map inside a global program runs: its body on the pieces, collectives
  rewritten, JAX's casts the identity (nothing is typed there)."""
  inside = copy.copy(opts)
  inside.casts = False

  def run(sub, values):
    jaxpr, consts = compat.open_jaxpr(sub)
    return eval_jaxpr(inside, jaxpr, consts, values)
  return run


def use(fun: Callable | None = None, *, algorithm="auto", wire_dtype=None, profile=None,
        axes=None, in_shardings=None, out_shardings=None, strict: bool = False):
  """Runs ``fun``'s lax collectives as jaxcoll collectives (a function transformation).

  Every ``psum`` (and its invariant form; ``pmean`` is a psum and a divide), ``pmax``,
  ``pmin``, ``all_gather``, ``psum_scatter``, ``all_to_all`` and every ``ppermute`` that is
  a shift (i -> i + k, wrapped or not) over shard_map axes becomes ``jaxcoll.all_reduce``,
  ``all_gather``, ``reduce_scatter``, ``all_to_all`` or ``shift`` with the same semantics:
  same shapes, dtypes and typing (invariant where lax's is), results within reduction-order
  tolerance, lax's gradients. The rewrite reaches into shard_map, nested jit, scan, while,
  cond, checkpoint/remat (the policy kept) and custom_jvp/custom_vjp functions (primal and
  rules); every other equation runs as it was.

  A step written for global arrays (plain ``jax.jit`` over sharded arrays, on an Auto or
  Explicit mesh) has no collective in its jaxpr: XLA's partitioner adds them. ``use`` runs
  such a step per device in one ``shard_map`` over the mesh axes its inputs are split on
  (:mod:`spmd`): each value tracked as split or a partial sum, jaxcoll collectives where a
  layout changes, partial sums reduced late and together in buckets. Inputs are laid out as
  the arguments are (concrete arrays' shardings, Explicit types), or as ``in_shardings`` or
  a jitted ``fun``'s own ``in_shardings`` say; arguments that are not arrays are passed as
  they are (a jitted function's static arguments). ``jaxcoll.explain_step`` reports what
  runs where.

  Usable as ``use(f)``, ``use(f, algorithm="ring")``, ``@use`` and ``@use(algorithm=...)``.

  Args:
    fun: the function (arguments: pytrees of arrays, and static values).
    algorithm: "auto" (the cost model, per call); a name, used by every primitive that
      offers it ("ring": all_reduce, reduce_scatter, all_gather; the others "schedule",
      auto among jaxcoll's schedules, so that no collective stays the lax one); or a
      mapping ``{primitive: algorithm}`` (unnamed primitives: "auto").
    wire_dtype: compress every floating all_reduce, reduce_scatter and all_gather
      (``jaxcoll.WIRE_DTYPES``); None sends values as they are.
    profile: the cost model's :class:`jaxcoll.Profile` (or preset name, or profile JSON path:
      :meth:`jaxcoll.Profile.resolve`) while ``fun`` is traced; None keeps
      ``jaxcoll.config``'s.
    axes: for a global program, the mesh axes jaxcoll takes over (the others stay with XLA's
      partitioner, reported); None: every axis the inputs are split on; () runs no global
      program per device.
    in_shardings: the inputs' layouts (NamedSharding or PartitionSpec leaves; a pytree
      prefix of ``(args, kwargs)``'s args, as ``jax.jit``'s), for abstract tracing.
    out_shardings: the outputs' layouts (a pytree prefix of the outputs); None: as the
      step computes them (a jitted ``fun``'s own ``out_shardings`` where it has them).
    strict: refuse (ValueError naming the equation and its source line) an equation whose
      split inputs have no per-device rule, instead of gathering them whole.

  Returns:
    The function, same pytrees in and out; ``.lower(*args)`` lowers it as that call runs.

  Raises:
    ValueError: an axis not in the mesh, shardings that are no prefix of the arguments,
      ``axes`` leaving out a shard_map's axes, inputs on different meshes (at the call),
      an equation refused under ``strict``. TypeError: ``fun`` that is not callable, a
      ``strict`` that is no bool.

  Example:
    >>> step = jaxcoll.use(train_step, algorithm="ring")   # doctest: +SKIP
    >>> params, loss = step(params, batch)   # arrays laid out on a mesh   # doctest: +SKIP
  """
  opts = _Options(algorithm, wire_dtype, profile, axes, in_shardings, out_shardings, strict)
  if fun is None:
    return lambda f: rewrite(_callable(f), opts)
  return rewrite(_callable(fun), opts)


def _callable(fun):
  if not callable(fun):
    raise TypeError(f"use(fun={fun!r}): expected a callable (a function, a jax.jit-ed "
                    "function, a flax apply), not a " + type(fun).__name__)
  return fun
