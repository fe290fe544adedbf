"""Values every device can make piece by piece: ``iota`` and partitionable threefry bits.
(:mod:`jaxcoll._src.use.rules`)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.random import threefry2x32_p

from jaxcoll._src import compat
from jaxcoll._src.use.placement import Placement
from jaxcoll._src.use.rules.elementwise import _replicated_rule


def _iota(ev, eqn, ins):
  """Every device computes the whole iota; a piece of it is its own iota plus the piece's
  offset along the counting dimension."""
  (out,) = _replicated_rule(ev, eqn, ins)
  p = eqn.params
  d = p["dimension"]

  def piece(place: Placement):
    local = ev.local_shape(p["shape"], place)
    value = ev.bind(eqn, [], shape=local)[0]
    axes = place.dims[d]
    if not axes:
      return value
    return value + (ev.index(axes) * local[d]).astype(value.dtype)
  out.slicer = piece
  return [out]


def _random_bits(ev, eqn, ins):
  """Random bits as ``jax.jit`` draws them: with ``jax_threefry_partitionable`` (the
  default) bit i of a threefry key's draw hashes the key with i's position in the whole
  array, so a device draws its own block alone (``threefry2x32`` of its positions, as
  jax's own ``_threefry_random_bits_partitionable`` computes the whole); otherwise, or for
  another generator, every device draws the whole array."""
  (out,) = _replicated_rule(ev, eqn, ins)
  (key,) = ins
  shape, width = tuple(eqn.params["shape"]), eqn.params["bit_width"]
  if compat.threefry_partitionable(eqn) and width in (8, 16, 32) and \
      key.place.ndim == 0 and math.prod(shape) < 2 ** 32 and \
      str(jax.random.key_impl(key.value)) == "threefry2x32":
    out.slicer = lambda place: _threefry_block(ev, key.value, shape, width, place)
  return [out]


def _threefry_block(ev, key, shape, width, place: Placement):
  """This device's block of ``random_bits(key, width, shape)`` under ``place``."""
  local = ev.local_shape(shape, place)
  strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
  count = jnp.zeros(local, jnp.uint32)
  for d, n in enumerate(local):
    position = lax.broadcasted_iota(jnp.uint32, local, d)
    if place.dims[d]:
      position = position + (ev.index(place.dims[d]) * n).astype(jnp.uint32)
    count = count + position * np.uint32(strides[d])
  k1, k2 = jax.random.key_data(key)
  bits1, bits2 = threefry2x32_p.bind(k1, k2, jnp.zeros(local, jnp.uint32), count)
  bits = bits1 ^ bits2
  return bits if width == 32 else bits.astype({8: jnp.uint8, 16: jnp.uint16}[width])
