"""``JAXCOLL_DEBUG=INFO`` (or ``jaxcoll.config(debug=True)``): every choice auto makes, logged.

Like ``NCCL_DEBUG=INFO`` with ``NCCL_DEBUG_SUBSYS=TUNING``: when a collective is traced
with ``algorithm="auto"`` (or an override of it), one line on the ``"jaxcoll"`` logger
says what runs and why::

  [0] jaxcoll INFO all_reduce float32[1,4096] over x (8; links host, process-major):
      binomial_tree, predicted 2.13 ms, native 7.38 ms (3.47x faster than native; a schedule
      must be 1.25x faster), profile cpu

Each distinct choice is logged once per process (a retrace that chooses the same thing
is quiet). The logger gets a stderr handler of its own only when neither it nor the root
logger has one, so an application's logging configuration takes precedence.
"""

from __future__ import annotations

import logging
import os
import sys

from jaxcoll._src import config as config_lib
from jaxcoll._src.algorithms import NATIVE

ENV_DEBUG = "JAXCOLL_DEBUG"
LEVELS = ("INFO", "TRACE")
logger = logging.getLogger("jaxcoll")
_seen: set = set()


def enabled() -> bool:
  """Whether choices are logged: ``config(debug=...)`` if set, else ``JAXCOLL_DEBUG``."""
  setting = config_lib.current().debug
  if setting is not None:
    return bool(setting)
  value = os.environ.get(ENV_DEBUG, "").strip().upper()
  if value and value not in LEVELS + ("WARN", "WARNING", "0", "OFF", "NONE"):
    raise ValueError(f"{ENV_DEBUG}={value!r}: expected INFO (log every choice) or WARN (quiet)")
  return value in LEVELS


def _handler() -> None:
  """INFO on the "jaxcoll" logger; a stderr handler only when no logger above has one."""
  logger.setLevel(logging.INFO)
  if logger.hasHandlers():
    return
  import jax
  handler = logging.StreamHandler(sys.stderr)
  handler.setFormatter(logging.Formatter(f"[{jax.process_index()}] %(name)s %(levelname)s "
                                         "%(message)s"))
  logger.addHandler(handler)
  logger.propagate = False


def _ms(s: float) -> str:
  return f"{s * 1e3:.3g} ms"


def why(chosen, weighed, *, trusted: bool, native_allowed: bool, margin: float,
        profile_name: str) -> str:
  """The reason auto ran ``chosen`` out of ``weighed`` (native first), in words."""
  native, *scheduled = weighed
  best = min(scheduled, key=lambda c: c.vs(native), default=native)
  if not native_allowed:
    return (f"native cannot send a wire format (or algorithm='schedule' excludes it); "
            f"fastest schedule {best.label}")
  if not trusted:
    return (f"profile {profile_name or 'custom'} was not measured on this backend: native "
            f"kept (fastest schedule {best.label}, predicted {_ms(best.predicted_s)})")
  ratio = 1 / max(best.vs(native), 1e-30)
  placed = "" if not best.elsewhere_s else " under every placement of the hosts"
  if chosen is native:
    return (f"fastest schedule {best.label} predicted {_ms(best.predicted_s)}, {ratio:.2f}x "
            f"native's speed{placed}; a schedule must be {margin:g}x faster")
  return f"{ratio:.2f}x faster than native{placed}; a schedule must be {margin:g}x faster"


def log(key: tuple, message: str) -> None:
  """Logs ``message`` once per ``key`` when enabled."""
  if not enabled() or key in _seen:
    return
  _seen.add(key)
  _handler()
  logger.info(message)


def choice(primitive: str, call: str, axis_names, axis_sizes, chosen, weighed, profile,
           topo, *, trusted: bool, native_allowed: bool, margin: float) -> None:
  """Logs what auto chose for one traced call (module docstring)."""
  if not enabled():
    return
  shape = "x".join(map(str, axis_sizes))
  others = {c.label: c.predicted_s for c in weighed}
  reason = why(chosen, weighed, trusted=trusted, native_allowed=native_allowed, margin=margin,
               profile_name=profile.name)
  log((primitive, call, tuple(axis_names), tuple(axis_sizes), chosen.label, profile.name,
       topo.label),
      f"{primitive} {call} over {','.join(axis_names)} ({shape}; links {topo.label}): "
      f"{chosen.label}, predicted {_ms(chosen.predicted_s)}"
      + ("" if chosen.label == NATIVE else f", native {_ms(others[NATIVE])}")
      + f" ({reason}), profile {profile.name or 'custom'}")


def override(primitive: str, call: str, axis_names, algorithm: str) -> None:
  """Logs an algorithm "auto" was overridden to (``jaxcoll.config`` / ``JAXCOLL_ALGORITHM``)."""
  log((primitive, call, tuple(axis_names), algorithm),
      f"{primitive} {call} over {','.join(axis_names)}: {algorithm} (overridden by "
      f"jaxcoll.config / {config_lib.ENV_ALGORITHM})")
