"""What a traced program's collectives run as, kept for a report (``jaxcoll.explain_step``).

While :func:`recording` is active, every jaxcoll collective traced adds a :class:`Line`: the
collective, its axes, its operand and bytes, and the algorithm that runs it (an "auto" pick
resolved). ``jaxcoll.use`` tags each line with the equation of the user's program it
evaluates (:func:`at`: the primitive and the source line), and adds lines of its own for
what does not run as a jaxcoll collective: an equation run on whole inputs for want of a
per-device rule, a lax collective or mesh axis left to XLA (:func:`note`). Nothing here
changes what is traced. With ``JAXCOLL_DEBUG=INFO`` every line is also logged
(:mod:`debug_log`), once per distinct line.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import ClassVar

from jaxcoll._src.auto import debug_log


@dataclasses.dataclass(frozen=True)
class Line:
  """One line of a step's report.

  ``kind``: "jaxcoll" (a jaxcoll collective; ``algorithm`` says how it runs, "native" being
  the lax collective), "whole" (an equation run on whole inputs) or "xla" (left to XLA).
  ``what``: the collective or primitive; ``equation`` and ``where``: the user's equation
  that needed it and its source line; ``detail``: the operand, or the reason; ``count``:
  how many times one call runs it (the trip counts of the ``scan`` s around it; a
  ``while`` body's, whose count is not known when traced, once)."""

  COLLECTIVE: ClassVar[str] = "jaxcoll"
  WHOLE: ClassVar[str] = "whole"
  XLA: ClassVar[str] = "xla"

  kind: str
  what: str
  axes: tuple[str, ...] = ()
  nbytes: int = 0
  algorithm: str = ""
  equation: str = "-"
  where: str = "-"
  detail: str = ""
  count: int = 1

  def __str__(self) -> str:
    over = f" over {','.join(self.axes)}" if self.axes else ""
    runs = f" x{self.count}" if self.count > 1 else ""
    how = f" ({self.algorithm}, {self.nbytes} B{runs})" if self.kind == Line.COLLECTIVE else ""
    return (f"{self.kind}: {self.what}{over}{how} for {self.equation} at {self.where}"
            + (f": {self.detail}" if self.detail else ""))


_lines: contextvars.ContextVar = contextvars.ContextVar("jaxcoll_record", default=None)
_equation: contextvars.ContextVar = contextvars.ContextVar("jaxcoll_equation",
                                                          default=("-", "-"))


@contextlib.contextmanager
def recording():
  """Collects the lines traced inside; yields the list they are appended to."""
  lines: list[Line] = []
  token = _lines.set(lines)
  try:
    yield lines
  finally:
    _lines.reset(token)


@contextlib.contextmanager
def paused():
  """Nothing traced inside is recorded (an abstract run whose collectives never execute)."""
  token = _lines.set(None)
  try:
    yield
  finally:
    _lines.reset(token)


@contextlib.contextmanager
def at(primitive: str, where: str):
  """Lines added inside are for the user's equation ``primitive`` at ``where``."""
  token = _equation.set((primitive, where))
  try:
    yield
  finally:
    _equation.reset(token)


def where() -> tuple[str, str]:
  """The user's equation lines added now are for: ``(primitive, source line)``."""
  return _equation.get()


_repeats: contextvars.ContextVar = contextvars.ContextVar("jaxcoll_repeats", default=1)


@contextlib.contextmanager
def repeated(times: int):
  """Lines added inside run ``times`` times a call (a ``scan`` body of that length)."""
  token = _repeats.set(_repeats.get() * int(times))
  try:
    yield
  finally:
    _repeats.reset(token)


_in_use: contextvars.ContextVar = contextvars.ContextVar("jaxcoll_in_use", default=False)


@contextlib.contextmanager
def in_use():
  """Lines added inside are ``jaxcoll.use``'s: logged under ``JAXCOLL_DEBUG=INFO`` (a
  collective called directly is logged by the dispatcher alone)."""
  token = _in_use.set(True)
  try:
    yield
  finally:
    _in_use.reset(token)


def _add(line: Line) -> None:
  lines = _lines.get()
  if lines is not None:
    lines.append(line)
  if _in_use.get():
    debug_log.log(("line", line), f"use: {line}")


def collective(primitive: str, axes, nbytes: int, algorithm: str, operand: str) -> None:
  """A jaxcoll collective traced: ``primitive`` over ``axes`` on ``operand``, run by
  ``algorithm``."""
  equation, where = _equation.get()
  _add(Line(Line.COLLECTIVE, primitive, tuple(axes), int(nbytes), algorithm, equation, where,
            operand, _repeats.get()))


def note(kind: str, what: str, detail: str, axes=()) -> None:
  """An equation run whole (``kind`` "whole") or something left to XLA ("xla")."""
  equation, where = _equation.get()
  _add(Line(kind, what, tuple(axes), equation=equation, where=where, detail=detail))
