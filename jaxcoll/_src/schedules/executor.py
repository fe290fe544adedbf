"""The one executor: any :class:`~jaxcoll._src.schedules.schedule.Schedule` as ppermute code.

Every ``jax.lax.ppermute`` jaxcoll runs goes through :func:`ppermute` here: the executor's,
and ``shift``'s when its algorithm is native (:mod:`jaxcoll._src.collectives` calls it
directly then). The executor runs inside ``shard_map`` on one rank's buffer of rows ``[C, L]``;
every rank runs the same code, and in a transfer that reaches some ranks only the others
read some rows and write them back unchanged (a select, no scratch rows: a scratch row made
every tree concatenate and slice the whole buffer; measured: docs/measurements.md#executor).
Chunk indices come from NumPy tables indexed by ``lax.axis_index`` and the step, each lookup
in a jit of its own so that ``jax.remat`` recomputes it rather than saving the table.

Per transfer of a step: read the rows to send (``dynamic_slice`` when each
rank's rows are contiguous, a gather otherwise), one ``ppermute``, then
combine into the destination rows in place (``dynamic_update_slice`` of
``op(old, received)``, or of the received rows for a copy). No step
concatenates or copies the buffer, and the compiled HLO of every schedule holds no copy of
the whole buffer, nor builds it twice (``tests/test_executor.py`` counts both), because of
three ``lax.optimization_barrier`` s:

- on the buffer as it comes in. Without it XLA fuses the op that built the buffer (the
  concatenate of a gradient bucket) into each of its readers, so a buffer of ``n``
  elements is built twice: ``[1, n]`` for the first send and ``[n]`` for the first combine
  (2-device recursive doubling of a 12 MiB bucket: two 12 MiB concatenates, 12 MiB more
  temp memory, a slower step; measured: docs/measurements.md#executor).
- after every unrolled step. Without it XLA fuses the next step's send (a slice of the
  buffer) with a recomputation of this step's update (slice of dynamic-update-slice
  becomes one fusion reading the old buffer and the received message), which keeps the
  old buffer alive past the in-place update, so XLA copies the whole buffer every step
  (measured: docs/measurements.md#executor).
- between the sends and the receives of a step with several transfers (bidirectional ring,
  double binary tree): every read of the step happens before any write, so no write
  has to wait for a read of the old buffer (a copy, again; measured:
  docs/measurements.md#executor).

(A one-trip ``fori_loop`` around each unrolled step does nothing here: XLA removes loops of
one trip before it places copies.)

A phase (:mod:`jaxcoll._src.schedules.plan`: consecutive steps of one structure, as in every ring)
of at least ``LOOP_MIN_STEPS`` (2) steps runs as one ``lax.fori_loop``
over per-step tables, so a ring on N ranks compiles to two ppermutes however
large N is. The loop matters for speed too: unrolled, XLA fuses each step's
next send (which reads the chunk just combined) with a recomputation of that
combine, which keeps the old buffer alive and costs a whole-buffer copy per
step (measured: docs/measurements.md#executor). The loop
boundary stops that fusion, so the carry is updated in place. A step whose
permutation differs from its neighbours' (halving-doubling, recursive
doubling) is unrolled, behind the barrier above, which does the same.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcoll._src import axes as axes_lib
from jaxcoll._src import checks, ops
from jaxcoll._src.schedules.plan import LOOP_MIN_STEPS, Phase, TransferPlan, plan
from jaxcoll._src.schedules.schedule import Schedule
from jaxcoll._src.spec import spec
from jaxcoll._src.wire import formats as wire_lib
from jaxcoll._src.wire import rounding
from jaxcoll._src.wire.formats import WireFormat
from jaxcoll._src.wire.fused_combine import fused_combine, fused_combine_reference


def ppermute(x, axes: tuple[str, ...], perm):
  """``lax.ppermute`` of ``perm``, pairs of ranks numbered as ``lax.axis_index(axes)`` numbers
  them (:func:`jaxcoll._src.axes.ppermute_args` puts them in the form every jax reads the
  same), with floats narrower than 32 bits sent as unsigned integers.

  XLA's CPU backend widens a bfloat16 collective-permute to float32 (the compiled HLO
  converts before and after it), which doubles the bytes on the link, so over a slow link
  16-bit floats sent as integers take markedly less time (measured:
  docs/measurements.md#bfloat16-over-gloo). The bitcasts cost nothing elsewhere. Gradients
  see a plain ppermute (custom JVP).
  """
  axis_name, perm = axes_lib.ppermute_args(axes, perm)
  if not jnp.issubdtype(x.dtype, jnp.floating) or x.dtype.itemsize >= 4:
    return lax.ppermute(x, axis_name, perm)
  return _ppermute_as_bits(x, axis_name, perm)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2))
def _ppermute_as_bits(x, axis_name, perm):
  bits = lax.bitcast_convert_type(x, {2: jnp.uint16, 1: jnp.uint8}[x.dtype.itemsize])
  return lax.bitcast_convert_type(lax.ppermute(bits, axis_name, perm), x.dtype)


@_ppermute_as_bits.defjvp
def _ppermute_as_bits_jvp(axis_name, perm, primals, tangents):
  return (_ppermute_as_bits(primals[0], axis_name, perm),
          lax.ppermute(tangents[0], axis_name, perm))


def _lookup(table: np.ndarray, *index):
  """``table[index]`` in a jit of its own, whose constant the table is: the caller's program
  holds no table, so ``jax.remat`` recomputes the lookup instead of saving the table as a
  residual (``tests/test_gradients.py``: a remat'd collective saves its input alone). One
  jit per table's contents, so a table read again (every step of a phase, every leaf of a
  tree, every call) is traced once."""
  return _lookup_jit(table.tobytes(), table.shape, table.dtype.str)(*index)   # C-order bytes


@functools.lru_cache(maxsize=512)   # tables of steps x ranks (x rows) ints, bounded in number
def _lookup_jit(data: bytes, shape: tuple[int, ...], dtype: str):
  table = np.frombuffer(data, dtype).reshape(shape)

  def lookup(*index):   # in range by construction: no negative-index or bounds arithmetic
    start = [jnp.asarray(i, jnp.int32) for i in index] + [0] * (len(shape) - len(index))
    sizes = (1,) * len(index) + shape[len(index):]
    return lax.dynamic_slice(jnp.asarray(table), start, sizes,
                             allow_negative_indices=False).reshape(shape[len(index):])
  return jax.jit(lookup)


def _read(rows, index, plan_: TransferPlan, contiguous: bool):
  if contiguous:
    return lax.dynamic_slice_in_dim(rows, index, plan_.rows, allow_negative_indices=False)
  return jnp.take(rows, index, axis=0, mode="clip")


def _write(rows, index, value, contiguous: bool):
  if contiguous:
    index = jnp.asarray(index)   # the column start of the index's own type (jax_enable_x64)
    return lax.dynamic_update_slice(rows, value, (index, jnp.zeros_like(index)),
                                    allow_negative_indices=False)
  return rows.at[index].set(value, mode="promise_in_bounds")


def execute(schedule: Schedule, rows: jax.Array, axis_name, *, op: str = "sum",
            copy_dtype=None, wire: WireFormat | None = None, fused: bool = False,
            key=None, loop_min_steps: int = LOOP_MIN_STEPS) -> jax.Array:
  """Runs ``schedule`` on this rank's ``rows`` (``[C, L]``) inside shard_map.

  Args:
    schedule: the schedule.
    rows: this rank's buffer, already varying over ``axis_name``.
    axis_name: the mesh axis (or tuple) the schedule runs over; schedule rank r
      is the device with ``lax.axis_index(axis_name) == r``.
    op: the reduction op of reduce transfers.
    copy_dtype: dtype that copy transfers carry on the wire (the output dtype
      when ``rows`` hold float32 partial sums); None keeps ``rows.dtype``.
    wire: a compressed wire format for every transfer (rows hold float32 and
      their length is a multiple of ``wire.row_multiple``). A sender that will
      combine into rows it sent keeps their decoded value (so both partners of a
      symmetric exchange add the same two values), and a replicated result ends
      with one decode(encode(.)) pass, a fixed point for every value that was
      sent, so ranks that kept a value they sent agree with its receivers (see
      :mod:`jaxcoll._src.wire.formats`).
    fused: run reduce combines (and their decode) as the Pallas kernel
      :func:`jaxcoll.kernels.fused_combine`.
    key: round stochastically, with bits drawn from the key and the chunk alone (never
      the device: :mod:`jaxcoll._src.wire.rounding`): every reduce combine of bfloat16/float16
      rows (bits of the step and first chunk combined, so devices combining the same chunks
      in a step agree bit for bit), or, where rows hold wider partial sums, every copy to
      ``copy_dtype``.
    loop_min_steps: phases at least this long run as a ``fori_loop``.

  Returns:
    The rows after the last step.
  """
  if schedule.num_chunks != rows.shape[0]:
    raise ValueError(f"rows has {rows.shape[0]} chunks, the schedule needs {schedule.num_chunks}")
  if not schedule.steps:
    return rows
  rank = axes_lib.index(axis_name)
  axes = checks.as_axes(axis_name)
  rows = lax.optimization_barrier(rows)   # built once: see the module docstring

  def keep(p: TransferPlan, rows, index, data, kept):
    """The sender's rows with ``kept`` (what its message carries) in place of ``data``."""
    if p.senders is not None:   # ranks outside the permutation keep their rows
      kept = jnp.where(_lookup(np.asarray(p.senders), rank), kept, data)
    return _write(rows, index, kept.astype(rows.dtype), p.send_contiguous)

  def send(p: TransferPlan, rows, index):
    """(rows, message): the message to ppermute (encoded with a wire format; the sender's
    rows then keep the decoded message where it reduces into them again). A copy of wider
    partial sums is rounded to ``copy_dtype``, stochastically with ``key`` (bits of the
    chunk alone), and then the sender keeps the rounded value too: every copy of a final
    value is the same rounding of it."""
    data = _read(rows, index, p, p.send_contiguous)
    if wire is None:
      if p.combine != "copy" or copy_dtype is None:
        return rows, data
      if key is None:
        return rows, data.astype(copy_dtype)
      ids = index + jnp.arange(p.rows) if p.send_contiguous else index
      sent = rounding.round_rows(data, copy_dtype, rounding.copy_key(key), ids)
      return keep(p, rows, index, data, sent), sent
    values, exponents = wire.encode(data)
    message = wire_lib.pack(wire, values, exponents)
    if not p.sent_rows_reduced_into:
      return rows, message
    return keep(p, rows, index, data, wire.decode(values, exponents)), message

  def receive(p: TransferPlan, rows, index, message, key):
    """Combines ``message`` into this rank's rows ``index``; in a transfer that reaches some
    ranks only, the others (index: any valid rows) write back what they read."""
    old = _read(rows, index, p, p.recv_contiguous)
    exponents = None
    if wire is not None:
      message, exponents = wire_lib.unpack(wire, message, rows.shape[1])
    if p.combine == "reduce" and (fused or key is not None):   # key: low-precision rows
      stochastic = {} if key is None else dict(
          rounding="stochastic",
          key=rounding.chunk_key(key, index if p.recv_contiguous else index[0]))
      data = (fused_combine if fused else fused_combine_reference)(
          old, message, op=op, recv_exponents=exponents, **stochastic)
    else:
      data = message if wire is None else wire.decode(message, exponents)
      if p.combine == "reduce":
        data = ops.combine(jnp, op, old, data)
    data = data.astype(rows.dtype)
    if p.receivers is not None:
      data = jnp.where(_lookup(np.asarray(p.receivers), rank), data, old)
    return _write(rows, index, data, p.recv_contiguous)

  def run_step(phase: Phase, number: int, rows, t):
    key_t = None if key is None or not rounding.low_precision(rows.dtype) else (
        rounding.step_key(key, number, t))
    messages = []
    for p, table in zip(phase.transfers, phase.send):
      rows, message = send(p, rows, _lookup(table, t, rank))
      messages.append(message)
    if len(messages) > 1:   # every read of the step done before any write
      rows, messages = lax.optimization_barrier((rows, messages))
    received = [ppermute(m, axes, p.perm) for p, m in zip(phase.transfers, messages)]
    for p, table, message in zip(phase.transfers, phase.recv, received):
      rows = receive(p, rows, _lookup(table, t, rank), message, key_t)
    return rows

  for number, phase in enumerate(plan(schedule)):
    if phase.num_steps >= loop_min_steps:
      rows = lax.fori_loop(0, phase.num_steps, lambda t, rows, phase=phase, number=number:
                           run_step(phase, number, rows, t), rows)
    else:
      for t in range(phase.num_steps):
        rows = lax.optimization_barrier(run_step(phase, number, rows, t))
  if wire is not None and spec(schedule.primitive).replicated:
    # A rank that computed or sent a final value may hold v where the others hold
    # decode(encode(v)); one more pass (a fixed point for the rest) makes them agree.
    rows = wire.decode(*wire.encode(rows)).astype(rows.dtype)
  return rows
