"""The fused reduce step: ``acc <- round(op(acc, decode(recv)) * scale)`` as one Pallas kernel.

One pass over memory: read a tile of the accumulator and of the received chunk
(decoding a compressed wire format on the way, :func:`jaxcoll._src.wire.formats.dequantize`),
combine in float32 for float16/bfloat16 data (the dtype itself otherwise),
scale, round to the output dtype (to nearest, or stochastically), and write the
tile back over the accumulator (``input_output_aliases``: in place when the
output dtype is the accumulator's). Any length: the data is viewed as rows of
a lane width that divides it (1024, 512, 256 or 128; else padded to 128, which
costs the in-place write), and the grid's last tile is partial (Pallas masks
it). Cost: 2 reads and 1 write of the chunk (plus 4 bytes a value of random
bits for stochastic rounding), so its bandwidth bound is 3 * bytes / HBM rate.

``interpret=None`` compiles the kernel where Pallas can (GPU, TPU) and runs it
in interpret mode elsewhere (CPU, the tests). The math is one function shared by
the kernel and :func:`fused_combine_reference` (plain jax.numpy), so the two
agree bit for bit. Gradients: a custom JVP through the reference, with
stochastic rounding passed straight through.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from jaxcoll._src import compat, ops
from jaxcoll._src import config as config_lib
from jaxcoll._src.wire.formats import dequantize, pow2, scales

ROUNDINGS = ("nearest", "stochastic")
KERNEL_OPS = ("sum", "prod", "min", "max", "mean")
LANES = (1024, 512, 256, 128)
TILE_VALUES = 1 << 16        # values per tile (256 KiB of float32)
COMPILED_BACKENDS = ("gpu", "cuda", "rocm", "tpu")
GPU_COMPILERS = ("triton", "mosaic_gpu")   # Pallas' GPU back ends (``compiler=``)


def gpu_compilers() -> tuple[str, ...]:
  """The Pallas GPU back ends ``fused_combine(compiler=...)`` can compile with under the
  installed jax: Triton always; Mosaic GPU where this jax's ``pallas_call`` lowers it
  (jax 0.10, with the kernel's tiles at most 256 wide; not jax 0.12).

  Returns:
    A tuple of names from ``("triton", "mosaic_gpu")``.

  Raises:
    Nothing.

  Example:
    >>> import jaxcoll
    >>> jaxcoll.kernels.gpu_compilers()[0]
    'triton'
  """
  return GPU_COMPILERS if compat.PALLAS_CALL_LOWERS_MOSAIC_GPU else GPU_COMPILERS[:1]


def backend_compiles() -> bool:
  """Whether Pallas compiles the kernel on the backend the program is for
  (:func:`compat.target_backend`; else: interpret mode)."""
  return compat.target_backend() in COMPILED_BACKENDS


def combines(dtype) -> bool:
  """Whether the kernel combines ``dtype`` (floating or integer data)."""
  return bool(jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer))


@dataclasses.dataclass(frozen=True)
class _Spec:
  op: str
  scale: float | None
  out_dtype: np.dtype
  work_dtype: np.dtype
  stochastic: bool
  interpret: bool
  compiler: str | None = None
  kernel: bool = True      # False: the jax.numpy reference (same math, same custom JVP)


def fused_combine(acc, recv, *, op: str = "sum", scale: float | None = None, out_dtype=None,
                  rounding: str = "nearest", key=None, recv_exponents=None,
                  interpret: bool | None = None, compiler: str | None = None):
  """``round(op(acc, decode(recv)) * scale)``, computed in one Pallas kernel.

  Args:
    acc: the accumulator (any shape; a float or integer dtype).
    recv: the received chunk, ``acc``'s shape; its dtype may differ (a wire dtype).
    op: "sum", "prod", "min", "max" ("mean" combines as "sum").
    scale: a Python float multiplied in after the combine (e.g. 1/N for a mean).
    out_dtype: the result's dtype; default ``acc.dtype`` (then the result is
      written in place of ``acc``, ``input_output_aliases={0: 0}``).
    rounding: "nearest" (round to nearest even, as ``astype``) or "stochastic"
      (to one of the two neighbours with probabilities that make it unbiased;
      needs ``key``; for bfloat16/float16 outputs of float32 work).
    key: a ``jax.random`` key for stochastic rounding; the same key gives the
      same bits.
    recv_exponents: int8 power-of-two exponents of a block-scaled ``recv``
      (``recv.shape[:-1] + (blocks,)``): value = recv * 2**e per block of
      ``recv.shape[-1] // blocks``; a format's codes for inf and NaN decode to them
      (:mod:`jaxcoll._src.wire.formats`).
    interpret: run Pallas' interpreter; None: only where the backend cannot
      compile the kernel (CPU).
    compiler: on a GPU, Pallas' back end: "triton" or "mosaic_gpu" (where this jax has
      it); None: Pallas' default. Only for a compiled kernel (an error in interpret mode).

  Returns:
    The new accumulator, ``acc``'s shape, dtype ``out_dtype``.

  Raises:
    ValueError: an ``op`` or ``rounding`` not taken, ``rounding="stochastic"`` without a
      ``key``, shapes that do not match, a ``compiler`` in interpret mode.

  Example:
    >>> import jax.numpy as jnp, jaxcoll
    >>> acc = jnp.ones((2, 128), jnp.bfloat16)
    >>> out = jaxcoll.kernels.fused_combine(acc, acc, out_dtype=jnp.bfloat16)
    >>> out.dtype, out[0, 0].item()
    (dtype(bfloat16), 2.0)
  """
  acc, recv = jnp.asarray(acc), jnp.asarray(recv)
  out_dtype = np.dtype(acc.dtype if out_dtype is None else out_dtype)
  spec = _check(acc, recv, op, scale, out_dtype, rounding, key, recv_exponents, interpret)
  if compiler is not None:
    if compiler not in GPU_COMPILERS:
      raise ValueError(f"compiler={compiler!r}: expected one of {GPU_COMPILERS} or None")
    if spec.interpret or compat.target_backend() != "gpu":
      raise ValueError(f"compiler={compiler!r} chooses a GPU back end; this kernel runs "
                       f"{'interpreted' if spec.interpret else 'on ' + compat.target_backend()}")
    if compiler == "mosaic_gpu" and not compat.PALLAS_CALL_LOWERS_MOSAIC_GPU:
      raise ValueError(f"compiler='mosaic_gpu': jax {compat.JAX_VERSION_TEXT}'s pallas_call has no "
                       "Mosaic GPU lowering; use 'triton' (the default on a GPU)")
    spec = dataclasses.replace(spec, compiler=compiler)
  shape = acc.shape
  lanes = [w for w in LANES if w <= _max_block(spec.compiler)]
  width = recv.shape[-1] // recv_exponents.shape[-1] if recv_exponents is not None else (
      next((w for w in lanes if acc.size % w == 0), lanes[-1]))
  as_rows = lambda x: _rows(x.reshape(-1), width)   # noqa: E731
  exps = None if recv_exponents is None else scales(recv_exponents.reshape(-1, 1))
  bits = None if key is None else jax.random.bits(key, (acc.size,), jnp.uint32)
  out = _fused(spec, as_rows(acc), as_rows(recv), exps, None if bits is None else as_rows(bits))
  return out.reshape(-1)[:acc.size].reshape(shape)


def fused_combine_reference(acc, recv, *, op: str = "sum", scale: float | None = None,
                            out_dtype=None, rounding: str = "nearest", key=None,
                            recv_exponents=None):
  """:func:`fused_combine` in plain jax.numpy (what XLA fuses by itself); the same bits.

  Args:
    acc, recv, op, scale, out_dtype, rounding, key, recv_exponents: as
      :func:`fused_combine`'s.

  Returns:
    The new accumulator, bit for bit :func:`fused_combine`'s.

  Raises:
    ValueError: as :func:`fused_combine` raises.

  Example:
    >>> import jax.numpy as jnp, jaxcoll
    >>> acc = jnp.full((1, 128), 3.0)
    >>> jaxcoll.kernels.fused_combine_reference(acc, acc, op="max")[0, :2]
    Array([3., 3.], dtype=float32)
  """
  acc, recv = jnp.asarray(acc), jnp.asarray(recv)
  out_dtype = np.dtype(acc.dtype if out_dtype is None else out_dtype)
  spec = _check(acc, recv, op, scale, out_dtype, rounding, key, recv_exponents, True)
  shape, exps = acc.shape, None
  if recv_exponents is not None:
    width = recv.shape[-1] // recv_exponents.shape[-1]
    acc, recv = acc.reshape(-1, width), recv.reshape(-1, width)
    exps = scales(recv_exponents.reshape(-1, 1))
  bits = None if key is None else jax.random.bits(key, (acc.size,), jnp.uint32)
  out = _fused(dataclasses.replace(spec, kernel=False), acc, recv, exps,
               None if bits is None else bits.reshape(acc.shape))
  return out.reshape(shape)


def _check(acc, recv, op, scale, out_dtype, rounding, key, exps, interpret) -> _Spec:
  if op not in KERNEL_OPS:
    raise ValueError(f"op={op!r}: expected one of {KERNEL_OPS}")
  if acc.shape != recv.shape:
    raise ValueError(f"recv.shape {recv.shape} must equal acc.shape {acc.shape}")
  for name, x in (("acc", acc), ("recv", recv)):
    if not combines(x.dtype):
      raise ValueError(f"{name} has dtype {x.dtype}; the kernel combines float or integer data")
  work = ops.compute_dtype(acc.dtype)
  if scale is not None and not jnp.issubdtype(work, jnp.floating):
    raise ValueError(f"scale={scale!r} applies to floating data; acc has dtype {acc.dtype}")
  if rounding not in ROUNDINGS:
    raise ValueError(f"rounding={rounding!r}: expected one of {ROUNDINGS}")
  stochastic = rounding == "stochastic"
  if stochastic:
    if key is None:
      raise ValueError("rounding='stochastic' needs key= (a jax.random key)")
    if not ops.low_precision(out_dtype) or work != np.float32:
      raise ValueError(f"rounding='stochastic' rounds float32 work to bfloat16 or float16; "
                       f"got acc {acc.dtype} -> out_dtype {out_dtype.name}")
  elif key is not None:
    raise ValueError("key= is for rounding='stochastic'")
  if exps is not None:
    if exps.dtype != jnp.int8 or exps.shape[:-1] != acc.shape[:-1] or exps.shape[-1] < 1 or (
        acc.shape[-1] % exps.shape[-1]):
      raise ValueError(f"recv_exponents must be int8 of shape {acc.shape[:-1]} + (blocks,), "
                       f"blocks dividing {acc.shape[-1:]}; got {exps.dtype}{exps.shape}")
  if interpret is None:
    interpret = not backend_compiles()
  return _Spec(op, None if scale is None else float(scale), out_dtype, work, stochastic,
               bool(interpret))


def _rows(flat, width: int):
  pad = -flat.shape[0] % width
  return (jnp.pad(flat, (0, pad)) if pad else flat).reshape(-1, width)


def stochastic_round(y, out_dtype, bits):
  """float32 ``y`` to ``out_dtype`` rounded up with probability (y - lo) / (hi - lo).

  lo and hi are y's neighbours in ``out_dtype``; ``bits`` uint32, 24 of them used,
  so the probability is exact for every y in the normal range (the fraction has
  at most 23 - mantissa bits). Magnitudes below 2**-119 round on the grid of
  2**-126 (still unbiased). inf and NaN pass through.

  Args:
    y: float32 values.
    out_dtype: bfloat16 or float16.
    bits: uint32 random bits of ``y``'s shape (``jax.random.bits``).

  Returns:
    ``y`` rounded to ``out_dtype``, unbiased: the mean over keys is ``y``.

  Raises:
    ValueError: ``y`` not float32, an ``out_dtype`` that is neither, ``bits`` of another
      shape or dtype.

  Example:
    >>> import jax, jax.numpy as jnp, jaxcoll
    >>> y = jnp.full((4096,), 1.0 + 2.0 ** -10)           # between two bfloat16 values
    >>> r = jaxcoll.kernels.stochastic_round(y, jnp.bfloat16,
    ...                                      jax.random.bits(jax.random.key(0), y.shape))
    >>> abs(float(r.astype(jnp.float32).mean()) - float(y[0])) < 2e-4
    True
  """
  if np.dtype(y.dtype) != np.float32:
    raise ValueError(f"stochastic_round: y has dtype {np.dtype(y.dtype).name}; expected float32")
  if not ops.low_precision(out_dtype):
    raise ValueError(f"out_dtype={out_dtype!r}: expected bfloat16 or float16")
  if tuple(bits.shape) != tuple(y.shape) or np.dtype(bits.dtype) != np.uint32:
    raise ValueError(f"bits: expected uint32 of y's shape {tuple(y.shape)}, got "
                     f"{np.dtype(bits.dtype).name}{list(bits.shape)}")
  info = ml_dtypes.finfo(out_dtype)
  mag = jnp.abs(y)
  exponent = (lax.bitcast_convert_type(mag, jnp.int32) >> 23) - 127
  k = jnp.maximum(jnp.maximum(exponent, int(info.minexp)) - int(info.nmant), -126)
  t = mag * pow2(-k)
  lo = jnp.floor(t)
  u = (bits >> 8).astype(jnp.float32) * np.float32(2.0 ** -24)
  r = (lo + (u < t - lo).astype(jnp.float32)) * pow2(k)
  return jnp.where(y < 0, -r, r).astype(out_dtype)


def _math(spec: _Spec, acc, recv, exps, bits, *, straight_through: bool = False):
  """The combine on 2-D tiles: shared by the kernel and the reference."""
  work = spec.work_dtype
  r = dequantize(recv, exps, work)   # exps: float32 scales (wire.scales), one per row
  y = ops.combine(jnp, spec.op, acc.astype(work), r.astype(work))
  if spec.scale is not None:
    y = y * jnp.asarray(spec.scale, work)
  if not spec.stochastic:
    return y.astype(spec.out_dtype)
  rounded = stochastic_round(y, spec.out_dtype, bits)
  if straight_through:
    return (y + lax.stop_gradient(rounded.astype(work) - y)).astype(spec.out_dtype)
  return rounded


def _kernel(spec: _Spec, has_exps: bool, has_bits: bool, *refs):
  acc_ref, recv_ref, *rest = refs
  exps = rest.pop(0)[...] if has_exps else None
  bits = rest.pop(0)[...] if has_bits else None
  (out_ref,) = rest
  out_ref[...] = _math(spec, acc_ref[...], recv_ref[...], exps, bits)


def _varying_type(*xs):
  """The manual-axis type shared by ``xs`` (inside shard_map: the union of their varying axes)."""
  mats = [jax.typeof(x).mat for x in xs]
  varying = frozenset().union(*(m.varying for m in mats))
  return mats[0].update(varying=varying)


def _max_block(compiler: str | None) -> int:
  """The longest block dimension a back end copies: Mosaic GPU's asynchronous copies move at
  most 256 elements along each dimension; Triton and Mosaic TPU take any."""
  return 256 if compiler == "mosaic_gpu" else 1 << 30


def _tile_values(compiler: str | None) -> int:
  """Values per tile: Mosaic GPU stages every operand's tile, double-buffered, in shared
  memory (at most 227 KiB on an H100/H200): 4096 float32 a tile keeps four operands in
  128 KiB."""
  return 1 << 12 if compiler == "mosaic_gpu" else TILE_VALUES


def _pallas(spec: _Spec, acc, recv, exps, bits):
  rows, width = acc.shape
  tile = min(max(_tile_values(spec.compiler) // width, 1),
             1 << max(rows - 1, 0).bit_length(), _max_block(spec.compiler))
  block = lambda w: pl.BlockSpec((tile, w), lambda i: (i, 0))   # noqa: E731
  operands = [x for x in (acc, recv, exps, bits) if x is not None]
  in_specs = [block(width), block(width)] + ([block(1)] if exps is not None else []) + (
      [block(width)] if bits is not None else [])
  out = jax.ShapeDtypeStruct(acc.shape, spec.out_dtype, manual_axis_type=_varying_type(*operands))
  call = pl.pallas_call(
      functools.partial(_kernel, spec, exps is not None, bits is not None),
      grid=(pl.cdiv(rows, tile),), in_specs=in_specs, out_specs=block(width), out_shape=out,
      input_output_aliases={0: 0} if spec.out_dtype == acc.dtype else {},
      interpret=spec.interpret, name="jaxcoll_fused_combine",
      compiler_params=_compiler_params(spec))
  return call(*operands)


def _compiler_params(spec: _Spec):
  """Pallas' compiler parameters that select ``spec.compiler``; None: Pallas' default, save
  for a kernel compiled for a GPU, where it is Triton (jax 0.10's default is Mosaic GPU,
  which lowers this kernel only in tiles of at most 256 and without stochastic rounding;
  jax 0.12's pallas_call has no Mosaic GPU lowering: tests/test_lowering.py)."""
  compiler = spec.compiler
  if compiler is None and not spec.interpret and compat.target_backend() == "gpu":
    compiler = "triton"
  if compiler == "triton":
    from jax.experimental.pallas import triton
    return triton.CompilerParams()
  if compiler == "mosaic_gpu":
    from jax.experimental.pallas import mosaic_gpu
    return mosaic_gpu.CompilerParams()
  return None


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _fused(spec: _Spec, acc, recv, exps, bits):
  """The kernel (or, ``spec.kernel`` False, the reference); gradients straight through the
  rounding (the JVP below), as of the combine computed exactly."""
  if spec.kernel and not _interpreter_cannot_type(spec, acc, recv, exps, bits):
    return _pallas(spec, acc, recv, exps, bits)
  return _math(spec, acc, recv, exps, bits)


def _interpreter_cannot_type(spec: _Spec, acc, recv, exps, bits) -> bool:
  """Whether Pallas' interpreter would fail jax's varying-axes check (inside shard_map,
  jax 0.10 and 0.12: an operation of a varying value with a constant in the kernel body) on
  the stochastic rounding's integer arithmetic or a scaled wire format's codes for inf and
  NaN: then the reference runs, the same math and the same bits. Compiled kernels (GPU,
  TPU) are unaffected; outside shard_map the interpreter runs them all."""
  if not spec.interpret or not (spec.stochastic or exps is not None):
    return False
  return bool(_varying_type(*(x for x in (acc, recv, exps, bits) if x is not None)).varying)


@_fused.defjvp
def _fused_jvp(spec, primals, tangents):
  acc, recv, exps, bits = primals
  differentiable = lambda a, r: _math(spec, a, r, exps, bits, straight_through=True)  # noqa: E731
  _, tangent = jax.jvp(differentiable, (acc, recv), tangents[:2])
  return _fused(spec, *primals), tangent


# ---- the setting: jaxcoll.config(fused_kernel=...) ----

FUSED_MIN_BYTES = 1 << 16   # "auto": smaller chunks stay in XLA's own fusion


def _fused_setting(value, name):
  if value not in (True, False, "auto"):
    raise ValueError(f"config({name}={value!r}): expected True, False or 'auto'")
  return value


config_lib.config_field("fused_kernel", default="auto", check=_fused_setting, built_in=True)


def use_fused_kernel(chunk_bytes: int, dtype) -> bool:
  """Whether a reduce step on chunks of ``chunk_bytes`` runs the Pallas kernel (see config)."""
  if not combines(dtype):
    return False
  setting = config_lib.current().fused_kernel
  if setting == "auto":
    return backend_compiles() and chunk_bytes >= FUSED_MIN_BYTES
  return bool(setting)
