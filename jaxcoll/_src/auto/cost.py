"""The alpha-beta cost model, read from the schedules themselves.

A schedule runs as a sequence of ppermutes (its transfers, step by step; XLA
runs the collective-permutes of one program one after another on the CPU, and
each is a collective launch everywhere). On mesh axes of sizes ``axis_sizes``,
a message of M bytes, profile p:

  T = p.overhead + sum over transfers t of [ max over the links l its messages use of
        (alpha_l + beta_l * B_t)  +  (mu + nu * B_t) * K_t / N  +  delta * W ]
      + gamma * sum over steps s of (L_s + U_s)  +  fresh * F  +  codec * E

- B_t: the bytes each message of t carries (every rank sends at most one message
  per transfer, so this is also the most any device sends in it); reduce
  transfers carry ``partial_sum_scale`` times the bytes (float32 partial sums of
  bfloat16 data).
- l: the link a message uses, ``Profile.link(axis, class)``: a link the profile
  names for the outermost axis its two devices differ in (as in
  :meth:`Schedule.traffic`), else the link of its class (:mod:`topology`:
  "process", "host" or "network", read from where the two devices are), else
  the profile's "*" link.
- K_t: the number of messages of t; mu * K_t / N is the per-message work that
  devices sharing CPUs (or one NIC) do one after another: a transfer in which
  every device sends costs mu more, one in which one device sends mu / N. On
  the 2-process CPU testbed this term is what makes a binomial tree (few
  messages per step) beat recursive doubling (every device, every step);
  0 in the accelerator presets. nu * B_t * K_t / N is the same for bytes: where
  devices share the CPUs that move them (gloo over TCP, 2 cores for 8 devices)
  the bytes of all devices together set the time, not the busiest device's. On
  the emulated two-node cluster at 1 Gbit/s this is why the hierarchical
  all-reduce (the same 1.75 M a device through TCP as a ring, in fewer, larger
  steps on the fast axis) is no faster than the ring.
- L_s: the most bytes a device touches locally in step s (the chunks it copies
  out to send, writes back on receipt, and combines); U_s the whole buffer's
  bytes where XLA copies the buffer after step s: never on jax 0.12 (the
  executor's barriers keep every update in place, ``tests/test_executor.py``),
  after every unrolled step on 0.10.2 (``compat.BARRIERS_KEEP_UPDATES_IN_PLACE``).
- W: the whole buffer; delta prices what a ppermute costs as the buffer grows
  (loop carries), fitted by :func:`jaxcoll.calibrate`.
- F: the bytes of buffers of at least ``p.fresh_threshold`` bytes the schedule
  makes anew: every received message that large, and every buffer copy (U_s)
  when the buffer is. ``p.fresh`` prices their first touch: on
  the CPU, glibc serves allocations above its mmap threshold (32 MiB at most)
  with fresh pages on every call, whose page faults cost time per byte (measured:
  docs/measurements.md#cost-model);
  0 where a pooling allocator reuses device memory.
- E: on a compressed wire (a :class:`~jaxcoll._src.wire.formats.WireFormat` whose messages are
  ``wire_ratio`` of the data's bytes; B_t is then the compressed bytes), the bytes the
  busiest device's messages would be uncompressed, sum over transfers of B_t / ratio:
  each is encoded and decoded by its sender and decoded by its receiver. The link terms
  price the compressed bytes; ``codec`` prices the arithmetic. A measured schedule time
  (``calibrate`` times uncompressed schedules) is priced at the compressed bytes plus
  codec * E.

Worked example (the design notes'): ring all_reduce, N = 8, M = 500 MB of
float16, alpha = 5 us, beta = 1 / 50 GB/s: 14 transfers of M/8 bytes = 70 us +
875 MB / 50 GB/s = 17.5 ms, total 17.57 ms, 99.6% of it the bandwidth term.

"native" (the jax.lax collective) is priced from the profile's measured times
of it when it has them (:func:`jaxcoll.calibrate` records them), else as what
NCCL would run on the same links (the algorithms registered ``native_like``: the cheaper
of its ring and tree for all_reduce, its ring for reduce_scatter and all_gather, pairwise
exchange for all_to_all, a tree for broadcast and reduce), all over the flattened axes.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import numpy as np

from jaxcoll._src import compat
from jaxcoll._src.auto.profile import Link, Profile
from jaxcoll._src.auto.topology import CLASSES, Topology, single_process
from jaxcoll._src.schedules.algorithms import entries, schedule
from jaxcoll._src.schedules.plan import LOOP_MIN_STEPS, phase_keys, plan
from jaxcoll._src.schedules.schedule import Schedule, crossing_axis, per_array

FEATURES = 2 * len(CLASSES) + 7   # the length of a :func:`features` row


@dataclasses.dataclass(frozen=True)
class Loads:
  """What the model reads off a schedule on one mesh shape and topology, per transfer
  (``[T]``, ``[T, A, C]``) and per step (``[S]``), in units of chunks. A run of steps of one
  structure (:class:`~jaxcoll._src.schedules.schedule.Run`) is read once: its first step stands for
  ``repeats`` steps."""

  repeats: np.ndarray     # [T] steps the transfer stands for
  step_repeats: np.ndarray  # [S] steps the step stands for
  chunks: np.ndarray      # [T] chunks per message
  reduce: np.ndarray      # [T] bool: a reduce transfer (carries partial sums)
  crosses: np.ndarray     # [T, A, C] bool: some message of t crosses axis a on a class-c link
  messages: np.ndarray    # [T] messages that cross any axis
  touched: np.ndarray     # [S] chunks the busiest device touches locally, + U_s
  unrolled: np.ndarray    # [S] bool: XLA copies the buffer after the step (U_s)
  buffer_chunks: int      # W in chunks

  @property
  def moving(self) -> np.ndarray:
    """[T] bool: the transfer moves data (a self-send crosses nothing, costs nothing)."""
    return self.crosses.any(axis=(1, 2))

  @property
  def slowest(self) -> np.ndarray:
    """[T]: the slowest link class each transfer uses (where calibrate charges it)."""
    used = self.crosses.any(axis=1)
    return len(CLASSES) - 1 - used[:, ::-1].argmax(axis=1)


def clear_caches() -> None:
  """Forgets every schedule built, priced and planned in this process (what auto's first
  choice in a fresh process starts from)."""
  schedule.cache_clear()
  loads.cache_clear()
  plan.cache_clear()


def unrolled_steps(sched: Schedule) -> np.ndarray:
  """``[S]`` bools, one per part of :meth:`Steps.runs`: the steps after which XLA copies the
  whole buffer (U_s): the steps the executor runs outside a loop, where its barriers do not
  keep the update in place (never on jax 0.12). The executor loops over a phase of at least
  ``LOOP_MIN_STEPS`` steps of one structure (:func:`plan.phase_keys`), read here without the
  chunk rows."""
  parts = list(sched.steps.runs())
  if compat.BARRIERS_KEEP_UPDATES_IN_PLACE:
    return np.zeros(len(parts), bool)
  keys = phase_keys([step for step, _ in parts])
  out, start = np.zeros(len(parts), bool), 0
  for i in range(1, len(parts) + 1):
    if i == len(parts) or keys[i] != keys[start]:
      out[start:i] = sum(count for _, count in parts[start:i]) < LOOP_MIN_STEPS
      start = i
  return out


@functools.lru_cache(maxsize=1024)
def loads(sched: Schedule, axis_sizes: tuple[int, ...], topo: Topology | None = None) -> Loads:
  """The schedule's :class:`Loads` on a mesh of ``axis_sizes`` (outermost first) whose ranks
  sit as ``topo`` says (default: one process).

  Work grows with the distinct permutations and step structures, not with the steps: a
  ring's thousands of steps share one permutation (their :class:`Transfer` s share rank
  arrays, :func:`per_array`), whose links are read once."""
  n = sched.axis_size
  topo = topo or single_process(n)

  @per_array
  def lane(src, dst):   # (crosses [A, C], moving messages, moving src, moving dst)
    axis = crossing_axis(axis_sizes, src, dst)
    moving = axis >= 0
    src, dst = src[moving], dst[moving]
    crossed = np.zeros((len(axis_sizes), len(CLASSES)), bool)
    crossed[axis[moving], topo.classes(src, dst)] = True
    return crossed, int(moving.sum()), src, dst

  touched_of: dict[tuple, float] = {}

  def touched(step) -> float:   # chunks the busiest device copies out, writes back, combines
    key = tuple((id(t.src), id(t.dst), t.chunks_per_message, t.combine) for t in step.transfers)
    if key not in touched_of:
      local = np.zeros(n)
      for t in step.transfers:
        _, _, src, dst = lane(t.src, t.dst)
        k = t.chunks_per_message
        local[src] += k
        local[dst] += 2 * k if t.combine == "reduce" else k
      touched_of[key] = local.max(initial=0)
    return touched_of[key]

  parts = list(sched.steps.runs())
  transfers = [t for step, _ in parts for t in step.transfers]
  step_repeats = np.array([count for _, count in parts], float).reshape(-1)
  repeats = np.array([count for step, count in parts for _ in step.transfers], float)
  chunks = np.array([t.chunks_per_message for t in transfers], float)
  reduce = np.array([t.combine == "reduce" for t in transfers], bool)
  lanes = [lane(t.src, t.dst) for t in transfers]
  crosses = np.array([crossed for crossed, *_ in lanes], bool).reshape(
      len(transfers), len(axis_sizes), len(CLASSES))
  messages = np.array([moving for _, moving, *_ in lanes], float)
  buffer_chunks = sched.num_chunks
  unrolled = unrolled_steps(sched)
  steps_touched = np.array([touched(step) for step, _ in parts], float).reshape(-1)
  return Loads(repeats, step_repeats, chunks, reduce, crosses, messages,
               steps_touched + unrolled * buffer_chunks, unrolled, buffer_chunks)


def fresh_bytes(ld: Loads, sent: np.ndarray, buffer: float, threshold: float) -> float:
  """F of the module docstring: bytes of messages (``sent``, per transfer) and unrolled
  buffer copies (``buffer`` bytes) of at least ``threshold`` bytes."""
  messages = (np.where(ld.moving & (sent >= threshold), sent, 0.0) * ld.repeats).sum()
  return float(messages + (buffer if buffer >= threshold else 0.0)
               * (ld.unrolled * ld.step_repeats).sum())


def codec_bytes(sched: Schedule, axis_sizes: Sequence[int], nbytes: float,
                wire_ratio: float = 1.0, topology: Topology | None = None) -> float:
  """E of the module docstring: the uncompressed bytes of the busiest device's messages on
  a wire that sends ``wire_ratio`` of them (``nbytes``: M as sent, compressed); 0 for an
  uncompressed wire (``wire_ratio`` 1)."""
  if wire_ratio == 1.0:
    return 0.0
  ld = loads(sched, tuple(axis_sizes), topology)
  chunk = nbytes / sched.message_chunks
  return float((ld.chunks * chunk * ld.moving * ld.repeats).sum() / wire_ratio)


def predict(sched: Schedule, profile: Profile, axis_names: Sequence[str],
            axis_sizes: Sequence[int], nbytes: float, *, partial_sum_scale: float = 1.0,
            wire_ratio: float = 1.0, topology: Topology | None = None) -> float:
  """Predicted seconds of ``sched`` for an M = ``nbytes`` message (module docstring; on a
  compressed wire M is the compressed bytes, ``wire_ratio`` of the data's), its ranks placed
  as ``topology`` says (default: one process), under ``profile``'s figures for the span of
  its links (:meth:`Profile.for_span`)."""
  ld = loads(sched, tuple(axis_sizes), topology)
  if topology is not None:
    profile = profile.for_span(topology.span)
  chunk = nbytes / sched.message_chunks
  used = ld.crosses.any(axis=0)                                                # [A, C]
  links = [[profile.link(a, c) if used[i, j] else Link(0.0, 0.0)
            for j, c in enumerate(CLASSES)] for i, a in enumerate(axis_names)]
  alpha = np.array([[link.alpha for link in row] for row in links])          # [A, C]
  beta = np.array([[link.beta for link in row] for row in links])
  sent = ld.chunks * np.where(ld.reduce, partial_sum_scale, 1.0) * chunk        # [T]
  wire = np.where(ld.crosses, alpha + beta * sent[:, None, None], 0.0).max(axis=(1, 2),
                                                                            initial=0.0)
  buffer = ld.buffer_chunks * chunk
  per_transfer = (wire + (profile.mu + profile.nu * sent) * ld.messages / sched.axis_size
                  + profile.delta * buffer * ld.moving)
  fresh = profile.fresh * fresh_bytes(ld, sent, buffer, profile.fresh_threshold)
  codec = profile.codec * codec_bytes(sched, axis_sizes, nbytes, wire_ratio, topology)
  return float(profile.overhead + (per_transfer * ld.repeats).sum() + fresh + codec
               + profile.gamma * (ld.touched * ld.step_repeats).sum() * chunk)


def features(sched: Schedule, axis_sizes: Sequence[int], nbytes: float,
             fresh_threshold: float, topology: Topology | None = None,
             wire_ratio: float = 1.0) -> np.ndarray:
  """:func:`predict` as a linear function of the profile: the row ``f`` with
  ``predict = f @ [overhead, (alpha_c, beta_c) per link class ..., mu, nu, delta, fresh,
  gamma, codec]`` for a profile whose links are per class (:data:`topology.CLASSES`), each
  transfer charged to the slowest class it uses (the max over its links of ``predict``)."""
  ld = loads(sched, tuple(axis_sizes), topology)
  chunk = nbytes / sched.message_chunks
  row = np.zeros(FEATURES)
  row[0] = 1.0
  for t in np.flatnonzero(ld.moving):
    c = ld.slowest[t]
    row[1 + 2 * c] += ld.repeats[t]
    row[2 + 2 * c] += ld.repeats[t] * ld.chunks[t] * chunk
  buffer = ld.buffer_chunks * chunk
  row[-6] = (ld.messages * ld.repeats).sum() / sched.axis_size
  row[-5] = (ld.messages * ld.chunks * ld.repeats).sum() * chunk / sched.axis_size
  row[-4] = buffer * (ld.moving * ld.repeats).sum()
  row[-3] = fresh_bytes(ld, ld.chunks * chunk, buffer, fresh_threshold)
  row[-2] = (ld.touched * ld.step_repeats).sum() * chunk
  row[-1] = codec_bytes(sched, axis_sizes, nbytes, wire_ratio, topology)
  return row


def predict_native(primitive: str, profile: Profile, axis_names: Sequence[str],
                   axis_sizes: Sequence[int], nbytes: float, *,
                   topology: Topology | None = None) -> float:
  """Predicted seconds of the jax.lax collective (module docstring): its times measured on
  links of the same span, else its NCCL equivalent priced on the links."""
  topology = topology or single_process(math.prod(axis_sizes))
  measured = profile.for_span(topology.span).native_times(primitive, axis_sizes,
                                                          span=topology.span)
  if measured is not None:
    return measured.time(nbytes)
  n = math.prod(axis_sizes)
  return min(predict(schedule(primitive, a, n), profile, axis_names, axis_sizes, nbytes,
                     topology=topology)
             for a in native_equivalents(primitive))


def native_equivalents(primitive: str) -> tuple[str, ...]:
  """The schedules the lax collective is priced as when never measured (registered
  ``native_like``: what NCCL runs for it); the cheapest counts."""
  return tuple(a.name for a in entries(primitive, native_like=True))


def schedule_times(primitive: str, profile: Profile, axis_names: Sequence[str],
                   axis_sizes: Sequence[int], nbytes: float, *, partial_sum_scale: float = 1.0,
                   wire_ratio: float = 1.0, topology: Topology | None = None):
  """(label, algorithm, options, schedule, seconds) for every schedule auto weighs: measured
  beats modeled. A schedule the profile has times of (``calibrate`` times the ones it fits
  to) is priced by them; every other by :func:`predict` times the most the model
  underestimated a measured schedule of this primitive at this size (never less than 1), so
  the model is never more optimistic than it proved to be where it was checked. On a
  compressed wire (``wire_ratio`` < 1, ``nbytes`` the compressed M) a measured time is
  read at the compressed bytes, plus the encoding (``codec * E``)."""
  topology = topology or single_process(math.prod(axis_sizes))
  figures = profile.for_span(topology.span)
  out, shortfall = [], 1.0
  for label, algo, options, sched in candidate_schedules(primitive, axis_sizes):
    model = predict(sched, profile, axis_names, axis_sizes, nbytes,
                    partial_sum_scale=partial_sum_scale, wire_ratio=wire_ratio,
                    topology=topology)
    seen = figures.native_times(primitive, axis_sizes, span=topology.span, algorithm=label)
    seconds = None if seen is None else seen.time(nbytes) + figures.codec * codec_bytes(
        sched, axis_sizes, nbytes, wire_ratio, topology)
    if seconds is not None and model > 0:
      shortfall = max(shortfall, seconds / model)
    out.append([label, algo, options, sched, model, seconds])
  return [(label, algo, options, sched, model * shortfall if seconds is None else seconds)
          for label, algo, options, sched, model, seconds in out]


def not_weighed(primitive: str, axis_sizes: Sequence[int]) -> tuple[str, ...]:
  """What auto leaves out on these axes because they span too many devices to price it
  (``max_devices``): the primitive's algorithms, and on several axes the stage algorithms
  (a hierarchical stage of ``primitive`` or of the reduce_scatter twin of its inner stages)."""
  shape, n = tuple(axis_sizes), math.prod(axis_sizes)

  def left(algos):
    return [a.name for a in algos if a.max_devices is not None and n > a.max_devices]

  out = left(entries(primitive, num_axes=len(shape)))
  if len(shape) > 1:
    stages = entries(primitive, stage=True) + entries("reduce_scatter", stage=True)
    out += [f"{name} (as a stage)" for name in dict.fromkeys(left(stages))]
  return tuple(out)


def candidate_schedules(primitive: str, axis_sizes: Sequence[int]):
  """(label, algorithm, schedule options, schedule) for every scheduled choice auto weighs:
  every variant (:meth:`Algorithm.choices`) of every algorithm that runs on these axes."""
  n, shape = math.prod(axis_sizes), tuple(axis_sizes)
  out = []
  for algo in entries(primitive, num_axes=len(shape), devices=n):
    for label, options in algo.choices(shape):
      try:
        sched = schedule(primitive, algo.name, n, **options)
      except ValueError:   # e.g. halving_doubling has no reduce_scatter stage for that size
        continue
      out.append((label, algo.name, options, sched))
  return out
