"""How a reduction's bfloat16/float16 result is rounded: to nearest, or stochastically.

``rounding="stochastic"`` with ``key=`` (the reducing collectives, the gradient sync, the
optax transformation, the FSDP gradient reduce-scatter) rounds each combine, computed in
float32, to one of its two neighbours in the data's dtype with the probabilities that make
it unbiased (:func:`jaxcoll.kernels.stochastic_round`): the mean over keys of the result is
the float32 value, where round-to-nearest drops every contribution smaller than half a unit
in the last place of the running sum. Where partial sums travel in float32
(``accumulate_dtype``, a compressed wire, the lax collective) the one rounding at the end
is the stochastic one.

Which random bits a rounding uses is a pure function of the key, the leaf, the schedule's
step and the chunk combined (:func:`step_key`, :func:`chunk_key`), never of the device: both
partners of a symmetric exchange combine the same chunk with the same bits and get the same
value, so replicated results stay bit-identical; devices combining different chunks draw
different bits. A result that is not replicated (reduce_scatter, reduce) folds the device's
index into its final rounding, so shards of one gradient do not share their rounding noise.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxcoll._src.invariant import check_vma_enabled
from jaxcoll._src.ops import low_precision
from jaxcoll._src.wire.fused_combine import ROUNDINGS, stochastic_round

COPY = 2**31 - 1   # folded into the key of copies (phases fold in 0, 1, ...)


def is_key(key) -> bool:
  """Whether ``key`` is a ``jax.random`` key: typed (``jax.random.key``) or raw
  (``jax.random.PRNGKey``: uint32 of shape (2,))."""
  dtype = getattr(key, "dtype", None)
  if dtype is None:
    return False
  if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
    return jnp.ndim(key) == 0
  return np.dtype(dtype) == np.uint32 and tuple(np.shape(key)) == (2,)


def check(rounding, key, *, op: str | None = None, dtypes=None, where: str = "rounding"):
  """The key a call rounds with: None for ``rounding="nearest"``, ``key`` for "stochastic".

  Args:
    rounding: "nearest" or "stochastic".
    key: a ``jax.random`` key (only with "stochastic").
    op: the reduction; "max" and "min" select a value and round nothing.
    dtypes: the dtypes of the data (stochastic rounding needs a bfloat16/float16 one).
    where: the argument's name in errors.

  Raises:
    ValueError: an unknown ``rounding``; "stochastic" without a key, with "max"/"min", or
      on data without a bfloat16/float16 leaf; a key with "nearest".
    TypeError: a ``key`` that is not a ``jax.random`` key.
  """
  if not isinstance(rounding, str) or rounding not in ROUNDINGS:
    raise ValueError(f"{where}={rounding!r}: expected one of {ROUNDINGS}")
  if rounding == "nearest":
    if key is not None:
      raise ValueError(f"key= is for {where}='stochastic' ({where}={rounding!r} uses no key)")
    return None
  if key is None:
    raise ValueError(f"{where}='stochastic' needs key= (a jax.random key, the same on every "
                     "device)")
  if not is_key(key):
    raise TypeError(f"key={key!r}: expected a jax.random key (jax.random.key(seed) or "
                    "jax.random.PRNGKey(seed))")
  if op in ("max", "min"):
    raise ValueError(f"{where}='stochastic' rounds sums and products; op={op!r} selects a "
                     "value and rounds nothing")
  if dtypes is not None and not any(low_precision(d) for d in dtypes):
    names = sorted({np.dtype(d).name for d in dtypes})
    raise ValueError(f"{where}='stochastic' rounds bfloat16 and float16 results; the data "
                     f"has {', '.join(names) or 'no leaves'}")
  return key


def leaf_keys(key, dtypes) -> list:
  """One key per leaf: ``key`` folded with the leaf's index for bfloat16/float16 leaves,
  None for the others (rounded to nearest: exact in their own dtype's arithmetic)."""
  return [jax.random.fold_in(key, i) if rounds_stochastically(key is not None, d) else None
          for i, d in enumerate(dtypes)]


def rounds_stochastically(stochastic: bool, dtype) -> bool:
  """Whether a leaf of ``dtype`` in a reduction asked to round stochastically does: only
  bfloat16/float16 leaves (the others round to nearest). The one place it is decided, for
  a call (:func:`leaf_keys`) and for ``algorithm_of`` alike."""
  return stochastic and low_precision(dtype)


def round_to(y, dtype, key=None):
  """``y`` in ``dtype``: rounded to nearest (``astype``), or, with ``key`` and a
  bfloat16/float16 ``dtype``, stochastically from float32 with the key's bits. Gradients
  pass straight through (as of ``astype``)."""
  dtype = np.dtype(dtype)
  if key is None or not low_precision(dtype):
    return y.astype(dtype)
  y = y.astype(jnp.float32)
  return _stochastic(y, dtype, jax.random.bits(key, y.shape, jnp.uint32))


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def _stochastic(y, dtype, bits):
  return stochastic_round(y, dtype, bits)


@_stochastic.defjvp
def _stochastic_jvp(dtype, primals, tangents):
  (y, bits), (dy, _) = primals, tangents
  return _stochastic(y, dtype, bits), dy.astype(dtype)


def check_same_everywhere(key, axes: tuple[str, ...]) -> None:
  """Inside ``shard_map(check_vma=True)``: ValueError if ``key`` varies over ``axes`` (then
  devices would round one value differently and replicas would differ)."""
  if key is None or not check_vma_enabled(axes):
    return
  varying = set(axes) & set(jax.typeof(key).mat.varying)
  if varying:
    raise ValueError(f"key= varies over {sorted(varying)}: stochastic rounding needs the same "
                     "key on every device of the axis (pass it replicated, e.g. in_specs "
                     "P(), or fold in only what every device shares)")


def step_key(key, phase: int, t):
  """The key of step ``t`` of the schedule's phase ``phase``."""
  return jax.random.fold_in(jax.random.fold_in(key, phase), t)


def copy_key(key):
  """The key final values held in wider partial sums round with (:func:`round_rows`): one
  for every step, so a chunk rounds alike wherever and whenever it is sent or kept."""
  return jax.random.fold_in(key, COPY)


def round_rows(rows, dtype, key=None, ids=None):
  """Rows ``[R, L]`` in ``dtype``, each rounded with bits of its chunk id alone (``ids``,
  default ``0..R-1``; stochastically with ``key``): a chunk rounds to the same bits in a
  copy that carries it and where its final value stays."""
  if key is None or not low_precision(dtype):
    return rows.astype(dtype)
  ids = jnp.arange(rows.shape[0]) if ids is None else ids
  bits = jax.vmap(lambda i: jax.random.bits(jax.random.fold_in(key, i), rows.shape[1:],
                                            jnp.uint32))(ids)
  return _stochastic(rows.astype(jnp.float32), np.dtype(dtype), bits)


def chunk_key(key, first_chunk):
  """The key a combine of a step into the chunks starting at ``first_chunk`` rounds with."""
  return jax.random.fold_in(key, first_chunk)
