"""Schedules as data: who sends which chunk to whom, and how it is combined.

A collective's buffer is split into ``num_chunks`` equal chunks (rows). A
:class:`Schedule` is a sequence of :class:`Step` s; within one step every
:class:`Transfer` runs concurrently: all sends read the buffer as it was before
the step, then every received message is combined into its destination rows,
either reduced with the collective's op (``"reduce"``) or written over them
(``"copy"``). One transfer is one ``jax.lax.ppermute``: a static permutation in
which every message carries the same number of chunks.

Nothing here imports JAX. The same object is run by the ppermute executor
(:mod:`jaxcoll._src.schedules.executor`), priced by the cost model, and checked by the
NumPy reference executor :meth:`Schedule.simulate`, which is vectorized over
ranks so that schedules of thousands of ranks simulate in seconds.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import weakref
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from typing import Literal, NamedTuple

import numpy as np

from jaxcoll._src.spec import PRIMITIVES, spec

Combine = Literal["reduce", "copy"]


def _ranks(x) -> np.ndarray:
  arr = np.asarray(x, np.int32)   # the same object for an int32 vector: shared ranks stay shared
  return _frozen(arr if arr.ndim == 1 else arr.reshape(-1))


def _chunks(x, messages: int) -> np.ndarray:
  """[K, k] chunk rows from [K, k], [1, k] (one row for every message) or [K] (one each)."""
  arr = np.asarray(x, np.int32)
  arr = arr.reshape(-1, 1) if arr.ndim < 2 else arr
  arr = np.broadcast_to(arr, (messages, arr.shape[1])) if arr.shape[0] == 1 else arr
  if arr.ndim != 2 or len(arr) != messages:
    raise ValueError(f"chunk rows of shape {arr.shape} for {messages} messages: expected one "
                     "row per message (or one row for all)")
  return _frozen(arr)


def _frozen(arr: np.ndarray) -> np.ndarray:
  if arr.flags.writeable:
    arr.setflags(write=False)
  return arr


def _remembered(fn):
  """``fn`` of rank arrays, remembered per set of (read-only) array objects while they live:
  rank arrays shared by thousands of steps (every ring's) are read once."""
  cache: dict[tuple[int, ...], tuple[tuple[weakref.ref, ...], object]] = {}

  @functools.wraps(fn)
  def remembered(*arrays):
    key = tuple(map(id, arrays))
    hit = cache.get(key)
    if hit is not None and all(ref() is a for ref, a in zip(hit[0], arrays)):
      return hit[1]
    out = fn(*arrays)
    if not any(a.flags.writeable for a in arrays):
      if len(cache) >= 1 << 16:
        cache.clear()
      cache[key] = (tuple(map(weakref.ref, arrays)), out)
    return out
  return remembered


@_remembered
def _distinct(ranks: np.ndarray) -> bool:
  """No rank twice."""
  if len(ranks) < 2:
    return True
  if ranks.min() < 0:
    ordered = np.sort(ranks)
    return not (ordered[1:] == ordered[:-1]).any()
  return bool(np.bincount(ranks).max() <= 1)


@dataclasses.dataclass(frozen=True, eq=False)
class Rows:
  """The chunk rows of K messages (``[K, k]``: message i's k chunks), made when first read.

  Pricing reads how many chunks a message carries (``width``), never which, so builders
  may give the rows as a function (:meth:`lazy`): a schedule over thousands of ranks is
  priced without the arrays that only running or simulating it needs. ``array`` makes
  (once) and returns the read-only rows.
  """

  count: int
  width: int
  make: Callable[[], np.ndarray] | None = None

  @classmethod
  def of(cls, x, count: int) -> Rows:
    """Rows of ``count`` messages from a :class:`Rows` or an array-like ([K, k], [1, k] or
    [K], as :meth:`Messages.of` takes)."""
    if isinstance(x, Rows):
      if x.count != count:
        raise ValueError(f"chunk rows of {x.count} messages for {count} messages")
      return x
    arr = _chunks(x, count)
    rows = cls(count, arr.shape[1])
    rows.__dict__["array"] = arr   # what cached_property would store
    return rows

  @classmethod
  def lazy(cls, count: int, width: int, make: Callable[[], np.ndarray]) -> Rows:
    """Rows that ``make()`` returns when first read ([K, k], [1, k] or [K])."""
    return cls(int(count), int(width), make)

  @functools.cached_property
  def array(self) -> np.ndarray:
    arr = _chunks(self.make(), self.count)
    if arr.shape[1] != self.width:
      raise AssertionError(f"rows made {arr.shape[1]} chunks per message, declared {self.width}")
    return arr

  def map(self, fn: Callable[[np.ndarray], np.ndarray], width: int) -> Rows:
    """``fn`` of the rows (``[K, width]``), made when read."""
    return Rows.lazy(self.count, width, lambda: fn(self.array))

  def take(self, idx: np.ndarray) -> Rows:
    """The rows of messages ``idx``."""
    return Rows.lazy(len(idx), self.width, lambda: self.array[idx])

  @staticmethod
  def concat(parts: Sequence[Rows]) -> Rows:
    if len(parts) == 1:
      return parts[0]
    return Rows.lazy(sum(p.count for p in parts), parts[0].width,
                     lambda: np.concatenate([p.array for p in parts]))


class Messages(NamedTuple):
  """Messages of one step that a builder makes together (its unit; not stored).

  Message i goes from ``src[i]`` to ``dst[i]``; the sender reads its rows ``send[i]``, the
  receiver combines them into its rows ``recv[i]``. Every message of a group carries the
  same number of chunks; :meth:`of` takes sequences and broadcasts one row of chunks to
  every message.
  """

  src: np.ndarray    # [K]
  dst: np.ndarray    # [K]
  send: Rows         # [K, k]
  recv: Rows         # [K, k]
  combine: Combine

  @classmethod
  def of(cls, src, dst, send, recv=None, combine: Combine = "reduce") -> Messages:
    """Messages from array-likes: ``send``/``recv`` of shape [K, k], [1, k] (one row for
    every message) or [K] (one chunk each), or :class:`Rows`; ``recv`` defaults to ``send``."""
    src, dst = _ranks(src), _ranks(dst)
    send = Rows.of(send, len(src))
    return cls(src, dst, send, send if recv is None else Rows.of(recv, len(src)), combine)

  @staticmethod
  def ragged(src: Sequence[int], dst: Sequence[int], send: Sequence[Sequence[int]],
             recv: Sequence[Sequence[int]] | None = None,
             combine: Combine = "reduce") -> list[Messages]:
    """Messages whose chunk counts differ, one group per count (in order of first use)."""
    recv = send if recv is None else recv
    counts = np.fromiter(map(len, send), int, len(send))
    src, dst = np.asarray(src), np.asarray(dst)
    out = []
    for count in dict.fromkeys(counts.tolist()):   # in order of first use
      idx = np.flatnonzero(counts == count)
      if count:
        out.append(Messages.of(src[idx], dst[idx], np.stack([send[i] for i in idx]),
                               np.stack([recv[i] for i in idx]), combine))
    return out


@dataclasses.dataclass(frozen=True, eq=False)
class Transfer:
  """Messages of one step that form a single ``ppermute``.

  Message ``i`` goes from ``src[i]`` to ``dst[i]``; the sender reads rows
  ``send_chunks[i]`` of its buffer, the receiver combines the message into its
  rows ``recv_chunks[i]``. Sources are distinct, destinations are distinct, and
  every message carries ``chunks_per_message`` rows. Ranks are read-only NumPy arrays
  (``[K]``), the rows :class:`Rows` (``[K, k]``, made when first read; sequences are
  converted), so schedules of thousands of ranks stay arrays, not Python objects;
  transfers compare by identity.
  """

  src: np.ndarray
  dst: np.ndarray
  send: Rows
  recv: Rows
  combine: Combine

  def __post_init__(self):
    src, dst = _ranks(self.src), _ranks(self.dst)
    n = len(src)
    if n != len(dst) or n == 0:
      raise ValueError("Transfer needs one src, dst, send and recv entry per message")
    try:
      send, recv = Rows.of(self.send, n), Rows.of(self.recv, n)
      if send.width != recv.width:
        raise ValueError(f"{send.width} chunks sent, {recv.width} received")
    except ValueError as e:   # ragged, rows for other messages, or widths that differ
      raise ValueError("every message of a Transfer must carry the same number of chunks, "
                       f"one row of them per message: {e}") from e
    for name, value in (("src", src), ("dst", dst), ("send", send), ("recv", recv)):
      object.__setattr__(self, name, value)
    if not (_distinct(src) and _distinct(dst)):
      raise ValueError(f"Transfer sources and destinations must be distinct: {self.perm}")
    if self.combine not in ("reduce", "copy"):
      raise ValueError(f"combine must be 'reduce' or 'copy', got {self.combine!r}")

  @property
  def send_chunks(self) -> np.ndarray:
    """``[K, k]``: the rows each sender reads."""
    return self.send.array

  @property
  def recv_chunks(self) -> np.ndarray:
    """``[K, k]``: the rows each receiver combines into."""
    return self.recv.array

  @property
  def perm(self) -> tuple[tuple[int, int], ...]:
    """The static ``(source, destination)`` pairs, as ``lax.ppermute`` takes them."""
    return tuple(zip(self.src.tolist(), self.dst.tolist()))

  @property
  def chunks_per_message(self) -> int:
    return self.send.width


def _first_fit(src: np.ndarray, dst: np.ndarray, sizes: Sequence[int]) -> np.ndarray:
  """[K]: the transfer (layer) of each message, exactly as placing them one by one in order
  gives: the first layer whose sources and destinations do not hold the message's, a new
  one if none.

  Only earlier messages that share a source or destination decide a message's layer, so
  every round places at once each message that no unplaced earlier one shares a rank with
  (a tree's step takes two or three rounds, not one per message); a group (``sizes`` cuts
  the messages into groups) with distinct sources and destinations is one round."""
  if len(sizes) == 1 and _distinct(src) and _distinct(dst):
    return np.zeros(len(src), np.int64)
  n = int(max(src.max(), dst.max())) + 1
  used_src, used_dst = np.zeros((0, n), bool), np.zeros((0, n), bool)
  layer = np.empty(len(src), np.int64)
  ends = np.cumsum(sizes)
  todo = np.arange(len(src))
  while len(todo):
    first = int(np.sum(todo < ends[np.searchsorted(ends, todo[0], side="right")]))
    if _distinct(src[todo[:first]]) and _distinct(dst[todo[:first]]):
      ready = np.arange(len(todo)) < first   # the rest of the first unplaced one's group
    else:
      ready = np.zeros(len(todo), bool)
      ready[np.unique(src[todo], return_index=True)[1]] = True
      first_dst = np.zeros(len(todo), bool)
      first_dst[np.unique(dst[todo], return_index=True)[1]] = True
      ready &= first_dst
    s, d = src[todo[ready]], dst[todo[ready]]
    fits = ~used_src[:, s] & ~used_dst[:, d]                   # [layers, messages]
    first = np.where(fits.any(0), fits.argmax(0) if len(fits) else 0, len(used_src))
    if (first == len(used_src)).any():
      used_src = np.vstack([used_src, np.zeros((1, n), bool)])
      used_dst = np.vstack([used_dst, np.zeros((1, n), bool)])
    used_src[first, s] = True
    used_dst[first, d] = True
    layer[todo[ready]] = first
    todo = todo[~ready]
  return layer


@_remembered
def _packed(*ranks: np.ndarray) -> np.ndarray:
  """:func:`_first_fit` of groups given as their sources, then their destinations (a run's
  steps pack alike: once)."""
  src, dst = ranks[:len(ranks) // 2], ranks[len(ranks) // 2:]
  return _first_fit(np.concatenate(src), np.concatenate(dst), [len(s) for s in src])


@dataclasses.dataclass(frozen=True)
class Step:
  """Transfers that run concurrently (all sends see the pre-step buffer)."""

  transfers: tuple[Transfer, ...]

  @staticmethod
  def of(groups: Sequence[Messages]) -> Step:
    """Packs a step's messages into as few ppermutes as their shapes allow.

    Messages with the same chunk count and combine share a transfer as long as no rank
    sends or receives twice in it; each message joins the first transfer it fits (in
    order), and transfers are ordered by their first message.
    """
    keyed: dict[tuple[int, str], list[tuple[Messages, np.ndarray]]] = {}
    seen = 0
    for g in (g for g in groups if len(g.src)):
      if g.send.width != g.recv.width or g.send.width < 1:
        raise ValueError(f"messages {g} must send as many chunks as they receive (>= 1)")
      keyed.setdefault((g.send.width, g.combine), []).append(
          (g, np.arange(seen, seen + len(g.src))))
      seen += len(g.src)
    made = []
    for (_, combine), gs in keyed.items():
      if len(gs) == 1 and _distinct(gs[0][0].src) and _distinct(gs[0][0].dst):
        g, at = gs[0]   # one group that is one ppermute: its arrays as they are
        made.append((at[0], Transfer(g.src, g.dst, g.send, g.recv, combine)))
        continue
      src, dst, order = (np.concatenate(f) for f in zip(*((g.src, g.dst, at) for g, at in gs)))
      send, recv = (Rows.concat([g[i] for g, _ in gs]) for i in (2, 3))
      layer = _packed(*(g.src for g, _ in gs), *(g.dst for g, _ in gs))
      whole = {int(at[0]): g for g, at in gs}   # a transfer of one whole group keeps its arrays
      for j in range(layer.max() + 1):
        idx = np.flatnonzero(layer == j)
        first, g = order[idx[0]], whole.get(int(order[idx[0]]))
        if g is None or len(g.src) != len(idx) or order[idx[-1]] - first != len(idx) - 1:
          g = Messages(src[idx], dst[idx], send.take(idx), recv.take(idx), combine)
        made.append((first, Transfer(g.src, g.dst, g.send, g.recv, combine)))
    return Step(tuple(t for _, t in sorted(made, key=lambda m: m[0])))


@dataclasses.dataclass(frozen=True, eq=False)
class Run:
  """``count`` consecutive steps of one structure: the same transfers (ranks, chunks per
  message, combines, and whether each message's rows are consecutive) moving different
  chunks, as in every ring. Step i is ``make(i)``, made when read; pricing reads ``first``
  alone (:meth:`Steps.runs`)."""

  count: int
  make: Callable[[int], Step]

  @functools.cached_property
  def first(self) -> Step:
    return self.make(0)


class Steps(Sequence):
  """A schedule's steps, in order: some held as :class:`Run` s, made one by one when read,
  so a ring's thousands of steps cost nothing until a simulator or executor walks them."""

  def __init__(self, parts: Iterable[Step | Run]):
    self.parts = tuple(p for p in parts if not isinstance(p, Run) or p.count)
    self._ends = np.cumsum([p.count if isinstance(p, Run) else 1 for p in self.parts],
                           dtype=np.int64)

  def __len__(self) -> int:
    return int(self._ends[-1]) if len(self._ends) else 0

  def __getitem__(self, i):
    if isinstance(i, slice):
      return tuple(self[j] for j in range(*i.indices(len(self))))
    i = operator.index(i) + (len(self) if i < 0 else 0)
    if not 0 <= i < len(self):
      raise IndexError(f"step {i} of {len(self)}")
    p = int(np.searchsorted(self._ends, i, side="right"))
    part = self.parts[p]
    return part if isinstance(part, Step) else part.make(i - int(self._ends[p]) + part.count)

  def __iter__(self) -> Iterator[Step]:
    for part in self.parts:
      if isinstance(part, Step):
        yield part
      else:
        yield from map(part.make, range(part.count))

  def runs(self) -> Iterator[tuple[Step, int]]:
    """(step, count): each part once, a run as its first step and its length."""
    for part in self.parts:
      yield (part, 1) if isinstance(part, Step) else (part.first, part.count)

  def map(self, fn: Callable[[Step], Step]) -> Steps:
    """``fn`` of every step, runs kept runs (``fn`` must keep a run's steps one structure)."""
    return Steps(fn(p) if isinstance(p, Step) else
                 Run(p.count, lambda i, make=p.make: fn(make(i))) for p in self.parts)

  def __eq__(self, other) -> bool:
    return isinstance(other, Steps) and self.parts == other.parts

  def __hash__(self) -> int:
    return hash(self.parts)

  def __repr__(self) -> str:
    return f"Steps({len(self)} steps in {len(self.parts)} parts)"


def per_array(fn):
  """``fn`` of NumPy arrays, computed once per distinct set of array objects (by identity).

  Schedules share rank arrays between steps (a ring's thousands of steps hold one
  permutation), so whatever is computed from them alone is computed once; the cache lives
  as long as the returned function (one pass over one schedule)."""
  cache: dict[tuple[int, ...], tuple[tuple, object]] = {}

  def cached(*arrays):
    key = tuple(map(id, arrays))
    if key not in cache:
      cache[key] = (arrays, fn(*arrays))   # holds the arrays: their ids stay theirs
    return cache[key][1]
  return cached


class _Weights:
  """Sums weights per key of rank arrays, ``of(*arrays)`` computed once per distinct key
  (by identity, :func:`per_array`), so a pass over a schedule costs O(steps + distinct
  permutations x N), not O(steps x N)."""

  def __init__(self, of):
    self.of = per_array(of)
    self.weights: dict[tuple, list] = {}

  def add(self, key: tuple, weight: float) -> np.ndarray:
    """Adds ``weight`` to ``key`` (flags and arrays); returns ``of`` of its arrays."""
    arrays = tuple(k for k in key if isinstance(k, np.ndarray))
    slot = self.weights.setdefault(tuple(id(k) if isinstance(k, np.ndarray) else k
                                         for k in key), [key, 0])
    slot[1] += weight
    return self.of(*arrays)

  def totals(self):
    """(key, weight * of(key's arrays)) per key."""
    for key, weight in self.weights.values():
      yield key, weight * self.of(*(k for k in key if isinstance(k, np.ndarray)))


def crossing_axis(axis_sizes: Sequence[int], src: np.ndarray, dst: np.ndarray) -> np.ndarray:
  """[K]: for each message, the outermost mesh axis (of sizes ``axis_sizes``, outermost
  first) in which its two ranks' coordinates differ, -1 for a message to itself. The one
  rule that charges a message to an axis (:meth:`Schedule.traffic`, the cost model).

  Coordinates 0..a agree exactly when ``rank // stride_a`` does (stride_a: the product of
  the sizes inside axis a), and those that agree are a prefix, so the axis is how many
  agree."""
  strides = np.cumprod((1, *axis_sizes[:0:-1]))[::-1]   # [A]: product of the inner sizes
  agree = sum(src // s == dst // s for s in strides.tolist())
  return np.where(agree == len(strides), -1, agree)


class AxisTraffic(NamedTuple):
  """What a schedule sends over one mesh axis: steps that use it, most bytes any rank sends."""

  steps: int
  bytes: float


@dataclasses.dataclass(frozen=True)
class Schedule:
  """A collective as data.

  Attributes:
    primitive: one of ``PRIMITIVES``.
    algorithm: the algorithm's name.
    axis_size: the number of ranks N.
    num_chunks: C, the number of equal chunks the buffer is split into. For
      ``reduce_scatter`` and ``all_gather`` C is a multiple of N and rank r's
      block is chunks ``[r*C/N, (r+1)*C/N)``.
    steps: the steps, run in order (a :class:`Steps`; any sequence of :class:`Step` and
      :class:`Run` is converted).
    root: the root rank of ``broadcast`` and ``reduce``.
    axis_sizes: the sizes of the mesh axes the ranks span, outermost first
      (rank = ``np.ravel_multi_index(coords, axis_sizes)``, ``lax.axis_index``'s
      order over a tuple of axes); ``(N,)`` for one axis. Hierarchical schedules
      are built for a shape; :meth:`traffic` prices any schedule on any shape.
    workspace_chunks: all_to_all only: rows between the input and the output
      region that start zero (the in-flight area of multi-hop exchanges).

  The message is M bytes: the per-device input of all_reduce, reduce_scatter,
  broadcast, reduce, all_to_all and shift, the per-device output of
  all_gather. Rank r starts with its input in the buffer (all_gather: its piece
  in its block, the rest zeros) and ends with: the reduction everywhere
  (all_reduce); the reduction of its block in its block (reduce_scatter); every
  rank's piece in place (all_gather); the root's buffer (broadcast); the
  reduction at the root (reduce).

  all_to_all's buffer is ``[input | workspace | output]``: N input blocks (block
  j is bound for rank j), ``workspace_chunks`` rows, and N output blocks (block
  j comes from rank j); the rank's own block starts already copied into its
  output block. shift's buffer is ``[input, output]``, the output zero: a rank
  ends with its sender's input in row 1 (zeros if nobody sends to it).
  """

  primitive: str
  algorithm: str
  axis_size: int
  num_chunks: int
  steps: Steps
  root: int = 0
  axis_sizes: tuple[int, ...] = ()
  workspace_chunks: int = 0

  def __post_init__(self):
    if self.primitive not in PRIMITIVES:
      raise ValueError(f"unknown primitive {self.primitive!r}; expected one of {PRIMITIVES}")
    n, c, kind = self.axis_size, self.num_chunks, self.layout
    if not self.axis_sizes:
      object.__setattr__(self, "axis_sizes", (n,))
    if int(np.prod(self.axis_sizes)) != n:
      raise ValueError(f"axis_sizes {self.axis_sizes} do not multiply to axis_size {n}")
    if spec(self.primitive).blocked and c % n:
      raise ValueError(f"{self.primitive} schedules need num_chunks divisible by axis_size")
    if kind == "exchange" and (c - self.workspace_chunks) % (2 * n):
      raise ValueError("all_to_all schedules need num_chunks - workspace_chunks divisible by "
                       "2 * axis_size")
    if kind == "pair" and c != 2:
      raise ValueError("shift schedules have 2 chunks: input and output")
    if self.workspace_chunks and kind != "exchange":
      raise ValueError("only all_to_all schedules have workspace_chunks")
    if not isinstance(self.steps, Steps):
      object.__setattr__(self, "steps", Steps(self.steps))
    ranks = per_array(lambda a: (a.min(), a.max()))
    for step, _ in self.steps.runs():
      for t in step.transfers:
        (lo_src, hi_src), (lo_dst, hi_dst) = ranks(t.src), ranks(t.dst)
        if min(lo_src, lo_dst) < 0 or max(hi_src, hi_dst) >= n:
          raise ValueError(f"rank out of range [0, {n}) in {t.perm}")
    for step, _ in self.steps.runs():
      self._check_rows(step, made_only=True)

  def checked_steps(self) -> Iterator[Step]:
    """Every step, made, with its chunk rows checked to lie in ``[0, num_chunks)`` (raises
    otherwise): how the simulator and the executor's plan, which read every row, walk the
    schedule. Construction checks the rows already made; builders leave the rest to be
    made when read."""
    for step in self.steps:
      self._check_rows(step)
      yield step

  def _check_rows(self, step: Step, *, made_only: bool = False) -> None:
    c = self.num_chunks
    for t in step.transfers:
      for rows in (t.send, t.recv):
        if made_only and "array" not in rows.__dict__:
          continue
        if rows.array.min() < 0 or rows.array.max() >= c:
          raise ValueError(f"chunk out of range [0, {c}) in step {step}")

  @property
  def num_steps(self) -> int:
    """Number of sequential communication rounds (the alpha term's count)."""
    return len(self.steps)

  @property
  def layout(self) -> str:
    """How the buffer's rows are laid out: the primitive's :attr:`CollectiveSpec.layout`."""
    return spec(self.primitive).layout

  @property
  def blocks_per_rank(self) -> int:
    """Chunks per rank's block (reduce_scatter, all_gather, all_to_all)."""
    if self.layout == "exchange":
      return (self.num_chunks - self.workspace_chunks) // (2 * self.axis_size)
    return self.num_chunks // self.axis_size

  @property
  def message_chunks(self) -> int:
    """How many chunks the M-byte message spans (the unit of ``bytes_per_rank``)."""
    if self.layout == "exchange":
      return self.axis_size * self.blocks_per_rank
    return 1 if self.layout == "pair" else self.num_chunks

  @functools.cached_property
  def chunks_sent(self) -> np.ndarray:
    """``[2, N]`` array: chunks each rank sends in reduce transfers (row 0) and copies (row 1)."""
    weights = _Weights(lambda src: np.bincount(src, minlength=self.axis_size))
    for step, count in self.steps.runs():
      for t in step.transfers:
        weights.add((t.combine == "copy", t.src), t.chunks_per_message * count)
    sent = np.zeros((2, self.axis_size), np.int64)
    for (copy, _), total in weights.totals():
      sent[int(copy)] += total
    return sent

  def bytes_per_rank(self, nbytes: float, *, partial_sum_scale: float = 1.0) -> float:
    """The most bytes any one rank sends over the whole schedule.

    Args:
      nbytes: M, the full buffer (see the class docstring).
      partial_sum_scale: size factor of the partial sums that reduce transfers
        carry: 2.0 when bfloat16 data accumulates in float32 on the wire.
    """
    reduce_chunks, copy_chunks = self.chunks_sent
    per_rank = reduce_chunks * partial_sum_scale + copy_chunks
    return float(per_rank.max(initial=0)) * nbytes / self.message_chunks

  def traffic(self, nbytes: float, axis_sizes: Sequence[int] | None = None, *,
              partial_sum_scale: float = 1.0) -> tuple[AxisTraffic, ...]:
    """Steps and bytes per mesh axis, outermost first.

    A message is charged to the outermost axis in which its two ranks'
    coordinates differ (on a ("node", "local") mesh every message between
    nodes crosses the node link). ``steps`` counts the steps with at least one
    message on that axis, ``bytes`` the most any rank sends over it.

    Args:
      nbytes: M, as in :meth:`bytes_per_rank`.
      axis_sizes: the shape to price on; default the schedule's own.
      partial_sum_scale: as in :meth:`bytes_per_rank`.
    """
    shape = tuple(axis_sizes or self.axis_sizes)
    if int(np.prod(shape)) != self.axis_size:
      raise ValueError(f"axis_sizes {shape} do not multiply to axis_size {self.axis_size}")
    axes = np.arange(len(shape))

    def lane(src, dst):   # [A, N]: messages each rank sends over each axis
      axis = crossing_axis(shape, src, dst)
      return np.stack([np.bincount(src[axis == a], minlength=self.axis_size) for a in axes])

    weights = _Weights(lane)
    steps = np.zeros(len(shape), np.int64)
    for step, count in self.steps.runs():
      crossed = np.zeros(len(shape), bool)
      for t in step.transfers:
        crossed |= weights.add((t.src, t.dst), count * t.chunks_per_message * (
            partial_sum_scale if t.combine == "reduce" else 1.0)).any(axis=1)
      steps += crossed * count
    sent = sum((total for _, total in weights.totals()), np.zeros((len(shape), self.axis_size)))
    scale = nbytes / self.message_chunks
    return tuple(AxisTraffic(int(s), float(b.max(initial=0)) * scale)
                 for s, b in zip(steps, sent))

  def in_pieces(self, pieces: int, steps: Collection[int] | None = None) -> Schedule:
    """The same collective with every step cut into ``pieces`` steps of 1/pieces the bytes.

    Chunk c becomes chunks ``c*pieces ... c*pieces + pieces-1`` (blocks stay blocks), and
    step s becomes steps s_0 ... s_{pieces-1}, step s_j moving piece j of every chunk s
    moves. ``steps`` (indices) cuts only those steps; the others move all pieces of their
    chunks at once. Elementwise combines act on each piece alone, so results are identical.
    Cost: ``pieces`` times the cut steps (alpha), the same bytes (beta). What it buys is
    smaller messages in flight, which over gloo's TCP fill a link better than one large
    message does (measured: docs/measurements.md#messages-in-pieces). Runs of
    pieces share one structure, so the executor runs them as one loop.
    """
    if not isinstance(pieces, int) or pieces < 1:
      raise ValueError(f"pieces={pieces!r} must be a positive int")
    if pieces == 1:
      return self
    cut = set(range(len(self.steps)) if steps is None else steps)
    expand = lambda rows, js: rows.map(  # noqa: E731
        lambda c: (c[:, :, None] * pieces + js).reshape(len(c), -1), rows.width * len(js))
    whole = np.arange(pieces)
    steps_out = tuple(
        Step(tuple(dataclasses.replace(t, send=expand(t.send, js), recv=expand(t.recv, js))
                   for t in step.transfers))
        for i, step in enumerate(self.steps)
        for js in (whole[:, None] if i in cut else [whole]))
    return dataclasses.replace(self, num_chunks=self.num_chunks * pieces, steps=steps_out,
                               workspace_chunks=self.workspace_chunks * pieces)

  def relabel(self, root: int) -> Schedule:
    """The same schedule with rank v played by rank (v + root) mod N."""
    n = self.axis_size
    shift = per_array(lambda ranks: (ranks + root) % n)   # shared arrays stay shared
    steps = self.steps.map(lambda s: Step(tuple(
        dataclasses.replace(t, src=shift(t.src), dst=shift(t.dst)) for t in s.transfers)))
    return dataclasses.replace(self, steps=steps, root=(self.root + root) % n)

  def check(self, inputs: Sequence[np.ndarray] | None = None, op: str = "sum") -> None:
    """Simulates the schedule (:meth:`simulate`) and compares every rank's result with the
    collective's NumPy reference (:meth:`CollectiveSpec.expected`), exactly.

    Args:
      inputs: one array per rank, as :meth:`simulate` takes them; default: small integers,
        different on every rank and element (sums of them are exact in any order).
      op: "sum", "prod", "min" or "max".

    Raises:
      AssertionError: a rank whose result differs, named with the first differing element.

    Example:
      >>> import jaxcoll
      >>> jaxcoll.schedule("all_reduce", "ring", 5).check()
    """
    n = self.axis_size
    if inputs is None:
      length = 3 if spec(self.primitive).message == "output" else 3 * n
      inputs = [(np.arange(length) * (r + 2) + r) % 7 for r in range(n)]
    got = self.simulate(inputs, op=op)
    want = spec(self.primitive).expected(inputs, self.root, op)
    for r, (g, w) in enumerate(zip(got, want)):
      if g.shape != w.shape or not np.array_equal(g, w):
        at = "shape" if g.shape != w.shape else int(np.flatnonzero(g != w)[0])
        raise AssertionError(f"{self.primitive} schedule {self.algorithm!r} on {n} ranks "
                             f"(root {self.root}, op {op}): rank {r} ends with {g.tolist()}, "
                             f"expected {w.tolist()} (first difference at {at})")

  def simulate(self, inputs: Sequence[np.ndarray], op: str = "sum") -> list[np.ndarray]:
    """NumPy reference executor: runs the schedule on per-rank inputs, no JAX.

    Args:
      inputs: one array per rank: the full buffer (any shape, flattened) for
        all_reduce, reduce_scatter, broadcast and reduce; the rank's piece for
        all_gather.
      op: "sum", "prod", "min" or "max". Float16/bfloat16 combines compute in
        float32 and round once, as the JAX executor does.

    Returns:
      One flat array per rank: the buffer (all_reduce, broadcast, reduce,
      all_gather), the rank's block (reduce_scatter) or its output
      (all_to_all, shift). Chunks are padded to
      equal length internally and the padding is dropped.
    """
    from jaxcoll._src import (
      layout,  # NumPy-only too
      ops,  # local: ops is NumPy-only too
    )

    n = self.axis_size
    if len(inputs) != n:
      raise ValueError(f"simulate needs {n} inputs (one per rank), got {len(inputs)}")
    flat = [np.asarray(x).reshape(-1) for x in inputs]
    if len({f.size for f in flat}) != 1:
      raise ValueError("every rank's input must have the same size")
    size = flat[0].size
    buf = np.stack([layout.to_rows(np, f, self, rank=r) for r, f in enumerate(flat)])
    combine = functools.partial(ops.combine_numpy, op)
    for step in self.checked_steps():
      sent = [buf[t.src[:, None], t.send_chunks] for t in step.transfers]
      for t, data in zip(step.transfers, sent):
        dst, rows = t.dst[:, None], t.recv_chunks
        buf[dst, rows] = combine(buf[dst, rows], data) if t.combine == "reduce" else data
    out = [layout.from_rows(np, buf[r], self, size, rank=r) for r in range(n)]
    facts = spec(self.primitive)
    if facts.rooted and facts.reduces:   # reduce: only the root keeps the result
      out = [o if r == self.root else np.zeros_like(o) for r, o in enumerate(out)]
    return out
