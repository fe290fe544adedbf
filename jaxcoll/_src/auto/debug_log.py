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
import sys

from jaxcoll._src import config as config_lib
from jaxcoll._src.schedules.algorithms import NATIVE
from jaxcoll._src.units import format_ms

ENV_DEBUG = "JAXCOLL_DEBUG"
logger = logging.getLogger("jaxcoll")
_seen: set = set()


def enabled() -> bool:
  """Whether choices are logged: ``config(debug=...)`` if set, else ``JAXCOLL_DEBUG``."""
  return bool(config_lib.setting("debug"))


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


def log(key: tuple, message: str) -> None:
  """Logs ``message`` once per ``key`` when enabled."""
  if not enabled() or key in _seen:
    return
  _seen.add(key)
  _handler()
  logger.info(message)


def decision(d) -> None:
  """Logs what one traced call runs and why (:class:`dispatch.Decision`; module docstring)."""
  if not enabled() or (d.chosen is None and not d.overridden):   # an explicit algorithm=
    return
  call = d.call
  shape = "x".join(map(str, call.axis_sizes))
  where = f"{call.primitive} {call.description} over {','.join(call.axis_names)} ({shape}"
  if d.chosen is None:
    log((call, d.label), f"{where}): {d.label} ({d.reason})")
    return
  native = d.candidates[0].predicted_s
  pricing = d.pricing
  log((call, d.label, pricing.profile.name, pricing.topology.label),
      f"{where}; links {pricing.topology.label}): {d.label}, predicted "
      f"{format_ms(d.chosen.predicted_s)}"
      + ("" if d.label == NATIVE else f", native {format_ms(native)}")
      + f" ({d.reason}), profile {pricing.profile.name or 'custom'}")


def _parse_debug(text: str) -> bool:
  """``JAXCOLL_DEBUG``: INFO or TRACE log every choice; WARN (or 0, OFF, NONE) is quiet."""
  value = text.upper()
  if value not in ("INFO", "TRACE", "WARN", "WARNING", "0", "OFF", "NONE"):
    raise ValueError(f"{ENV_DEBUG}={value!r}: expected INFO (log every choice) or WARN (quiet)")
  return value in ("INFO", "TRACE")


def _flag(value, name):
  if value not in (True, False):
    raise ValueError(f"config({name}={value!r}): expected True or False")
  return value


config_lib.config_field("debug", check=_flag, env=ENV_DEBUG, parse=_parse_debug,
                        built_in=True)
