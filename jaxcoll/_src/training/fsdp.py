"""Sharded-parameter training (FSDP / ZeRO-3) with ZeRO++'s options, on the public collectives.

Every parameter is split along one of its dimensions (``axis``, default 0: FSDP2's per-
parameter dim-0 sharding), padded with zeros to a multiple of N; device r holds block r
(:func:`shard`, :class:`Sharded`). A layer gathers its parameters just before use
(:func:`gather`); under :func:`layer` the gathered copy is not kept for backward:
backward gathers it again, and every gather's VJP reduce-scatters the gradient back to
the shards. Each device so holds 1/N of the parameters, gradients and
optimizer state, plus the gathered parameters of the layer at hand.

Bytes per device per step for a layer of M parameter bytes (ring, N devices): forward
gather (N-1)/N * M, backward re-gather (N-1)/N * M, gradient reduce-scatter (N-1)/N * M:
3 (N-1)/N * M, against data parallel's all-reduce of 2 (N-1)/N * M.

ZeRO++'s three options (the gather's and layer's arguments):

- qwZ, ``wire_dtype="int8"``: gathers send block-quantized parameters (each device's own
  block stays exact; every other block errs by at most the format's bound, once per hop).
- qgZ, ``grad_wire_dtype="int8"``: the reduce-scatter sends quantized partial sums, each
  decoded and reduced in full precision.
- hpZ, ``secondary_axis="local"`` on ``axis_name=("node", "local")``: the gather runs in two
  stages, first over the axes before ``secondary_axis``, then over it. The first stage's
  result, a copy of the parameters sharded over "local" alone (1/L of them, L the size of
  "local"), is what :func:`layer` keeps for backward, so the backward re-gather runs over
  "local" only and never crosses "node". Memory: that copy, per layer.

Precision: ``dtype=`` (e.g. bfloat16) casts the shards before the gather, so the wire and
the layer see the compute dtype while the shards (the optimizer's master copy) keep theirs;
gradients are reduced in float32 at least and arrive in the shards' dtype, rounded once:
to nearest, or with ``rounding="stochastic"`` and a key (bfloat16/float16 shards) to one of
the two neighbours with the probabilities that make it unbiased, each leaf, gather stage
and device with its own bits.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcoll._src.collectives import all_gather, reduce_scatter
from jaxcoll.extend import (
  axes_in_mesh,
  axis_index,
  check_algorithm,
  check_axis_names,
  check_floating,
  check_int,
  check_rounding,
  normalize_axes,
  offered_algorithm,
  round_to,
  wire_format,
)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Sharded:
  """One parameter split along ``axis``: ``value`` is the whole padded array outside
  shard_map and this device's block inside it. ``shape`` (static) is the original shape,
  so :func:`unshard` and :func:`gather` give the parameter back exactly."""

  value: jax.Array
  shape: tuple[int, ...] = dataclasses.field(metadata={"static": True})
  axis: int = dataclasses.field(metadata={"static": True})


def _is_sharded(x) -> bool:
  return isinstance(x, Sharded)


def _axes_tree(axis, params):
  """``axis`` (an int, or a pytree prefix of ``params`` with int leaves) for every leaf."""
  return jax.tree.map(lambda a, sub: jax.tree.map(lambda _: a, sub), axis, params)


def shard(params, num_shards: int, *, axis=0):
  """Every leaf of ``params`` as a :class:`Sharded`, padded along ``axis`` to a multiple of
  ``num_shards`` (scalars become 1-element vectors). ``axis``: an int for every leaf, or a
  pytree prefix of ``params`` with an int per subtree. ``unshard(shard(p, n)) == p``.

  Args:
    params: a pytree of arrays.
    num_shards: how many blocks each leaf is split into (the axis size).
    axis: the dimension split (above).

  Returns:
    ``params`` with every leaf a :class:`Sharded` (the whole padded array).

  Raises:
    ValueError: ``num_shards`` below 1, an ``axis`` out of range or not matching
      ``params``' structure.

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np, jaxcoll
    >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("fsdp",))
    >>> params = {"w": jnp.arange(6.0).reshape(3, 2), "b": jnp.ones(2)}
    >>> s = jaxcoll.fsdp.shard(params, 4)
    >>> s["w"].value.shape, s["w"].shape      # padded from 3 rows to 4
    ((4, 2), (3, 2))
  """
  check_int(num_shards, "num_shards", least=1)
  try:
    axes = _axes_tree(axis, params)
  except ValueError:   # not a prefix of params (None is an empty one)
    raise ValueError(f"shard: axis={axis!r}: expected an int, or a pytree prefix of params "
                     "with an int per leaf or subtree") from None

  def one(path, leaf, ax):
    leaf = jnp.asarray(leaf)
    value = leaf.reshape(1) if leaf.ndim == 0 else leaf
    if isinstance(ax, bool) or not isinstance(ax, (int, np.integer)) or \
        not -value.ndim <= ax < value.ndim:
      raise ValueError(f"shard: params{jax.tree_util.keystr(path)} has shape {leaf.shape}; "
                       f"axis={ax!r} is not one of its dimensions (axis= may be a pytree of "
                       "ints, one per leaf or subtree)")
    ax = int(ax) % value.ndim
    pad = [(0, 0)] * value.ndim
    pad[ax] = (0, -value.shape[ax] % num_shards)
    return Sharded(jnp.pad(value, pad), tuple(leaf.shape), ax)

  return jax.tree_util.tree_map_with_path(one, params, axes)


def _trim(s: Sharded, full):
  """The gathered (or whole padded) value cut back to the original shape."""
  extent = s.shape[s.axis] if s.shape else 1
  return jax.lax.slice_in_dim(full, 0, extent, axis=s.axis).reshape(s.shape)


def unshard(sharded):
  """The original parameters of a whole (not per-device) :func:`shard` result.

  Args:
    sharded: what :func:`shard` returned (or a state's parameters gathered whole).

  Returns:
    The parameters, padding removed, other leaves as they are.

  Raises:
    ValueError: a :class:`Sharded` whose value is not the whole padded array.

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np, jaxcoll
    >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("fsdp",))
    >>> params = {"w": jnp.arange(6.0).reshape(3, 2), "b": jnp.ones(2)}
    >>> back = jaxcoll.fsdp.unshard(jaxcoll.fsdp.shard(params, 4))
    >>> bool(jnp.array_equal(back["w"], params["w"]))
    True
  """
  def whole(s):
    if not _is_sharded(s):
      return s
    v, want = np.shape(s.value), s.shape or (1,)   # a scalar is sharded as a 1-vector
    if len(v) != len(want) or any(a != b for d, (a, b) in enumerate(zip(v, want))
                                  if d != s.axis) or v[s.axis] < want[s.axis]:
      raise ValueError(f"unshard: a Sharded parameter of shape {s.shape} (axis {s.axis}) holds "
                       f"a value of shape {v}; expected the whole padded array (outside "
                       "shard_map, or gathered)")
    return _trim(s, s.value)
  return jax.tree.map(whole, sharded, is_leaf=_is_sharded)


def specs(sharded, axis_name):
  """PartitionSpecs matching ``sharded`` for shard_map's ``in_specs``/``out_specs`` (and
  ``NamedSharding``): each :class:`Sharded` split over ``axis_name`` along its axis, any
  other leaf replicated.

  Args:
    sharded: a pytree holding :class:`Sharded` leaves (and any others).
    axis_name: the mesh axis (or tuple) the blocks are split over.

  Returns:
    A pytree of ``PartitionSpec`` of the same structure.

  Raises:
    ValueError, TypeError: a bad ``axis_name`` (named).

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np, jaxcoll
    >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("fsdp",))
    >>> params = {"w": jnp.arange(6.0).reshape(3, 2), "b": jnp.ones(2)}
    >>> tuple(jaxcoll.fsdp.specs(jaxcoll.fsdp.shard(params, 4), "fsdp")["w"].value)
    ('fsdp',)
  """
  def spec(s):
    if not _is_sharded(s):
      return P()
    return dataclasses.replace(s, value=P(*(None,) * s.axis, axis_name))
  check_axis_names(axis_name)
  return jax.tree.map(spec, sharded, is_leaf=_is_sharded)


def place(sharded, mesh, axis_name):
  """``sharded`` put on ``mesh``, each device holding its blocks (:func:`specs`).

  Args:
    sharded: what :func:`shard` returned.
    mesh: the ``jax.sharding.Mesh``.
    axis_name: its axis (or tuple) the blocks are split over.

  Returns:
    ``sharded`` with every array on ``mesh``, laid out as :func:`specs` says.

  Raises:
    ValueError: an axis not in ``mesh``, or blocks that do not divide among its devices.

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np, jaxcoll
    >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("fsdp",))
    >>> params = {"w": jnp.arange(6.0).reshape(3, 2), "b": jnp.ones(2)}
    >>> placed = jaxcoll.fsdp.place(jaxcoll.fsdp.shard(params, 4), mesh, "fsdp")
    >>> tuple(placed["w"].value.sharding.spec)
    ('fsdp',)
  """
  n = math.prod(axes_in_mesh(axis_name, mesh)[1])
  for s in jax.tree.leaves(sharded, is_leaf=_is_sharded):
    if _is_sharded(s) and np.shape(s.value)[s.axis] % n:
      raise ValueError(f"place: a parameter padded to {np.shape(s.value)} along axis {s.axis} "
                       f"does not split among {n} devices of axis_name={axis_name!r}; shard "
                       f"it with num_shards={n}")
  shardings = jax.tree.map(lambda p: NamedSharding(mesh, p), specs(sharded, axis_name),
                           is_leaf=lambda x: isinstance(x, P))
  return jax.device_put(sharded, shardings)


@dataclasses.dataclass(frozen=True)
class _Stage:
  """The static half of one gather stage (custom_vjp's nondiff argument)."""

  axes: tuple[str, ...]
  algorithm: object
  grad_algorithm: object
  wire_dtype: object
  grad_wire_dtype: object
  dtype: object            # what the stage sends and returns
  input_dtype: object      # the block's own (what its gradient comes back in)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _gather_stage(v, key, stage: _Stage):
  """All blocks of ``v`` over ``stage.axes``, stacked: ``[n, *v.shape]`` in ``stage.dtype``.
  VJP: the reduce-scatter of the cotangent, computed in float32 at least, rounded once to
  ``v``'s dtype (stochastically with ``key``, which each device folds its index into)."""
  del key
  return all_gather(v.astype(stage.dtype), stage.axes, algorithm=stage.algorithm,
                    wire_dtype=stage.wire_dtype)


def _gather_stage_fwd(v, key, stage):
  return _gather_stage(v, key, stage), key


def _gather_stage_bwd(stage, key, ct):
  wide = ct.astype(jnp.promote_types(ct.dtype, jnp.float32))
  reduced = reduce_scatter(wide, stage.axes, algorithm=stage.grad_algorithm,
                           wire_dtype=stage.grad_wire_dtype)
  if key is not None:   # a shard of its own on each device: bits of its own
    key = jax.random.fold_in(key, axis_index(stage.axes))
  return round_to(reduced, stage.input_dtype, key), None


_gather_stage.defvjp(_gather_stage_fwd, _gather_stage_bwd)


def _split(axes: tuple[str, ...], secondary_axis) -> list[tuple[str, ...]]:
  """The gather's stages: all of ``axes``, or (hpZ) the axes before ``secondary_axis`` and
  then ``secondary_axis`` (the innermost of ``axes``)."""
  if secondary_axis is None:
    return [axes]
  inner = normalize_axes(secondary_axis)
  if len(axes) <= len(inner) or axes[-len(inner):] != inner:
    raise ValueError(f"secondary_axis={secondary_axis!r} must be the innermost axes of "
                     f"axis_name={axes!r} (hpZ keeps a copy sharded over them), e.g. "
                     "axis_name=('node', 'local'), secondary_axis='local'")
  return [axes[:-len(inner)], inner]


def _leaf_stages(s: Sharded, stages, options: dict) -> list[_Stage]:
  """The gather stages of one leaf (floating leaves send ``dtype``; others as they are)."""
  floating = jnp.issubdtype(s.value.dtype, jnp.inexact)
  dtype = np.dtype(options["dtype"]) if options["dtype"] is not None and floating \
      else s.value.dtype
  out, given = [], s.value.dtype
  for axes in stages:
    algorithm = options["algorithm"]
    out.append(_Stage(axes, offered_algorithm("all_gather", algorithm, len(axes)),
                      offered_algorithm("reduce_scatter", algorithm, len(axes)),
                      options["wire_dtype"] if floating else None,
                      options["grad_wire_dtype"] if floating else None, dtype, given))
    given = dtype
  return out


def _stage_key(key, number: int):
  """The key of a leaf's gather stage ``number`` (None: round to nearest)."""
  return None if key is None else jax.random.fold_in(key, number)


def _run(v, stages: list[_Stage], key=None, first: int = 0):
  """``v`` through the gather stages (floating data differentiably, the rest without), the
  first of them stage number ``first`` of the leaf (whose ``key`` rounds its gradients)."""
  for number, stage in enumerate(stages, first):
    if jnp.issubdtype(v.dtype, jnp.inexact):
      v = _gather_stage(v, _stage_key(key, number), stage)
    else:
      v = jax.lax.stop_gradient(all_gather(v, stage.axes, algorithm=stage.algorithm))
  return v


def _assemble(s: Sharded, got, num_stages: int):
  """The whole parameter from the stacked blocks: ``[n, *block]``, or with two stages (hpZ)
  ``[n_secondary, n_other, *block]`` (rank order (other, secondary), row-major)."""
  block = s.value.shape
  blocks = (got if num_stages == 1 else jnp.swapaxes(got, 0, 1)).reshape((-1,) + block)
  full = jnp.moveaxis(blocks, 0, s.axis)
  return _trim(s, full.reshape(block[:s.axis] + (-1,) + block[s.axis + 1:]))


def check_options(algorithm, wire_dtype, grad_wire_dtype, dtype) -> dict:
  """The gather options (:func:`gather`'s arguments), checked before anything is traced;
  each error names its argument. Returns them as the dict the stages read."""
  check_algorithm("all_gather", algorithm)
  wire_format(wire_dtype, np.float32)
  wire_format(grad_wire_dtype, np.float32, where="grad_wire_dtype")
  check_floating(dtype, "dtype")
  return dict(algorithm=algorithm, wire_dtype=wire_dtype, grad_wire_dtype=grad_wire_dtype,
              dtype=dtype)


def _stages_of(sharded, axis_name, secondary_axis, options: dict):
  """Every :class:`Sharded` leaf's gather stages (:func:`_leaf_stages`)."""
  axes = normalize_axes(axis_name)
  if secondary_axis is None:   # one stage over every axis: the algorithm must run over them
    check_algorithm("all_gather", options["algorithm"], num_axes=len(axes))
  stages = _split(axes, secondary_axis)
  return _map_sharded(lambda s: _leaf_stages(s, stages, options), sharded)


def _map_sharded(f, *trees):
  return jax.tree.map(lambda s, *rest: f(s, *rest) if _is_sharded(s) else s, *trees,
                      is_leaf=_is_sharded)


def _with_keys(f, key):
  """``f(s, *rest, leaf_key)`` for :func:`_map_sharded`: the n-th :class:`Sharded` leaf (in
  tree order) gets ``key`` folded with n (None without a key)."""
  numbers = itertools.count()
  return lambda s, *rest: f(s, *rest, _stage_key(key, next(numbers)))


def _check_rounding(rounding, key, sharded):
  """The key gradients round with (None: to nearest); "stochastic" needs bfloat16/float16
  shards (others reduce and arrive in float32 or wider, nothing to round)."""
  dtypes = [s.value.dtype for s in jax.tree.leaves(sharded, is_leaf=_is_sharded)
            if _is_sharded(s) and jnp.issubdtype(s.value.dtype, jnp.inexact)]
  return check_rounding(rounding, key, dtypes=dtypes)


def gather(params, axis_name, *, algorithm="auto", wire_dtype=None, grad_wire_dtype=None,
           secondary_axis=None, dtype=None, rounding: str = "nearest", key=None):
  """Inside shard_map: the whole parameters of every :class:`Sharded` leaf of ``params``
  (other leaves pass through), like ``lax.all_gather(..., tiled=True)`` along each leaf's
  axis and cut to its original shape.

  Args:
    params: a pytree with :class:`Sharded` leaves holding this device's blocks.
    axis_name: the mesh axis (or tuple) the parameters are sharded over.
    algorithm: the all_gather algorithm (any of ``jaxcoll.algorithms("all_gather")``); the
      gradient's reduce-scatter, and each hpZ stage, runs the same one where it exists for
      that primitive and number of axes, else "schedule" (auto among jaxcoll's schedules),
      as ``jaxcoll.use`` does (:func:`jaxcoll.extend.offered_algorithm`).
    wire_dtype: qwZ: the gathers send compressed blocks (``jaxcoll.WIRE_DTYPES``).
    grad_wire_dtype: qgZ: the gradient's reduce-scatter sends compressed partial sums.
    secondary_axis: hpZ: gather over the other axes first, then over this one (the
      innermost of ``axis_name``); the intermediate is the parameters sharded over
      ``secondary_axis`` alone, which :func:`layer` keeps for backward.
    dtype: the compute dtype the blocks are cast to before they are sent (e.g.
      bfloat16 parameters from float32 shards); gradients come back in the shards' dtype.
    rounding, key: "stochastic" with a ``jax.random`` key (the same on every device): the
      gradients of bfloat16/float16 shards, reduced in float32, round to their dtype
      stochastically (module docstring); "nearest" (default) as ``astype``.

  Gradient: the VJP of each gather stage is a reduce-scatter of the cotangent over the same
  axes (a sum, as lax's all_gather transposes to psum_scatter), computed in float32 at least.
  Cost per stage of n devices (ring): forward (n-1)/n * M, backward the same.

  Returns:
    ``params`` with every :class:`Sharded` leaf gathered whole (its original shape, in
    ``dtype`` when given); other leaves as they are.

  Raises:
    ValueError: a bad option, named (a ``secondary_axis`` that is not the innermost axis of
      ``axis_name``, an unknown ``wire_dtype``, "stochastic" without a key or without
      bfloat16/float16 shards, ...).

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np, jaxcoll
    >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("fsdp",))
    >>> params = {"w": jnp.arange(6.0).reshape(3, 2), "b": jnp.ones(2)}
    >>> blocks = jaxcoll.fsdp.place(jaxcoll.fsdp.shard(params, 4), mesh, "fsdp")
    >>> whole = jax.shard_map(lambda p: jaxcoll.fsdp.gather(p, "fsdp"), mesh=mesh,
    ...                       in_specs=(jaxcoll.fsdp.specs(blocks, "fsdp"),),
    ...                       out_specs=jax.P(), check_vma=False)(blocks)
    >>> bool(jnp.array_equal(whole["w"], params["w"]))
    True
  """
  options = check_options(algorithm, wire_dtype, grad_wire_dtype, dtype)
  key = _check_rounding(rounding, key, params)
  return _map_sharded(_with_keys(lambda s, p, k: _assemble(s, _run(s.value, p, k), len(p)),
                                 key), params,
                      _stages_of(params, axis_name, secondary_axis, options))


def _units(fns: tuple, axis_name, secondary_axis, options: dict, prefetch: int) -> Callable:
  """``run(blocks, keys, x)``: ``x`` through ``fns[i](params_i, x)`` in turn, each unit's
  parameters gathered from ``blocks[i]`` (rounded with ``keys[i]``), differentiable, with the
  memory and order of :func:`layers` (its docstring). One mechanism for :func:`layer` (one
  unit) and :func:`layers`.

  Forward gathers unit j once the input of unit ``max(j - prefetch, 0)`` exists and keeps
  only the units' inputs (hpZ: also each unit's copy sharded over ``secondary_axis``);
  backward gathers unit j again once the cotangent of unit ``min(j + prefetch, last)``'s
  output exists, recomputes unit j, and reduce-scatters its parameters' gradients, which
  the end of unit j-1's backward waits for. Each "once ... exists" and "waits for" is a
  ``lax.optimization_barrier``: XLA may run a gather later, beside the units before it,
  never earlier; and it may run a reduce-scatter beside the next unit's backward, never
  merged with every other one at the end of the step (XLA's combiner joins independent
  reduce-scatters)."""
  kept = 0 if secondary_axis is None else 1    # stages whose result forward keeps (hpZ)

  def stages_of(sharded):
    return _stages_of(sharded, axis_name, secondary_axis, options)

  def kept_stages(sharded, stages):
    """Each leaf through its first ``kept`` stages (not differentiated: backward's own)."""
    return _map_sharded(lambda s, p: _run(s.value, p[:kept]), sharded, stages)

  def whole(sharded, stages, mids, key):
    """The parameters from ``mids`` (the rest of each leaf's stages); other leaves as given."""
    f = _with_keys(lambda s, p, m, k: _assemble(s, _run(m, p[kept:], k, first=kept), len(p)),
                   key)
    return jax.tree.map(lambda s, p, m: f(s, p, m) if _is_sharded(s) else m, sharded, stages,
                        mids, is_leaf=_is_sharded)

  def block_grads(sharded, stages, d_mids, key):
    """The blocks' gradients: ``d_mids`` back through the kept stages' reduce-scatters."""
    def one(s, p, d, k):
      if not jnp.issubdtype(s.value.dtype, jnp.inexact):
        return dataclasses.replace(s, value=np.zeros(s.value.shape, jax.dtypes.float0))
      for number in reversed(range(kept)):
        d, _ = _gather_stage_bwd(p[number], _stage_key(k, number), d)
      return dataclasses.replace(s, value=d)
    f = _with_keys(one, key)
    return jax.tree.map(lambda s, p, d: f(s, p, d) if _is_sharded(s) else d, sharded, stages,
                        d_mids, is_leaf=_is_sharded)

  def forward(blocks, keys, x):
    last, xs, ready, mids = len(blocks) - 1, [x], {}, []
    for i in range(last + 1):
      for j in range(len(mids), min(i + prefetch, last) + 1):   # issued once xs[i] exists
        sharded, _ = jax.lax.optimization_barrier((blocks[j], xs[i]))
        stages = stages_of(sharded)
        mids.append(kept_stages(sharded, stages))
        ready[j] = whole(sharded, stages, mids[j], keys[j])
      xs.append(fns[i](ready.pop(i), xs[i]))
    return xs[-1], (blocks, keys, mids if kept else None, xs[:-1])

  @jax.custom_vjp
  def run(blocks, keys, x):
    return forward(blocks, keys, x)[0]

  def backward(res, ct):
    blocks, keys, mids, xs = res
    grads, pulls, issued, pending = [None] * len(blocks), {}, len(blocks), None

    def reduce(d_params, pull, sharded, stages, i):   # layer i's reduce-scatters
      grads[i] = block_grads(sharded, stages, pull(d_params)[0], keys[i])

    for i in reversed(range(len(blocks))):
      for j in reversed(range(max(i - prefetch, 0), issued)):   # issued once ct exists
        plain = _map_sharded(lambda s: s.value, blocks[j]) if mids is None else mids[j]
        sharded, m, _ = jax.lax.optimization_barrier((blocks[j], plain, ct))
        stages = stages_of(sharded)
        params, pull = jax.vjp(lambda m, s=sharded, p=stages, k=keys[j]: whole(s, p, m, k), m)
        pulls[j] = params, pull, sharded, stages
      issued = min(issued, max(i - prefetch, 0))
      params, pull, sharded, stages = pulls.pop(i)
      x, _ = jax.lax.optimization_barrier((xs[i], ct))   # recomputed once its cotangent exists
      y, unit = jax.vjp(fns[i], params, x)
      if pending is not None:   # layer i+1's reduce-scatters: after this recompute ...
        d_next, _ = jax.lax.optimization_barrier((pending[0], y))
        reduce(d_next, *pending[1:])
      d_params, ct = unit(ct)
      if pending is not None:   # ... and before this layer's gradients are out
        d_params, ct, _ = jax.lax.optimization_barrier((d_params, ct, _arrays(grads[i + 1])))
      pending = d_params, pull, sharded, stages, i
    reduce(*pending)
    return type(blocks)(grads), None, ct

  run.defvjp(lambda blocks, keys, x: forward(blocks, keys, x), backward)
  return run


def _arrays(tree) -> list:
  """The leaves of ``tree`` that hold data (not float0 gradients of integer leaves)."""
  return [v for v in jax.tree.leaves(tree) if v.dtype != jax.dtypes.float0]


def layer(fn: Callable, axis_name, *, secondary_axis=None, algorithm="auto", wire_dtype=None,
          grad_wire_dtype=None, dtype=None, rounding: str = "nearest") -> Callable:
  """``fn(params, *args)`` as an FSDP unit: ``layer(fn, axis)(sharded, *args)`` gathers
  ``sharded`` (:func:`gather`, with these options) and runs ``fn``, keeping for backward
  only its inputs (with hpZ, instead of the blocks, the copy sharded over
  ``secondary_axis``). Backward gathers the parameters again (hpZ: over ``secondary_axis``
  alone), recomputes ``fn`` (the layer is rematerialised whole), and reduce-scatters the
  parameters' gradients.

  The gathers are ordered, not only scheduled, by data: the forward gather waits for the
  layer's inputs and the backward one for the layer's output cotangent
  (``lax.optimization_barrier``), so XLA cannot hoist every layer's gather to the start
  of the step. Peak memory: the blocks, the saved layer inputs, one layer's gathered
  parameters and gradients (two while XLA overlaps neighbours). To gather the next layer
  while this one computes, run the layers as :func:`layers` (``prefetch=``).

  Args:
    fn: ``fn(params, *args)``: the layer, on whole parameters.
    axis_name: the FSDP mesh axis (or tuple).
    secondary_axis, algorithm, wire_dtype, grad_wire_dtype, dtype: as :func:`gather`'s.
    rounding: as :func:`gather`'s; with "stochastic" the layer takes ``key=`` at each call.

  Returns:
    ``layer(blocks, *args, key=None)``: ``fn`` on the gathered parameters, differentiable,
    with the parameters' gradients reduce-scattered back to blocks (rounded with ``key``).

  Raises:
    ValueError: a bad option, as :func:`gather` raises, or ``fn`` that is not callable;
      at a call, a ``key`` that the rounding does not take or lacks.

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np, jaxcoll
    >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("fsdp",))
    >>> params = {"w": jnp.arange(6.0).reshape(3, 2), "b": jnp.ones(2)}
    >>> blocks = jaxcoll.fsdp.place(jaxcoll.fsdp.shard(params, 4), mesh, "fsdp")
    >>> dense = jaxcoll.fsdp.layer(lambda p, x: x @ p["w"] + p["b"], "fsdp")
    >>> out = jax.shard_map(dense, mesh=mesh, in_specs=(jaxcoll.fsdp.specs(blocks, "fsdp"),
    ...                     jax.P()), out_specs=jax.P(), check_vma=False)(blocks, jnp.ones(3))
    >>> out
    Array([ 7., 10.], dtype=float32)
  """
  options = check_options(algorithm, wire_dtype, grad_wire_dtype, dtype)
  if not callable(fn):
    raise TypeError(f"layer: fn={fn!r}: expected a function fn(params, *args)")
  if rounding != "stochastic":   # "stochastic" takes its key at each call
    check_rounding(rounding, None)
  run = _units((lambda p, args: fn(p, *args),), axis_name, secondary_axis, options, 0)

  def call(sharded, *args, key=None):
    return run([sharded], [_check_rounding(rounding, key, sharded)], args)
  return call


def layers(fn, axis_name, *, prefetch: int = 1, secondary_axis=None, algorithm="auto",
           wire_dtype=None, grad_wire_dtype=None, dtype=None,
           rounding: str = "nearest") -> Callable:
  """A stack of FSDP units whose gathers run ``prefetch`` layers ahead: layer i+1's
  parameters travel while layer i computes (FSDP2's forward and backward prefetch).

  ``layers(fn, axis)(blocks, x)`` is ``x`` through ``fn(params_i, x)`` for each layer's
  :class:`Sharded` blocks ``blocks[i]`` in turn, each layer a :func:`layer` (gathered,
  run, recomputed in backward, its gradients reduce-scattered) except when its gathers may
  start: forward gathers layer j once layer ``j - prefetch``'s input exists, backward
  gathers it again once the cotangent of layer ``j + prefetch``'s output exists
  (``lax.optimization_barrier``). XLA's scheduler may then run each gather beside the
  ``prefetch`` layers before it (on a GPU, an async all-gather beside their GEMMs; a ring
  schedule is a loop that runs alone, so pick ``algorithm="auto"`` or ``"native"`` there:
  docs/guide/overlap.md). ``prefetch=0`` is :func:`layer` applied layer by layer.

  Memory bound: at most ``prefetch + 1`` layers' gathers in flight at a time (one more
  layer per unit of ``prefetch``) and, in backward, one layer's unreduced gradient waiting
  for the next layer's recomputed forward, beside the blocks and the saved layer inputs
  (hpZ: and each layer's copy over ``secondary_axis``).

  Args:
    fn: ``fn(params, x) -> x``, the layer on whole parameters, or a sequence of such
      functions, one per layer.
    axis_name: the FSDP mesh axis (or tuple).
    prefetch: how many layers ahead a gather may start (an int, at least 0).
    secondary_axis, algorithm, wire_dtype, grad_wire_dtype, dtype: as :func:`gather`'s.
    rounding: as :func:`gather`'s; with "stochastic" each call takes ``key=`` (layer i
      rounds with ``jax.random.fold_in(key, i)``).

  Returns:
    ``layers(blocks, x, key=None)``: ``blocks`` a list or tuple of per-layer pytrees with
    :class:`Sharded` leaves; the last layer's output, differentiable in ``blocks`` (their
    gradients reduce-scattered back to blocks) and ``x``.

  Raises:
    ValueError, TypeError: a bad option, as :func:`gather` raises; ``prefetch`` not an int
      of at least 0; ``fn`` not a function or a sequence of them; at a call, ``blocks`` not a
      non-empty list or tuple, or not as long as ``fn``; a bad ``key``.

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np, jaxcoll
    >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("fsdp",))
    >>> params = [{"w": jnp.eye(3) * (i + 1)} for i in range(3)]
    >>> blocks = jaxcoll.fsdp.place(jaxcoll.fsdp.shard(params, 4), mesh, "fsdp")
    >>> stack = jaxcoll.fsdp.layers(lambda p, x: x @ p["w"], "fsdp", prefetch=1)
    >>> out = jax.shard_map(stack, mesh=mesh, in_specs=(jaxcoll.fsdp.specs(blocks, "fsdp"),
    ...                     jax.P()), out_specs=jax.P(), check_vma=False)(blocks, jnp.ones(3))
    >>> out
    Array([6., 6., 6.], dtype=float32)
  """
  options = check_options(algorithm, wire_dtype, grad_wire_dtype, dtype)
  prefetch = check_int(prefetch, "prefetch", least=0)
  fns = (fn,) if callable(fn) else tuple(fn) if isinstance(fn, (list, tuple)) else None
  if not fns or not all(callable(f) for f in fns):
    raise TypeError(f"layers: fn={fn!r}: expected a function fn(params, x), or a non-empty "
                    "sequence of them (one per layer)")
  if rounding != "stochastic":
    check_rounding(rounding, None)

  def call(blocks, x, key=None):
    if not isinstance(blocks, (list, tuple)) or not blocks:
      raise TypeError(f"layers: blocks of type {type(blocks).__name__}: expected a non-empty "
                      "list or tuple of per-layer parameter pytrees")
    if len(fns) > 1 and len(fns) != len(blocks):
      raise ValueError(f"layers: fn holds {len(fns)} functions and blocks {len(blocks)} "
                       "layers: expected one function per layer (or one function for all)")
    key = _check_rounding(rounding, key, blocks)
    keys = [None if key is None else jax.random.fold_in(key, i) for i in range(len(blocks))]
    run = _units(fns * len(blocks) if len(fns) == 1 else fns, axis_name, secondary_axis,
                 options, prefetch)
    return run(list(blocks), keys, x)
  return call
