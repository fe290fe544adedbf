"""Hierarchical collectives over several mesh axes, composed from flat schedules.

The ranks span mesh axes of sizes ``axis_sizes = (s_0, ..., s_{k-1})``, the
outermost (slowest link, e.g. "node") first; rank = ravel(coords), the order
``lax.axis_index`` gives over the tuple. A *stage* runs one flat schedule over
one axis t on every group of ranks that differ only in coordinate t, all groups
in the same steps (:func:`embed`). Each stage's algorithm is chosen per axis
(``per_axis``; default "ring", "direct" for all_to_all), and so is the number of
pieces its steps are cut into (``stage_pieces``, :meth:`Schedule.in_pieces`:
smaller messages across a slow link, the same bytes, pieces times the steps).

all_reduce: reduce_scatter over the innermost axis, then the next one out on
  the shard, ..., all_reduce over the outermost axis on a 1/(s_1...s_{k-1})
  shard, then all_gather back in reverse (intra-node first). With rings on
  (outer o, inner i): inner 2(i-1) steps and 2(i-1)/i * M bytes, outer 2(o-1)
  steps and 2(o-1)/o * M/i bytes per device; a flat ring over the product puts
  2(N-1)/N * M through the slowest link a device uses.
reduce_scatter: innermost axis first, so the outer axis carries 1/s_{k-1} of
  the data: rings give (i-1)/i * M over inner and (o-1)/o * M/i over outer.
all_gather: the reverse, outermost first: (o-1)/o * M/i over outer, (i-1)/i * M
  over inner (M = the gathered output).
all_to_all: dimension-ordered routing, innermost axis first. A stage over axis
  t forwards every block a device holds to the group member whose coordinate t
  is the block's destination's, so across axis t each device sends s_t - 1
  messages of N/s_t blocks. On (node, local) this is NCCL's PXN: o - 1 messages
  cross the node link instead of (o-1)*i; bytes over outer stay (o-1)/o * M,
  and the inner axis carries (i-1)/i * M more. Blocks in flight live in
  workspace rows, one region of N per stage but the last. ``stage_pieces`` cuts a
  stage's steps after the whole schedule is built (every block in pieces, only
  that stage's steps cut: :meth:`Schedule.in_pieces` with ``steps``). It is built rank by
  rank in Python (O(N^2)), so auto weighs it on meshes of at most 64 devices
  (``max_devices``; 1 s at 128); a call that names it runs at any size.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Sequence

import numpy as np

from jaxcoll._src.schedules.algorithms.common import Repeat, Rounds, build
from jaxcoll._src.schedules.algorithms.registry import entries, register, schedule
from jaxcoll._src.schedules.schedule import Rows, Schedule, Step, Transfer, per_array

NAME = "hierarchical"
DEFAULT_STAGE = {"all_to_all": "direct"}
_STAGE_ALIASES = {("all_gather", "halving_doubling"): "recursive_doubling"}


@dataclasses.dataclass(frozen=True)
class Hierarchical:
  """``algorithm=`` value: the hierarchical algorithm with a flat algorithm per axis.

  ``Hierarchical(("recursive_doubling", "ring"))`` on axis_name ("node", "local")
  runs the node stage with recursive doubling and the local stages with rings;
  ``None`` entries (and ``algorithm="hierarchical"``) use the default, "ring"
  ("direct" for all_to_all). ``pieces=(8, 1)`` cuts the node stage's steps into
  8 pieces each (:meth:`Schedule.in_pieces`): the same bytes in smaller messages,
  which a slow TCP link carries better.
  """

  per_axis: tuple[str | None, ...] = ()
  pieces: tuple[int, ...] = ()

  name = NAME

  def options(self) -> dict:
    """The schedule options this value adds to the call's (dispatch adds ``axis_sizes``)."""
    return {"per_axis": tuple(self.per_axis) or None} | (
        {"stage_pieces": tuple(self.pieces)} if self.pieces else {})

  def label(self, primitive: str, num_axes: int) -> str:
    """The name explain and the benchmarks give it: ``hierarchical(ring,ring)``."""
    default = DEFAULT_STAGE.get(primitive, "ring")
    stages = ",".join(a or default for a in (self.per_axis or (None,) * num_axes))
    cut = f"; pieces {','.join(map(str, self.pieces))}" if self.pieces else ""
    return f"{NAME}({stages}{cut})"


def stage_names(primitive: str, devices: int | None = None) -> tuple[str, ...]:
  """The flat algorithms that may run one axis's stage: those registered with ``stage=True``
  (for all_reduce, reduce_scatter and all_gather the inner stages are a reduce_scatter and
  its all_gather twin of the same name, so reduce_scatter's say), the one the lax collective
  is priced as first, then registration order; with ``devices``, those auto weighs on a mesh
  of that many (``max_devices``)."""
  which = "reduce_scatter" if primitive in ("reduce_scatter", "all_gather") else primitive
  stages = sorted(entries(which, num_axes=1, devices=devices, stage=True),
                  key=lambda a: not a.native_like)
  return tuple(a.name for a in stages)


def variants(primitive: str, axis_sizes: tuple[int, ...]) -> list[tuple[str, dict]]:
  """(label, options) of every per-axis choice auto weighs: any stage algorithm on the
  outermost axis, a reduce_scatter stage on the others (all_to_all: its own stages)."""
  devices = math.prod(axis_sizes)
  inner = stage_names("all_to_all" if primitive == "all_to_all" else "reduce_scatter", devices)
  per_axis = [stage_names(primitive, devices)] + [inner] * (len(axis_sizes) - 1)
  return [(f"{NAME}({','.join(names)})", {"axis_sizes": axis_sizes, "per_axis": names})
          for names in itertools.product(*per_axis)]


def label(primitive: str, num_axes: int) -> str:
  return Hierarchical().label(primitive, num_axes)


_META = dict(num_axes=2, variants=variants, label=label)


def stage_schedule(primitive: str, name: str | None, size: int, pieces: int = 1) -> Schedule:
  """The flat schedule a stage over one axis runs, in ``pieces`` (names may alias:
  halving_doubling's all_gather half is recursive_doubling)."""
  name = name or DEFAULT_STAGE.get(primitive, "ring")
  name = _STAGE_ALIASES.get((primitive, name), name)
  if name in (NAME, "native", "auto"):
    raise ValueError(f"per_axis: {name!r} cannot be a stage of a hierarchical {primitive}; "
                     "name a flat algorithm")
  return schedule(primitive, name, size).in_pieces(pieces)


def groups(shape: Sequence[int], axis: int) -> np.ndarray:
  """[G, s]: the groups of ranks that differ only in coordinate ``axis``, in coordinate order."""
  ranks = np.arange(math.prod(shape)).reshape(shape)
  return np.moveaxis(ranks, axis, -1).reshape(-1, shape[axis])


def embed(sub: Schedule, rank_groups: np.ndarray, pieces) -> list[Rounds]:
  """Runs ``sub`` on every group at once: sub-rank k of a group is global rank
  ``rank_groups[g, k]``, and sub-chunk c of global rank r is global chunks ``pieces[r, c]``
  (``[N, C_sub, w]``, or a function of ranks [K] giving their rows [K, C_sub, w], read only
  when the rows are). One step per step of ``sub``, one transfer per transfer of it (the
  groups' ranks are disjoint, so what one ppermute did in a group it does in all); the
  parts of rounds :func:`build` takes, a run of ``sub`` (:class:`Run`) kept a repeat."""
  pieces_of = pieces if callable(pieces) else np.asarray(pieces).__getitem__
  copies, width = len(rank_groups), pieces_of(rank_groups[:1, 0]).shape[2]
  everyone = functools.cache(lambda: pieces_of(np.arange(rank_groups.size)))   # [N, C_sub, w]
  ranks = per_array(lambda sub: rank_groups[:, sub].reshape(-1).astype(np.int32))

  def rows(ranks: np.ndarray, sub_rows):   # made when read: pricing never reads them
    return Rows.lazy(len(ranks), sub_rows.width * width, lambda: everyone()[
        ranks[:, None], np.tile(sub_rows.array, (copies, 1))].reshape(len(ranks), -1))

  def copies_of(t: Transfer) -> Transfer:   # every group's copy of t: one ppermute still
    src, dst = ranks(t.src), ranks(t.dst)
    return Transfer(src, dst, rows(src, t.send), rows(dst, t.recv), t.combine)

  step_of = lambda step: Step(tuple(map(copies_of, step.transfers)))  # noqa: E731
  return [[step_of(part)] if isinstance(part, Step) else
          Repeat(part.count, lambda i, make=part.make: step_of(make(i)))
          for part in sub.steps.parts]


def _blocked_pieces(sub: Schedule, sub_blocks: np.ndarray) -> np.ndarray:
  """[N, C_sub, w]: sub-chunks of a blocked sub-schedule from each rank's sub-blocks
  ([N, s, h]): sub-block j's b chunks are its h chunks split b ways."""
  n, s, h = sub_blocks.shape
  if h % sub.blocks_per_rank:
    raise AssertionError(f"{h} chunks do not split into {sub.blocks_per_rank}")
  return sub_blocks.reshape(n, s * sub.blocks_per_rank, -1)


def _check_shape(n: int, axis_sizes, per_axis, stage_pieces=None
                 ) -> tuple[tuple[int, ...], tuple, tuple[int, ...]]:
  if axis_sizes is None:
    raise ValueError(f"{NAME} needs axis_sizes=(outer, ..., inner): the sizes of the mesh axes")
  shape = tuple(int(s) for s in axis_sizes)
  if len(shape) < 2 or math.prod(shape) != n:
    raise ValueError(f"{NAME} runs over a tuple of at least two mesh axes whose sizes multiply "
                     f"to the axis size {n}; got axis_sizes={axis_sizes}")
  per_axis = tuple(per_axis) if per_axis else (None,) * len(shape)
  if len(per_axis) != len(shape):
    raise ValueError(f"per_axis={per_axis} must name one algorithm per axis {shape}")
  pieces = tuple(stage_pieces) if stage_pieces else (1,) * len(shape)
  if len(pieces) != len(shape) or not all(isinstance(p, int) and p >= 1 for p in pieces):
    raise ValueError(f"pieces={stage_pieces} must give one positive int per axis {shape}")
  return shape, per_axis, pieces


@register("all_reduce", NAME, fit=True, **_META)
def all_reduce(n: int, *, axis_sizes=None, per_axis=None, stage_pieces=None) -> Schedule:
  shape, names, pieces = _check_shape(n, axis_sizes, per_axis, stage_pieces)
  k = len(shape)
  rs = {t: stage_schedule("reduce_scatter", names[t], shape[t], pieces[t]) for t in range(1, k)}
  ag = {t: stage_schedule("all_gather", names[t], shape[t], pieces[t]) for t in range(1, k)}
  top = stage_schedule("all_reduce", names[0], shape[0], pieces[0])
  chunks = top.num_chunks   # chunks needed at the outermost stage, then outward-in
  for t in range(1, k):
    chunks = math.lcm(rs[t].num_chunks, ag[t].num_chunks, shape[t] * chunks)
  coords = np.stack(np.unravel_index(np.arange(n), shape), axis=1)

  def held(r):   # [K, h]: the chunks each of ranks r reduces (functions: made when read)
    return np.broadcast_to(np.arange(chunks), (len(r), chunks))

  down, up = [], []
  for t in range(k - 1, 0, -1):
    def parts(r, held=held, t=t):   # [K, s_t, h / s_t]: sub-block j of each rank's chunks
      return held(r).reshape(len(r), shape[t], -1)

    down += embed(rs[t], groups(shape, t), lambda r, p=parts, t=t: _blocked_pieces(rs[t], p(r)))
    up = embed(ag[t], groups(shape, t), lambda r, p=parts, t=t: _blocked_pieces(ag[t], p(r))) + up

    def held(r, parts=parts, t=t):   # the sub-block of its own coordinate
      return parts(r)[np.arange(len(r)), coords[r, t]]

  middle = embed(top, groups(shape, 0), lambda r: held(r).reshape(len(r), top.num_chunks, -1))
  return build("all_reduce", NAME, n, chunks, *down, *middle, *up, axis_sizes=shape)


def _blocked(primitive: str, n: int, axis_sizes, per_axis, stage_pieces,
             order: Sequence[int]) -> Schedule:
  """reduce_scatter (innermost axis first) or all_gather (outermost first) over blocks.

  Global block q (rank q's) is chunks [q*g, (q+1)*g). Before the stage over axis t,
  with the axes in ``done`` processed, rank r's working set is the blocks q whose
  coordinates equal r's on ``done`` (reduce_scatter: it still reduces them) or on
  the unprocessed axes (all_gather: it holds them); sub-block j is the part with
  coordinate t equal to j.
  """
  shape, names, pieces = _check_shape(n, axis_sizes, per_axis, stage_pieces)
  stages = {t: stage_schedule(primitive, names[t], shape[t], pieces[t]) for t in order}
  g = math.lcm(*(s.blocks_per_rank for s in stages.values()))
  k = len(shape)
  coords = np.stack(np.unravel_index(np.arange(n), shape), axis=1)
  ranks = np.arange(n, dtype=np.int32).reshape(shape)   # int32: the [N, N g] rows halve
  rounds, done = [], []
  for t in order:
    fixed = list(done) if primitive == "reduce_scatter" else [u for u in range(k)
                                                              if u not in done and u != t]
    free = [u for u in range(k) if u not in fixed and u != t]
    by_rank = np.transpose(ranks, fixed + [t] + free)       # [*fixed, s_t, *free]

    def pieces(r, t=t, fixed=fixed, by_rank=by_rank):      # ranks [K] -> [K, C_sub, w]
      blocks = (by_rank[tuple(coords[r][:, fixed].T)] if fixed  # [K, s_t, *free]: blocks q
                else np.broadcast_to(by_rank, (len(r),) + by_rank.shape))
      sub_blocks = blocks.reshape(len(r), shape[t], -1, 1) * g + np.arange(g, dtype=np.int32)
      return _blocked_pieces(stages[t], sub_blocks.reshape(len(r), shape[t], -1))

    rounds += embed(stages[t], groups(shape, t), pieces)
    done.append(t)
  return build(primitive, NAME, n, n * g, *rounds, axis_sizes=shape)


@register("reduce_scatter", NAME, **_META)
def reduce_scatter(n: int, *, axis_sizes=None, per_axis=None, stage_pieces=None) -> Schedule:
  return _blocked("reduce_scatter", n, axis_sizes, per_axis, stage_pieces,
                  order=range(len(axis_sizes or ()) - 1, -1, -1))


@register("all_gather", NAME, **_META)
def all_gather(n: int, *, axis_sizes=None, per_axis=None, stage_pieces=None) -> Schedule:
  return _blocked("all_gather", n, axis_sizes, per_axis, stage_pieces,
                  order=range(len(axis_sizes or ())))


@register("all_to_all", NAME, max_devices=64, **_META)   # built rank by rank in Python: O(N^2)
def all_to_all(n: int, *, axis_sizes=None, per_axis=None, stage_pieces=None) -> Schedule:
  """Dimension-ordered all-to-all; see the module docstring.

  A block is identified by (source, destination). Before the stage over axis t
  (axes ``done`` processed) it sits at the rank with its destination's
  coordinates on ``done`` and its source's elsewhere. The blocks a rank sends
  to group member j and those it receives from j are enumerated by the same
  free coordinates (source on ``done``, destination on the rest but t), so
  sender and receiver list them in the same order.
  """
  shape, names, cuts = _check_shape(n, axis_sizes, per_axis, stage_pieces)
  k = len(shape)
  out = k * n
  loc = {(s, d): d for s in range(n) for d in range(n)}   # row at the block's current holder
  rounds: Rounds = []
  done: list[int] = []
  spans = []   # (axis, first step, end step) of each stage, in schedule order
  for stage, t in enumerate(range(k - 1, -1, -1)):
    sub = stage_schedule("all_to_all", names[t], shape[t])
    if sub.workspace_chunks or sub.blocks_per_rank != 1:
      raise ValueError(f"per_axis: {sub.algorithm!r} cannot be a stage of a hierarchical "
                       "all_to_all (it needs its own workspace)")
    rest = [u for u in range(k) if u != t]
    frees = list(itertools.product(*(range(shape[u]) for u in rest)))
    pieces, moved = [], {}
    for r in range(n):
      rc = np.unravel_index(r, shape)
      block = functools.partial(_routed_block, shape, rc, t, rest, done)
      send = [tuple(loc[block(j, f, sending=True)] for f in frees) for j in range(shape[t])]
      recv = []
      for j in range(shape[t]):
        if j == rc[t]:
          recv.append(send[j])   # blocks that stay put
          continue
        rows = []
        for i, f in enumerate(frees):
          b = block(j, f, sending=False)
          last = all(rc[u] == f[rest.index(u)] for u in rest if u not in done)
          moved[b] = out + b[0] if last else n * (1 + stage) + j * len(frees) + i
          rows.append(moved[b])
        recv.append(tuple(rows))
      pieces.append(send + recv)
    stage_rounds = [r for part in embed(sub, groups(shape, t), np.array(pieces)) for r in part]
    spans.append((t, len(rounds), len(rounds) + len(stage_rounds)))
    rounds += stage_rounds
    loc.update(moved)
    done.append(t)
  sched = build("all_to_all", NAME, n, (k + 1) * n, rounds, axis_sizes=shape,
                workspace_chunks=(k - 1) * n)
  for t, first, end in reversed(spans):   # later stages first: earlier indices stay put
    sched = sched.in_pieces(cuts[t], steps=range(first, end))
  return sched


def _routed_block(shape, rc, t, rest, done, j, free, *, sending):
  """(source, destination) of the all_to_all block that rank ``rc`` sends to (``sending``)
  or receives from group member j in the stage over axis t, with free coordinates ``free``
  on the axes ``rest``."""
  src, dst = list(rc), list(rc)
  for u, f in zip(rest, free):
    (src if u in done else dst)[u] = f
  (dst if sending else src)[t] = j
  return int(np.ravel_multi_index(src, shape)), int(np.ravel_multi_index(dst, shape))
