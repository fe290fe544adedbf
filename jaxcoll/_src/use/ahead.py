"""``use(step).lower(*args)``: a step lowered ahead of time, from arrays or from their types
(``jax.ShapeDtypeStruct`` with shardings, as MaxText's ``train_compile.py`` compiles for a
machine it is not on), and compiled into an executable called as the step is called.

jaxcoll runs a global step as ``jax.jit`` of a function of its array arguments alone (the
static ones closed over); the objects here give back ``jax.jit``'s interface on the step's
own arguments: ``lowered.compile()(*args, **kwargs)`` as ``step(*args, **kwargs)``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class Lowered:
  """A lowered step (``jax.stages.Lowered``'s attributes: ``as_text``, ``compiler_ir``,
  ``cost_analysis``...); :meth:`compile` gives a :class:`Compiled`.

  Args:
    lowered: the ``jax.stages.Lowered`` of jaxcoll's function of the array arguments.
    arrays: ``(args, kwargs) -> list``, the array arguments of a call, checked against those
      lowered with (raises TypeError naming the difference).
    finish: what the step does to the executable's outputs (host memory moves).
  """

  def __init__(self, lowered, arrays: Callable, finish: Callable):
    self._lowered, self._arrays, self._finish = lowered, arrays, finish

  def compile(self, *args, **kwargs) -> Compiled:
    """``jax.stages.Lowered.compile``'s arguments (``compiler_options=``)."""
    return Compiled(self._lowered.compile(*args, **kwargs), self._arrays, self._finish)

  def __getattr__(self, name: str) -> Any:
    return getattr(self._lowered, name)


class Compiled:
  """A compiled step, called with the step's own arguments (arrays laid out as the
  arguments it was lowered from); ``jax.stages.Compiled``'s attributes (``as_text``,
  ``memory_analysis``, ``cost_analysis``, ``input_shardings``...)."""

  def __init__(self, compiled, arrays: Callable, finish: Callable):
    self._compiled, self._arrays, self._finish = compiled, arrays, finish

  def __call__(self, *args, **kwargs):
    return self._finish(self._compiled(*self._arrays(args, kwargs)))

  def __getattr__(self, name: str) -> Any:
    return getattr(self._compiled, name)
