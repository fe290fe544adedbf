"""A wire format declared outside the package, as a user would add one: block-scaled float16.

float16 keeps 11 significant bits, so one value rounds with a relative error of 2**-11. Its
range (65504) is far narrower than float32's, so it needs a scale: each block of values
shares a power-of-two exponent chosen so that its largest finite value is at most 2**15.
The block's smallest values then fall among float16's subnormals at worst (2**-24 apart):
half that step, scaled, is at most 2**-25 / 2**14 = 2**-39 of the block's largest value.
2 bytes a value and one exponent byte a block. float16 carries inf and NaN itself. Built
only from the public API: one :class:`jaxcoll.extend.WireElement`.
"""

from __future__ import annotations

from jaxcoll.extend import WireElement

FLOAT16 = WireElement("float16", relative_error=2.0 ** -11 + 2.0 ** -39, finite_max=2.0 ** 15)
