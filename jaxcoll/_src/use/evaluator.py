"""A global program run per device: ``jaxcoll.use`` on ``jax.jit`` steps over sharded arrays.

A step written for global arrays ("pjit style": JAX's examples, flax, MaxText) has no
collective in its jaxpr; XLA's partitioner inserts them when it compiles, out of ``use``'s
reach. :func:`run` instead evaluates the step's global jaxpr equation by equation inside one
``jax.shard_map`` over the manual mesh axes, every value one device's piece with a
:class:`Placement` (sharded, partial sum or replicated per axis), and inserts jaxcoll
collectives where a piece must change its placement (:mod:`redistribute`): a partial sum
that must be whole or split, a split dimension that must be whole, an axis that moves.

- Input placements come from the arguments' shardings; each equation's rule
  (:mod:`spmd_rules`) says which placements its inputs must have and what it gives.
- Partial sums are reduced late and together: a partial value waits until some equation
  needs it whole (or the output does); then every partial value waiting in the same scope is
  reduced at once, in buckets (:func:`redistribute.reduce_many`). Where a sum is headed for
  a split layout (an FSDP parameter's gradient), it is reduce-scattered to it: the layout is
  read ahead from the equations that consume it (:meth:`Evaluator.headed_for`).
- An equation without a rule gets its inputs whole and runs as it was (correct, and
  reported), or, with ``strict``, is an error naming it and its source line.
- The outputs' placements are known once the body is traced; jax reads a shard_map's
  ``out_specs`` only then (:func:`compat.shard_map_specs_after`), so the program is traced
  once.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxcoll._src import compat
from jaxcoll._src.interpreter import FORMS, bodies, form_of, live, walk
from jaxcoll._src.use.backward import backward_values
from jaxcoll._src.use.partial_sums import choose, one_sum, origin_of, reduced_apart
from jaxcoll._src.use.placement import (
  Local,
  Placement,
  entries,
  explicit,
  from_spec,
  replicated,
  with_leading,
)
from jaxcoll._src.use.redistribute import Comm, redistribute, reduce_many
from jaxcoll._src.use.rules import (
  BY_FORM,
  ELEMENTWISE,
  REBUILT,
  RULES,
  Refused,
  asked,
  fallback,
  keeps_partial,
  laid_out_as_asked,
)
from jaxcoll.extend import ReportLine, axis_index, record_at, record_note

# Equations whose result has its operand's rank and carries each of its dimensions
# through (resized, reordered within it, or combined with other operands along it).
_CARRIED_THROUGH = frozenset({
    "slice", "dynamic_slice", "dynamic_update_slice", "concatenate", "pad", "rev", "sort",
    "scatter", "scatter-add", "scatter_add", "reduce_window_sum", "reduce_window",
    "reduce_window_max", "reduce_window_min", "cumsum", "cumprod", "cummax", "cummin",
    "cumlogsumexp"})


@dataclasses.dataclass
class _Scope:
  """One jaxpr being evaluated: its values, the partial sums waiting to be reduced, and the
  values reduced in its region (``reduced``, by key: shared by the scopes of calls run
  inline, apart for each loop or branch body, whose values live in a trace of their own)."""

  jaxpr: object
  env: dict
  reduced: dict
  moved: dict                # values moved to other placements here: (key, placement)
  pending: dict = dataclasses.field(default_factory=dict)
  consumers: dict | None = None
  producers: dict | None = None
  last_use: dict | None = None
  position: int = 0          # the equation being evaluated
  live: list | None = None   # per equation: whether it reaches an output (interpreter.live)


class Evaluator:
  """Evaluates global jaxprs per device (module docstring). ``options(primitive, axes,
  dtype)``: the collectives' keyword arguments. Each equation's collectives are recorded
  as its (:mod:`record`)."""

  def __init__(self, sizes: dict, manual: tuple[str, ...], options: Callable,
               strict: bool = False, rewrite_island: Callable | None = None,
               abstract: bool = False, known: dict | None = None,
               hoisted: dict | None = None, gradients: frozenset = frozenset()):
    self.sizes, self.manual, self.strict = dict(sizes), tuple(manual), strict
    self.gradients = gradients   # the variables autodiff's backward pass made (backward.py)
    self.hoisted = {} if hoisted is None else hoisted   # id(const) -> its piece (run)
    self.rewrite_island = rewrite_island
    self.known = {} if known is None else known   # bodies' placements (abstract_places)
    self.scopes: list[_Scope] = []
    self.comm = Comm(options, self.manual, abstract, self.index)
    self.where = ["-"]   # the innermost user source line (library code inside has none)

  def index(self, axes) -> object:
    """This device's index over ``axes`` (``lax.axis_index``), once per region: each
    index lowers to partition-id arithmetic of its own."""
    moved = self.scopes[-1].moved
    key = ("index", tuple(axes))
    if key not in moved:
      moved[key] = axis_index(axes)
    return moved[key]

  def fresh(self) -> Evaluator:
    """An evaluator of the same mesh and options for an abstract run (a loop body's, to
    find its carries' placements): the same placements, lax collectives in place of
    jaxcoll's (:class:`redistribute.Comm`), nothing recorded."""
    return Evaluator(self.sizes, self.manual, self.comm.options, self.strict,
                     self.rewrite_island, abstract=True, known=self.known,
                     hoisted=self.hoisted, gradients=self.gradients)

  def const(self, c) -> Local:
    """A constant of a nested jaxpr: the program's input it entered as (:func:`run`), else
    whole on every device."""
    return self.hoisted.get(id(c)) or Local(c, replicated(jnp.ndim(c)))

  # ---- evaluation ----

  def run_jaxpr(self, jaxpr, consts: Sequence[Local], args: Sequence[Local],
                targets=None, inline: bool = False) -> list:
    """``jaxpr`` (open) on per-device ``args``. Returns the outputs' pieces (partial sums
    among them still partial), or, given ``targets`` (placements, or a function of the
    outputs' pieces giving them), their values moved there (the partial sums among them
    reduced together). ``inline``: a call in the current trace (its values reduced are the
    caller's); else a body of its own (a loop's or a branch's)."""
    outer = self.scopes[-1] if inline and self.scopes else None
    scope = _Scope(jaxpr, {}, {}, {}) if outer is None else \
        _Scope(jaxpr, {}, outer.reduced, outer.moved)
    scope.live = live(jaxpr)
    self.scopes.append(scope)
    try:
      for var, local in (*zip(jaxpr.constvars, consts), *zip(jaxpr.invars, args)):
        self._set(scope, var, local)
      for scope.position, eqn in enumerate(jaxpr.eqns):
        if not scope.live[scope.position]:   # dead: XLA drops it, nothing of it is sent
          continue
        ins = [self.read(v) for v in eqn.invars]
        where = compat.source_line(eqn) or self.where[-1]
        outs = self.apply(eqn, ins, where)
        if eqn.primitive.name not in FORMS:   # a body's outputs are values of their own
          outs = [x if any(x.key == i.key for i in ins) else
                  dataclasses.replace(x, origin=origin_of(eqn, ins, x, k, where))
                  for k, x in enumerate(outs)]
        if eqn.primitive.name in _CARRIED_THROUGH:
          outs = [dataclasses.replace(outs[0], kept=self.kept(eqn, ins[0], outs[0])),
                  *outs[1:]]
        for var, out in zip(eqn.outvars, outs):
          if not isinstance(var, jax.extend.core.DropVar):
            self._set(scope, var, out)
      scope.position = len(jaxpr.eqns)
      outs = [self.read(v) for v in jaxpr.outvars]
      if not inline and reduced_apart([o for o in outs if o.place.partial], scope.reduced):
        self.flush(scope)   # a body hands out sums that would cross the wire twice
        outs = [self.read(v) for v in jaxpr.outvars]
      if targets is None:
        return outs
      if callable(targets):
        targets = targets(outs)
      producers = self._producers(scope)
      moved = []
      for var, o, t in zip(jaxpr.outvars, outs, targets):   # reported at the maker's line
        made = None if isinstance(var, jax.extend.core.Literal) else producers.get(var)
        with record_at("output", made is not None and compat.source_line(made)
                       or self.where[-1]):
          moved.append(self.to(o, t))
      return moved
    finally:
      self.scopes.pop()

  def apply(self, eqn, ins: Sequence[Local], where: str) -> list[Local]:
    """``eqn``'s rule on the pieces ``ins``, its result laid out as the equation asks; what
    it traces is recorded as the equation's, at ``where``."""
    self.where.append(where)
    try:
      with compat.equation_config(eqn), record_at(eqn.primitive.name, where):
        outs = self.rule(eqn, list(ins))
        return laid_out_as_asked(self, eqn, outs)
    finally:
      self.where.pop()

  def rule(self, eqn, ins: list[Local]) -> list[Local]:
    """``eqn`` on ``ins`` by its rule: a first-order primitive's (:data:`RULES`), a
    higher-order one's by name or by form (:func:`interpreter.form_of`), else
    :func:`fallback`."""
    rule = RULES.get(eqn.primitive.name)
    if rule is not None:
      return rule(self, eqn, ins)
    form = form_of(eqn)
    if form is None:
      return fallback(self, eqn, ins)
    return REBUILT.get(eqn.primitive.name, BY_FORM[type(form)])(self, eqn, form, ins)

  def _set(self, scope: _Scope, var, local: Local) -> None:
    local = local.bound_to(var)
    scope.env[var] = local
    scope.pending.pop(var, None)
    if local.place.partial and local.key not in scope.reduced:
      scope.pending[var] = local

  def read(self, var) -> Local:
    if isinstance(var, jax.extend.core.Literal):
      return Local(var.val, replicated(len(getattr(var.aval, "shape", ()))))
    return self.scopes[-1].env[var]

  def to(self, local: Local, place: Placement):
    """``local``'s value moved to ``place``. A partial sum that must lose partial axes is
    reduced with every other one still to be read here (:meth:`flush`), each source's terms
    once (:mod:`partials`); a value reduced before is read back, never reduced again."""
    scope = self.scopes[-1]
    if local.place.partial and local.key in scope.reduced:
      local = scope.reduced[local.key]
    if local.place == place:
      return local.value
    if local.place.partial - place.partial:
      waiting = scope.pending.get(local.var)
      if waiting is not None and waiting.key == local.key and not local.carried:
        self.flush(scope, {local.key: place})
      else:
        self._reduce([local], {local.key: place})
      local = self.derive(local)
      if local.place == place:
        return local.value
    key = _moved_key(local, place)   # once per value and placement: many readers
    if key not in scope.moved:
      if local.slicer is not None and local.finer(place):
        scope.moved[key] = local.slicer(place)
        self._split_from_here(scope, local, place, scope.moved[key])
      else:
        scope.moved[key] = redistribute(local.value, local.place, place, self.comm)
    return scope.moved[key]

  def moved(self, local: Local, place: Placement):
    """``local``'s value at ``place`` where a reader moved it there already (or a rule made
    it there, :meth:`keep_moved`), else None; no collective."""
    return self.scopes[-1].moved.get(_moved_key(local, place))

  def keep_moved(self, local: Local, place: Placement, value) -> None:
    """``value`` is ``local`` at ``place``, made by a rule that moved it itself (a collective
    matmul's gathered operand): :meth:`to` reads it back for later readers."""
    self.scopes[-1].moved[_moved_key(local, place)] = value

  def _split_from_here(self, scope: _Scope, local: Local, place: Placement, piece) -> None:
    """A value this program computes whole, read split (its piece made by its slicer), is
    read split by later readers too, as jit's partitioner propagates a split into the value
    it splits: a sum of it is then a partial sum of pieces, each device's work divided. The
    whole value stays at hand for readers that need it whole (no gather)."""
    var = local.var
    if local.given or var is None or scope.env.get(var) is not local:
      return
    split = dataclasses.replace(local, value=piece, place=place, kept=None)
    scope.env[var] = split
    scope.moved[_moved_key(split, local.place)] = local.value

  def flush(self, scope: _Scope, wanted: dict | None = None) -> None:
    """Every partial sum waiting in ``scope`` that is still to be read made whole (or split
    where it is headed: :meth:`headed_for`, or where ``wanted`` asks, by key), together: the
    values :func:`partials.choose` picks reduced in buckets, the others derived from them."""
    live = self._last_use(scope)
    waiting = [(v, local) for v, local in scope.pending.items()   # an accumulator only adds
               if live.get(v, -1) >= scope.position and not local.carried]
    if not waiting:
      return
    self._reduce([local for _, local in waiting], wanted)
    for var, local in waiting:   # each where it is headed, as if it had been reduced itself
      derived = self.derive(local)
      target = _asked(wanted, local.key) or self.headed_for(scope, var, local.place)
      if derived.place != target:
        derived = Local(redistribute(derived.value, derived.place, target, self.comm), target)
      self._set(scope, var, derived)

  def _reduce(self, members: Sequence[Local], wanted: dict | None = None) -> None:
    """The values :func:`partials.choose` picks for ``members`` reduced together, each kept
    in the region's ``reduced`` under its key; one asked for in ``wanted`` (by key) lands
    split as asked there (a reduce-scatter), the others where they are headed."""
    reduced = self.scopes[-1].reduced
    sources = choose(members, reduced)
    if not sources:
      return
    targets = [_asked(wanted, s.key) or self._headed(s) for s in sources]
    values = reduce_many([(s.value, s.place, t) for s, t in zip(sources, targets)], self.comm,
                         gradient=[s.var in self.gradients for s in sources])
    for s, value, target in zip(sources, values, targets):
      reduced[s.key] = Local(value, target, key=s.key)

  def one_sum(self, x: Local, y: Local) -> bool:
    """Whether two partial values are one sum (:func:`partials.one_sum`): reducing one
    derives the other, so a rule that needs both whole pays for one reduction."""
    return one_sum(x, y, self.scopes[-1].reduced)

  def derive(self, local: Local) -> Local:
    """``local`` (a partial sum) as a whole value: read back if reduced, else made by its
    origin's equation from its parents, derived the same way (no communication for the
    sum: the parents' terms crossed the wire once, in :meth:`_reduce`)."""
    reduced = self.scopes[-1].reduced
    if local.key in reduced:
      return reduced[local.key]
    origin = local.origin
    ins = [self.derive(x) if x.place.partial else x for x in origin.ins]
    out = self.apply(origin.eqn, ins, origin.where)[origin.index]
    if out.place.partial:   # a rule that split a whole input's contraction anew
      out = Local(redistribute(out.value, out.place, out.place.whole(), self.comm),
                  out.place.whole())
    reduced[local.key] = Local(out.value, out.place, key=local.key)
    return reduced[local.key]

  def _headed(self, source: Local) -> Placement:
    """Where the reduced ``source`` is headed (:meth:`headed_for`, read in the scope that
    binds it; whole where none does)."""
    for scope in reversed(self.scopes):
      bound = scope.env.get(source.var) if source.var is not None else None
      if bound is not None and bound.key == source.key:
        return self.headed_for(scope, source.var, source.place)
    return source.place.whole()

  def kept(self, eqn, operand: Local, out: Local) -> Placement | None:
    """Where ``out`` falls as an output that nothing declares (:attr:`Local.kept`): its
    dimensions carried through from ``operand`` keep the operand's split where the rule
    made them whole, as XLA's partitioner keeps it under ``jax.jit``; None where that
    adds nothing."""
    if operand.place.ndim != out.place.ndim:
      return None
    whole = out.place.whole()
    used, dims = set(whole.sharded), []
    for have, split, n in zip(whole.dims, operand.place.dims, eqn.outvars[0].aval.shape):
      fits = [split[:k] for k in range(len(split), 0, -1)   # the longest major part
              if not used & set(split[:k]) and n % self.count(split[:k]) == 0]
      dims.append(have or (fits[0] if fits else ()))
      used |= set(dims[-1])
    return None if tuple(dims) == whole.dims else Placement(tuple(dims))

  # ---- where a partial sum is headed ----

  def headed_for(self, scope: _Scope, var, place: Placement) -> Placement:
    """The placement the sum in ``var`` will be needed in: following its consumers through
    equations that keep it a sum of the same shape (a scale, a negation, an add of another
    sum) and through transposes (a weight gradient's ``x^T dy``), the first that meets a
    value of known, split placement (an FSDP parameter, or its optimizer state) or a
    sharding annotation that splits it (the transpose of an FSDP
    layer's ``reshard(w, P())``) splits it the same way, as far as the sum's own axes go
    (the rest is sliced for free where it meets that value); else whole (an all-reduce).
    Whichever value's reading makes the sums whole, each lands where it is headed: the
    order of two annotations changes nothing."""
    consumers = self._consumers(scope)
    frontier, seen = [(var, tuple(range(place.ndim)))], set()
    while frontier:
      v, order = frontier.pop(0)   # v's dimension i is var's dimension order[i]
      if v in seen:
        continue
      seen.add(v)
      here = Placement(tuple(place.dims[d] for d in order), place.partial)
      for eqn in consumers.get(v, ()):
        found = self._headed_at(scope, eqn, v, here)
        if found is not None:
          dims = [()] * place.ndim
          for i, d in enumerate(order):
            dims[d] = found.dims[i]
          return Placement(tuple(dims))
        if eqn.primitive.name == "transpose":   # a weight gradient's x^T dy, transposed
          frontier.append((eqn.outvars[0],
                           tuple(order[i] for i in eqn.params["permutation"])))
        elif eqn.primitive.name in ELEMENTWISE and asked(self, eqn) is None and \
            keeps_partial(eqn):
          frontier += [(o, order) for o in eqn.outvars
                       if getattr(o.aval, "shape", ()) == v.aval.shape]
    return place.whole()

  def _headed_at(self, scope: _Scope, eqn, v, place: Placement) -> Placement | None:
    """Where ``eqn``, a reader of the sum ``v`` (placed ``place``), splits it: a sharding
    annotation that splits it, or an elementwise partner of known, split placement; None
    where it says nothing (:meth:`headed_for`)."""
    def fits(target):
      return target.sharded and all(not place.dims[d] or place.dims[d] == target.dims[d]
                                    for d in range(place.ndim))
    target = asked(self, eqn)   # a sharding annotation: where the sum is moved to
    if target is not None:
      target = _within(target, place.partial | place.sharded)
      return target if fits(target) else None
    if eqn.primitive.name not in ELEMENTWISE:
      return None
    for other in eqn.invars:
      if other is v or isinstance(other, jax.extend.core.Literal):
        continue
      known = self._known_place(scope, other)
      if known is not None and known.ndim == place.ndim and not known.partial:
        known = Placement(tuple(a if n == m else () for a, n, m in   # lax broadcasts 1s
                                zip(known.dims, other.aval.shape, v.aval.shape)))
        target = _within(known, place.partial | place.sharded)
        if fits(target):
          return target
    return None

  def _known_place(self, scope: _Scope, var, depth: int = 8) -> Placement | None:
    """``var``'s placement if computed, or read off the elementwise equation that makes it
    from a computed value and scalars."""
    if var in scope.env:
      return scope.env[var].place
    if depth == 0:
      return None
    producer = self._producers(scope).get(var)
    if producer is None or producer.primitive.name not in ELEMENTWISE:
      return None
    ndim = len(var.aval.shape)
    for v in producer.invars:
      if not isinstance(v, jax.extend.core.Literal) and len(v.aval.shape) == ndim:
        return self._known_place(scope, v, depth - 1)
    return None

  def _last_use(self, scope: _Scope) -> dict:
    """The index of the last equation reading each variable (the jaxpr's length for its
    outputs)."""
    if scope.last_use is None:
      scope.last_use = {}
      for i, eqn in enumerate(scope.jaxpr.eqns):
        for v in eqn.invars if scope.live[i] else ():
          if not isinstance(v, jax.extend.core.Literal):
            scope.last_use[v] = i
      for v in scope.jaxpr.outvars:
        if not isinstance(v, jax.extend.core.Literal):
          scope.last_use[v] = len(scope.jaxpr.eqns)
    return scope.last_use

  def _consumers(self, scope: _Scope) -> dict:
    if scope.consumers is None:
      scope.consumers = {}
      for eqn, alive in zip(scope.jaxpr.eqns, scope.live):
        for v in eqn.invars if alive else ():
          if not isinstance(v, jax.extend.core.Literal):
            scope.consumers.setdefault(v, []).append(eqn)
    return scope.consumers

  def _producers(self, scope: _Scope) -> dict:
    if scope.producers is None:
      scope.producers = {v: eqn for eqn in scope.jaxpr.eqns for v in eqn.outvars}
    return scope.producers

  # ---- helpers for the rules ----

  def bind(self, eqn, values, **params) -> list:
    """``eqn``'s primitive on per-device ``values``: its params with ``params`` replacing
    some, and no global sharding (``out_sharding``, ``sharding``: the mesh axes are manual
    here)."""
    merged = dict(eqn.params)
    for key in ("out_sharding", "sharding"):
      if key in merged:
        merged[key] = None
    merged.update(params)
    out = eqn.primitive.bind(*values, **eqn.primitive.get_bind_params(merged))
    return list(out) if eqn.primitive.multiple_results else [out]

  def local_shape(self, shape, place: Placement) -> tuple[int, ...]:
    return place.local_shape(shape, self.sizes)

  def count(self, axes) -> int:
    """How many devices ``axes`` span."""
    return math.prod(self.sizes[a] for a in axes)

  def splits(self, shape, place: Placement) -> bool:
    """Whether ``place`` splits ``shape`` evenly."""
    return all(n % self.count(axes) == 0 for n, axes in zip(shape, place.dims))

  def note_fallback(self, eqn, reason: str) -> None:
    if self.strict:
      raise Refused(f"use(strict=True): {eqn.primitive.name} at {self.where[-1]} has "
                    f"no per-device rule for these layouts ({reason}); without strict it runs "
                    "on whole inputs (gathered)")
    record_note(ReportLine.WHOLE, eqn.primitive.name, reason)


def _moved_key(local: Local, place: Placement) -> tuple:
  """What a value moved to ``place`` is kept under in a region (:meth:`Evaluator.to`)."""
  return local.key, local.place, place


def _within(place: Placement, axes) -> Placement:
  """``place``'s splits cut to what ``axes`` can make: each dimension's longest run of axes
  among them, from the major end."""
  dims = []
  for d in place.dims:
    run = []
    for a in d:
      if a not in axes:
        break
      run.append(a)
    dims.append(tuple(run))
  return Placement(tuple(dims))


class options_for:   # noqa: N801 (a function of the options, with one more question)
  """The collectives' keyword arguments under ``use``'s options: called, the algorithm each
  primitive gets and the wire format where ``use`` compresses (``opts.wire_for``);
  :meth:`matmul`, whether a gather and the matmul reading it run as one collective matmul
  (``opts.matmul_for``)."""

  def __init__(self, opts):
    self.opts = opts

  def __call__(self, primitive: str, axes, dtype, op: str = "sum", size: int | None = None,
               gradient: bool = True) -> dict:
    return {"algorithm": self.opts.algorithm_for(primitive, tuple(axes)),
            **self.opts.wire_for(primitive, dtype, op, size, gradient)}

  def matmul(self, primitive: str, axes, dtype, size: int, gradient: bool = True):
    return self.opts.matmul_for(primitive, tuple(axes), dtype, size, gradient)


def input_places(leaves, manual: Sequence[str], given=None) -> list[Placement]:
  """Each input's placement over the ``manual`` axes: from ``given`` (shardings or specs),
  else from the array's own sharding (a concrete array's, or an Explicit-mode type's)."""
  out = []
  for i, x in enumerate(leaves):
    spec = spec_of(given[i]) if given is not None and given[i] is not None else spec_of(
        _sharding_of(x))
    out.append(from_spec(spec, len(jnp.shape(x)), manual))
  return out


def _sharding_of(x):
  sharding = getattr(x, "sharding", None)
  if isinstance(x, jax.core.Tracer) or sharding is None:
    try:
      sharding = jax.typeof(x).sharding
    except TypeError:
      return None
  return sharding


def spec_of(sharding):
  if sharding is None:
    return None
  if isinstance(sharding, P):
    return sharding
  return getattr(sharding, "spec", None)


def mesh_of(leaves, given=None, names=None):
  """The mesh the inputs are laid out on: their NamedShardings' (given, else the arrays'
  own), else the one ``jax.set_mesh`` set; None when there is none.

  Raises:
    ValueError: two inputs on different meshes (``names``: the inputs' names for the
      message), which ``jax.jit`` refuses too.
  """
  found = []
  for i, x in enumerate(leaves):
    s = given[i] if given is not None and given[i] is not None else _sharding_of(x)
    mesh = getattr(s, "mesh", None)
    if mesh is not None and getattr(mesh, "axis_names", ()):
      found.append((i, mesh))
  for i, mesh in found[1:]:
    if _differ(mesh, found[0][1]):
      name = (lambda k: names[k] if names else f"input {k}")   # noqa: E731
      raise ValueError(
          f"use: the inputs are laid out on different meshes: {name(found[0][0])} on "
          f"{_words(found[0][1])}, {name(i)} on {_words(mesh)}; jax.jit refuses that too. "
          "Expected every input on one mesh (jax.device_put), or use(in_shardings=...) "
          "naming one")
  if found:
    return found[0][1]
  mesh = jax.sharding.get_abstract_mesh()
  return mesh if getattr(mesh, "axis_names", ()) else None


def _devices(mesh) -> list | None:
  """A concrete mesh's device ids in mesh order (None for an abstract mesh)."""
  if not isinstance(mesh, jax.sharding.Mesh):
    return None
  return [d.id for d in mesh.devices.flat]


def _words(mesh) -> str:
  shape = dict(zip(mesh.axis_names, mesh.axis_sizes))
  return f"{shape}" + ("" if _devices(mesh) is None else f" (devices {_devices(mesh)})")


def _differ(a, b) -> bool:
  """Whether two meshes are different ones: other axes or sizes, or other devices where
  both are concrete."""
  if tuple(a.axis_names) != tuple(b.axis_names) or \
      tuple(a.axis_sizes) != tuple(b.axis_sizes):
    return True
  devices = [_devices(m) for m in (a, b)]
  return None not in devices and devices[0] != devices[1]


def _asked(wanted: dict | None, key) -> Placement | None:
  """The whole placement ``wanted`` asks for the value ``key`` (a split to reduce-scatter
  to), None where it asks for none or for one still partial."""
  place = (wanted or {}).get(key)
  return None if place is None or place.partial else Placement(place.dims)


def laid_out_consts(jaxpr) -> list:
  """The constants of the jaxprs nested in ``jaxpr`` that are arrays laid out on a mesh
  (each once): a shard_map may not close over them (an Explicit one's type names the mesh
  outside it), so they enter the program as inputs."""
  found: dict = {}
  for eqn, _ in walk(jaxpr):
    for body in bodies(eqn):
      for c in body.consts:
        if isinstance(getattr(c, "sharding", None), jax.sharding.NamedSharding):
          found.setdefault(id(c), c)
  return list(found.values())


def run(closed, leaves, mesh, manual: tuple[str, ...], places: Sequence[Placement],
        options: Callable, strict: bool = False, out_places=None,
        rewrite_island: Callable | None = None, stack: Callable | None = None,
        nested: Sequence = ()):
  """``closed`` (a closed jaxpr of global values) on ``leaves`` placed as ``places``, per
  device in one shard_map over ``manual``; returns the outputs, laid out as their final
  placements (or ``out_places`` where given, a placement or None per output). ``nested``:
  the nested jaxprs' laid-out constants (:func:`laid_out_consts`), which enter as inputs.

  ``stack(x, mesh, axes, spec)`` (:func:`varying.stack`), where given, makes an input
  replicated over some manual axes one copy per device of them, so that the shard_map's
  transpose (``jax.grad`` of the result) sums nothing itself: the sum runs as the stack's
  transpose, a jaxcoll all_reduce."""
  sizes = {a: int(mesh.shape[a]) for a in manual}
  gradients = backward_values(closed.jaxpr)
  n, m = len(leaves), len(closed.consts)   # the constants enter as inputs: no closure
  leaves = [*leaves, *closed.consts, *nested]
  places = [*places, *input_places([*closed.consts, *nested], manual)]

  def body(stacked, *locals_):
    """The program on this device's pieces: ``(outputs, their specs)``."""
    pieces = [Local(v[0] if s else v, p, given=True)
              for v, s, p in zip(locals_, stacked, places)]
    args, consts = pieces[:n], pieces[n:n + m]
    ev = Evaluator(sizes, manual, options, strict, rewrite_island,
                   hoisted={id(c): x for c, x in zip(nested, pieces[n + m:])},
                   gradients=gradients)
    chosen: list = []

    def targets(outs):   # where the outputs fall (out_places where given)
      given = out_places or [None] * len(outs)
      chosen.extend(g if g is not None else o.kept or o.place.whole()
                    for g, o in zip(given, outs))
      return chosen

    outs = ev.run_jaxpr(closed.jaxpr, consts, args, targets)
    return outs, [p.spec() for p in chosen]

  def program(*leaves):   # under jit: a stack is a broadcast whose copies stay where they are
    leaves, in_specs, stacked = list(leaves), [], []
    typed_here = explicit(mesh, manual)   # a type names the layout: a declared one moves it
    for i, p in enumerate(places):
      missing = tuple(a for a in manual if a not in p.used)
      spec = p.spec()
      typed = getattr(jax.typeof(leaves[i]), "sharding", None)
      if typed_here and from_spec(getattr(typed, "spec", None), p.ndim, manual) != p:
        leaves[i] = jax.sharding.reshard(leaves[i], spec)
      if stack is not None and missing:
        leaves[i] = stack(leaves[i], mesh, missing, entries(spec))
        spec = with_leading(spec, missing)
      in_specs.append(spec)
      stacked.append(stack is not None and bool(missing))
    auto = set(mesh.axis_names) - set(manual)
    return compat.shard_map_specs_after(functools.partial(body, stacked), mesh=mesh,
                                        in_specs=tuple(in_specs),
                                        axis_names=manual if auto else None)(*leaves)

  return list(jax.jit(program)(*leaves))
