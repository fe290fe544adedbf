"""The sorted MoE layout: each device's received rows in one ``[R, d]`` array, expert-major.

The buffers layout gives every (source, expert) its own C slots, so dropless means C = T * k
slots for each: ``[E, T * k, d]`` per device, E / (k * f) times a capacity factor f's
buffers. Here (MegaBlocks, MaxText's sparse path) the rows a device receives are packed:
for local expert 0 the rows from source 0, then source 1, ..., then local expert 1, ...,
into a static ``R = buffer_factor * T * k`` rows (``buffer_factor`` times the mean load;
None: N * T * k, the most any device can receive). The experts multiply them with a
grouped matmul (:func:`jaxcoll.moe.grouped_matmul`) by ``group_sizes``.

1. Counts: each device's pairs per expert, ``[E]`` int32, all_gathered: ``G [N, E]``, the
   same on every device, so every device computes the whole layout (:func:`plan`). The
   rows of expert g from source s start at the receiver at the pairs before them in
   (local expert, source) order; those past R are dropped: for each (source, expert) the
   kept rows are a prefix, ``K [N_dst, E/N, N_src]``, and the sender knows which of its
   pairs those are, so it counts its own drops and never sends them.
2. Rows: sender s's kept rows for device j form one segment, ordered by (local expert,
   rank of the pair among s's pairs to that expert, choice-major as the buffers layout).
   The segments go in trips of ``chunk`` rows per (source, destination): trip i sends rows
   ``[i * chunk, (i + 1) * chunk)`` of every segment in one jaxcoll all_to_all of
   ``[N, chunk, d]``; the receiver writes each at its place. The trips are the longest
   segment over the axis divided by ``chunk``, known from ``G`` on every device alike,
   so no extra collective. Bytes per device: (N-1)/N * N * trips * chunk * d * itemsize,
   the longest segment rounded up to a chunk. ``chunk`` defaults to a quarter of the
   balanced segment, ceil(T * k / (4 N)): a segment a little over the balanced load (as
   the longest of N^2 segments under random routing is: 284 and 300 rows against 256 at
   T = 1024, k = 2, N = 8, E = 16 and 64) costs one more small trip, not a second full
   one.
3. Combine is the transpose: each trip gathers the rows back from their places, one
   all_to_all returns them, and the sender puts each at its pair.

The exchange and its return are each other's transposes; a trip count that depends on the
data cannot be reverse-differentiated as a loop, so each has a custom VJP that runs the
other on the cotangent, with the same trips.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from jaxcoll._src.collectives import all_gather, all_to_all
from jaxcoll.extend import axis_index, axis_size, make_varying, normalize_axes


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Plan:
  """One device's part of the sorted layout (module docstring), from the gathered counts.

  Attributes:
    table: ``[T * k]`` int32: the pair (t * k + j) at each place of this device's sending
      order, T * k past the kept pairs.
    seg_start, seg_len: ``[N]`` where this device's segment for each destination starts in
      ``table``, and its rows.
    recv_start: ``[E/N, N]`` the row of ``R`` where each (local expert, source) block
      starts.
    recv_off: ``[N, E/N]`` where each local expert's rows start in each source's segment.
    recv_len: ``[N]`` each source's segment for this device.
    group_sizes: ``[E/N]`` rows per local expert.
    kept: ``[T, k]`` bool, the pairs that have a row.
    trips: int32, the trips of ``chunk`` rows the longest segment needs.
    rows, chunk, k: R, the rows per trip, the choices per token (static).
  """

  table: jax.Array
  seg_start: jax.Array
  seg_len: jax.Array
  recv_start: jax.Array
  recv_off: jax.Array
  recv_len: jax.Array
  group_sizes: jax.Array
  kept: jax.Array
  trips: jax.Array
  rows: int = dataclasses.field(metadata={"static": True})
  chunk: int = dataclasses.field(metadata={"static": True})
  k: int = dataclasses.field(metadata={"static": True})


def rows_bound(t: int, k: int, n: int, buffer_factor: float | None) -> int:
  """R, the rows a device can receive: ceil(buffer_factor * T * k), at most N * T * k (None:
  N * T * k)."""
  most = n * t * k
  return most if buffer_factor is None else min(most, max(1, math.ceil(buffer_factor * t * k)))


def default_chunk(t: int, k: int, n: int) -> int:
  """Rows per (source, destination) a trip sends by default: ceil(T * k / (4 N))."""
  return -(-t * k // (4 * n))


def _exclusive(a, axis: int):
  return jnp.cumsum(a, axis=axis) - a


def plan(expert_ids, ranks, counts, axis_name, *, num_experts: int, rows: int,
         chunk: int) -> Plan:
  """The sorted layout for this device (module docstring, step 1). ``ranks [T, k]`` each
  pair's rank among this device's pairs to its expert, ``counts [E]`` its pairs per expert."""
  t, k = expert_ids.shape
  axes = normalize_axes(axis_name)
  n, me = axis_size(axes), axis_index(axes)
  local = num_experts // n
  g = all_gather(counts.astype(jnp.int32), axis_name)                     # [N_src, E]
  by_dst = jnp.transpose(g.reshape(n, n, local), (1, 2, 0)).reshape(n, local * n)
  start = _exclusive(by_dst, 1)                                          # [N_dst, E/N * N_src]
  kept = jnp.minimum(by_dst, jnp.maximum(rows - start, 0)).reshape(n, local, n)
  start = start.reshape(n, local, n)
  mine = kept[:, :, me]                                                  # [N_dst, E/N] I send
  seg_len = jnp.sum(mine, axis=1)
  seg_start = _exclusive(seg_len, 0)
  valid = (expert_ids >= 0) & (expert_ids < num_experts)
  e = jnp.where(valid, expert_ids, 0)
  dst, loc = e // local, e % local
  keep = valid & (ranks < mine[dst, loc])
  place = seg_start[dst] + _exclusive(mine, 1)[dst, loc] + ranks
  pairs = jnp.arange(t * k, dtype=jnp.int32).reshape(t, k)
  table = jnp.full((t * k,), t * k, jnp.int32).at[jnp.where(keep, place, t * k)].set(
      pairs, mode="drop")
  received = kept[me]                                                    # [E/N, N_src]
  most = jnp.max(jnp.sum(kept, axis=1))
  return Plan(table, seg_start, seg_len, start[me], _exclusive(received, 0).T,
              jnp.sum(received, axis=0), jnp.sum(received, axis=1), keep,
              (most + chunk - 1) // chunk, rows, chunk, k)


def _sent(p: Plan, q):
  """The pair at place ``q [chunk]`` of every destination's segment: ``[N, chunk]``, T * k
  past a segment's end."""
  idx = p.seg_start[:, None] + q[None]
  pair = p.table[jnp.minimum(idx, p.table.shape[0] - 1)]
  return jnp.where(q[None] < p.seg_len[:, None], pair, p.table.shape[0])


def _received(p: Plan, q):
  """The row of R where place ``q [chunk]`` of every source's segment goes: ``[N, chunk]``,
  R past a segment's end."""
  loc = jnp.sum(q[None, :, None] >= p.recv_off[:, None, 1:], axis=-1)        # [N_src, chunk]
  src = jnp.arange(p.recv_off.shape[0])[:, None]
  row = p.recv_start[loc, src] + q[None] - p.recv_off[src, loc]
  return jnp.where(q[None] < p.recv_len[:, None], row, p.rows)


def _move(p: Plan, src, take, put, rows: int, axis_name, algorithm, wire_dtype):
  """Each trip's places ``q``: the rows ``src[take(q)]`` (``[N, chunk]``, zero where out of
  range) in one all_to_all, written at ``put(q)`` of ``[rows, d]`` (dropped where out of
  range). The carry starts typed varying over the axis, as the exchanged rows are."""
  def trip(i, out):
    q = i * p.chunk + jnp.arange(p.chunk)
    got = all_to_all(src.at[take(q)].get(mode="fill", fill_value=0), axis_name, 0, 0,
                     tiled=True, algorithm=algorithm, wire_dtype=wire_dtype)
    return out.at[put(q)].set(got.astype(out.dtype), mode="drop")
  init = make_varying(jnp.zeros((rows, src.shape[-1]), src.dtype), normalize_axes(axis_name))
  return lax.fori_loop(0, p.trips, trip, init)


def _send(p: Plan, src, axis_name, algorithm, wire_dtype):
  """``src [T, k', d]`` (k' = 1: every choice reads its token's row) to the rows ``[R, d]``.
  A pair past a segment's end (T * k) reads row T * k', out of range: zero."""
  t, kk, d = src.shape
  return _move(p, src.reshape(t * kk, d), lambda q: _sent(p, q) // (p.k // kk),
               lambda q: _received(p, q), p.rows, axis_name, algorithm, wire_dtype)


def _return(p: Plan, y, axis_name, algorithm, wire_dtype):
  """The rows ``y [R, d]`` back to their pairs: ``[T, k, d]``, zero for pairs not kept."""
  pairs = p.table.shape[0]
  back = _move(p, y, lambda q: _received(p, q), lambda q: _sent(p, q), pairs, axis_name,
               algorithm, wire_dtype)
  return back.reshape(pairs // p.k, p.k, y.shape[-1])


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def send(src, p: Plan, axis_name, algorithm, wire_dtype):
  """:func:`_send`; its VJP returns the cotangent's rows (summed over the choices when
  ``src`` has one row per token)."""
  return _send(p, src, axis_name, algorithm, wire_dtype)


def _send_fwd(src, p, axis_name, algorithm, wire_dtype):
  return _send(p, src, axis_name, algorithm, wire_dtype), (p, src.shape[1])


def _send_bwd(axis_name, algorithm, wire_dtype, saved, ct):
  p, kk = saved
  back = _return(p, ct, axis_name, algorithm, None)
  return (back if kk == p.k else jnp.sum(back, axis=1, keepdims=True)), None


send.defvjp(_send_fwd, _send_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def give_back(y, p: Plan, axis_name, algorithm, wire_dtype):
  """:func:`_return`; its VJP sends the cotangent ``[T, k, d]`` to the rows."""
  return _return(p, y, axis_name, algorithm, wire_dtype)


def _give_back_fwd(y, p, axis_name, algorithm, wire_dtype):
  return _return(p, y, axis_name, algorithm, wire_dtype), p


def _give_back_bwd(axis_name, algorithm, wire_dtype, p, ct):
  return _send(p, ct, axis_name, algorithm, None), None


give_back.defvjp(_give_back_fwd, _give_back_bwd)
