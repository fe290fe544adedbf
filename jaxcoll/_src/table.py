"""A small result table: plain text with ``str()``, a rich table where rich is installed."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class Table:
  """Rows of cells under headers. ``print(table)`` gives aligned text; ``table.print()``
  renders with rich on a terminal when rich is importable (first column left-aligned, the
  rest right)."""

  title: str
  headers: tuple[str, ...]
  rows: tuple[tuple, ...]

  @classmethod
  def of(cls, title: str, headers: Sequence[str], rows: Sequence[Sequence]) -> Table:
    return cls(title, tuple(headers), tuple(tuple(map(str, r)) for r in rows))

  def __str__(self) -> str:
    widths = [max(len(c) for c in col) for col in zip(self.headers, *self.rows)]
    fmt = lambda cells: "  ".join(c.rjust(w) if i else c.ljust(w)
                                  for i, (c, w) in enumerate(zip(cells, widths)))
    lines = [self.title, fmt(self.headers), "  ".join("-" * w for w in widths)]
    return "\n".join(lines + [fmt(r) for r in self.rows])

  def __rich__(self):
    from rich.table import Table as RichTable
    table = RichTable(title=self.title)
    for i, h in enumerate(self.headers):
      table.add_column(h, justify="left" if i == 0 else "right")
    for row in self.rows:
      table.add_row(*row)
    return table

  def print(self) -> None:
    """rich on a terminal (when installed), plain aligned text otherwise (logs, pipes)."""
    try:
      from rich.console import Console
    except ImportError:
      Console = None
    if Console is None or not sys.stdout.isatty():
      print(self)
      return
    Console().print(self)
