"""Each partial sum reduced once: where a partial value came from, and what to reduce.

Inside :mod:`spmd` a value may be a partial sum over some mesh axes (each device holds a
term; the global value is their sum). A linear equation of a partial value (a scale, a
negation, a widening cast, a reshape, a slice, an add of two sums over the same axes) keeps
the result partial, so a training step's gradient ``g`` has partial descendants before
anything needs it whole: Adam's first moment reads ``(1 - b1) * g`` and its second
``g ** 2``. Reducing each descendant that is needed whole would reduce ``g``'s terms more
than once: the bytes twice, and on a lossy wire two roundings of one value that then
disagree (an Adam entry whose first moment is non-zero while its second is exactly zero:
``mu / eps``).

The invariant, by construction: **every term of a partial sum crosses the wire once per
step.** A partial value records how it was made (:class:`Origin`: the linear equation and
its inputs); a partial value made otherwise (a contraction over split dimensions, a sum
over a split dimension, a scatter-add, a loop's result) is a *source*. When partial values
must become whole, :func:`choose` picks which values to reduce: for each group of waiting
values that share a source, one value from which every member of the group is derived by
its linear equations alone, the smallest such (a descendant when it is smaller than its
source, as a bias gradient's sum over a batch is, else the source itself); where no single
value derives them all (sums of several sources needed apart), the sources. Everything else
is derived from the reduced values by re-running those equations on whole inputs
(:meth:`spmd.Evaluator.derive`): local arithmetic, no bytes.

Why reduce the source and derive, rather than keep descendants partial and reduce each: k
consumers of one gradient would move its bytes k times, and round it k ways; the source
once moves them once. A descendant that is the only one needed (a bias gradient's column
sums) is reduced itself when it is smaller, so nothing moves more than before.

What is not covered (documented in docs/guide/training.md): a loop's whole initial value
that the body adds partial sums to (a gradient accumulator started from a non-zero value)
is held by one device of the axes and crosses the wire again with the sums.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

from jaxcoll._src.use.placement import Local


@dataclasses.dataclass(frozen=True, eq=False)
class Origin:
  """How a partial value was made from partial ones: equation ``eqn`` of inputs ``ins``
  (as read, partial parents among them), output ``index``; ``where``: its source line."""

  eqn: object
  ins: tuple[Local, ...]
  index: int
  where: str = "-"

  @property
  def parents(self) -> tuple[Local, ...]:
    return tuple(x for x in self.ins if x.place.partial)


def origin_of(eqn, ins: Sequence[Local], out: Local, index: int, where: str) -> Origin | None:
  """``out``'s origin when it is partial over exactly the axes its partial inputs are (a
  linear function of them, the other inputs fixed); None for a source."""
  parents = [x for x in ins if x.place.partial]
  if not out.place.partial or not parents:
    return None
  if any(x.place.partial != out.place.partial for x in parents):
    return None
  return Origin(eqn, tuple(ins), index, where)


def _ancestors(x: Local, covered: Mapping) -> dict:
  """Every value ``x`` is derived from (itself included), by key, not walking past values
  already reduced (``covered``)."""
  found, todo = {}, [x]
  while todo:
    y = todo.pop()
    if y.key in found:
      continue
    found[y.key] = y
    if y.key not in covered and y.origin is not None:
      todo.extend(y.origin.parents)
  return found


def _sources(ancestors: Mapping, covered: Mapping) -> set:
  return {k for k, y in ancestors.items() if y.origin is None and k not in covered}


def reduced_apart(values: Sequence[Local], covered: Mapping) -> bool:
  """Whether partial sums a loop or branch body hands out (each to be reduced after it,
  apart) would cross the wire twice: two of them hold terms of one source, or one holds
  terms the body already reduced (in a call inside it). The body then makes them whole."""
  seen: set = set()
  for x in values:
    found = _ancestors(x, covered)
    if any(k in covered for k in found):
      return True
    s = _sources(found, covered)
    if seen & s:
      return True
    seen |= s
  return False


def one_sum(x: Local, y: Local, covered: Mapping) -> bool:
  """Whether the partial values ``x`` and ``y`` are one sum (``y = g.T`` of ``x = g``: every
  term of each from the same sources), so that reducing one derives the other."""
  sx, sy = (_sources(_ancestors(v, covered), covered) for v in (x, y))
  return bool(sx) and sx == sy


def derivable(x: Local, given: set, covered: Mapping) -> bool:
  """Whether ``x`` follows from the values of ``given`` (keys) and ``covered`` by its
  linear equations alone."""
  if x.key in given or x.key in covered:
    return True
  if x.origin is None:
    return False
  return all(derivable(p, given, covered) for p in x.origin.parents)


def _size(x: Local) -> int:
  return math.prod(getattr(x.value, "shape", ()))


def choose(members: Sequence[Local], covered: Mapping) -> list[Local]:
  """The values to reduce so that every partial value of ``members`` follows from them and
  from ``covered`` (values reduced before, by key) by linear equations, each source's terms
  in exactly one of them (module docstring)."""
  ancestry = [_ancestors(m, covered) for m in members]
  sources = [_sources(a, covered) for a in ancestry]
  groups: list[tuple[set, list[int]]] = []   # members joined by a shared source
  for i, s in enumerate(sources):
    if not s:
      continue   # derived from values already reduced
    touching = [g for g in groups if g[0] & s]
    merged = (set(s), [i])
    for g in touching:
      merged[0].update(g[0])
      merged[1].extend(g[1])
      groups.remove(g)
    groups.append(merged)
  chosen: dict = {}
  for _, idx in groups:
    common = dict(ancestry[idx[0]])
    for i in idx[1:]:
      common = {k: v for k, v in common.items() if k in ancestry[i]}
    fits = [c for c in common.values() if c.key not in covered and all(
        derivable(members[i], {c.key}, covered) for i in idx)]
    if fits:
      best = min(fits, key=_size)
      chosen[best.key] = best
    else:
      for i in idx:
        for k in sources[i]:
          chosen[k] = ancestry[i][k]
  return list(chosen.values())


_ADDS = frozenset({"add", "add_any", "sub", "neg"})
_PASSES = frozenset({"convert_element_type", "copy", "copy_p", "reduce_precision"})


def accumulators(jaxpr, carries: Sequence[int], outs: Sequence[int]) -> frozenset[int]:
  """The loop carries a body only adds to: carry ``carries[i]`` (an input position of
  ``jaxpr``) whose every use, through adds, subtractions and casts, ends in carry output
  ``outs[i]`` and nowhere else (``acc + g``, a gradient accumulator). Such a carry may join
  the partial sums added to it and stay partial through the loop, reduced once after it;
  a carry the body reads otherwise (a residual stream a norm reads) may not. Returns
  positions ``i``."""
  uses: dict = {}
  for eqn in jaxpr.eqns:
    for v in eqn.invars:
      if not hasattr(v, "val"):
        uses.setdefault(v, []).append(eqn)
  found = set()
  for i, (c, o) in enumerate(zip(carries, outs)):
    start, target = jaxpr.invars[c], jaxpr.outvars[o]
    if hasattr(target, "val"):
      continue
    todo, seen, ok = [start], set(), True
    while todo and ok:
      v = todo.pop()
      if v in seen:
        continue
      seen.add(v)
      hits = [j for j, w in enumerate(jaxpr.outvars) if w is v]
      ok = all(j == o for j in hits) and (v is not target or len(hits) == 1)
      for eqn in uses.get(v, ()):
        name = eqn.primitive.name
        ok = ok and name in _ADDS | _PASSES
        todo.extend(eqn.outvars)
    if ok and target in seen:
      found.add(i)
  return frozenset(found)
