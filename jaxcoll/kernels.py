"""Pallas kernels: the fused reduce step of every schedule.

``fused_combine(acc, recv, ...)`` computes ``round(op(acc, decode(recv)) * scale)``
in one pass, in place; ``fused_combine_reference`` is the same math in plain
jax.numpy; ``stochastic_round`` is its unbiased rounding. The executor uses the
kernel as ``jaxcoll.config(fused_kernel=...)`` says. :meth:`jaxcoll.WireFormat.encode`
makes a compressed chunk (values and the ``recv_exponents`` the kernel takes);
:meth:`jaxcoll.WireFormat.decode` reads it back as every receiver does.
"""

from jaxcoll._src.wire.fused_combine import (
  ROUNDINGS,
  fused_combine,
  fused_combine_reference,
  gpu_compilers,
  stochastic_round,
)

__all__ = ("ROUNDINGS", "fused_combine", "fused_combine_reference", "gpu_compilers",
           "stochastic_round")
