"""Pallas kernels: the fused reduce step of every schedule.

``fused_combine(acc, recv, ...)`` computes ``round(op(acc, decode(recv)) * scale)``
in one pass, in place; ``fused_combine_reference`` is the same math in plain
jax.numpy; ``stochastic_round`` is its unbiased rounding. The executor uses the
kernel as ``jaxcoll.config(fused_kernel=...)`` says.
"""

from jaxcoll._src.fused_combine import (
  ROUNDINGS,
  fused_combine,
  fused_combine_reference,
  stochastic_round,
)

__all__ = ("ROUNDINGS", "fused_combine", "fused_combine_reference", "stochastic_round")
