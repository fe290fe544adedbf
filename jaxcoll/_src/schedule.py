"""Schedules as data: who sends which chunk to whom, and how it is combined.

A collective's buffer is split into ``num_chunks`` equal chunks (rows). A
:class:`Schedule` is a sequence of :class:`Step` s; within one step every
:class:`Transfer` runs concurrently: all sends read the buffer as it was before
the step, then every received message is combined into its destination rows,
either reduced with the collective's op (``"reduce"``) or written over them
(``"copy"``). One transfer is one ``jax.lax.ppermute``: a static permutation in
which every message carries the same number of chunks.

Nothing here imports JAX. The same object is run by the ppermute executor
(:mod:`jaxcoll._src.executor`), priced by the cost model, and checked by the
NumPy reference executor :meth:`Schedule.simulate`, which is vectorized over
ranks so that schedules of thousands of ranks simulate in seconds.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Collection, Sequence
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
  return _frozen(np.broadcast_to(arr, (messages, arr.shape[1])) if arr.shape[0] == 1 else arr)


def _frozen(arr: np.ndarray) -> np.ndarray:
  if arr.flags.writeable:
    arr.setflags(write=False)
  return arr


def _distinct(ranks: np.ndarray) -> bool:
  if len(ranks) < 2:
    return True
  if ranks.min() < 0:
    ordered = np.sort(ranks)
    return not (ordered[1:] == ordered[:-1]).any()
  return np.bincount(ranks).max() <= 1


class Messages(NamedTuple):
  """Messages of one step that a builder makes together (its unit; not stored).

  Message i goes from ``src[i]`` to ``dst[i]``; the sender reads its rows ``send[i]``, the
  receiver combines them into its rows ``recv[i]``. Every message of a group carries the
  same number of chunks; :meth:`of` takes sequences and broadcasts one row of chunks to
  every message.
  """

  src: np.ndarray    # [K]
  dst: np.ndarray    # [K]
  send: np.ndarray   # [K, k]
  recv: np.ndarray   # [K, k]
  combine: Combine

  @classmethod
  def of(cls, src, dst, send, recv=None, combine: Combine = "reduce") -> Messages:
    """Messages from array-likes: ``send``/``recv`` of shape [K, k], [1, k] (one row for
    every message) or [K] (one chunk each); ``recv`` defaults to ``send``."""
    src, dst = _ranks(src), _ranks(dst)
    send = _chunks(send, len(src))
    return cls(src, dst, send, send if recv is None else _chunks(recv, len(src)), combine)

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
        out.append(Messages(_ranks(src[idx]), _ranks(dst[idx]),
                            _chunks(np.stack([send[i] for i in idx]), len(idx)),
                            _chunks(np.stack([recv[i] for i in idx]), len(idx)), combine))
    return out


@dataclasses.dataclass(frozen=True, eq=False)
class Transfer:
  """Messages of one step that form a single ``ppermute``.

  Message ``i`` goes from ``src[i]`` to ``dst[i]``; the sender reads rows
  ``send_chunks[i]`` of its buffer, the receiver combines the message into its
  rows ``recv_chunks[i]``. Sources are distinct, destinations are distinct, and
  every message carries ``chunks_per_message`` rows. The fields are read-only NumPy
  arrays (``[K]`` ranks, ``[K, k]`` chunks; sequences are converted), so schedules of
  thousands of ranks stay arrays, not Python objects; transfers compare by identity.
  """

  src: np.ndarray
  dst: np.ndarray
  send_chunks: np.ndarray
  recv_chunks: np.ndarray
  combine: Combine

  def __post_init__(self):
    n = np.size(self.src)
    if not (n == np.size(self.dst) == len(self.send_chunks) == len(self.recv_chunks)) or n == 0:
      raise ValueError("Transfer needs one src, dst, send and recv entry per message")
    try:
      send, recv = _chunks(self.send_chunks, n), _chunks(self.recv_chunks, n)
    except ValueError:   # ragged
      send = recv = None
    if send is None or send.ndim != 2 or send.shape != recv.shape:
      raise ValueError("every message of a Transfer must carry the same number of chunks")
    object.__setattr__(self, "src", _ranks(self.src))
    object.__setattr__(self, "dst", _ranks(self.dst))
    object.__setattr__(self, "send_chunks", send)
    object.__setattr__(self, "recv_chunks", recv)
    if not (_distinct(self.src) and _distinct(self.dst)):
      raise ValueError(f"Transfer sources and destinations must be distinct: {self.perm}")
    if self.combine not in ("reduce", "copy"):
      raise ValueError(f"combine must be 'reduce' or 'copy', got {self.combine!r}")

  @property
  def perm(self) -> tuple[tuple[int, int], ...]:
    """The static ``(source, destination)`` pairs, as ``lax.ppermute`` takes them."""
    return tuple(zip(self.src.tolist(), self.dst.tolist()))

  @property
  def chunks_per_message(self) -> int:
    return self.send_chunks.shape[1]


def _first_fit(src: np.ndarray, dst: np.ndarray, sizes: Sequence[int]) -> np.ndarray:
  """[K]: the transfer (layer) of each message: the first whose sources and destinations
  do not hold the message's, a new one if none. ``sizes`` cuts the messages into groups; a
  group with distinct sources and destinations is placed at once (its messages cannot block
  each other, so this equals placing them one by one), any other one message at a time."""
  if len(sizes) == 1 and _distinct(src) and _distinct(dst):
    return np.zeros(len(src), np.int64)
  n = int(max(src.max(), dst.max())) + 1
  used_src, used_dst = np.zeros((0, n), bool), np.zeros((0, n), bool)
  layer = np.empty(len(src), np.int64)
  start = 0
  for size in sizes:
    part = slice(start, start + size)
    start += size
    s, d = src[part], dst[part]
    if _distinct(s) and _distinct(d):
      blocks = [(slice(None), s, d)]
    else:
      blocks = [(slice(i, i + 1), s[i:i + 1], d[i:i + 1]) for i in range(size)]
    for where, s_, d_ in blocks:
      fits = ~used_src[:, s_] & ~used_dst[:, d_]                 # [layers, messages]
      first = np.where(fits.any(0), fits.argmax(0) if len(fits) else 0, len(used_src))
      if (first == len(used_src)).any():
        used_src = np.vstack([used_src, np.zeros((1, n), bool)])
        used_dst = np.vstack([used_dst, np.zeros((1, n), bool)])
      used_src[first, s_] = True
      used_dst[first, d_] = True
      layer[part][where] = first
  return layer


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
      if g.send.shape != g.recv.shape or g.send.shape[1] < 1:
        raise ValueError(f"messages {g} must send as many chunks as they receive (>= 1)")
      keyed.setdefault((g.send.shape[1], g.combine), []).append(
          (g, np.arange(seen, seen + len(g.src))))
      seen += len(g.src)
    made = []
    for (_, combine), gs in keyed.items():
      src, dst, send, recv, order = (np.concatenate(f) if len(gs) > 1 else f[0]
                                     for f in zip(*((*g[:4], at) for g, at in gs)))
      layer = _first_fit(src, dst, [len(g.src) for g, _ in gs])
      whole = {int(at[0]): g for g, at in gs}   # a transfer of one whole group keeps its arrays
      for j in range(layer.max() + 1):
        idx = np.flatnonzero(layer == j)
        first, g = order[idx[0]], whole.get(int(order[idx[0]]))
        if g is None or len(g.src) != len(idx) or order[idx[-1]] - first != len(idx) - 1:
          g = Messages(src[idx], dst[idx], send[idx], recv[idx], combine)
        made.append((first, Transfer(g.src, g.dst, g.send, g.recv, combine)))
    return Step(tuple(t for _, t in sorted(made, key=lambda m: m[0])))


def per_array(fn):
  """``fn`` of NumPy arrays, computed once per distinct set of array objects (by identity).

  Schedules share rank arrays between steps (a ring's thousands of steps hold one
  permutation), so whatever is computed from them alone is computed once; the cache lives
  as long as the returned function (one pass over one schedule)."""
  cache: dict[tuple[int, ...], object] = {}

  def cached(*arrays):
    key = tuple(map(id, arrays))
    if key not in cache:
      cache[key] = fn(*arrays)
    return cache[key]
  return cached


def _per_rank(ranks: np.ndarray, n: int, weight: float) -> np.ndarray:
  """[N]: ``weight`` for every rank in ``ranks`` (distinct), 0 elsewhere."""
  return np.bincount(ranks, minlength=n) * weight


def crossing_axis(coords: np.ndarray, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
  """[K]: for each message, the outermost mesh axis in which its two ranks' coordinates
  (``coords``: [N, A]) differ, -1 for a message to itself. The one rule that charges a
  message to an axis (:meth:`Schedule.traffic`, the cost model)."""
  differ = coords[src] != coords[dst]
  return np.where(differ.any(1), differ.argmax(1), -1)


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
    steps: the steps, run in order.
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
  steps: tuple[Step, ...]
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
    for step in self.steps:
      for t in step.transfers:
        if min(t.src.min(), t.dst.min()) < 0 or max(t.src.max(), t.dst.max()) >= n:
          raise ValueError(f"rank out of range [0, {n}) in {t.perm}")
        if (min(t.send_chunks.min(), t.recv_chunks.min()) < 0
            or max(t.send_chunks.max(), t.recv_chunks.max()) >= c):
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
    sent = np.zeros((2, self.axis_size), np.int64)
    for step in self.steps:
      for t in step.transfers:
        sent[0 if t.combine == "reduce" else 1] += _per_rank(t.src, self.axis_size,
                                                              t.chunks_per_message)
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
    coords = np.stack(np.unravel_index(np.arange(self.axis_size), shape), axis=1)
    steps = np.zeros(len(shape), np.int64)
    sent = np.zeros((len(shape), self.axis_size))
    crossing = per_array(functools.partial(crossing_axis, coords))
    for step in self.steps:
      crossed = np.zeros(len(shape), bool)
      for t in step.transfers:
        axis = crossing(t.src, t.dst)
        weight = t.chunks_per_message * (partial_sum_scale if t.combine == "reduce" else 1.0)
        for a in range(len(shape)):
          on = axis == a
          crossed[a] |= on.any()
          sent[a] += _per_rank(t.src[on], self.axis_size, weight)
      steps += crossed
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
    expand = lambda chunks, js: (chunks[:, :, None] * pieces + js).reshape(len(chunks), -1)  # noqa: E731
    whole = np.arange(pieces)
    steps_out = tuple(
        Step(tuple(dataclasses.replace(t, send_chunks=expand(t.send_chunks, js),
                                       recv_chunks=expand(t.recv_chunks, js))
                   for t in step.transfers))
        for i, step in enumerate(self.steps)
        for js in (whole[:, None] if i in cut else [whole]))
    return dataclasses.replace(self, num_chunks=self.num_chunks * pieces, steps=steps_out,
                               workspace_chunks=self.workspace_chunks * pieces)

  def relabel(self, root: int) -> Schedule:
    """The same schedule with rank v played by rank (v + root) mod N."""
    n = self.axis_size
    shift = per_array(lambda ranks: (ranks + root) % n)   # shared arrays stay shared
    steps = tuple(
        Step(tuple(dataclasses.replace(t, src=shift(t.src), dst=shift(t.dst)) for t in s.transfers))
        for s in self.steps)
    return dataclasses.replace(self, steps=steps, root=(self.root + root) % n)

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
    for step in self.steps:
      sent = [buf[t.src[:, None], t.send_chunks] for t in step.transfers]
      for t, data in zip(step.transfers, sent):
        dst, rows = t.dst[:, None], t.recv_chunks
        buf[dst, rows] = combine(buf[dst, rows], data) if t.combine == "reduce" else data
    out = [layout.from_rows(np, buf[r], self, size, rank=r) for r in range(n)]
    facts = spec(self.primitive)
    if facts.rooted and facts.reduces:   # reduce: only the root keeps the result
      out = [o if r == self.root else np.zeros_like(o) for r, o in enumerate(out)]
    return out
