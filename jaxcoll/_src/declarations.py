"""A table of declarations by name, the one mechanism behind every extension point: wire
formats (:data:`jaxcoll._src.wire.formats.ELEMENTS`), MoE routers
(:data:`jaxcoll._src.moe.routers.ROUTERS`), ``jaxcoll.config`` settings
(:data:`jaxcoll._src.config.FIELDS`) and ``use``'s per-device rules
(:data:`jaxcoll._src.per_device_rules.RULES`). What jaxcoll declares is built in; what a user
adds can be removed again. Imports nothing of jaxcoll's."""

from __future__ import annotations


class Declarations(dict):
  """``{name: declaration}``, read as a dict; :meth:`add` and :meth:`remove` change it.

  Example:
    >>> from jaxcoll._src.declarations import Declarations
    >>> table = Declarations("router")
    >>> table.add("softmax", 1, built_in=True)
    1
    >>> table.add("softmax", 2)
    Traceback (most recent call last):
    ...
    ValueError: router 'softmax' is already declared
  """

  def __init__(self, kind: str):
    super().__init__()
    self.kind = kind
    self.built_in: set[str] = set()

  def add(self, name: str, declaration, *, built_in: bool = False):
    """Declares ``name``; returns the declaration.

    Raises:
      ValueError: ``name`` is declared already.
    """
    if name in self:
      raise ValueError(f"{self.kind} {name!r} is already declared")
    self[name] = declaration
    if built_in:
      self.built_in.add(name)
    return declaration

  def remove(self, name: str) -> None:
    """Removes a declaration added from outside (absent: nothing to do).

    Raises:
      ValueError: ``name`` is built in.
    """
    if name in self.built_in:
      raise ValueError(f"{self.kind} {name!r} is built in")
    self.pop(name, None)
