"""Shared test helpers: meshes over the first n CPU devices, and jaxpr byte counting."""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

AXIS = "x"
LAX_COLLECTIVES = frozenset({"psum", "psum_invariant", "pmax", "pmin", "all_gather",
                             "all_gather_invariant", "reduce_scatter", "psum_scatter",
                             "all_to_all"})


def mesh(n: int) -> Mesh:
  return Mesh(np.array(jax.devices()[:n]), (AXIS,))


def per_device(fn, n: int, *, replicated_out: bool = False, check_vma: bool = True, jit=True):
  """``fn`` maps one device's pytree to one device's pytree; the wrapper takes and returns
  arrays with a leading axis of n (device r's value at index r).

  With ``replicated_out`` the outputs leave shard_map with ``out_specs=P()`` (they must be
  typed invariant) and come back without the leading axis.
  """
  m = mesh(n)
  out_spec = P() if replicated_out else P(AXIS)

  def body(tree):
    out = fn(jax.tree.map(lambda v: v[0], tree))
    return out if replicated_out else jax.tree.map(lambda v: v[None], out)

  f = jax.shard_map(body, mesh=m, in_specs=P(AXIS), out_specs=out_spec, check_vma=check_vma)
  f = jax.jit(f) if jit else f

  def call(tree):
    tree = jax.tree.map(lambda v: jax.device_put(v, NamedSharding(m, P(AXIS))), tree)
    return f(tree)
  return call


def assert_close_after_sums(got, want, terms: int, scale=None) -> None:
  """``got`` equals ``want`` (pytrees of arrays) within what summing ``terms`` values in
  another order can change: per leaf, 4 * sqrt(terms) ulps of the largest term, taken as
  ``scale`` where given, else the leaf's largest magnitude (a rounding error of a random
  walk, so the same on any CPU: no tolerance read off one machine's result)."""
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    g, w = np.asarray(g), np.asarray(w)
    assert g.shape == w.shape and g.dtype == w.dtype, (g.shape, g.dtype, w.shape, w.dtype)
    eps = float(np.finfo(w.dtype).eps) if np.issubdtype(w.dtype, np.floating) else 0.0
    big = float(np.max(np.abs(w), initial=0.0)) if scale is None else float(scale)
    np.testing.assert_allclose(g, w, rtol=0, atol=4 * math.sqrt(terms) * eps * big)


def iter_eqns(jaxpr, mult: int = 1):
  """Every equation of a (closed) jaxpr and its sub-jaxprs, with its scan trip-count multiplier."""
  jx = jaxpr.jaxpr if hasattr(jaxpr, "jaxpr") else jaxpr
  for eqn in jx.eqns:
    yield eqn, mult
    if eqn.primitive.name == "while":
      raise AssertionError("unbounded while loop: trip count unknown")
    inner = mult * eqn.params["length"] if eqn.primitive.name == "scan" else mult
    for v in eqn.params.values():
      for j in (v if isinstance(v, (tuple, list)) else (v,)):
        if hasattr(j, "eqns") or hasattr(getattr(j, "jaxpr", None), "eqns"):
          yield from iter_eqns(j, inner)


def eqns(jaxpr):
  """Every equation of a jaxpr and of all its sub-jaxprs (cond branches, loops included)."""
  for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
    yield eqn
    for v in eqn.params.values():
      for sub in v if isinstance(v, (tuple, list)) else (v,):
        if hasattr(sub, "eqns") or hasattr(getattr(sub, "jaxpr", None), "eqns"):
          yield from eqns(sub)


def primitives(jaxpr) -> set[str]:
  """The names of every primitive in a jaxpr and its sub-jaxprs."""
  return {e.primitive.name for e in eqns(jaxpr)}


def ppermute_bytes_per_rank(jaxpr, n: int) -> np.ndarray:
  """Bytes each rank sends through ppermute in a (closed) jaxpr, loops counted by trip count."""
  sent = np.zeros(n, np.int64)
  for eqn, mult in iter_eqns(jaxpr):
    if eqn.primitive.name == "ppermute":
      aval = eqn.invars[0].aval
      for src, _ in eqn.params["perm"]:
        sent[src] += mult * math.prod(aval.shape) * aval.dtype.itemsize
  return sent


def count_primitive(jaxpr, name: str) -> int:
  return sum(eqn.primitive.name == name for eqn, _ in iter_eqns(jaxpr))


def mesh_perm(axes, perm, mesh_names, sizes):
  """``perm`` over ranks numbered as ``lax.axis_index(axes)`` does, rewritten in the mesh-order
  numbering ``lax.ppermute`` reads (written out here independently of jaxcoll)."""
  order = sorted(range(len(axes)), key=lambda t: mesh_names.index(axes[t]))
  def to_mesh(r):
    coords = np.unravel_index(r, sizes)
    return int(np.ravel_multi_index([coords[t] for t in order], [sizes[t] for t in order]))
  return [(to_mesh(s), to_mesh(d)) for s, d in perm]


def call(primitive: str, x, axes, algorithm: str, root: int = 0, **extra):
  """One jaxcoll collective with the arguments the shared tests use (tiled layouts);
  ``extra`` keyword arguments go to it (``wire_dtype=``)."""
  import jaxcoll
  kw = {"algorithm": algorithm, **extra}
  if primitive in ("reduce_scatter", "all_gather"):
    kw["tiled"] = True
  if primitive in ("broadcast", "reduce"):
    kw["root"] = root
  if primitive == "all_to_all":
    return jaxcoll.all_to_all(x, axes, 0, 0, tiled=True, **kw)
  return getattr(jaxcoll, primitive)(x, axes, **kw)


def call_lax(primitive: str, x, axes, root: int = 0):
  """The jax.lax computation ``call`` must equal (shift over a tuple: ppermute in mesh order)."""
  from jax import lax
  axes_t = axes if isinstance(axes, tuple) else (axes,)
  n = math.prod(lax.axis_size(a) for a in axes_t)
  me = lax.axis_index(axes)
  if primitive == "all_reduce":
    return lax.psum(x, axes)
  if primitive == "reduce_scatter":
    return lax.psum_scatter(x, axes, tiled=True)
  if primitive == "all_gather":
    return lax.all_gather(x, axes, tiled=True)
  if primitive == "all_to_all":
    return lax.all_to_all(x, axes, 0, 0, tiled=True)
  if primitive == "broadcast":
    return lax.psum(jax.numpy.where(me == root, x, 0), axes)
  if primitive == "reduce":
    return jax.numpy.where(me == root, lax.psum(x, axes), 0)
  if primitive == "shift":
    perm = [(i, (i + 1) % n) for i in range(n)]
    names = tuple(jax.sharding.get_abstract_mesh().axis_names)
    if len(axes_t) > 1:   # ppermute takes the tuple in mesh order (jax 0.12 requires it)
      perm = mesh_perm(axes_t, perm, names, tuple(lax.axis_size(a) for a in axes_t))
      axes = tuple(sorted(axes_t, key=names.index))
    return lax.ppermute(x, axes, perm)
  raise ValueError(primitive)


def input_length(primitive: str, n: int, length: int) -> int:
  """A per-device input length valid for ``primitive`` on n ranks (all_gather: the piece)."""
  return length if primitive == "all_gather" else n * length


def assert_like_jit_with_permutes_only(got, want, report, tol: float = 1e-5,
                                       communicates: bool = True) -> None:
  """A step under ``jaxcoll.use`` (``got``; ``report``: its ``jaxcoll.explain_step``)
  against plain ``jax.jit``'s (``want``): values within ``tol``, the same output shardings,
  a compiled step whose only collectives are the schedules' collective-permutes (some,
  where it ``communicates``), nothing run on whole inputs, no collective left to the lax
  one."""
  import chex
  chex.assert_trees_all_close(got, want, rtol=tol, atol=tol)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert g.sharding.is_equivalent_to(w.sharding, g.ndim), (g.sharding, w.sharding)
  assert report.xla_collectives == 0, report
  assert report.compiled["collective-permute"] > 0 or not communicates, report
  assert not report.whole, report
  assert "native" not in {x.algorithm for x in report.collectives}, report


def auto_disagreements(mesh: Mesh, profile, *, primitives=("all_reduce", "all_gather",
                                                            "reduce_scatter"),
                       sizes=(1 << 10, 1 << 16, 1 << 22)) -> list[str]:
  """Where what auto runs in a traced call (its algorithm and the debug log's line),
  ``jaxcoll.explain`` and ``jaxcoll.bench.run`` (which bench_dispatch's path shares) name
  different things, over ``mesh``'s axes together and each alone: the one decision seen
  from each of its readers (empty when they agree)."""
  import logging

  import jaxcoll
  import jaxcoll.bench
  from jaxcoll._src.auto import debug_log
  lines: list[str] = []
  handler = logging.Handler()
  handler.emit = lambda record: lines.append(record.getMessage())
  logger = logging.getLogger("jaxcoll")
  logger.addHandler(handler)
  out = []
  try:
    for axes in (tuple(mesh.axis_names), *((a,) for a in mesh.axis_names)):
      n = math.prod(dict(mesh.shape)[a] for a in axes)
      for primitive in primitives:
        for nbytes in sizes:
          length = int(jaxcoll.spec(primitive).input_bytes(nbytes, n)) // 4
          explained = jaxcoll.explain(primitive, jax.ShapeDtypeStruct((length,), np.float32),
                                      mesh, axes, profile).chosen
          traced = {}

          def body(v, primitive=primitive, axes=axes, traced=traced):
            traced["algorithm"] = jaxcoll.tools.algorithm_of(primitive, v[0], axes)
            return call(primitive, v[0], axes, "auto")[None]

          debug_log._seen.clear()   # noqa: SLF001 (each distinct line is logged once)
          del lines[:]
          spec = P(mesh.axis_names)
          with jaxcoll.config(profile=profile, mesh=mesh, debug=True):
            jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec)).lower(
                jax.ShapeDtypeStruct((math.prod(mesh.devices.shape), length), np.float32,
                                     sharding=NamedSharding(mesh, spec)))
          logged = [line.split("): ", 1)[1].split(" (")[0].split(",")[0] for line in lines]
          benched = None
          if axes == tuple(mesh.axis_names):
            with jaxcoll.config(mesh=mesh):
              row, = jaxcoll.bench.run(primitive, [nbytes], ["auto"], mesh=mesh, axes=axes,
                                       iters=1, warmup=0, profile=profile)
            benched = row.algorithm.removeprefix("auto -> ")
          seen = {"explain": explained, "debug log": logged[0] if logged else None,
                  "bench": benched or explained}
          if len(set(seen.values())) != 1 or explained.split("(")[0] != traced["algorithm"]:
            out.append(f"{primitive} {nbytes} B over {axes}: {seen}, traced call runs "
                       f"{traced['algorithm']}")
  finally:
    logger.removeHandler(handler)
  return out


# ---- what a step's collectives send: jit's compiled HLO against use's report ----

def _received(kind: str, nbytes: float, n: int) -> float:
  """What each device of a group of n receives for a collective of a value of ``nbytes``
  (an all-reduce's or a reduce-scatter's operand, an all-gather's result, an all-to-all's or
  a permute's operand) under a bandwidth-optimal algorithm."""
  if n <= 1 and kind != "collective-permute":
    return 0.0
  share = {"all-reduce": 2 * (n - 1) / n, "collective-permute": 1.0}
  return nbytes * share.get(kind, (n - 1) / n)


def hlo_collective_bytes(text: str) -> dict[str, float]:
  """Bytes each device receives for a compiled module's collectives, by kind
  (:func:`_received`), times the trip count XLA knows for each loop around them."""
  from jaxcoll._src import hlo
  module = hlo.parse(text)
  out: dict[str, float] = {}
  for comp, times in module.runs.items():
    for i in module.computations.get(comp, ()):
      kind = i.opcode.removesuffix("-start")
      if kind not in hlo.COLLECTIVES or i.opcode.endswith("-done"):
        continue
      if kind == "reduce-scatter":
        value = module.operand_bytes(i)
      else:   # a permute's start holds its operand and its result
        value = i.nbytes / (2 if i.opcode.endswith("-start") and i.type.startswith("(") else 1)
      out[kind] = out.get(kind, 0) + _received(kind, value, hlo.group_size(i.attributes)) * times
  return out


def report_bytes(report, mesh) -> dict[str, float]:
  """Bytes each device receives for a ``jaxcoll.explain_step`` report's collectives, by kind,
  as :func:`hlo_collective_bytes` counts jit's (whatever algorithm runs them), times how
  often a call runs each."""
  sizes = dict(mesh.shape)
  out: dict[str, float] = {}
  for line in report.collectives:
    n = math.prod(sizes[a] for a in line.axes)
    kind = line.what.replace("_", "-")
    value = line.nbytes * (n if line.what == "all_gather" else 1)
    out[kind] = out.get(kind, 0) + _received(kind, value, n) * line.count
  return out
