"""The public collectives: argument checks, pytrees, layout, and the call into the executor.

Every function runs inside ``jax.shard_map`` and has the semantics of its
``jax.lax`` counterpart (``psum``/``pmax``/``pmin``/``pmean``,
``psum_scatter``, ``all_gather``, ``all_to_all``, ``ppermute`` for ``shift``);
``broadcast`` and ``reduce`` are the rooted collectives lax lacks.
``axis_name`` is a mesh axis or a tuple of them, as in lax: one collective
over their product, ranks numbered as ``lax.axis_index(axis_name)`` numbers
them. Results that are replicated over the axis (all_reduce,
broadcast, all_gather with ``to="invarying"``) are typed invariant, like
lax's, so they may leave shard_map with ``out_specs=P()``.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcoll._src import axes as axes_lib
from jaxcoll._src import checks, layout, ops, record
from jaxcoll._src import spec as spec_lib
from jaxcoll._src.auto import dispatch
from jaxcoll._src.invariant import as_replicated, make_varying
from jaxcoll._src.schedules.algorithms import NATIVE, check_algorithm, schedule
from jaxcoll._src.schedules.executor import execute, ppermute
from jaxcoll._src.wire import formats as wire_lib
from jaxcoll._src.wire import fused_combine
from jaxcoll._src.wire import rounding as rounding_lib

_NATIVE_REDUCE = {"sum": lax.psum, "max": lax.pmax, "min": lax.pmin, "mean": lax.pmean}


def _prepare(x, op: str | None):
  """The leaf as an array in the dtype the collective computes in (bool sums count as int32)."""
  x = jnp.asarray(x)
  if op is not None and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    raise TypeError(f"op={op!r} on x, a PRNG key array ({x.dtype}): keys are not numbers "
                    "to reduce; they are gathered, scattered and permuted")
  if op is not None:
    ops.check_op(op, x.dtype)
    if x.dtype == bool and op in ("sum", "mean"):
      x = x.astype(jnp.int32)
  return x


def _mean(y, op: str, n: int, key):
  """The mean's division of a reduction ``y`` (else ``y``): rounded stochastically from
  float32 with ``key`` for bfloat16/float16 (so a mean stays unbiased), else as lax's."""
  if op != "mean":
    return y
  if key is None or not rounding_lib.low_precision(y.dtype):
    return y / n
  return rounding_lib.round_to(y.astype(jnp.float32) / n, y.dtype, key)


_scopes: contextvars.ContextVar = contextvars.ContextVar("jaxcoll_scopes", default=None)


def _decide(primitive, algorithm, axes, x, nbytes, accumulate=None, wire=None,
            stochastic=False):
  """``(algorithm, schedule options, call description)`` for leaf ``x`` whose message is
  M = ``nbytes``: "auto" resolved (:func:`dispatch.decide`, the one decision)."""
  call = dispatch.Call.of(primitive, axes, axes_lib.sizes(axes), nbytes, x.dtype,
                          accumulate=accumulate, wire=wire, stochastic=stochastic,
                          description=f"{x.dtype.name}[{','.join(map(str, x.shape))}]")
  algo, options = dispatch.resolve(call, algorithm)
  if not call.native_allowed and algo == NATIVE:
    raise ValueError(f"algorithm={NATIVE!r} (the jax.lax collective) cannot send "
                     f"wire_dtype={wire.name!r}; use a schedule, e.g. 'ring', or 'auto'")
  return algo, options, call.description


def _resolve(primitive, algorithm, axes, x, nbytes, accumulate=None, wire=None,
             stochastic=False):
  """:func:`_decide`, recorded (:mod:`record`); the rest of the leaf's trace runs under
  ``jax.named_scope("jaxcoll.<primitive>.<algo>")`` (:func:`_map_leaves` holds the scope)."""
  algo, options, call = _decide(primitive, algorithm, axes, x, nbytes, accumulate, wire,
                                stochastic)
  record.collective(primitive, axes, x.nbytes, algo, call)
  scopes = _scopes.get()
  if scopes is not None:
    scopes.enter_context(jax.named_scope(f"jaxcoll.{primitive}.{algo}"))
  return algo, options


def _wire(wire_dtype, dtype, wire_block_size, accumulate, op=None):
  fmt = wire_lib.wire_format(wire_dtype, dtype, wire_block_size, op=op)
  if fmt is not None and accumulate is not None and np.dtype(accumulate) != np.float32:
    raise ValueError(f"wire_dtype={fmt.name!r} accumulates in float32; "
                     f"accumulate_dtype={np.dtype(accumulate).name} conflicts with it")
  return fmt


def _leaf_call(facts, x, n: int, accumulate_dtype, wire_dtype, wire_block_size, op=None):
  """``(accumulate dtype, wire format, M)`` of a call on leaf ``x`` (an array or its
  ``ShapeDtypeStruct``) over ``n`` devices: what auto prices it by, read once for the call
  (:func:`_collective`) and for :func:`algorithm_of` alike. A lossy wire on a max or a min
  is an error (:func:`_wire`)."""
  acc = checks.accumulate(accumulate_dtype, x.dtype) if facts.reduces else None
  fmt = _wire(wire_dtype, x.dtype, wire_block_size, acc, op) if facts.wire else None
  nbytes = math.prod(x.shape) * np.dtype(x.dtype).itemsize
  return acc, fmt, facts.message_bytes(nbytes, n)


def _straight_through(fn, x, wire, key, *, linear: bool):
  """``fn(x, wire, key)``, differentiated as ``fn(x, None, None)``: compression and
  stochastic rounding are invisible to gradients (straight-through), which flow as through
  the uncompressed collective rounded to nearest (uncompressed, jax differentiates the
  rounding itself, which passes tangents straight through)."""
  if wire is None:
    return fn(x, None, key)

  @jax.custom_jvp
  def compressed(x):
    return fn(x, wire, key)

  @compressed.defjvp
  def _(primals, tangents):
    (x,), (dx,) = primals, tangents
    if linear and x.dtype.itemsize >= 4:   # fn is linear: its value at dx is the tangent
      return compressed(x), fn(dx, None, None)
    # (16-bit floats travel bitcast to integers, a primal reverse mode cannot transpose:
    # their tangents take the ppermute's own JVP)
    return compressed(x), jax.jvp(lambda v: fn(v, None, None), (x,), (dx,))[1]

  return compressed(x)


def _run(primitive, algorithm, n, flat, axes, *, op="sum", root=0, accumulate=None,
         options=None, wire=None, key=None):
  """Runs ``algorithm``'s schedule on one rank's flat buffer; returns the final rows. With
  ``key``, combines of bfloat16/float16 rows round stochastically (wider partial sums are
  rounded once, by the caller)."""
  sched = schedule(primitive, algorithm, n, root=root, **(options or {}))
  if wire is not None:
    accumulate = jnp.promote_types(flat.dtype, jnp.float32)
  work = flat if accumulate is None else flat.astype(accumulate)
  multiple = 1 if wire is None else wire.row_multiple(layout.row_length(sched, work.shape[0]))
  rows = make_varying(layout.to_rows(jnp, work, sched, multiple=multiple), axes)
  rows = layout.place_own(jnp, rows, work, sched, axes_lib.index(axes))
  fused = fused_combine.use_fused_kernel(rows.shape[1] * rows.dtype.itemsize, rows.dtype)
  rows = execute(sched, rows, axes, op=op, wire=wire, fused=fused,
                 copy_dtype=None if accumulate is None else flat.dtype, key=key)
  if accumulate is not None and key is not None:   # as the copies rounded: by chunk
    rows = rounding_lib.round_rows(rows, flat.dtype, rounding_lib.copy_key(key))
  return sched, rows


def _map_leaves(fn, x, keys=None):
  """``fn(leaf, key)`` on every leaf of ``x`` (``keys``: one per leaf, default None), each in
  a scope :func:`_resolve` may name."""
  leaves, tree = jax.tree.flatten(x)
  out = []
  for leaf, key in zip(leaves, keys or [None] * len(leaves)):
    with contextlib.ExitStack() as scopes:
      token = _scopes.set(scopes)
      try:
        out.append(fn(leaf, key))
      finally:
        _scopes.reset(token)
  return jax.tree.unflatten(tree, out)


def _collective(primitive: str, x, axis_name, algorithm, *, native, finish, op=None,
                check=None, move=None, root: int = 0, options=None, accumulate_dtype=None,
                wire_dtype=None, wire_block_size: int = wire_lib.DEFAULT_BLOCK_SIZE,
                rounding: str = "nearest", key=None):
  """The one core every public collective runs: per leaf of ``x``, the argument checks,
  the algorithm (:func:`_resolve`), then ``native(leaf)`` (the lax collective) or the
  schedule on the leaf's flat buffer, compressed straight-through when ``wire_dtype`` says.

  ``check(leaf)`` raises on bad arguments; ``move(leaf)`` is the array whose flat buffer the
  schedule runs on (default the leaf); ``finish(rows, schedule, leaf, moved, key)`` makes
  the result from the final rows (a mean divides with :func:`_mean`). M, the
  message size auto prices, follows the spec (:meth:`CollectiveSpec.message_bytes`).
  ``rounding="stochastic"`` (reductions): each bfloat16/float16 leaf rounds with its own
  key (:mod:`rounding`); where partial sums are wider (``accumulate_dtype``, a wire
  format, the lax collective, which then reduces float32) the final rounding is the
  stochastic one (:func:`rounding.round_rows`, as the schedule's copies of final values
  round). A non-replicated result folds the device into the key of its mean's division
  and of the lax collective's rounding.
  """
  facts = spec_lib.spec(primitive)
  axes = axes_lib.normalize(axis_name)
  n = axes_lib.size(axes)
  move = move or (lambda v: v)

  check_algorithm(primitive, algorithm, num_axes=len(axes))
  keys = None
  if facts.reduces:
    checks.choice(op, ops.OPS, "op")
  x = jax.tree.map(lambda v: _prepare(v, op), x)
  if facts.reduces:
    dtypes = [v.dtype for v in jax.tree.leaves(x)]
    key = rounding_lib.check(rounding, key, op=op, dtypes=dtypes)
    rounding_lib.check_same_everywhere(key, axes)
    keys = rounding_lib.leaf_keys(key, dtypes)

  def leaf(x, key):
    if check is not None:
      check(x)
    acc, fmt, nbytes = _leaf_call(facts, x, n, accumulate_dtype, wire_dtype, wire_block_size,
                                  op)
    if x.size == 0:   # nothing to send: lax's (empty) answer whatever the algorithm
      return native(x)
    algo, chosen = _resolve(primitive, algorithm, axes, x, nbytes, accumulate=acc, wire=fmt,
                            stochastic=key is not None)
    final = key if key is None or facts.replicated else jax.random.fold_in(
        key, axes_lib.index(axes))
    if algo == NATIVE:   # accumulate_dtype / stochastic: lax's collective on wider sums
      wide = acc if acc is not None or key is None else np.dtype(np.float32)
      return native(x) if wide is None else rounding_lib.round_to(
          native(x.astype(wide)), x.dtype, final)

    def run(x, wire, key):
      moved = move(make_varying(x, axes))
      sched, rows = _run(primitive, algo, n, moved.reshape(-1), axes, op=op or "sum",
                         root=root, accumulate=acc, options=chosen | (options or {}),
                         wire=wire, key=key)
      return finish(rows, sched, x, moved, None if key is None else final)
    return _straight_through(run, x, fmt, key, linear=op in (None, "sum", "mean"))

  return _map_leaves(_keys_as_data(leaf, primitive, wire_dtype), x, keys)


def _keys_as_data(leaf, primitive: str, wire_dtype):
  """``leaf(x, key)``, where ``x`` is a PRNG key array (``jax.random.key``) moved as its key
  data, one uint32 component at a time: each component has the keys' shape, so every axis
  argument means what it means for the keys. Keys on a lossy wire are a TypeError (a
  reduction of keys is refused by :func:`_prepare`)."""
  def run(x, key):
    if not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      return leaf(x, key)
    if wire_dtype is not None:
      raise TypeError(f"{primitive} of x, a PRNG key array ({x.dtype}), with wire_dtype="
                      f"{wire_dtype!r}: keys travel exact; leave wire_dtype out")
    data = jax.random.key_data(x)
    parts = [leaf(data[(..., *i)], None) for i in np.ndindex(data.shape[x.ndim:])]
    moved = jnp.stack(parts, -1).reshape(parts[0].shape + data.shape[x.ndim:])
    return jax.random.wrap_key_data(moved, impl=jax.random.key_impl(x))
  return run


def algorithm_of(primitive: str, x, axis_name, *, algorithm="auto", op: str | None = None,
                 accumulate_dtype=None, wire_dtype=None, rounding: str = "nearest") -> str:
  """The algorithm a call of ``primitive`` on one array ``x`` (or its ``ShapeDtypeStruct``)
  over ``axis_name`` runs, inside shard_map: ``algorithm`` with "auto" (and "schedule")
  resolved exactly as the call resolves it. Nothing is traced or recorded. An integration
  asks before it packs values for a collective (a lax collective needs no packing).

  Args:
    primitive: a collective of ``jaxcoll.PRIMITIVES``.
    x: the operand, or its shape and dtype.
    axis_name, algorithm, op, accumulate_dtype, wire_dtype, rounding: as the collective
      takes them (the key does not change the choice, only whether there is one).

  Returns:
    The algorithm's name ("native" for the lax collective).

  Raises:
    ValueError: a ``rounding`` other than "nearest" and "stochastic".
  """
  facts = spec_lib.spec(primitive)
  axes = axes_lib.normalize(axis_name)
  x = jax.ShapeDtypeStruct(np.shape(x), jnp.int32 if x.dtype == bool and op in ("sum", "mean")
                           else x.dtype)
  acc, fmt, nbytes = _leaf_call(facts, x, axes_lib.size(axes), accumulate_dtype, wire_dtype,
                                wire_lib.DEFAULT_BLOCK_SIZE, op)
  checks.choice(rounding, rounding_lib.ROUNDINGS, "rounding")
  stochastic = facts.reduces and rounding_lib.rounds_stochastically(rounding == "stochastic",
                                                                    x.dtype)
  return _decide(primitive, algorithm, axes, x, nbytes, accumulate=acc, wire=fmt,
                 stochastic=stochastic)[0]


def all_reduce(x, axis_name, *, op: str = "sum", algorithm: str = "auto",
               accumulate_dtype=None, wire_dtype=None,
               wire_block_size: int = wire_lib.DEFAULT_BLOCK_SIZE, rounding: str = "nearest",
               key=None):
  """Reduces x over ``axis_name``; every device gets the result (like ``lax.psum``).

  Args:
    x: a pytree of arrays, any shape and dtype lax accepts for ``op``.
    axis_name: a mesh axis of the enclosing shard_map, or a tuple of them.
    op: "sum", "prod", "min", "max" or "mean" (``lax.pmean``: sum / N).
    algorithm: "auto", "schedule" (auto among jaxcoll's schedules, never the lax
      collective), a name from ``algorithms("all_reduce")``, or
      ``Hierarchical(per_axis)`` (over a tuple: one flat algorithm per axis).
    accumulate_dtype: e.g. "float32" for bfloat16 data: partial sums travel and
      combine in this dtype and are rounded once at the end (reduce steps send
      itemsize(accumulate)/itemsize(x) times the bytes). None: each combine
      computes in float32 and rounds to x's dtype (NCCL's behaviour).
    wire_dtype: compress every message: a name of ``jaxcoll.wire_dtypes()`` ("bfloat16";
      "float8_e4m3fn", "float8_e5m2" or "int8", block-scaled, one power-of-two exponent
      per ``wire_block_size`` values; any format registered since); partial sums
      accumulate in float32 and are re-encoded before each send. Replicas stay
      bit-identical; each encode errs by at most ``WireFormat.relative_error`` times its
      block's largest magnitude. Gradients are those of the uncompressed collective. x's own
      dtype (or None) sends x uncompressed; "native" cannot compress. Non-finite values
      arrive as lax's: an inf with its sign, a NaN as NaN, the finite values of their
      block scaled without them (:class:`jaxcoll.WireFormat`).
    wire_block_size: values per shared exponent (a power of two).
    rounding: "nearest" (lax's) or "stochastic": each bfloat16/float16 combine, computed in
      float32, rounds to one of its two neighbours with the probabilities that make it
      unbiased (the mean over keys is the float32 result). Where partial sums are wider
      (``accumulate_dtype``, a ``wire_dtype``, "native", which then reduces float32) the
      one final rounding is the stochastic one. Other leaves round as lax's.
    key: a ``jax.random`` key for "stochastic", the same on every device (replicas then
      agree bit for bit); each leaf, step and chunk draws its own bits from it. Gradients
      pass straight through the rounding.

  Returns:
    The reduction, typed invariant over ``axis_name``. Cost (ring): 2(N-1)
    steps, 2(N-1)/N * M bytes per device (times ``WireFormat.ratio`` when
    compressed); see each algorithm's schedule.

  Raises:
    ValueError: at trace time, naming the argument: an axis no enclosing shard_map binds, an
      algorithm that does not run all_reduce over these axes, an ``op`` the dtype does not
      take, a ``wire_dtype`` that is not a wire format, that ``algorithm="native"`` cannot
      send or with op "max"/"min" (a max or a min travels exact), an ``accumulate_dtype``
      narrower than x's, a ``rounding`` other than the two,
      "stochastic" without a key, with op "max"/"min" or on data without a
      bfloat16/float16 leaf, a key with "nearest".
    TypeError: an argument of the wrong kind (e.g. an algorithm that is neither a name nor
      an algorithm value, a key that is not a ``jax.random`` key).

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np, jaxcoll
    >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("x",))
    >>> f = jax.shard_map(lambda v: jaxcoll.all_reduce(v, "x", algorithm="ring"),
    ...                   mesh=mesh, in_specs=jax.P("x"), out_specs=jax.P())
    >>> f(jnp.arange(8.0))
    Array([12., 16.], dtype=float32)
    >>> g = jax.shard_map(lambda v: jaxcoll.all_reduce(v, "x", rounding="stochastic",
    ...                                                key=jax.random.key(0)),
    ...                   mesh=mesh, in_specs=jax.P("x"), out_specs=jax.P())
    >>> g(jnp.full(4, 256.0, jnp.bfloat16) + jnp.array([0, 1, 1, 1], jnp.bfloat16)).dtype
    dtype(bfloat16)
  """
  axes = axes_lib.normalize(axis_name)
  n = axes_lib.size(axes)

  def native(x):
    if op == "prod":
      return as_replicated(jnp.prod(lax.all_gather(x, axes), axis=0, dtype=x.dtype), axes)
    return _NATIVE_REDUCE[op](x, axes)

  def finish(rows, sched, x, _, key):
    y = layout.from_rows(jnp, rows, sched, x.size).reshape(x.shape).astype(x.dtype)
    return as_replicated(_mean(y, op, n, key), axes)

  return _collective("all_reduce", x, axis_name, algorithm, native=native, finish=finish,
                     op=op, accumulate_dtype=accumulate_dtype, wire_dtype=wire_dtype,
                     wire_block_size=wire_block_size, rounding=rounding, key=key)


def reduce_scatter(x, axis_name, *, scatter_dimension: int = 0, tiled: bool = False,
                   op: str = "sum", algorithm: str = "auto", accumulate_dtype=None,
                   wire_dtype=None, wire_block_size: int = wire_lib.DEFAULT_BLOCK_SIZE,
                   rounding: str = "nearest", key=None):
  """Reduces x over ``axis_name`` and scatters the result (like ``lax.psum_scatter``).

  Device r gets block r of the reduction along ``scatter_dimension``: with
  ``tiled=False`` that dimension must equal N and is removed; with
  ``tiled=True`` it must be divisible by N and shrinks N-fold. ``wire_dtype``
  and ``wire_block_size`` compress the partial sums as in :func:`all_reduce`.
  Cost (ring): N-1 steps, (N-1)/N * M bytes per device (M = the input).

  Args:
    x: a pytree of arrays.
    axis_name: a mesh axis of the enclosing shard_map, or a tuple of them.
    scatter_dimension: the dimension split among the devices.
    tiled: as ``lax.psum_scatter``'s (above).
    op, algorithm, accumulate_dtype, wire_dtype, wire_block_size, rounding, key: as
      :func:`all_reduce`'s (the final rounding of each device's block also folds in the
      device's index, so shards do not share their rounding noise).

  Returns:
    Device r's block of the reduction.

  Raises:
    ValueError: at trace time, naming the argument: an axis no enclosing shard_map binds, an
      algorithm that does not run reduce_scatter over these axes, a ``scatter_dimension`` out
      of range or not split evenly, an ``op`` the dtype does not take, a ``wire_dtype`` with
      op "max"/"min", a bad ``rounding`` or ``key`` (as :func:`all_reduce`).
    TypeError: an argument of the wrong kind (e.g. an algorithm that is neither a name nor
      an algorithm value).

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np, jaxcoll
    >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("x",))
    >>> f = jax.shard_map(lambda v: jaxcoll.reduce_scatter(v, "x", tiled=True),
    ...                   mesh=mesh, in_specs=jax.P("x"), out_specs=jax.P("x"))
    >>> f(jnp.arange(16.0))
    Array([24., 28., 32., 36.], dtype=float32)

  """
  axes = axes_lib.normalize(axis_name)
  n = axes_lib.size(axes)
  checks.flag(tiled, "tiled")
  dim = lambda x: _normalize_dim(scatter_dimension, x.ndim, "scatter_dimension")  # noqa: E731

  def check(x):
    d = dim(x)
    _check_split(x.shape[d], n, tiled, f"scatter_dimension={scatter_dimension}: x.shape[{d}]")

  def native(x):
    d, extent = dim(x), x.shape[dim(x)]
    if op in ("sum", "mean"):
      return _mean(lax.psum_scatter(x, axes, scatter_dimension=d, tiled=tiled), op, n, None)
    full = all_reduce(x, axis_name, op=op, algorithm=NATIVE)
    y = lax.dynamic_slice_in_dim(full, axes_lib.index(axes) * (extent // n), extent // n, d)
    return y if tiled else jnp.squeeze(y, d)

  def finish(rows, sched, x, moved, key):
    b, d = sched.blocks_per_rank, dim(x)
    mine = lax.dynamic_slice_in_dim(rows, axes_lib.index(axes) * b, b, axis=0)
    y = layout.from_rows(jnp, mine, sched, moved.size).astype(x.dtype)
    y = jnp.moveaxis(y.reshape((x.shape[d] // n,) + moved.shape[1:]), 0, d)
    return _mean(y if tiled else jnp.squeeze(y, d), op, n, key)

  return _collective("reduce_scatter", x, axis_name, algorithm, native=native, finish=finish,
                     check=check, move=lambda x: jnp.moveaxis(x, dim(x), 0), op=op,
                     accumulate_dtype=accumulate_dtype, wire_dtype=wire_dtype,
                     wire_block_size=wire_block_size, rounding=rounding, key=key)


def all_gather(x, axis_name, *, axis: int = 0, tiled: bool = False, algorithm: str = "auto",
               to: str = "varying", wire_dtype=None,
               wire_block_size: int = wire_lib.DEFAULT_BLOCK_SIZE):
  """Gathers x from every device along ``axis`` (like ``lax.all_gather``).

  ``tiled=False`` stacks the N pieces along a new dimension ``axis``;
  ``tiled=True`` concatenates them along the existing ``axis``. ``to`` is
  lax's: "varying" (default) or "invarying" (typed invariant, for
  ``out_specs=P()``). ``wire_dtype`` sends every piece compressed as in
  :func:`all_reduce` (each device's own piece comes back decoded too, so all
  copies agree bit for bit). Cost (ring): N-1 steps, (N-1)/N * M bytes per device
  (M = the gathered output).

  Args:
    x: a pytree of arrays, the device's piece.
    axis_name: a mesh axis of the enclosing shard_map, or a tuple of them.
    axis: where the pieces go (above).
    tiled: stack (False) or concatenate (True).
    algorithm: as :func:`all_reduce`'s.
    to: "varying" or "invarying" (above).
    wire_dtype, wire_block_size: as :func:`all_reduce`'s.

  Returns:
    Every device's piece, in device order, on every device.

  Raises:
    ValueError: at trace time, naming the argument: an axis no enclosing shard_map binds, an
      algorithm that does not run all_gather over these axes, an ``axis`` out of range,
      ``tiled=True`` on a scalar, a ``to`` other than the two.
    TypeError: an argument of the wrong kind (e.g. an algorithm that is neither a name nor
      an algorithm value).

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np, jaxcoll
    >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("x",))
    >>> f = jax.shard_map(lambda v: jaxcoll.all_gather(v, "x", tiled=True, to="invarying"),
    ...                   mesh=mesh, in_specs=jax.P("x"), out_specs=jax.P())
    >>> f(jnp.arange(4.0))
    Array([0., 1., 2., 3.], dtype=float32)

  """
  checks.choice(to, ("varying", "invarying", "invariant"), "to")
  checks.flag(tiled, "tiled")
  axes = axes_lib.normalize(axis_name)
  n = axes_lib.size(axes)

  def dim(x):
    if tiled and x.ndim == 0:
      raise ValueError("all_gather with tiled=True needs x with at least one dimension")
    return _normalize_dim(axis, x.ndim if tiled else x.ndim + 1, "axis")

  def native(x):
    return lax.all_gather(x, axes, axis=dim(x), tiled=tiled,
                          to="invarying" if to != "varying" else "varying")

  def finish(rows, sched, x, _, key):
    a = dim(x)
    y = layout.from_rows(jnp, rows, sched, x.size).reshape((n,) + x.shape).astype(x.dtype)
    y = jnp.moveaxis(y, 0, a)
    if tiled:
      y = y.reshape(x.shape[:a] + (n * x.shape[a],) + x.shape[a + 1:])
    return as_replicated(y, axes, typed=to != "varying")

  return _collective("all_gather", x, axis_name, algorithm, native=native, finish=finish,
                     check=dim, wire_dtype=wire_dtype, wire_block_size=wire_block_size)


def broadcast(x, axis_name, *, root: int = 0, algorithm: str = "auto"):
  """Every device gets the ``root`` device's x (typed invariant over the axis).

  Cost (binomial_tree): ceil(log2 N) steps, ceil(log2 N) * M bytes at the root;
  (scatter_allgather): ceil(log2 N) + N - 1 steps, 2(N-1)/N * M.

  Args:
    x: a pytree of arrays.
    axis_name: a mesh axis of the enclosing shard_map, or a tuple of them.
    root: the device whose x everyone gets, ``0 <= root < N``.
    algorithm: as :func:`all_reduce`'s (names from ``algorithms("broadcast")``).

  Returns:
    The root's x on every device.

  Raises:
    ValueError: at trace time, naming the argument: an axis no enclosing shard_map binds, an
      algorithm that does not run broadcast over these axes, a ``root`` outside ``[0, N)``.
    TypeError: an argument of the wrong kind (e.g. an algorithm that is neither a name nor
      an algorithm value).

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np, jaxcoll
    >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("x",))
    >>> f = jax.shard_map(lambda v: jaxcoll.broadcast(v, "x", root=2),
    ...                   mesh=mesh, in_specs=jax.P("x"), out_specs=jax.P())
    >>> f(jnp.arange(4.0))
    Array([2.], dtype=float32)

  """
  axes = axes_lib.normalize(axis_name)
  _check_root(root, axes_lib.size(axes))

  def native(x):
    wide = x.astype(jnp.int32) if x.dtype == bool else x
    mine = jnp.where(axes_lib.index(axes) == root, wide, jnp.zeros_like(wide))
    return lax.psum(mine, axes).astype(x.dtype)

  def finish(rows, sched, x, _, key):
    return as_replicated(layout.from_rows(jnp, rows, sched, x.size).reshape(x.shape), axes)

  return _collective("broadcast", x, axis_name, algorithm, native=native, finish=finish,
                     root=root)


def reduce(x, axis_name, *, root: int = 0, op: str = "sum", algorithm: str = "auto",
           rounding: str = "nearest", key=None):
  """The ``root`` device gets the reduction of x over the axis; every other device zeros.

  Cost (binomial_tree): ceil(log2 N) steps, M bytes per device;
  (reduce_scatter_gather): N - 1 + ceil(log2 N) steps, at most 1.5 M.

  Args:
    x: a pytree of arrays.
    axis_name: a mesh axis of the enclosing shard_map, or a tuple of them.
    root: the device that gets the reduction, ``0 <= root < N``.
    op: as :func:`all_reduce`'s.
    algorithm: as :func:`all_reduce`'s (names from ``algorithms("reduce")``).
    rounding, key: as :func:`all_reduce`'s.

  Returns:
    The reduction at the root, zeros of its shape and dtype elsewhere.

  Raises:
    ValueError: at trace time, naming the argument: an axis no enclosing shard_map binds, an
      algorithm that does not run reduce over these axes, a ``root`` outside ``[0, N)``, an
      ``op`` the dtype does not take, a bad ``rounding`` or ``key`` (as :func:`all_reduce`).
    TypeError: an argument of the wrong kind (e.g. an algorithm that is neither a name nor
      an algorithm value).

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np, jaxcoll
    >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("x",))
    >>> f = jax.shard_map(lambda v: jaxcoll.reduce(v, "x", root=1),
    ...                   mesh=mesh, in_specs=jax.P("x"), out_specs=jax.P("x"))
    >>> f(jnp.arange(4.0))
    Array([0., 6., 0., 0.], dtype=float32)

  """
  axes = axes_lib.normalize(axis_name)
  n = axes_lib.size(axes)
  _check_root(root, n)
  at_root = lambda y: jnp.where(axes_lib.index(axes) == root, y, jnp.zeros_like(y))  # noqa: E731

  def native(x):
    return at_root(make_varying(all_reduce(x, axis_name, op=op, algorithm=NATIVE), axes))

  def finish(rows, sched, x, _, key):
    y = layout.from_rows(jnp, rows, sched, x.size).reshape(x.shape)
    return at_root(_mean(y, op, n, key))

  return _collective("reduce", x, axis_name, algorithm, native=native, finish=finish, op=op,
                     root=root, rounding=rounding, key=key)


def all_to_all(x, axis_name, split_axis: int, concat_axis: int, *, tiled: bool = False,
               algorithm="auto", wire_dtype=None,
               wire_block_size: int = wire_lib.DEFAULT_BLOCK_SIZE):
  """Device r sends block j of x along ``split_axis`` to device j (like ``lax.all_to_all``).

  ``tiled=False``: ``x.shape[split_axis]`` must equal N; the result has the
  same rank, block j (from device j) at index j of ``concat_axis``.
  ``tiled=True``: ``x.shape[split_axis]`` must be divisible by N; the blocks
  received are concatenated along ``concat_axis``. ``wire_dtype`` sends every block
  compressed as in :func:`all_reduce` (a device's own block stays exact; each hop of the
  others errs by at most ``WireFormat.relative_error`` of its block's largest magnitude).
  Cost (direct): N-1 steps,
  (N-1)/N * M bytes per device; (bruck): ceil(log2 N) steps, about
  (N/2) log2 N * M/N; (hierarchical, over (outer, inner)): inner-1 + outer-1
  steps, outer-1 messages across the outer axis.

  Args:
    x: a pytree of arrays.
    axis_name: a mesh axis of the enclosing shard_map, or a tuple of them.
    split_axis: the dimension split into N blocks, block j sent to device j.
    concat_axis: where the received blocks go.
    tiled: as ``lax.all_to_all``'s (above).
    algorithm, wire_dtype, wire_block_size: as :func:`all_reduce`'s.

  Returns:
    The blocks every device sent this one, in device order.

  Raises:
    ValueError: at trace time, naming the argument: an axis no enclosing shard_map binds, an
      algorithm that does not run all_to_all over these axes, a ``split_axis`` or
      ``concat_axis`` out of range, a split dimension not split evenly.
    TypeError: an argument of the wrong kind (e.g. an algorithm that is neither a name nor
      an algorithm value).

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np, jaxcoll
    >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("x",))
    >>> f = jax.shard_map(lambda v: jaxcoll.all_to_all(v, "x", 0, 0, tiled=True),
    ...                   mesh=mesh, in_specs=jax.P("x"), out_specs=jax.P("x"))
    >>> f(jnp.arange(16.0)).reshape(4, 4)[0]
    Array([ 0.,  4.,  8., 12.], dtype=float32)

  """
  axes = axes_lib.normalize(axis_name)
  n = axes_lib.size(axes)
  checks.flag(tiled, "tiled")
  split = lambda x: _normalize_dim(split_axis, x.ndim, "split_axis")  # noqa: E731
  concat = lambda x: _normalize_dim(concat_axis, x.ndim, "concat_axis")  # noqa: E731

  def check(x):
    if x.ndim == 0:
      raise ValueError("all_to_all needs x with at least one dimension")
    s, _ = split(x), concat(x)
    _check_split(x.shape[s], n, tiled, f"split_axis={split_axis}: x.shape[{s}]")

  def native(x):
    return lax.all_to_all(x, axes, split(x), concat(x), tiled=tiled)

  def finish(rows, sched, x, moved, key):
    s, c = split(x), concat(x)
    y = layout.from_rows(jnp, rows, sched, moved.size).astype(x.dtype)
    y = jnp.moveaxis(y.reshape((n, x.shape[s] // n) + moved.shape[1:]), 1, s + 1)  # [source, .]
    if not tiled:
      return jnp.moveaxis(jnp.squeeze(y, s + 1), 0, c)
    y = jnp.moveaxis(y, 0, c)
    return y.reshape(y.shape[:c] + (n * y.shape[c + 1],) + y.shape[c + 2:])

  return _collective("all_to_all", x, axis_name, algorithm, native=native, finish=finish,
                     check=check, move=lambda x: jnp.moveaxis(x, split(x), 0),
                     wire_dtype=wire_dtype, wire_block_size=wire_block_size)


def shift(x, axis_name, offset: int = 1, *, wrap: bool = True, algorithm="auto"):
  """Device i gets device (i - offset)'s x: pipeline-parallel send/recv.

  The same as ``lax.ppermute(x, axis_name, [(i, i + offset) ...])`` with the
  destinations taken mod N (``wrap=True``) or, with ``wrap=False``, only the
  pairs whose destination exists; devices nobody sends to get zeros. Device i
  is the one with ``lax.axis_index(axis_name) == i``, also over a tuple of
  axes. Cost: 1 step, M bytes per device.

  Args:
    x: a pytree of arrays.
    axis_name: a mesh axis of the enclosing shard_map, or a tuple of them.
    offset: how far each x travels (negative: backwards).
    wrap: destinations mod N (True), or only those that exist (False).
    algorithm: as :func:`all_reduce`'s (names from ``algorithms("shift")``).

  Returns:
    The x of device i - offset (zeros where none arrives).

  Raises:
    ValueError: at trace time, naming the argument: an axis no enclosing shard_map binds, an
      algorithm that does not run shift over these axes, an ``offset`` or ``wrap`` of the
      wrong kind.
    TypeError: an argument of the wrong kind (e.g. an algorithm that is neither a name nor
      an algorithm value).

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np, jaxcoll
    >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("x",))
    >>> f = jax.shard_map(lambda v: jaxcoll.shift(v, "x", wrap=False),
    ...                   mesh=mesh, in_specs=jax.P("x"), out_specs=jax.P("x"))
    >>> f(jnp.arange(1.0, 5.0))
    Array([0., 1., 2., 3.], dtype=float32)

  """
  axes = axes_lib.normalize(axis_name)
  n = axes_lib.size(axes)
  checks.integer(offset, "offset")
  checks.flag(wrap, "wrap")
  options = {"offset": int(offset) % n if wrap else int(offset), "wrap": bool(wrap)}
  perm = [(i, (i + options["offset"]) % n) for i in range(n)
          if wrap or 0 <= i + options["offset"] < n]

  def finish(rows, sched, x, _, key):
    return layout.from_rows(jnp, rows, sched, x.size).reshape(x.shape)

  return _collective("shift", x, axis_name, algorithm, finish=finish, options=options,
                     native=lambda x: ppermute(make_varying(x, axes), axes, perm))


def _check_split(extent: int, n: int, tiled: bool, what: str) -> None:
  """The dimension a collective splits N ways: equal to N untiled, divisible by N tiled."""
  if (not tiled and extent != n) or (tiled and extent % n):
    need = f"equal to the axis size {n}" if not tiled else f"divisible by the axis size {n}"
    raise ValueError(f"{what} = {extent} must be {need} (tiled={tiled})")


def _check_root(root, n):
  checks.integer(root, "root", least=0, most=n - 1)


def _normalize_dim(dim, ndim: int, argument: str) -> int:
  if isinstance(dim, bool) or not isinstance(dim, (int, np.integer)) or not -ndim <= dim < ndim:
    raise ValueError(f"{argument}={dim!r} is out of range for {ndim} dimension(s)")
  return int(dim) % ndim


def flat_call(primitive: str, x, axis_name, algorithm="auto", *, root: int = 0,
              wire_dtype=None):
  """``primitive`` on a flat per-device buffer ``x`` of M bytes (all_gather: the piece), with
  the layouts the schedules use: tiled reduce_scatter, all_gather and all_to_all along
  axis 0. What calibrate and the benchmarks time."""
  fn = PUBLIC[primitive]
  params = inspect.signature(fn).parameters
  args = (0, 0) if "split_axis" in params else ()
  kwargs = {k: v for k, v in (("tiled", True), ("root", root), ("wire_dtype", wire_dtype))
            if k in params and v is not None}
  return fn(x, axis_name, *args, algorithm=algorithm, **kwargs)


PUBLIC = {f.__name__: f for f in (all_reduce, reduce_scatter, all_gather, broadcast, reduce,
                                  all_to_all, shift)}
