"""Compressed wire formats: what a message looks like between two devices.

A :class:`WireFormat` encodes a float32 message of rows ``[k, L]`` into fewer
bytes and decodes it back to float32:

- ``bfloat16``: each value rounded to nearest bfloat16 (float32's exponent
  range, so no scale). 2 bytes a value.
- ``int8``, ``float8_e4m3fn``, ``float8_e5m2``: block floating point. Each
  block of ``block_size`` consecutive values of a row shares one power-of-two
  scale ``2**e``, stored as one int8 exponent (the E8M0 scale of the OCP
  Microscaling formats): ``e`` is the smallest exponent with
  ``max|finite values of the block| <= fmax * 2**e`` (fmax = 126, 416, 57344),
  values are scaled by ``2**-e`` (exact) and rounded to nearest in the element
  type. About 1 byte a value (1 + 1/block_size).

Why power-of-two scales: scaling by them is exact, so q = decode(encode(x)) is a
fixed point, decode(encode(q)) == q bit for bit. A device that forwards a value
it received (a ring's all-gather phase) re-encodes it to the same value, and a
sender that keeps ``decode(encode(x))`` in place of what it sent (the executor
does) holds exactly what its receivers hold. That keeps the
replicas of an all-reduce bit-identical for every schedule. The price is at most
one bit of resolution against a float scale.

Error of one encode/decode of a finite value in a block whose largest finite magnitude is
A (:attr:`WireFormat.relative_error` is the factor eps in ``|error| <= eps * A``):
bfloat16 2**-8 (relative to the value itself, so also to A), int8 1/126
(the step is 2**e < 2A/126, half a step at most), float8_e4m3fn 2**-4 + 2**-17,
float8_e5m2 2**-3 + 2**-31 (relative rounding, plus half the smallest
subnormal times the scale).

Non-finite values arrive as they were sent, as lax's collectives deliver them: an inf
with its sign, a NaN as NaN, and the finite values of the same block as if the inf or NaN
were not there (the scale comes from the finite values alone). bfloat16 and float8_e5m2
hold inf and NaN themselves; the other two reserve codes no finite value takes: int8
sends finite values in [-126, 126] and +inf as 127, -inf as -127, NaN as -128;
float8_e4m3fn sends finite values in [-416, 416] and +-inf as +-448 (its NaN is its own).
So a reduction over a compressed wire overflows, cancels (inf - inf = NaN) and propagates
NaN exactly where the uncompressed one does, and loss-scaling code that tells an overflow
(inf) from a NaN reads the same answer.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax

from jaxcoll._src import checks
from jaxcoll._src.declarations import Declarations

DEFAULT_BLOCK_SIZE = 256
MIN_EXPONENT = -126  # scales stay normal float32 numbers


@dataclasses.dataclass(frozen=True)
class Element:
  """How one wire dtype carries float32 values: a format is this one declaration
  (:func:`register_wire_format`); encoding, decoding, the fused kernel's decode, the cost
  model's bytes and every error read it.

  Attributes:
    name: the element dtype's name, as numpy or ml_dtypes knows it.
    relative_error: eps: one encode/decode errs by at most eps times the largest finite
      magnitude of the block (module docstring).
    finite_max: block-scaled formats: the largest magnitude a scaled value may take (the
      block's scale 2**e makes its largest finite value fit); None: each value rounded as it
      is, no scale (the dtype must hold float32's exponent range, as bfloat16 does).
    specials: the codes of +inf, -inf and NaN, outside ``[-finite_max, finite_max]``; None
      where the dtype's own inf and NaN carry them.
    integer: scaled values are rounded to integers before the cast (an integer dtype).
  """

  name: str
  relative_error: float
  finite_max: float | None = None
  specials: tuple[float, float, float] | None = None
  integer: bool = False

  @property
  def codes(self) -> tuple[float, float, float]:
    """What +inf, -inf and NaN are sent as."""
    return self.specials or (math.inf, -math.inf, math.nan)


ELEMENTS: Declarations = Declarations("wire format")


def register_wire_format(element: Element, *, built_in: bool = False) -> Element:
  """Declares a wire format: from then on every collective, integration and tool takes
  ``wire_dtype=element.name`` (:func:`wire_dtypes` lists it).

  Args:
    element: the declaration (:class:`Element`, ``jaxcoll.extend.WireElement``).
    built_in: jaxcoll's own (never removed).

  Returns:
    ``element``.

  Raises:
    ValueError: a name numpy and ml_dtypes do not know, or one already declared; a
      ``finite_max`` the dtype cannot hold; an unscaled format of an integer dtype.

  Example:
    >>> import jaxcoll
    >>> from jaxcoll.extend import WireElement, register_wire_format, unregister_wire_format
    >>> fp16 = register_wire_format(WireElement("float16", 2.0 ** -11, finite_max=32768.0))
    >>> jaxcoll.WireFormat("float16").bytes_per_value
    2.00390625
    >>> unregister_wire_format("float16")
  """
  dtype = np.dtype(getattr(ml_dtypes, element.name, element.name))
  if element.finite_max is None and (element.integer or not jnp.issubdtype(dtype, jnp.floating)):
    raise ValueError(f"wire format {element.name!r}: an integer dtype needs a finite_max "
                     "(block scaling)")
  if element.finite_max is not None:
    top = np.iinfo(dtype).max if element.integer else float(ml_dtypes.finfo(dtype).max)
    if not 0 < element.finite_max <= top:
      raise ValueError(f"wire format {element.name!r}: finite_max={element.finite_max} "
                       f"must be in (0, {top}]")
  return ELEMENTS.add(element.name, element, built_in=built_in)


def unregister_wire_format(name: str) -> None:
  """Removes a format :func:`register_wire_format` declared (not a built-in one)."""
  ELEMENTS.remove(name)


def wire_dtypes() -> tuple[str, ...]:
  """Every declared wire format's name: the built-in :data:`WIRE_DTYPES` and those
  registered since (:func:`jaxcoll.extend.register_wire_format`).

  Returns:
    The names ``wire_dtype=`` takes, built-in first.

  Raises:
    Nothing.

  Example:
    >>> import jaxcoll
    >>> jaxcoll.wire_dtypes()[:4]
    ('bfloat16', 'float8_e4m3fn', 'float8_e5m2', 'int8')
  """
  return tuple(ELEMENTS)


for _element in (
    Element("bfloat16", 2.0 ** -8),
    Element("float8_e4m3fn", 2.0 ** -4 + 2.0 ** -17, 416.0, (448.0, -448.0, math.nan)),
    Element("float8_e5m2", 2.0 ** -3 + 2.0 ** -31, 57344.0),
    Element("int8", 1 / 126, 126.0, (127.0, -127.0, -128.0), integer=True)):
  register_wire_format(_element, built_in=True)
WIRE_DTYPES = wire_dtypes()   # the built-in formats


@dataclasses.dataclass(frozen=True)
class WireFormat:
  """A wire format: element dtype name and, for scaled formats, the block size.

  It owns the encoding: :meth:`encode` and :meth:`decode`. The decode arithmetic itself is
  :func:`dequantize`, which the fused combine kernel also runs on its tiles, so every
  receiver gets the same bits.

  Attributes:
    name: one of ``WIRE_DTYPES``.
    block_size: values per shared exponent (a power of two; scaled formats).
  """

  name: str
  block_size: int = DEFAULT_BLOCK_SIZE

  def __post_init__(self):
    if self.name not in ELEMENTS:
      raise ValueError(f"wire_dtype={self.name!r}: expected one of {wire_dtypes()} "
                       "(or the input's own dtype, which sends it uncompressed)")
    b = checks.integer(self.block_size, "wire_block_size", least=1)
    if b & (b - 1):
      raise ValueError(f"wire_block_size={b!r} must be a positive power of two")

  @property
  def element(self) -> Element:
    return ELEMENTS[self.name]

  @property
  def dtype(self) -> np.dtype:
    return np.dtype(getattr(ml_dtypes, self.name, self.name))

  @property
  def scaled(self) -> bool:
    return self.element.finite_max is not None

  @property
  def bytes_per_value(self) -> float:
    """Wire bytes per value, the shared exponents included."""
    return self.dtype.itemsize + (1 / self.block_size if self.scaled else 0.0)

  def padded(self, size: int) -> int:
    """Values a leaf of ``size`` takes in a packed buffer: whole blocks of its own (a block's
    scale follows only that leaf's values), ``size`` for an unscaled format."""
    return -(-size // self.block_size) * self.block_size if self.scaled else size

  def wire_bytes(self, size: int) -> float:
    """Bytes a leaf of ``size`` values takes on the wire, packed on blocks of its own."""
    return self.padded(size) * self.bytes_per_value

  def ratio(self, dtype) -> float:
    """Wire bytes per byte of ``dtype`` data: the factor on ``Schedule.bytes_per_rank``."""
    return self.bytes_per_value / np.dtype(dtype).itemsize

  @property
  def relative_error(self) -> float:
    """eps: one encode/decode errs by at most eps * (largest magnitude in the block)."""
    return self.element.relative_error

  def block_length(self, row_length: int) -> int:
    """Values per exponent in rows of ``row_length``: block_size, or the next power of two
    of a shorter row (so short messages are not padded to a whole block)."""
    return min(self.block_size, 1 << max(row_length - 1, 0).bit_length())

  def row_multiple(self, row_length: int) -> int:
    """Rows must be a multiple of this long (1 for bfloat16)."""
    return self.block_length(row_length) if self.scaled else 1

  def round_trip(self, x):
    """decode(encode(x)) in x's shape and dtype: the value one send of x delivers, with
    blocks of ``block_size`` consecutive values of the flattened x (the last one padded).
    :meth:`error` is the local compression error that error feedback keeps."""
    flat = jnp.ravel(x).astype(jnp.float32)
    b = self.block_length(flat.size) if self.scaled else 1
    rows = jnp.pad(flat, (0, -flat.size % b))[None]
    out = self.decode(*self.encode(rows))[0, :flat.size]
    return out.reshape(jnp.shape(x)).astype(x.dtype)

  def error(self, x):
    """``x - round_trip(x)``: what one send of x loses, which error feedback sends next
    time; 0 where x is not finite (an inf or NaN arrives as it is: nothing to feed back,
    and a NaN residual would poison every later step)."""
    err = x - self.round_trip(x)
    return jnp.where(jnp.isfinite(x), err, jnp.zeros_like(err))

  def encode(self, rows):
    """float32 rows ``[k, L]`` -> (values ``[k, L]`` in ``self.dtype``, int8 exponents
    ``[k, L/B]`` or None). L must be a multiple of ``self.row_multiple(L)``."""
    rows = rows.astype(jnp.float32)
    if not self.scaled:
      return rows.astype(self.dtype), None
    k, length = rows.shape
    b = self.block_length(length)
    blocks = rows.reshape(k, length // b, b)
    fmax = self.element.finite_max
    finite = jnp.isfinite(blocks)
    e = _exponents(jnp.max(jnp.where(finite, jnp.abs(blocks), 0.0), axis=-1, keepdims=True),
                   fmax)
    scaled = jnp.clip(blocks * pow2(-e), -fmax, fmax)
    if self.element.integer:
      scaled = jnp.round(scaled)
    pos_inf, neg_inf, nan = self.element.codes
    special = jnp.where(jnp.isnan(blocks), nan, jnp.where(blocks > 0, pos_inf, neg_inf))
    values = jnp.where(finite, scaled, special).astype(self.dtype)
    return values.reshape(k, length), e[..., 0].astype(jnp.int8)

  def decode(self, values, exponents):
    """The float32 rows :meth:`encode` encoded (what every receiver computes, bit for bit):
    each block of values times its scale, by :func:`dequantize` (as the fused combine
    kernel decodes)."""
    if exponents is None:
      return dequantize(values, None)
    k, length = values.shape
    blocks = values.reshape(k, exponents.shape[-1], -1)
    return dequantize(blocks, scales(exponents)[..., None]).reshape(k, length)


def wire_name(wire_dtype, where: str = "wire_dtype") -> str:
  """The name of ``wire_dtype`` (a :class:`WireFormat`, a name, a dtype or a scalar type);
  ValueError naming ``where`` unless numpy or ml_dtypes knows it."""
  if isinstance(wire_dtype, WireFormat):
    return wire_dtype.name
  try:
    return checks.dtype(wire_dtype, where).name
  except TypeError:
    return _unknown(wire_dtype, where)


def _unknown(wire_dtype, where: str):
  raise ValueError(f"{where}={wire_dtype!r}: expected one of {wire_dtypes()}, None or x's own "
                   "dtype (sent uncompressed)")


def wire_format(wire_dtype, dtype, block_size: int = DEFAULT_BLOCK_SIZE, *,
                where: str = "wire_dtype", op: str | None = None) -> WireFormat | None:
  """The format for ``wire_dtype`` on ``dtype`` data; None where it sends ``dtype`` unchanged
  (None, or ``dtype`` itself). ``wire_dtype`` is a name, a dtype, or a :class:`WireFormat`
  (which brings its own block size: a different ``block_size`` conflicts with it). The one
  place a wire format argument is read: errors name ``where``. ``op``: the reduction the
  data goes to; a max or a min is never rounded (it selects one device's value, and a
  rounded one matches none), so a format that changes the data is a ValueError there."""
  if wire_dtype is None:
    return None
  if isinstance(wire_dtype, WireFormat):
    if block_size not in (DEFAULT_BLOCK_SIZE, wire_dtype.block_size):
      raise ValueError(f"{where}={wire_dtype!r} has block size {wire_dtype.block_size}; "
                       f"wire_block_size={block_size} conflicts with it")
    block_size = wire_dtype.block_size
  name = wire_name(wire_dtype, where)
  dtype = np.dtype(dtype)
  if name == dtype.name:
    return None
  if name not in ELEMENTS:
    _unknown(wire_dtype, where)
  fmt = WireFormat(name, block_size)
  if not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError(f"{where}={name!r} compresses floating data; x has dtype {dtype.name}")
  if not fmt.scaled and dtype.itemsize <= fmt.dtype.itemsize:
    raise ValueError(f"{where}={name!r} is not smaller than x's dtype {dtype.name}")
  if op in ("max", "min"):
    raise ValueError(f"{where}={name!r} with op={op!r}: a {op} selects one device's value, "
                     f"and a rounded one matches none (nor what lax.p{op} gives); a max or a "
                     f"min travels exact: pass {where}=None")
  return fmt


def compresses(wire_dtype, dtype, size: int | None = None) -> bool:
  """Whether ``wire_dtype`` compresses ``dtype`` data: floating data wider than an unscaled
  format (bfloat16), any floating data for a block-scaled one. Integers never compress.

  Given ``size``, whether a leaf of that many values, packed with others (a gradient
  bucket), travels compressed: a leaf lies on blocks of its own (:meth:`WireFormat.padded`),
  so it does where that is smaller than its own bytes, and never as a single value (a loss,
  a metric: one value gains nothing, and the number a user logs would read rounded). With
  int8 and blocks of 256, a leaf of more than 64 values; with bfloat16, of 2 or more."""
  if wire_dtype is None or not jnp.issubdtype(dtype, jnp.floating):
    return False
  name = wire_name(wire_dtype)
  if name not in ELEMENTS:
    _unknown(wire_dtype, "wire_dtype")
  fmt = wire_dtype if isinstance(wire_dtype, WireFormat) else WireFormat(name)
  if not (fmt.scaled or np.dtype(dtype).itemsize > fmt.dtype.itemsize):
    return False
  return size is None or (size > 1 and fmt.wire_bytes(size) < size * np.dtype(dtype).itemsize)


def pow2(e):
  """2.0**e as float32 for int32 e in [-126, 127], exactly (built from the exponent bits)."""
  return lax.bitcast_convert_type((e + 127) << 23, jnp.float32)


def _exponents(amax, fmax: float):
  """Smallest e >= MIN_EXPONENT with amax <= fmax * 2**e (amax finite, >= 0)."""
  biased = lax.bitcast_convert_type(amax, jnp.int32) >> 23    # amax >= 0: no sign bit
  e = jnp.maximum(biased - 127 - math.floor(math.log2(fmax)), MIN_EXPONENT)
  return jnp.where(amax * pow2(-e) > fmax, e + 1, e)


def scales(exponents):
  """float32 ``2**e`` of int8 exponents."""
  return pow2(exponents.astype(jnp.int32))


def dequantize(values, block_scales, dtype=jnp.float32):
  """``values`` as ``dtype`` times their block's scale: the one copy of the decode math.

  ``block_scales`` (float32 ``2**e`` from :func:`scales`) broadcasts against ``values``:
  ``[..., 1]`` against blocks ``[..., B]``; None for an unscaled format (the cast alone).
  The codes a scaled format keeps for +inf, -inf and NaN decode to them (module
  docstring). Casts, products and selects only, so it runs alike on jax arrays
  (:meth:`WireFormat.decode`) and on tiles loaded in the body of the Pallas fused combine
  kernel, which decodes in its work dtype (float32 for float data up to 32 bits).
  """
  element = ELEMENTS.get(np.dtype(values.dtype).name)
  values = values.astype(dtype)
  if block_scales is None:
    return values
  out = values * block_scales
  if element is None or element.specials is None:   # the dtype's own inf and NaN decode
    return out
  pos_inf, neg_inf, nan = element.specials
  out = jnp.where(values == pos_inf, jnp.inf, jnp.where(values == neg_inf, -jnp.inf, out))
  return out if math.isnan(nan) else jnp.where(values == nan, jnp.nan, out)


def pack(fmt: WireFormat, values, exponents):
  """One message (one ppermute): bfloat16 values as they are; scaled values and exponents
  as uint8 ``[k, L + L/B]``."""
  if exponents is None:
    return values
  k = values.shape[0]
  as_bytes = lax.bitcast_convert_type(values, jnp.uint8).reshape(k, -1)
  return jnp.concatenate([as_bytes, lax.bitcast_convert_type(exponents, jnp.uint8)], axis=1)


def unpack(fmt: WireFormat, message, row_length: int):
  """Inverse of :func:`pack`: (values, exponents)."""
  if not fmt.scaled:
    return message, None
  size = fmt.dtype.itemsize
  n = row_length * size
  codes = message[:, :n] if size == 1 else message[:, :n].reshape(-1, row_length, size)
  values = lax.bitcast_convert_type(codes, fmt.dtype)
  return values, lax.bitcast_convert_type(message[:, n:], jnp.int8)
