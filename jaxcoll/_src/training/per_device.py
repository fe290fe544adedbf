"""``PerDevice``: a pytree node marking state that differs from device to device.

Optimizer state is normally replicated: every device computes it alike from replicated
gradients. Error-feedback residuals are not: each device keeps the error of compressing
its own gradients. :func:`jaxcoll.data_parallel` passes the leaves under a ``PerDevice``
sharded along the data axis, one row per device, instead of replicated (which would keep
only one device's value). ``stacked`` says which form a value is in: False as created on
one device (``init``), True with a leading axis of one row per device (what
``data_parallel`` returns, to checkpoint as it is).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PerDevice:
  """``value``: a pytree of this device's state (``stacked=False``), or of every device's,
  stacked along a new leading axis (``stacked=True``)."""

  value: Any
  stacked: bool = dataclasses.field(default=False, metadata={"static": True})


def is_per_device(x) -> bool:
  return isinstance(x, PerDevice)
