"""Byte sizes as people write them: one parser and one formatter, powers of 1024 throughout."""

from __future__ import annotations

import argparse
import re

UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
  """``8``, ``64K``, ``16M``, ``1G``, ``2MiB``, ``4 KiB`` -> bytes (powers of 1024, as
  nccl-tests reads them). Raises ``argparse.ArgumentTypeError`` (argparse's ``type=``)."""
  m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)i?B?\s*", text, re.IGNORECASE)
  if not m:
    raise argparse.ArgumentTypeError(f"size {text!r}: expected a number of bytes such as 8, "
                                     "64K, 16M or 1G")
  return int(m.group(1)) * UNITS[m.group(2).upper()]


def format_size(nbytes: float, *, compact: bool = False) -> str:
  """``nbytes`` for people: ``100 B``, ``4 KiB``, ``1.5 MiB`` (three significant digits).

  ``compact=True``: nccl-tests' form, which :func:`parse_size` reads back exactly: ``8``,
  ``4K``, ``1M``, ``3G``; a size that is no whole number of the unit stays in bytes (``1000``).
  """
  for unit, size in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
    if compact and nbytes >= size and nbytes % size == 0:
      return f"{int(nbytes // size)}{unit}"
    if not compact and nbytes >= size:
      return f"{nbytes / size:.3g} {unit}iB"
  return f"{int(nbytes)}" if compact else f"{nbytes:.0f} B"


def format_ms(s: float) -> str:
  """``0.00213`` -> "2.13 ms": three significant digits in milliseconds, whatever the size
  (the debug log's and auto's reasons' unit, so that lines compare at a glance)."""
  return f"{s * 1e3:.3g} ms"


def format_seconds(s: float) -> str:
  """``0.0123`` -> "12.3 ms": three significant digits in s, ms, us or ns."""
  for unit, size in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
    if s >= size:
      return f"{s / size:.3g} {unit}"
  return f"{s * 1e9:.3g} ns"
