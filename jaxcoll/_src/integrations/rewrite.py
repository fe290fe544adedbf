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

import functools
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxcoll._src import compat
from jaxcoll._src.algorithms import algorithms
from jaxcoll._src.collectives import all_gather, all_reduce, all_to_all, reduce_scatter, shift
from jaxcoll._src.config import config
from jaxcoll._src.integrations.varying import stack, vary
from jaxcoll._src.profile import Profile
from jaxcoll._src.spec import PRIMITIVES
from jaxcoll.tools import check_choice, compresses, wire_format


class _Options:
  """What ``use`` was asked for: the algorithm per primitive, the wire format, the profile."""

  def __init__(self, algorithm, wire_dtype, profile):
    if isinstance(algorithm, Mapping):
      for p, a in algorithm.items():
        check_choice(p, a, "use(algorithm=...)")
      self.algorithm = dict(algorithm)
    elif isinstance(algorithm, str):
      if algorithm != "auto" and not any(algorithm in algorithms(p) for p in PRIMITIVES):
        raise ValueError(f"use(algorithm={algorithm!r}): no collective offers it; expected "
                         "'auto', a mapping {primitive: algorithm} or a name from "
                         "jaxcoll.algorithms(primitive)")
      self.algorithm = algorithm
    else:
      raise ValueError(f"use(algorithm={algorithm!r}): expected 'auto', a name or a mapping "
                       "{primitive: algorithm}")
    self.wire = None if wire_dtype is None else wire_format(wire_dtype, np.float32)
    self.profile = None if profile is None else Profile.resolve(profile, "use(profile=...)")

  def algorithm_for(self, primitive: str, axes: tuple[str, ...]):
    """A name applies to each primitive that offers it (hierarchical: over two axes or more);
    every other primitive gets "auto"."""
    if isinstance(self.algorithm, dict):
      return self.algorithm.get(primitive, "auto")
    name = self.algorithm
    if name not in algorithms(primitive, num_axes=len(axes)):
      return "auto"
    return name

  def wire_for(self, x) -> dict:
    """``wire_dtype=`` for a leaf the format compresses (the rest travel as they are)."""
    return {"wire_dtype": self.wire.name} if self.wire and compresses(
        self.wire.name, x.dtype) else {}

  def vary(self, x, axes: tuple[str, ...]):
    """:func:`varying.vary` with this rewrite's algorithm and wire format for its sum."""
    return vary(x, axes, *self._sum_options(axes))

  def stack(self, x, mesh, axes: tuple[str, ...], spec):
    """:func:`varying.stack` with this rewrite's algorithm and wire format for its sum."""
    return stack(x, mesh, axes, spec, *self._sum_options(axes))

  def _sum_options(self, axes) -> tuple:
    return self.algorithm_for("all_reduce", axes), self.wire.name if self.wire else None


def _manual(params, key: str = "axis_name") -> tuple[str, ...] | None:
  """The equation's axes (``params[key]``) as a tuple when every one is a manual
  (shard_map) axis here and no ``axis_index_groups`` are given, else None."""
  axes = params[key]
  axes = tuple(axes) if isinstance(axes, (tuple, list)) else (axes,)
  manual = set(getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ()) or ())
  if not axes or not set(axes) <= manual or params.get("axis_index_groups") is not None:
    return None
  return axes


# ---- lax collective -> jaxcoll collective (None: leave the equation as it is) ----

def _reduce(op: str):
  def rule(opts, invals, params):
    axes = _manual(params, "axes")
    if axes is None:
      return None
    return [all_reduce(x, axes, op=op, **opts.wire_for(x),
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
                       tiled=params["tiled"], to=to, **opts.wire_for(x),
                       algorithm=opts.algorithm_for("all_gather", axes))]
  return rule


def _reduce_scatter(opts, invals, params):
  axes = _manual(params)
  if axes is None:
    return None
  (x,) = invals
  return [reduce_scatter(x, axes, scatter_dimension=params["scatter_dimension"],
                         tiled=params["tiled"], **opts.wire_for(x),
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
  of a replicated value) runs as jaxcoll's all_reduce."""
  axes = _manual(params, "axes")
  if axes is None:
    return None
  return [opts.vary(x, axes) for x in invals]


COLLECTIVES: dict[str, Callable] = {
    "pvary": _pvary,
    "psum": _reduce("sum"), "psum_invariant": _reduce("sum"),
    "pmax": _reduce("max"), "pmin": _reduce("min"),
    "all_gather": _all_gather("varying"), "all_gather_invariant": _all_gather("invarying"),
    "reduce_scatter": _reduce_scatter, "all_to_all": _all_to_all, "ppermute": _ppermute,
}


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
    for i, (x, spec) in enumerate(zip(invals, in_specs)):
      missing = tuple(a for a in names if a in manual and a not in _mentioned(spec))
      if missing:
        invals[i] = opts.stack(x, p["mesh"], missing, tuple(spec))
        in_specs[i], stacked[i] = P(missing, *spec), True

  def run(*args):
    return tuple(body(*[a[0] if s else a for a, s in zip(args, stacked)]))

  return jax.shard_map(run, mesh=p["mesh"], in_specs=tuple(in_specs), out_specs=out_specs,
                       check_vma=p["check_vma"], axis_names=set(manual))(*invals)


def _mentioned(spec) -> set:
  """The mesh axes a PartitionSpec names."""
  out = set()
  for entry in spec:
    out |= set(entry) if isinstance(entry, (tuple, list)) else {entry} if entry else set()
  return out


def _jit(opts, eqn, invals):
  p = eqn.params
  body = _evaluator(opts, p["jaxpr"])

  def fn(*args):
    return tuple(body(*args))

  fn.__name__ = p.get("name", "jit")
  donate = tuple(i for i, d in enumerate(p.get("donated_invars", ())) if d)
  return jax.jit(fn, donate_argnums=donate, keep_unused=p.get("keep_unused", False))(*invals)


def _scan(opts, eqn, invals):
  p = eqn.params
  consts, carry = compat.scan_counts(p)
  body = _evaluator(opts, p["jaxpr"])
  c, init, xs = invals[:consts], invals[consts:consts + carry], invals[consts + carry:]

  def step(carry_in, x):
    out = body(*c, *carry_in, *x)
    return tuple(out[:carry]), tuple(out[carry:])

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
      if name in COLLECTIVES:
        out = COLLECTIVES[name](opts, invals, eqn.params)
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
  """``fun`` traced to a jaxpr and evaluated with the rewrite rules; same pytrees in and out."""
  @functools.wraps(fun)
  def wrapped(*args, **kwargs):
    flat, in_tree = jax.tree.flatten((args, kwargs))

    def flat_fun(*leaves):
      a, k = jax.tree.unflatten(in_tree, leaves)
      return fun(*a, **k)

    closed, out_shape = jax.make_jaxpr(flat_fun, return_shape=True)(*flat)
    with config() if opts.profile is None else config(profile=opts.profile):
      out = eval_jaxpr(opts, closed.jaxpr, closed.consts, flat)
    return jax.tree.unflatten(jax.tree.structure(out_shape), out)
  return wrapped


def use(fun: Callable | None = None, *, algorithm="auto", wire_dtype=None, profile=None):
  """Runs ``fun``'s lax collectives as jaxcoll collectives (a function transformation).

  Every ``psum`` (and its invariant form; ``pmean`` is a psum and a divide), ``pmax``,
  ``pmin``, ``all_gather``, ``psum_scatter``, ``all_to_all`` and every ``ppermute`` that is
  a shift (i -> i + k, wrapped or not) over shard_map axes becomes ``jaxcoll.all_reduce``,
  ``all_gather``, ``reduce_scatter``, ``all_to_all`` or ``shift`` with the same semantics:
  same shapes, dtypes and typing (invariant where lax's is), results within reduction-order
  tolerance, lax's gradients. The rewrite reaches into shard_map, nested jit, scan, while,
  cond, checkpoint/remat (the policy kept) and custom_jvp/custom_vjp functions (primal and
  rules); every other equation runs as it was.

  Usable as ``use(f)``, ``use(f, algorithm="ring")``, ``@use`` and ``@use(algorithm=...)``.

  Args:
    fun: the function (arguments: pytrees of arrays).
    algorithm: "auto" (the cost model, per call); a name, used by every primitive that
      offers it ("ring": all_reduce, reduce_scatter, all_gather; the others "auto"); or a
      mapping ``{primitive: algorithm}`` (unnamed primitives: "auto").
    wire_dtype: compress every floating all_reduce, reduce_scatter and all_gather
      (``jaxcoll.WIRE_DTYPES``); None sends values as they are.
    profile: the cost model's :class:`jaxcoll.Profile` (or preset name, or profile JSON path:
      :meth:`jaxcoll.Profile.resolve`) while ``fun`` is traced; None keeps
      ``jaxcoll.config``'s.

  Collectives that XLA inserts by itself under ``jax.jit`` sharding propagation do not
  appear in a jaxpr; write the step with ``jax.shard_map`` to make them visible.
  """
  opts = _Options(algorithm, wire_dtype, profile)
  if fun is None:
    return lambda f: rewrite(f, opts)
  return rewrite(fun, opts)
