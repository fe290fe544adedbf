"""Data-parallel gradient sync: :func:`sync_gradients` and :func:`sync_in_backward`.

Both reduce a pytree bucket by bucket (:mod:`buckets`): one ``jaxcoll.all_reduce`` per
bucket of leaves of one dtype, in reverse leaf order. ``sync_gradients`` runs after
backward; ``sync_in_backward`` is an identity on the parameters whose VJP reduces each
bucket's cotangents as soon as backward has produced them, so the reduction of the last
layers' gradients can run while backward still works on the first layers (DDP's autograd
hooks; Megatron's ``overlap_grad_reduce``).

Inside ``shard_map(check_vma=True)``, ``jax.grad`` with respect to parameters that are
invariant over the axis already sums their gradients (the transpose of jax's implicit
invariant-to-varying cast). :func:`sync_gradients` refuses such leaves (summing again would
be wrong); differentiate through :func:`sync_in_backward` instead, which takes the place of
that implicit sum, or run the step with ``check_vma=False`` (as :func:`data_parallel` does).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxcoll._src import compat
from jaxcoll._src.collectives import all_reduce
from jaxcoll._src.training import buckets
from jaxcoll.extend import (
  NATIVE,
  algorithm_of,
  check_algorithm,
  check_floating,
  check_int,
  check_op,
  check_rounding,
  check_vma_enabled,
  low_precision,
  make_varying,
  normalize_axes,
  wire_format,
)

BUCKET_BYTES = 25 * 2**20       # DDP's bucket_cap_mb=25
FIRST_BUCKET_BYTES = 2**20      # DDP's first bucket (1 MB), so the first reduce starts early
UNPACKED_LEAF_BYTES = 2**16     # a lax all-reduce's leaves this large (mean) are not packed


def _check_leaves(tree, axes, op: str, argument: str) -> list:
  """The leaves as arrays; errors name the leaf (its pytree path) and what was expected."""
  paths, out = jax.tree_util.tree_flatten_with_path(tree)[0], []
  vma = check_vma_enabled(axes)
  for path, leaf in paths:
    leaf = jnp.asarray(leaf)
    where = f"{argument}{jax.tree_util.keystr(path)}"
    try:
      check_op(op, leaf.dtype)
    except ValueError as e:
      raise ValueError(f"{where} (dtype {leaf.dtype}): {e}") from None
    if vma and not set(axes) <= set(jax.typeof(leaf).mat.varying):
      raise ValueError(
          f"{where} is already invariant over {axes}: inside shard_map(check_vma=True) jax "
          "sums the gradients of replicated parameters itself, so syncing them again would "
          "count them twice. Differentiate through jaxcoll.sync_in_backward(params, "
          f"{axes[0] if len(axes) == 1 else axes!r}) instead, or use check_vma=False")
    out.append(leaf)
  return out


def check_options(op: str, bucket_bytes, first_bucket_bytes, algorithm, wire_dtype,
                  accumulate_dtype, rounding="nearest", key=None, dtypes=None):
  """The sync options, checked before anything is traced (each error names its argument):
  what :func:`sync_gradients`, :func:`sync_in_backward` and ``jaxcoll.optax.sync`` take.
  Returns the key stochastic rounding uses (None to nearest); ``dtypes``: the leaves' (one
  must be bfloat16/float16 for stochastic rounding), None where not known yet."""
  key = check_rounding(rounding, key, op=op, dtypes=dtypes)
  check_op(op, np.float32)
  check_int(bucket_bytes, "bucket_bytes", least=1)
  check_int(first_bucket_bytes, "first_bucket_bytes", least=1)
  check_algorithm("all_reduce", algorithm)
  wire_format(wire_dtype, np.float32, op=op)   # a known format, never on a max or a min
  check_floating(accumulate_dtype, "accumulate_dtype")   # narrowing: per bucket, all_reduce
  return key


def _reduce_bucket(bucket: buckets.Bucket, leaves, out, axis_name, op, algorithm,
                   accumulate_dtype, key=None, previous=None):
  """One all_reduce of the bucket's leaves packed in one buffer; where that all_reduce is
  the lax collective, the job is one process and the leaves are large (at least
  ``UNPACKED_LEAF_BYTES`` on average), the leaves go to it as they are: XLA combines them
  into one all-reduce itself, and packing would copy every byte twice (8 CPU devices, 36
  leaves of 1 MiB: 54 ms unpacked, 201 ms packed; 200 leaves averaging 25 KiB: 65 ms
  unpacked, 40 ms packed). Across processes the leaves go as they are where the runtime
  reduces a combined all-reduce's operands together (jax 0.12: 200 leaves in 29 ms, packed
  33 ms), and packed where it runs one gloo call per operand (0.10.2: 1.09 s against 61 ms
  for one bucket; ``compat.GLOO_REDUCES_OPERANDS_TOGETHER``).
  ``key``: a bfloat16/float16 bucket rounds stochastically with it (others to nearest).
  The bucket travels on its own wire (``bucket.wire``: :func:`buckets.assign` put only
  leaves a compressed wire gains on in a compressed bucket).

  A bucket whose all_reduce is the lax collective starts after ``previous`` (the values the
  bucket before it returned, if that was the lax collective too), as DDP's buckets do: XLA
  would combine the independent all-reduces of all buckets into one that waits for the last
  gradient (measured, 8 ranks on 2 processes, 16 MiB MLP in two buckets: the sync took
  87-94 ms of the step in order, 122-151 ms combined; jax 0.10.2's XLA combines them
  regardless, ``compat.BARRIERS_ORDER_COLLECTIVES``). Returns the bucket's synced values
  where they came from the lax collective, else None."""
  floating = jnp.issubdtype(bucket.dtype, jnp.floating)
  options = dict(op=op, accumulate_dtype=accumulate_dtype if floating else None,
                 wire_dtype=bucket.wire)
  if key is not None and low_precision(bucket.dtype):
    options.update(rounding="stochastic", key=key)
  packed = jax.ShapeDtypeStruct((sum(bucket.sizes),), bucket.dtype)
  native = algorithm_of("all_reduce", packed, axis_name, algorithm=algorithm,
                        **{k: v for k, v in options.items() if k != "key"}) == NATIVE
  if native and previous is not None:
    members, _ = jax.lax.optimization_barrier(([leaves[i] for i in bucket.leaves], previous))
    leaves = list(leaves)
    for i, member in zip(bucket.leaves, members):
      leaves[i] = member
  large = bucket.nbytes >= UNPACKED_LEAF_BYTES * len(bucket.leaves)
  together = large if jax.process_count() == 1 else compat.GLOO_REDUCES_OPERANDS_TOGETHER
  if native and together:
    synced = all_reduce([leaves[i] for i in bucket.leaves], axis_name, algorithm=NATIVE,
                        **options)
    for i, value in zip(bucket.leaves, synced):
      out[i] = value
  else:
    synced = all_reduce(buckets.pack(bucket, leaves), axis_name, algorithm=algorithm,
                        **options)
    buckets.unpack(bucket, synced, out)
  return [out[i] for i in bucket.leaves] if native else None


def sync_gradients(grads, axis_name, *, op: str = "mean", bucket_bytes: int = BUCKET_BYTES,
                   first_bucket_bytes: int = FIRST_BUCKET_BYTES, algorithm="auto",
                   wire_dtype=None, accumulate_dtype=None, rounding: str = "nearest",
                   key=None):
  """All-reduces a gradient pytree over ``axis_name``, bucket by bucket (inside shard_map).

  Equal to ``jax.tree.map(lambda g: lax.pmean(g, axis_name), grads)`` (``op="sum"``:
  psum) within reduction-order tolerance, with the same structure, shapes and dtypes
  (integer leaves averaged come back float32, as from pmean). Leaves are grouped by dtype
  and packed, last leaf first, into buckets of about ``bucket_bytes`` (the first of each
  dtype ``first_bucket_bytes``); each bucket is one ``jaxcoll.all_reduce``. Cost: per
  bucket of B bytes, the all_reduce's (ring: 2(N-1) steps, 2(N-1)/N B bytes per device);
  buckets instead of leaves cut the per-collective cost (alpha) from once per leaf to once
  per bucket.

  Args:
    grads: any pytree of arrays (dicts, lists, registered dataclasses, optax states);
      zero-size and scalar leaves included.
    axis_name: the data-parallel mesh axis (or tuple) of the enclosing shard_map.
    op: "mean" (gradients of per-device mean losses) or "sum"; "max", "min" and "prod"
      are allowed too.
    bucket_bytes, first_bucket_bytes: bucket sizes (DDP: 25 MiB and 1 MiB).
    algorithm: the all_reduce algorithm (``jaxcoll.algorithms("all_reduce")`` or "auto").
    wire_dtype: compress floating buckets on the wire (``jaxcoll.WIRE_DTYPES``): each leaf
      on blocks of its own, so that a block's scale follows one leaf; a single value (a
      loss) and a leaf too small to gain from it (int8, blocks of 256: up to 64 values)
      travel uncompressed, as do integers. A max or a min is never compressed: an error.
    accumulate_dtype: e.g. "float32" for bfloat16 gradients (Megatron's
      ``grad_reduce_in_fp32``); applies to floating buckets.
    rounding, key: "stochastic" with a ``jax.random`` key (the same on every device, a new
      one each step): bfloat16/float16 buckets round each combine stochastically
      (:func:`jaxcoll.all_reduce`), each bucket with its own bits; other buckets as lax.

  Returns:
    ``grads`` synced: the same pytree, shapes and dtypes, every leaf the ``op`` over the
    axis (typed as the leaf was: invariant stays invariant).

  Raises:
    ValueError: a bad option (each named; "stochastic" without a key or without a
      bfloat16/float16 leaf; a ``wire_dtype`` with op "max"/"min"), a leaf already
      invariant inside ``shard_map(check_vma=True)`` (jax summed it already), a non-array
      leaf.

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np, jaxcoll
    >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("data",))
    >>> f = jax.shard_map(lambda g: jaxcoll.sync_gradients({"w": g}, "data"),
    ...                   mesh=mesh, in_specs=jax.P("data"), out_specs=jax.P(),
    ...                   check_vma=False)
    >>> f(jnp.arange(8.0))["w"]
    Array([3., 4.], dtype=float32)
  """
  axes = normalize_axes(axis_name)
  leaves = _check_leaves(grads, axes, op, "grads")
  key = check_options(op, bucket_bytes, first_bucket_bytes, algorithm, wire_dtype,
                      accumulate_dtype, rounding, key, [x.dtype for x in leaves])
  out, previous = list(leaves), None
  wire = wire_format(wire_dtype, np.float32)
  for i, bucket in enumerate(buckets.assign(leaves, bucket_bytes, first_bucket_bytes, wire)):
    previous = _reduce_bucket(bucket, leaves, out, axis_name, op, algorithm, accumulate_dtype,
                              None if key is None else jax.random.fold_in(key, i), previous)
  return jax.tree.unflatten(jax.tree.structure(grads), out)


def sync_in_backward(params, axis_name, *, op: str = "mean", bucket_bytes: int = BUCKET_BYTES,
                     first_bucket_bytes: int = FIRST_BUCKET_BYTES, algorithm="auto",
                     wire_dtype=None, accumulate_dtype=None, rounding: str = "nearest",
                     key=None):
  """The identity on ``params`` whose VJP syncs the cotangents bucket by bucket.

  ``loss = loss_fn(jaxcoll.sync_in_backward(params, "data"), batch)``: then ``jax.grad``
  of the loss returns gradients synced as by :func:`sync_gradients` (same options), each
  bucket's all_reduce issued as soon as backward has produced that bucket's cotangents,
  not after the whole backward pass. Inside ``shard_map(check_vma=True)`` the parameters
  leave typed varying (so jax adds no sum of its own) and their gradients come back with
  the parameters' own typing (invariant for replicated parameters).

  Args:
    params: the parameter pytree (replicated over ``axis_name``).
    axis_name: the data-parallel mesh axis (or tuple) of the enclosing shard_map.
    op, bucket_bytes, first_bucket_bytes, algorithm, wire_dtype, accumulate_dtype: as
      :func:`sync_gradients`'s.
    rounding, key: as :func:`sync_gradients`'s (the key rounds the cotangents' buckets).

  Returns:
    ``params`` unchanged in value; gradients taken through it arrive synced.

  Raises:
    ValueError: a bad option, named, as :func:`sync_gradients` raises.

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np, jaxcoll
    >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("data",))
    >>> def grads(w, x):
    ...   loss = lambda w: jnp.sum(jaxcoll.sync_in_backward(w, "data") * x)
    ...   return jax.grad(loss)(w)
    >>> f = jax.shard_map(grads, mesh=mesh, in_specs=(jax.P(), jax.P("data")),
    ...                   out_specs=jax.P())
    >>> f(jnp.ones(2), jnp.arange(8.0))
    Array([3., 4.], dtype=float32)
  """
  axes = normalize_axes(axis_name)
  leaves = [jnp.asarray(x) for x in jax.tree.leaves(params)]
  key = check_options(op, bucket_bytes, first_bucket_bytes, algorithm, wire_dtype,
                      accumulate_dtype, rounding, key,
                      [x.dtype for x in leaves if jnp.issubdtype(x.dtype, jnp.inexact)])
  options = (("op", op), ("algorithm", algorithm), ("wire_dtype", wire_dtype),
             ("accumulate_dtype", None if accumulate_dtype is None
              else np.dtype(accumulate_dtype).name))
  for leaf in leaves:
    check_op(op, leaf.dtype)
  out = list(leaves)
  # only inexact leaves have cotangents (integers get float0 ones, nothing to sync)
  inexact = [x if jnp.issubdtype(x.dtype, jnp.inexact) else jnp.zeros((0,), x.dtype)
             for x in leaves]
  wire = wire_format(wire_dtype, np.float32)
  for number, bucket in enumerate(buckets.assign(inexact, bucket_bytes, first_bucket_bytes,
                                                 wire)):
    if not jnp.issubdtype(bucket.dtype, jnp.inexact):
      continue
    members = tuple(leaves[i] for i in bucket.leaves)
    varying = tuple(bool(set(axes) <= set(jax.typeof(x).mat.varying)) for x in members)
    bucket_key = None if key is None else jax.random.fold_in(key, number)
    synced = _synced_identity(members, bucket_key, axis_name, options, varying)
    for i, value in zip(bucket.leaves, synced):
      out[i] = value
  return jax.tree.unflatten(jax.tree.structure(params), out)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _synced_identity(xs, key, axis_name, options, varying):
  """The identity on the bucket's leaves ``xs``; VJP: their cotangents synced (rounded with
  ``key`` where it is not None)."""
  axes = normalize_axes(axis_name)
  return tuple(make_varying(x, axes) if check_vma_enabled(axes) else x for x in xs)


def _synced_identity_fwd(xs, key, axis_name, options, varying):
  return _synced_identity(xs, key, axis_name, options, varying), key


def _synced_identity_bwd(axis_name, options, varying, key, cts):
  axes = normalize_axes(axis_name)
  cts = list(cts)
  out = list(cts)
  opts = dict(options)
  wire = wire_format(opts["wire_dtype"], np.float32)
  (bucket,) = buckets.assign(cts, 2**62, wire=wire)   # the one bucket these leaves form
  _reduce_bucket(bucket, cts, out, axis_name, opts["op"], opts["algorithm"],
                 opts["accumulate_dtype"], key)
  return (tuple(make_varying(o, axes) if v else o for o, v in zip(out, varying)), None)


_synced_identity.defvjp(_synced_identity_fwd, _synced_identity_bwd)
