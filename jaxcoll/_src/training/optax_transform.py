"""``jaxcoll.optax.sync``: gradient sync as an optax ``GradientTransformation``, with error
feedback for compressed wire formats.

Error feedback (EF-SGD; 1-bit Adam's worker error): each device adds the residual e it kept
to its gradient g, sends c = g + e compressed, and keeps e' = c - Q(c), where
Q(c) = decode(encode(c)) is the value its compressed message carries
(:meth:`jaxcoll.WireFormat.round_trip`; the residual :meth:`jaxcoll.WireFormat.error`, 0 where
c is not finite). What compression dropped in one step is sent in the
next, so the error does not accumulate in the parameters. The residuals differ from device
to device, so the state holds them under :class:`jaxcoll.PerDevice` (which
:func:`jaxcoll.data_parallel` keeps per device); the synced updates, and so the parameters,
stay bit-identical on every device. optax itself is optional: without it the
transformation is a NamedTuple with the same ``init`` and ``update``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxcoll._src.training.gradient_sync import (
  BUCKET_BYTES,
  FIRST_BUCKET_BYTES,
  check_options,
  sync_gradients,
)
from jaxcoll._src.training.per_device import PerDevice
from jaxcoll.extend import check_flag, compresses, wire_format

try:
  from optax import GradientTransformation
except ImportError:   # optax is optional
  class GradientTransformation(NamedTuple):
    init: Any
    update: Any


class SyncState(NamedTuple):
  """``residual``: a :class:`jaxcoll.PerDevice` of this device's error-feedback residuals
  (shaped like the parameters), or None without error feedback. ``key``: the
  ``jax.random`` key of the next step's stochastic rounding (the same on every device),
  or None."""

  residual: PerDevice | None
  key: Any = None


def sync(axis_name, *, op: str = "mean", wire_dtype=None, error_feedback: bool = True,
         bucket_bytes: int = BUCKET_BYTES, first_bucket_bytes: int = FIRST_BUCKET_BYTES,
         algorithm="auto", accumulate_dtype=None, rounding: str = "nearest",
         key=None) -> GradientTransformation:
  """Syncs the updates (gradients) over ``axis_name``: :func:`jaxcoll.sync_gradients` with
  these options. Chain it first: ``optax.chain(jaxcoll.optax.sync("data",
  wire_dtype="int8"), optax.adam(1e-3))``.

  With ``wire_dtype`` and ``error_feedback`` (the default), each floating leaf sends
  g + e and keeps e' = (g + e) - Q(g + e) (module docstring); integer leaves and leaves the
  format does not compress keep e = 0. Call ``update`` inside shard_map (or a step under
  :func:`jaxcoll.data_parallel`).

  Args:
    axis_name: the data-parallel mesh axis (or tuple).
    op, bucket_bytes, first_bucket_bytes, algorithm, accumulate_dtype: as
      :func:`jaxcoll.sync_gradients`'s.
    wire_dtype: compress the gradients on the wire (``jaxcoll.WIRE_DTYPES``).
    error_feedback: keep each device's compression error and send it with the next
      step's gradients (only with ``wire_dtype``).
    rounding, key: "stochastic" with a ``jax.random`` key: the state keeps the key and
      each ``update`` splits off the step's own (:func:`jaxcoll.sync_gradients`' rounding of
      bfloat16/float16 buckets); every device holds the same key, so replicas agree.

  Returns:
    An ``optax.GradientTransformation``; its state holds the residuals as a
    :class:`jaxcoll.PerDevice` leaf (one row per device outside shard_map).

  Raises:
    ValueError: a bad option, named; ``error_feedback=True`` is accepted without a
      ``wire_dtype`` (nothing to feed back: the state is empty). "stochastic" on updates
      without a bfloat16/float16 leaf, at ``update``.

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np, optax, jaxcoll
    >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("data",))
    >>> tx = optax.chain(jaxcoll.optax.sync("data", wire_dtype="int8"), optax.sgd(1.0))
    >>> def step(w, state, batch):
    ...   g = jax.grad(lambda w: jnp.sum(w * batch))(w)
    ...   updates, state = tx.update(g, state, w)
    ...   return optax.apply_updates(w, updates), state, {}
    >>> w, state, _ = jaxcoll.data_parallel(step, mesh)(jnp.zeros(2), tx.init(jnp.zeros(2)),
    ...                                                 jnp.ones((4, 2)))
    >>> w
    Array([-1., -1.], dtype=float32)
  """
  first_key = check_options(op, bucket_bytes, first_bucket_bytes, algorithm, wire_dtype,
                            accumulate_dtype, rounding, key)
  fmt = wire_format(wire_dtype, jnp.float32)
  feedback = check_flag(error_feedback, "error_feedback") and fmt is not None
  options = dict(op=op, bucket_bytes=bucket_bytes, first_bucket_bytes=first_bucket_bytes,
                 algorithm=algorithm, wire_dtype=wire_dtype, accumulate_dtype=accumulate_dtype)

  def init(params):
    residual = PerDevice(jax.tree.map(jnp.zeros_like, params)) if feedback else None
    return SyncState(residual, first_key)

  def synced(updates, state):
    """(the synced updates, the next key): this step rounds with a key split off the
    state's."""
    if state.key is None:
      return sync_gradients(updates, axis_name, **options), None
    next_key, step_key = jax.random.split(state.key)
    return sync_gradients(updates, axis_name, rounding="stochastic", key=step_key,
                          **options), next_key

  def update(updates, state, params=None):
    del params
    if not feedback:
      out, next_key = synced(updates, state)
      return out, SyncState(None, next_key)
    if state.residual is None or state.residual.stacked:
      raise ValueError("jaxcoll.optax.sync: state.residual must be this device's residuals "
                       "(PerDevice(stacked=False)); run update inside shard_map or "
                       "jaxcoll.data_parallel, which unstack them")

    def corrected(g, e):
      return g + e.astype(g.dtype) if compresses(wire_dtype, g.dtype, g.size) else g

    sent = jax.tree.map(corrected, updates, state.residual.value)
    residual = jax.tree.map(
        lambda c, e: fmt.error(c).astype(e.dtype)
        if compresses(wire_dtype, c.dtype, c.size) else e, sent, state.residual.value)
    out, next_key = synced(sent, state)
    return out, SyncState(PerDevice(residual), next_key)

  return GradientTransformation(init, update)
