"""Expert-parallel mixture of experts: routing, dispatch and combine over a mesh axis.

Experts are laid out ``num_experts / N`` per device over the axis (device r owns experts
r * E_local ... (r + 1) * E_local - 1). Every device routes its own T tokens:

1. :func:`route`: top-k experts per token and their gates (GShard / Switch).
2. :func:`dispatch`: each (token, choice) pair gets a slot in its expert's buffer of
   ``capacity`` slots per source device. Slots are a cumulative sum over a one-hot mask
   in choice-major order (every token's first choice before any second choice), so no
   sort; pairs beyond capacity are dropped and counted. The buffers ``[E, C, d]`` go to
   the experts' owners in one all-to-all (any jaxcoll algorithm), arriving as
   ``[E_local, N * C, d]``: for each local expert, C slots from device 0, then device 1, ...
3. The caller applies its local experts to that buffer.
4. :func:`combine`: the reverse all-to-all, then each token sums its kept choices'
   outputs weighted by their gates; dropped pairs add zero.

Buffers are filled by a gather through a slot table (the pair in each slot), so the local
work is the buffers' size, not the number of pairs the routing considered.

``algorithm="allgather"`` (MaxText's ring of experts) gathers every device's tokens and
routing instead (an all_gather of T * d values per device), fills the same
``[E_local, N * C, d]`` buffers locally, and combines with a reduce_scatter of the
per-source partial sums: no all-to-all, fewer bytes when k * capacity factor > N.
``algorithm="auto"`` prices both (:mod:`moe_cost`, ``jaxcoll.moe.explain``).

``layout="sorted"`` (``moe_sorted``) packs the rows each device receives into one
``[R, d]`` array, expert-major, for a grouped matmul: dropless without per-expert
worst-case buffers. :func:`dispatch_chosen` sends expert-choice routing's ``[E, C]``
tokens through the same buffers.

Costs per device, with M = T * d * itemsize: the all-to-all dispatch sends
(N-1)/N * E * C * d * itemsize bytes (direct: N-1 steps), as does combine; allgather
sends (N-1) * M forward (all_gather) and (N-1)/N * N * M back (reduce_scatter).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxcoll._src.collectives import all_gather, all_reduce, all_to_all, reduce_scatter
from jaxcoll._src.moe import sorted_layout as moe_sorted
from jaxcoll._src.moe.cost import (
  ALLGATHER,
  balanced_capacity,
  check_sizes,
  explain_moe,
)
from jaxcoll.extend import (
  axis_index,
  axis_size,
  axis_sizes,
  check_algorithm,
  check_flag,
  check_int,
  check_number,
  check_one_of,
  normalize_axes,
  wire_format,
)


def _logits(logits, where: str):
  """``logits`` as an array, which must be ``[tokens, experts]``."""
  logits = jnp.asarray(logits)
  if logits.ndim != 2:
    raise ValueError(f"{where}: logits must be [tokens, experts], got shape {logits.shape}")
  return logits


def route(logits, k: int, *, renormalize: bool = True, num_experts: int | None = None,
          key=None):
  """Top-k routing: ``(expert_ids [T, k] int32, gates [T, k])``.

  Gates are the softmax probabilities (computed in float32) of the chosen experts, in
  the order chosen (descending without noise), renormalised to sum to 1 over the k choices unless
  ``renormalize=False``; they have the logits' dtype. ``num_experts``: the E that
  :func:`dispatch` is given, checked against the router's width (``logits.shape[1]``), so
  a router wider than the experts is an error here rather than dropped pairs later.

  With a ``key``, the experts are chosen by the logits plus Gumbel noise (DeepSpeed's
  ``noisy_gate_policy="RSample"``): a token's first choice is then a sample of the softmax
  distribution (the Gumbel-max trick), the gates stay the noiseless probabilities. Noise
  on the router's input instead (DeepSpeed's "Jitter") is :func:`jitter`.

  Args:
    logits: ``[T, E]`` router logits.
    k: choices per token, ``1 <= k <= E``.
    renormalize: renormalise the k gates to sum to 1.
    num_experts: the E of :func:`dispatch`, checked against ``logits.shape[1]``.
    key: a ``jax.random`` key: choose with Gumbel noise (above); None: no noise.

  Returns:
    ``(expert_ids, gates)``, each ``[T, k]``.

  Raises:
    ValueError: ``logits`` not 2-D, ``k`` out of range, a ``num_experts`` that differs.

  Example:
    >>> import jax.numpy as jnp, jaxcoll
    >>> ids, gates = jaxcoll.moe.route(jnp.array([[0.0, 2.0, 1.0]]), 2)
    >>> ids.tolist(), gates.sum().round(3).item()
    ([[1, 2]], 1.0)
  """
  logits = _logits(logits, "route")
  check_int(k, "k", least=1, most=logits.shape[1])
  check_flag(renormalize, "renormalize")
  if num_experts is not None and check_int(num_experts, "num_experts") != logits.shape[1]:
    raise ValueError(f"num_experts={num_experts} differs from the router's width: logits "
                     f"have {logits.shape[1]} columns")
  probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
  if key is None:
    gates, ids = lax.top_k(probs, k)
  else:
    ids = lax.top_k(logits.astype(jnp.float32) + jax.random.gumbel(key, logits.shape), k)[1]
    gates = jnp.take_along_axis(probs, ids, axis=-1)
  if renormalize:
    gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
  return ids.astype(jnp.int32), gates.astype(logits.dtype)


def jitter(x, key, epsilon: float = 1e-2):
  """The router's input times noise uniform in [1 - epsilon, 1 + epsilon], elementwise
  (DeepSpeed's ``noisy_gate_policy="Jitter"``, Switch's multiplicative jitter): apply it in
  training, before the router's projection.

  Args:
    x: the tokens ``[..., d]`` the router reads.
    key: a ``jax.random`` key.
    epsilon: the noise's half-width, in [0, 1).

  Returns:
    ``x`` times the noise, in ``x``'s dtype.

  Raises:
    ValueError: an ``epsilon`` outside [0, 1).

  Example:
    >>> import jax, jax.numpy as jnp, jaxcoll
    >>> y = jaxcoll.moe.jitter(jnp.ones(1000), jax.random.key(0), 0.1)
    >>> bool(jnp.all((y >= 0.9) & (y <= 1.1)))
    True
  """
  check_number(epsilon, "epsilon", least=0)
  if epsilon >= 1:
    raise ValueError(f"epsilon={epsilon!r}: expected a number in [0, 1)")
  x = jnp.asarray(x)
  noise = jax.random.uniform(key, x.shape, jnp.float32, 1.0 - epsilon, 1.0 + epsilon)
  return (x * noise).astype(x.dtype)


def load_balancing_loss(logits, expert_ids):
  """Switch's auxiliary loss E * sum_e f_e * P_e: f_e the fraction of (token, choice) pairs
  routed to expert e, P_e the mean router probability of e (1.0 when balanced).

  Args:
    logits: ``[T, E]`` router logits.
    expert_ids: ``[T, k]`` the chosen experts (:func:`route`).

  Returns:
    A float32 scalar (this device's; average it over the data axis as the loss is).

  Raises:
    ValueError: shapes that do not match.

  Example:
    >>> import jax.numpy as jnp, jaxcoll
    >>> logits = jnp.zeros((4, 2))                      # uniform router, balanced choices
    >>> jaxcoll.moe.load_balancing_loss(logits, jnp.array([[0], [1], [0], [1]])).item()
    1.0
  """
  logits, expert_ids = _logits(logits, "load_balancing_loss"), jnp.asarray(expert_ids)
  if expert_ids.ndim != 2 or expert_ids.shape[0] != logits.shape[0]:
    raise ValueError(f"load_balancing_loss: expert_ids must be [tokens, k] for logits of "
                     f"shape {logits.shape}, got shape {expert_ids.shape}")
  num_experts = logits.shape[-1]
  probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
  routed = jax.nn.one_hot(expert_ids, num_experts, dtype=jnp.float32)   # [T, k, E]
  fraction = jnp.mean(jnp.sum(routed, axis=1), axis=0) / expert_ids.shape[-1]
  return num_experts * jnp.sum(fraction * jnp.mean(probs, axis=0))


def router_z_loss(logits):
  """ST-MoE's router z-loss: mean over tokens of logsumexp(logits)^2.

  Args:
    logits: ``[..., E]`` router logits (every leading dimension averaged over).

  Returns:
    A float32 scalar.

  Raises:
    Nothing of its own: any array with an expert axis is taken.

  Example:
    >>> import jax.numpy as jnp, jaxcoll
    >>> round(jaxcoll.moe.router_z_loss(jnp.zeros((3, 4))).item(), 4)   # log(4)^2
    1.9218
  """
  return jnp.mean(jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1) ** 2)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RoutingState:
  """What :func:`combine` needs, and what dispatch measured.

  Attributes:
    expert_ids: [T, k] the chosen experts.
    slots: [T, k] each pair's slot in its expert's buffer from this device (capacity
      where dropped).
    kept: [T, k] bool, whether the pair got a slot.
    counts: [E] pairs routed from this device to each expert (before dropping).
    dropped: int32 scalar, pairs this device dropped: beyond capacity, or routed to an
      expert id outside [0, num_experts) (a -1 from a masked router); :func:`total_dropped`
      sums it over the axis.
    exchanged: int32 scalar, slots per (source, expert) buffer the exchange sent: the
      capacity, or in dropless mode the chunks that hold tokens (the same on every device).
    num_experts, capacity, axis_name, algorithm: the dispatch's static arguments
      (dropless: capacity is T * k); chunk: the dropless exchange's chunk of slots (0
      with a capacity).
    table: ``algorithm="allgather"`` only, ``[N, E/N, C]`` int32: the pair (numbered over
      all devices' pairs, source * T * k + t * k + j) in each slot of this device's experts,
      N * T * k where empty.
    layout: "buffers" or "sorted" (:func:`dispatch`), or "chosen" (:func:`dispatch_chosen`).
      Sorted: ``capacity`` is R, the rows of the received array; ``slots`` each pair's rank
      among this device's pairs to its expert; ``exchanged`` the rows per (source,
      destination) the trips sent. Chosen: ``expert_ids`` holds the ``[E, C]`` tokens each
      expert chose, ``kept`` which of them are tokens of this device.
    plan: ``layout="sorted"`` only: where every row goes (``moe_sorted.Plan``).
    tokens: ``layout="chosen"`` only: T, this device's tokens.
  """

  expert_ids: jax.Array
  slots: jax.Array
  kept: jax.Array
  counts: jax.Array
  dropped: jax.Array
  exchanged: jax.Array
  num_experts: int = dataclasses.field(metadata={"static": True})
  capacity: int = dataclasses.field(metadata={"static": True})
  axis_name: object = dataclasses.field(metadata={"static": True})
  algorithm: object = dataclasses.field(metadata={"static": True})
  chunk: int = dataclasses.field(default=0, metadata={"static": True})
  table: jax.Array | None = None
  layout: str = dataclasses.field(default="buffers", metadata={"static": True})
  plan: moe_sorted.Plan | None = None
  tokens: int = dataclasses.field(default=0, metadata={"static": True})

  @property
  def group_sizes(self) -> jax.Array:
    """``layout="sorted"``: ``[E/N]`` int32, the received rows of each local expert, in
    order (:func:`grouped_matmul`'s ``group_sizes``)."""
    if self.plan is None:
      raise ValueError(f"group_sizes: a dispatch of layout='sorted' has them; this one's "
                       f"layout is {self.layout!r}")
    return self.plan.group_sizes


LAYOUTS = ("buffers", "sorted")


def _slots(expert_ids, num_experts: int, capacity_: int):
  """Slot of every (token, choice) pair, choice-major (all first choices first). A pair whose
  expert id is outside [0, num_experts) (a -1 from a masked router) is dropped: no slot,
  not counted for any expert."""
  t, k = expert_ids.shape
  onehot = jax.nn.one_hot(expert_ids.T.reshape(-1), num_experts, dtype=jnp.int32)  # [k*T, E]
  position = jnp.cumsum(onehot, axis=0) - 1
  slot = jnp.sum(position * onehot, axis=1).reshape(k, t).T                       # [T, k]
  kept = (expert_ids >= 0) & (expert_ids < num_experts) & (slot < capacity_)
  return jnp.where(kept, slot, capacity_), kept, jnp.sum(onehot, axis=0)


def _table(expert_ids, slots, first: int, num: int, capacity_: int):
  """``[num, C]`` int32: the pair ``t * k + j`` holding each slot of experts
  ``first ... first + num - 1``, ``T * k`` where the slot is empty (pairs of other experts
  and dropped pairs land outside)."""
  t, k = expert_ids.shape
  pairs = jnp.arange(t * k, dtype=jnp.int32).reshape(t, k)
  local = expert_ids - first
  local = jnp.where((local >= 0) & (local < num), local, num)
  return jnp.full((num, capacity_), t * k, jnp.int32).at[local, slots].set(pairs, mode="drop")


def _fill(x, table, k: int):
  """The buffers ``table``'s slots describe: row ``table // k`` of ``x [T', d]``, zero where
  empty (``table == T' * k``). A gather of one row per slot, so the work is the buffers'
  size, however many pairs the routing considered."""
  padded = jnp.concatenate([x, jnp.zeros((1, x.shape[-1]), x.dtype)])
  return padded[table // k]


def _gather(buf, expert_ids, slots, weights):
  """sum_j weights[t, j] * buf[expert_ids[t, j], slots[t, j]]: [T, d]."""
  picked = buf.at[expert_ids, slots].get(mode="fill", fill_value=0)       # [T, k, d]
  return jnp.einsum("tk,tkd->td", weights, picked)


def _exchange(buf, state: RoutingState, wire_dtype=None):
  """Block j of ``buf [N, E/N, C, d]`` to device j: one all_to_all, or in dropless mode a
  loop over chunks of slots up to ``state.exchanged`` (:func:`_chunked_exchange`)."""
  if not state.chunk:
    return all_to_all(buf, state.axis_name, 0, 0, tiled=True, algorithm=state.algorithm,
                      wire_dtype=wire_dtype)
  return _chunked_exchange(buf, state.exchanged // state.chunk, state.chunk, state.axis_name,
                           state.algorithm, wire_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _chunked_exchange(buf, trips, chunk, axis_name, algorithm, wire_dtype):
  """``trips`` all_to_alls of ``chunk`` slots each; the slots past them stay zero. The
  exchange is its own transpose (block j <-> device j), so its VJP runs it on the
  cotangent with the same trip count."""
  def step(i, out):
    piece = lax.dynamic_slice_in_dim(buf, i * chunk, chunk, axis=2)
    sent = all_to_all(piece, axis_name, 0, 0, tiled=True, algorithm=algorithm,
                      wire_dtype=wire_dtype)
    return lax.dynamic_update_slice_in_dim(out, sent.astype(out.dtype), i * chunk, axis=2)

  return lax.fori_loop(0, trips, step, jnp.zeros_like(buf))


def _chunked_exchange_fwd(buf, trips, chunk, axis_name, algorithm, wire_dtype):
  return _chunked_exchange(buf, trips, chunk, axis_name, algorithm, wire_dtype), trips


def _chunked_exchange_bwd(chunk, axis_name, algorithm, wire_dtype, trips, ct):
  return _chunked_exchange(ct, trips, chunk, axis_name, algorithm, None), None


_chunked_exchange.defvjp(_chunked_exchange_fwd, _chunked_exchange_bwd)


def _check(x, expert_ids, num_experts, capacity_, n):
  if x.ndim != 2:
    raise ValueError(f"dispatch: x must be this device's tokens [T, d], got shape {x.shape}")
  if expert_ids.ndim != 2 or expert_ids.shape[0] != x.shape[0]:
    raise ValueError(f"dispatch: expert_ids must be [T, k] with T = {x.shape[0]}, got shape "
                     f"{expert_ids.shape}")
  if not jnp.issubdtype(expert_ids.dtype, jnp.integer):
    raise ValueError(f"dispatch: expert_ids must be integers, got {expert_ids.dtype}")
  check_sizes(num_experts, capacity_, n)


def dispatch(x, expert_ids, *, num_experts: int, capacity: int | None, axis_name,
             algorithm="auto", wire_dtype=None, chunk: int | None = None,
             layout: str = "buffers", buffer_factor: float | None = None):
  """Sends each token to the devices that own its k experts.

  Args:
    x: this device's tokens ``[T, d]``.
    expert_ids: ``[T, k]`` int, from :func:`route`. A pair whose id is outside
      [0, num_experts) (a -1 from a masked router) is dropped and counted in
      ``state.dropped``; it contributes nothing to the output or the gradients.
    num_experts: E, a multiple of the axis size N; device r owns experts
      r * E/N ... (r+1) * E/N - 1.
    capacity: C, slots per expert for each source device (:func:`capacity`); pairs beyond
      it are dropped (first choices of every token are placed before second choices).
      None: dropless. Buffers hold the worst case, C = T * k, but the exchange sends only
      the chunks of ``chunk`` slots that hold tokens: ceil(m / chunk) all_to_alls, m the
      largest count of pairs any device routes to one expert (a max over the axis, so
      every device runs the same trips). Bytes on the wire follow the real load:
      (N-1)/N * E * ceil(m / chunk) * chunk * d * itemsize per device.
    axis_name: the expert-parallel mesh axis (or tuple, e.g. ("node", "local")).
    algorithm: an all_to_all algorithm ("direct", "bruck", "hierarchical", "native", a
      ``jaxcoll.Hierarchical``), "allgather" (module docstring), or "auto": the
      formulation (all_to_all or allgather) the cost model prices faster for these
      shapes and axes (:func:`explain` shows both), each collective at its own auto.
    wire_dtype: compress the dispatch exchange (``jaxcoll.WIRE_DTYPES``); combine sends
      in the activation dtype.
    chunk: dropless only: slots per exchanged chunk (default: the balanced load,
      ``capacity(T, E, k)``); sorted layout: rows per (source, destination) a trip sends
      (default: a quarter of the balanced segment, ceil(T * k / (4 N))).
    layout: "buffers" (above) or "sorted": the received rows packed into one ``[R, d]``
      array, expert-major (for local expert 0 the rows from device 0, then device 1, ...;
      then local expert 1, ...), for a grouped matmul (:func:`grouped_matmul` with
      ``state.group_sizes``). Dropless up to ``buffer_factor``, without per-expert worst-case
      buffers; takes ``capacity=None`` and an all_to_all algorithm. How and what it costs:
      ``jaxcoll/_src/moe/sorted_layout.py``, docs/guide/moe.md.
    buffer_factor: sorted layout only: R = ceil(buffer_factor * T * k) rows, the rows a
      device receives over the mean load (T * k); pairs past R are dropped, by order
      (local expert, source, rank), and counted in ``state.dropped`` by their source.
      None (default): R = N * T * k, the most a device can receive, so nothing is dropped.

  Returns:
    ``(expert_inputs [E/N, N * C, d], state)``: for each local expert, C slots from each
    source device in device order (empty slots are zero), and a :class:`RoutingState`.
    Sorted layout: ``(rows [R, d], state)``, zero past ``sum(state.group_sizes)``.

  Raises:
    ValueError: at trace time, naming the argument: shapes that do not match (``x`` not
      ``[T, d]``, ``expert_ids`` not ``[T, k]``), experts that do not divide among the
      devices, a capacity below 1, a ``chunk`` without a dropless dispatch, a bad algorithm
      or wire format, a bad ``layout``, a ``capacity``, "allgather" or a ``buffer_factor``
      with a layout they do not apply to.

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np, jaxcoll
    >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("expert",))
    >>> def send(x, ids):   # 4 experts, one per device: capacity 2 per (source, expert)
    ...   inputs, state = jaxcoll.moe.dispatch(x, ids, num_experts=4, capacity=2,
    ...                                        axis_name="expert")
    ...   return inputs
    >>> f = jax.jit(jax.shard_map(send, mesh=mesh, in_specs=jax.P("expert"),
    ...                           out_specs=jax.P("expert"), check_vma=False))
    >>> ids = (jnp.arange(16) % 4)[:, None]           # token t to expert t % 4
    >>> inputs = f(jnp.arange(16.0)[:, None] * jnp.ones((1, 2)), ids)
    >>> inputs.shape                                   # [E, N * C, d] over the 4 devices
    (4, 8, 2)
    >>> inputs[1, :, 0].tolist()                       # expert 1: tokens 1, 5, 9, 13
    [1.0, 0.0, 5.0, 0.0, 9.0, 0.0, 13.0, 0.0]
  """
  axes = normalize_axes(axis_name)
  n = axis_size(axes)
  x, expert_ids = jnp.asarray(x), jnp.asarray(expert_ids)
  _check(x, expert_ids, num_experts, capacity, n)
  check_algorithm("all_to_all", algorithm, num_axes=len(axes), extra=(ALLGATHER,))
  wire_format(wire_dtype, x.dtype)
  local = num_experts // n
  t, k = expert_ids.shape
  if check_one_of(layout, LAYOUTS, "layout") == "sorted":
    return _dispatch_sorted(x, expert_ids, n, num_experts, capacity, axis_name, algorithm,
                            wire_dtype, chunk, buffer_factor)
  if buffer_factor is not None:
    raise ValueError(f"buffer_factor={buffer_factor!r} applies to layout='sorted'; this "
                     f"dispatch's layout is 'buffers'")
  dropless = capacity is None
  if not dropless and chunk is not None:
    raise ValueError(f"chunk={chunk!r} applies to a dropless dispatch (capacity=None); this one "
                     f"has capacity={capacity}")
  if dropless:
    capacity = t * k
    chunk = balanced_capacity(t, num_experts, k) if chunk is None else \
        check_int(chunk, "chunk", least=1, most=capacity)
  if isinstance(algorithm, str) and algorithm == "auto":
    sizes = dict(zip(axes, axis_sizes(axes)))
    priced = explain_moe(x, k, num_experts=num_experts, capacity=chunk if dropless else capacity,
                         mesh=sizes, axis_name=axes, wire_dtype=wire_dtype)
    algorithm = ALLGATHER if priced.chosen == ALLGATHER else "auto"
  slots, kept, counts = _slots(expert_ids, num_experts, capacity)
  if dropless and algorithm != ALLGATHER:
    most = all_reduce(jnp.max(counts), axis_name, op="max")
    exchanged = (most + chunk - 1) // chunk * chunk
  else:
    exchanged, chunk = jnp.int32(capacity), 0
  state = RoutingState(expert_ids.astype(jnp.int32), slots, kept, counts,
                       jnp.sum(~kept).astype(jnp.int32), exchanged.astype(jnp.int32),
                       int(num_experts), int(capacity), axis_name, algorithm, int(chunk))
  d = x.shape[-1]
  if algorithm == ALLGATHER:
    xs = all_gather(x, axis_name, wire_dtype=wire_dtype)                 # [N, T, d]
    state = dataclasses.replace(state, table=_gathered_table(expert_ids, state))
    buf = _fill(xs.reshape(n * t, d), state.table, k)                    # [N, E/N, C, d]
  else:
    table = _table(expert_ids, slots, 0, num_experts, capacity)
    buf = _fill(x, table, k).reshape(n, local, capacity, d)
    buf = _exchange(buf, state, wire_dtype)
  return jnp.swapaxes(buf, 0, 1).reshape(local, n * capacity, d), state


def _dispatch_sorted(x, expert_ids, n, num_experts, capacity, axis_name, algorithm,
                     wire_dtype, chunk, buffer_factor):
  """:func:`dispatch` with ``layout="sorted"`` (``moe_sorted``)."""
  if capacity is not None:
    raise ValueError(f"capacity={capacity!r} applies to layout='buffers'; the sorted layout "
                     f"keeps every pair up to buffer_factor (pass capacity=None)")
  if algorithm == ALLGATHER:
    raise ValueError("algorithm='allgather' (the ring of experts) fills the buffers layout; "
                     "layout='sorted' takes an all_to_all algorithm")
  t, k = expert_ids.shape
  if buffer_factor is not None:
    check_number(buffer_factor, "buffer_factor", above=0)
  rows = moe_sorted.rows_bound(t, k, n, buffer_factor)
  chunk = moe_sorted.default_chunk(t, k, n) if chunk is None else \
      check_int(chunk, "chunk", least=1, most=t * k)
  ranks, _, counts = _slots(expert_ids, num_experts, t * k)
  p = moe_sorted.plan(expert_ids, ranks, counts, axis_name, num_experts=num_experts,
                      rows=rows, chunk=chunk)
  state = RoutingState(expert_ids.astype(jnp.int32), ranks, p.kept, counts,
                       jnp.sum(~p.kept).astype(jnp.int32), (p.trips * chunk).astype(jnp.int32),
                       int(num_experts), rows, axis_name, algorithm, chunk, layout="sorted",
                       plan=p)
  return moe_sorted.send(x[:, None], p, axis_name, algorithm, wire_dtype), state


def dispatch_chosen(x, token_ids, *, axis_name, algorithm="auto", wire_dtype=None):
  """Sends the tokens each expert chose (expert-choice routing, :func:`route_experts`) to
  the device that owns the expert.

  Every expert takes exactly C of this device's tokens, so there is no capacity to exceed
  and nothing is dropped: the ``[E, C, d]`` buffers are filled by a gather through
  ``token_ids`` and go to the experts' owners in one all_to_all, as :func:`dispatch`'s
  buffers layout. Cost per device: (N-1)/N * E * C * d * itemsize bytes each way.

  Args:
    x: this device's tokens ``[T, d]``.
    token_ids: ``[E, C]`` int, the tokens of ``x`` each expert chose (an id outside
      [0, T) is an empty slot); E a multiple of the axis size N, device r owns experts
      r * E/N ... (r+1) * E/N - 1.
    axis_name: the expert-parallel mesh axis (or tuple).
    algorithm: an all_to_all algorithm, or "auto".
    wire_dtype: compress the dispatch exchange (``jaxcoll.WIRE_DTYPES``).

  Returns:
    ``(expert_inputs [E/N, N * C, d], state)``: :func:`dispatch`'s buffers layout, and the
    :class:`RoutingState` that :func:`combine` takes with gates ``[E, C]``.

  Raises:
    ValueError: ``x`` not ``[T, d]``, ``token_ids`` not ``[E, C]`` integers, E not a
      multiple of the axis size, a bad algorithm ("allgather" included) or wire format.

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np, jaxcoll
    >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("expert",))
    >>> def layer(x, logits):   # 4 experts, each takes its top 2 tokens and doubles them
    ...   tokens, gates = jaxcoll.moe.route_experts(logits, 2)
    ...   inputs, state = jaxcoll.moe.dispatch_chosen(x, tokens, axis_name="expert")
    ...   return jaxcoll.moe.combine(2 * inputs, state, gates)
    >>> f = jax.jit(jax.shard_map(layer, mesh=mesh, in_specs=jax.P("expert"),
    ...                           out_specs=jax.P("expert"), check_vma=False))
    >>> logits = 4 * jax.nn.one_hot(jnp.arange(32) % 4, 4)   # token t prefers expert t % 4
    >>> out = f(jnp.ones((32, 1)), logits)
    >>> top = jax.nn.softmax(logits).max(axis=-1)   # each token's probability for its expert
    >>> bool(jnp.allclose(out[:, 0], 2 * top))        # each token chosen once, by that expert
    True
  """
  axes = normalize_axes(axis_name)
  n = axis_size(axes)
  x, token_ids = jnp.asarray(x), jnp.asarray(token_ids)
  if x.ndim != 2:
    raise ValueError(f"dispatch_chosen: x must be this device's tokens [T, d], got shape "
                     f"{x.shape}")
  if token_ids.ndim != 2 or not jnp.issubdtype(token_ids.dtype, jnp.integer):
    raise ValueError(f"dispatch_chosen: token_ids must be [E, C] integers, got "
                     f"{token_ids.dtype}{list(token_ids.shape)}")
  e, c = token_ids.shape
  check_sizes(e, c, n)
  check_algorithm("all_to_all", algorithm, num_axes=len(axes))
  wire_format(wire_dtype, x.dtype)
  t, d = x.shape
  valid = (token_ids >= 0) & (token_ids < t)
  table = jnp.where(valid, token_ids, t).astype(jnp.int32)
  state = RoutingState(table, jnp.zeros_like(table), valid, jnp.sum(valid, axis=1),
                       jnp.int32(0), jnp.int32(c), int(e), int(c), axis_name, algorithm,
                       layout="chosen", tokens=int(t))
  buf = _exchange(_fill(x, table, 1).reshape(n, e // n, c, d), state, wire_dtype)
  return jnp.swapaxes(buf, 0, 1).reshape(e // n, n * c, d), state


def _gathered_table(expert_ids, state: RoutingState):
  """The ring of experts' slot table ``[N, E/N, C]``: for each source device, its pairs
  routed to this device's experts, numbered over every device's pairs (source * T * k +
  t * k + j; N * T * k where empty). Slots are the source's own (:func:`_slots`)."""
  axes = normalize_axes(state.axis_name)
  n = axis_size(axes)
  t, k = expert_ids.shape
  local = state.num_experts // n
  ids = all_gather(expert_ids.astype(jnp.int32), state.axis_name)       # [N, T, k]
  first = axis_index(axes) * local

  def one(i, ei):
    table = _table(ei, _slots(ei, state.num_experts, state.capacity)[0], first, local,
                   state.capacity)
    return jnp.where(table == t * k, n * t * k, table + i * t * k)
  return jax.vmap(one)(jnp.arange(n, dtype=jnp.int32), ids)


def total_dropped(state: RoutingState):
  """The pairs every device of the axis dropped (``state.dropped`` summed over
  ``state.axis_name``: one all_reduce of a scalar), the figure to log. Inside shard_map.

  Args:
    state: the :class:`RoutingState` of a dispatch.

  Returns:
    An int32 scalar, the same on every device.

  Raises:
    ValueError: outside the shard_map that bound ``state.axis_name``.

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np, jaxcoll
    >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("expert",))
    >>> def dropped(x, ids):   # every token wants expert 0, which takes 1 from each device
    ...   _, state = jaxcoll.moe.dispatch(x, ids, num_experts=4, capacity=1,
    ...                                   axis_name="expert")
    ...   return jaxcoll.moe.total_dropped(state)[None]
    >>> f = jax.jit(jax.shard_map(dropped, mesh=mesh, in_specs=jax.P("expert"), out_specs=jax.P(),
    ...                           check_vma=False))
    >>> int(f(jnp.ones((16, 2)), jnp.zeros((16, 1), jnp.int32))[0])   # 3 of 4 per device
    12
  """
  return all_reduce(state.dropped, state.axis_name)


def expert_load(state: RoutingState):
  """The (token, choice) pairs every device of the axis routed to each expert, before any
  was dropped (``state.counts`` summed over ``state.axis_name``: one all_reduce of E
  int32), the load to log or to balance by (an aux-loss-free router's bias follows it).
  Inside shard_map.

  Args:
    state: the :class:`RoutingState` of a dispatch.

  Returns:
    An int32 ``[E]``, the same on every device; it sums to N * T * k less the pairs whose
    expert id was outside [0, E).

  Raises:
    ValueError: outside the shard_map that bound ``state.axis_name``.

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np, jaxcoll
    >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("expert",))
    >>> def load(x, ids):
    ...   _, state = jaxcoll.moe.dispatch(x, ids, num_experts=4, capacity=1,
    ...                                   axis_name="expert")
    ...   return jaxcoll.moe.expert_load(state)
    >>> f = jax.jit(jax.shard_map(load, mesh=mesh, in_specs=jax.P("expert"), out_specs=jax.P(),
    ...                           check_vma=False))
    >>> f(jnp.ones((16, 2)), jnp.zeros((16, 1), jnp.int32)).tolist()   # all to expert 0
    [16, 0, 0, 0]
  """
  return all_reduce(state.counts.astype(jnp.int32), state.axis_name)


def _kept_gates(gates, state: RoutingState, dtype):
  """``gates`` (checked against the routing's shape), zero where no pair was kept."""
  gates = jnp.asarray(gates)
  if gates.shape != state.expert_ids.shape:
    routing = "[E, C] like route_experts'" if state.layout == "chosen" else \
        "[T, k] like dispatch's expert_ids"
    raise ValueError(f"combine: gates must be {routing}, {state.expert_ids.shape}, got shape "
                     f"{gates.shape}")
  return jnp.where(state.kept, gates, jnp.zeros_like(gates)).astype(dtype)


def _combine_sorted(y, state: RoutingState, gates, wire_dtype):
  """:func:`combine` of a ``layout="sorted"`` dispatch: the rows back to their pairs, each
  token's gated sum."""
  if y.ndim != 2 or y.shape[0] != state.capacity:
    raise ValueError(f"combine: expert_outputs must be [{state.capacity}, d] (the sorted "
                     f"layout's rows), got shape {y.shape}")
  weights = _kept_gates(gates, state, y.dtype)
  wire_format(wire_dtype, y.dtype)
  back = moe_sorted.give_back(y, state.plan, state.axis_name, state.algorithm, wire_dtype)
  return jnp.einsum("tk,tkd->td", weights, back)


def combine(expert_outputs, state: RoutingState, gates, *, wire_dtype=None):
  """Each token's k expert outputs, weighted by ``gates`` ``[T, k]``: ``[T, d]``.

  ``expert_outputs`` has :func:`dispatch`'s layout ``[E/N, N * C, d]``. Dropped pairs
  contribute zero (``state.dropped`` counts them). The exchange runs in the outputs'
  dtype unless ``wire_dtype`` compresses it too (DeepEP keeps combine in bfloat16: the
  default, None, keeps the activations' precision); its algorithm is the dispatch's.

  Args:
    expert_outputs: the experts' outputs, ``[E/N, N * C, d]`` as :func:`dispatch` laid out
      their inputs.
    state: the :class:`RoutingState` :func:`dispatch` returned.
    gates: ``[T, k]`` combine weights (:func:`route`'s); after :func:`dispatch_chosen`
      ``[E, C]`` (:func:`route_experts`').
    wire_dtype: compress the combine exchange (``jaxcoll.WIRE_DTYPES``).

  Returns:
    ``[T, d]``: each token's gated sum of its experts' outputs, in the outputs' dtype.

  Raises:
    ValueError: ``expert_outputs`` or ``gates`` of a shape that does not match ``state``,
      a bad ``wire_dtype``.

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np, jaxcoll
    >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("expert",))
    >>> def layer(x, logits):   # 4 experts, one per device; each doubles its tokens
    ...   ids, gates = jaxcoll.moe.route(logits, 1)
    ...   inputs, state = jaxcoll.moe.dispatch(x, ids, num_experts=4, capacity=None,
    ...                                        axis_name="expert")
    ...   out = jaxcoll.moe.combine(2 * inputs, state, gates)
    ...   return out, jaxcoll.moe.total_dropped(state)[None]
    >>> f = jax.jit(jax.shard_map(layer, mesh=mesh, in_specs=jax.P("expert"),
    ...                           out_specs=(jax.P("expert"), jax.P()), check_vma=False))
    >>> x = jnp.arange(32.0).reshape(16, 2)
    >>> logits = jax.nn.one_hot(jnp.arange(16) % 4, 4)
    >>> out, dropped = f(x, logits)
    >>> bool(jnp.allclose(out, 2 * x)), int(dropped[0])
    (True, 0)
  """
  axes = normalize_axes(state.axis_name)
  n = axis_size(axes)
  local, c = state.num_experts // n, state.capacity
  y = jnp.asarray(expert_outputs)
  if state.layout == "sorted":
    return _combine_sorted(y, state, gates, wire_dtype)
  if y.shape[:2] != (local, n * c):
    raise ValueError(f"combine: expert_outputs must be [{local}, {n * c}, d] (dispatch's "
                     f"layout), got shape {y.shape}")
  weights = _kept_gates(gates, state, y.dtype)
  d = y.shape[-1]
  y = jnp.swapaxes(y.reshape(local, n, c, d), 0, 1)                       # [N, E/N, C, d]
  if state.algorithm == ALLGATHER:   # this device's experts' share of every token's sum
    g = all_gather(weights, state.axis_name).reshape(-1)                # [N * T * k]
    k = weights.shape[1]
    slot_weights = jnp.concatenate([g, jnp.zeros((1,), g.dtype)])[state.table]
    partial = jnp.zeros((g.shape[0] // k + 1, d), y.dtype).at[state.table // k].add(
        y * slot_weights[..., None])
    return reduce_scatter(partial[:-1].reshape(n, -1, d), state.axis_name,
                          scatter_dimension=0, tiled=True, wire_dtype=wire_dtype)[0]
  back = _exchange(y, state, wire_dtype).reshape(state.num_experts, c, d)
  if state.layout == "chosen":    # each expert's C outputs to the tokens it chose
    return jnp.zeros((state.tokens, d), back.dtype).at[state.expert_ids].add(
        weights[..., None] * back, mode="drop")
  return _gather(back, state.expert_ids, state.slots, weights)
