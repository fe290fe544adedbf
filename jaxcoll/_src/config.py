"""What ``algorithm="auto"`` defers to: ``jaxcoll.config`` and ``JAXCOLL_ALGORITHM``.

Most specific first: the call's ``algorithm=`` argument (anything but "auto");
the innermost ``jaxcoll.config(algorithm={primitive: name})``; the environment
variable ``JAXCOLL_ALGORITHM`` (``all_reduce=ring,all_gather=bruck``, in the
spirit of NCCL_ALGO); the cost model under the configured profile
(``jaxcoll.config(profile=...)``, default: the preset of the backend).

Configuration is read when a function is traced: a jitted function keeps the
choice it was traced with until it is traced again.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import os
from collections.abc import Callable, Mapping

from jaxcoll._src.declarations import Declarations

ENV_ALGORITHM = "JAXCOLL_ALGORITHM"   # the algorithm setting's variable (auto/dispatch.py)


@dataclasses.dataclass(frozen=True)
class Field:
  """One setting of ``jaxcoll.config``: a setting is this one declaration
  (:func:`config_field`); ``config(name=...)`` checks it, :func:`setting` reads it.

  Attributes:
    name: the keyword of ``jaxcoll.config``.
    default: its value where nothing sets it.
    check: ``check(value, name)``: the value as kept, or a ValueError naming
      ``config(name=...)``.
    env: an environment variable read where no ``config`` sets it (None: none).
    parse: ``parse(text)``: the variable's value as the setting keeps it (checked).
    merge: ``merge(outer, inner)``: how an inner setting combines with an outer one (and
      with the variable's); None: the inner replaces it.
  """

  name: str
  default: object = None
  check: Callable[[object, str], object] = lambda value, name: value
  env: str | None = None
  parse: Callable[[str], object] | None = None
  merge: Callable[[object, object], object] | None = None


FIELDS: Declarations = Declarations("config field")


def config_field(name: str, *, default=None, check=None, env: str | None = None, parse=None,
                 merge=None, built_in: bool = False) -> Field:
  """Declares a setting of ``jaxcoll.config`` (:class:`Field`).

  Raises:
    ValueError: a name already declared, or a ``parse`` without an ``env``.

  Example:
    >>> import jaxcoll
    >>> from jaxcoll.extend import config_field, remove_config_field, setting
    >>> _ = config_field("chunks", default=4, env="JAXCOLL_CHUNKS", parse=int)
    >>> with jaxcoll.config(chunks=8):
    ...   setting("chunks")
    8
    >>> remove_config_field("chunks")
  """
  if parse is not None and env is None:
    raise ValueError(f"config field {name!r}: parse= reads an environment variable; give env=")
  return FIELDS.add(name, Field(name, default, check or Field.check, env, parse, merge),
                    built_in=built_in)


def remove_config_field(name: str) -> None:
  """Removes a setting :func:`config_field` declared (not a built-in one)."""
  FIELDS.remove(name)


@dataclasses.dataclass(frozen=True)
class Config:
  """The configuration in effect (:func:`current`): the settings given, by name; a declared
  field not given reads as its default (``current().profile``)."""

  values: tuple[tuple[str, object], ...] = ()

  def __getattr__(self, name: str):
    if name in FIELDS:
      return dict(self.values).get(name, FIELDS[name].default)
    raise AttributeError(name)

  def given(self, name: str):
    """The value set for ``name``, or None."""
    return dict(self.values).get(name)

  def updated(self, changes: Mapping) -> Config:
    """This configuration with ``changes`` (``{field: value}``, checked; merged where the
    field merges)."""
    values = dict(self.values)
    for name, value in changes.items():
      merge = FIELDS[name].merge
      values[name] = merge(values[name], value) if merge and name in values else value
    return Config(tuple(sorted(values.items())))


# As jax keeps its own configuration: a process-wide value, which a plain
# ``jaxcoll.config(...)`` sets, under the changes of the enclosing ``with`` blocks of this
# thread or task (a context variable, outermost first), which ``current()`` applies in order.
_global = Config()
_scoped: contextvars.ContextVar[tuple[Mapping, ...]] = contextvars.ContextVar(
    "jaxcoll.config", default=())


def current() -> Config:
  """The configuration in effect here: the process-wide one under this context's blocks."""
  out = _global
  for changes in _scoped.get():
    out = out.updated(changes)
  return out


def setting(name: str):
  """The value of setting ``name`` in effect here: what ``jaxcoll.config`` sets, else its
  environment variable's, else its default (merged with the variable's where the field
  merges)."""
  field = FIELDS[name]
  configured, from_env = current().given(name), env_value(name)
  if configured is not None and from_env is not None and field.merge is not None:
    return field.merge(from_env, configured)
  for value in (configured, from_env):
    if value is not None:
      return value
  return field.default


def env_value(name: str):
  """Setting ``name``'s value from its environment variable (parsed and checked), or None
  where it has none or the variable is unset or blank."""
  field = FIELDS[name]
  text = os.environ.get(field.env, "").strip() if field.env else ""
  return _parsed(field.name, field.env, text) if text else None


@functools.cache
def _parsed(name: str, env: str, text: str):
  """An environment variable's value, parsed and checked (once per distinct value)."""
  field = FIELDS[name]
  return field.check(field.parse(text) if field.parse else text, env)


class config:  # noqa: N801 (used like a function: jaxcoll.config(...))
  """Sets what ``algorithm="auto"`` uses: from now on, or as a ``with`` block only inside it.

  Args:
    algorithm: ``{primitive: algorithm}`` (a name or ``Hierarchical``) that
      "auto" resolves to for that primitive.
    profile: the :class:`Profile` (or a preset name, or a profile JSON's path:
      :meth:`Profile.resolve`) the cost model prices with.
    fused_kernel: whether reduce steps run the Pallas kernel
      (:func:`jaxcoll.kernels.fused_combine`): True (interpret mode where the
      backend cannot compile it, as on CPU: slow, for tests), False (plain
      jax.numpy, which XLA fuses), or "auto" (default: the kernel where the
      backend compiles it and a chunk is at least ``FUSED_MIN_BYTES``).
    debug: log every choice auto makes (:mod:`jaxcoll._src.auto.debug_log`); None defers to
      ``JAXCOLL_DEBUG=INFO``.
    mesh: the concrete ``jax.sharding.Mesh`` the program runs on, so that the cost model
      reads where its devices are (:mod:`jaxcoll._src.auto.topology`) rather than deriving it
      from the standard, process-major, device order (a trace sees only the abstract mesh).

  Raises:
    ValueError: an argument of the wrong kind, named; nothing is changed then.

  As jax keeps its own configuration: ``jaxcoll.config(profile=p)`` sets the process-wide
  value (every thread sees it); ``with jaxcoll.config(...):`` changes it only inside the
  block and only for this thread (or asyncio task), and restores it on exit, exceptions
  included. A plain call inside a block sets the process-wide value, which outlives the
  block; the block's own fields still take precedence inside it. Unnamed fields keep their
  value; algorithms merge per primitive.

  Example:
    >>> import jax, jaxcoll
    >>> with jaxcoll.config(algorithm={"all_reduce": "ring"}, profile="dcn"):
    ...   jaxcoll.explain("all_reduce", jax.ShapeDtypeStruct((1024,), "float32"),
    ...                   {"x": 8}, "x").chosen
    'ring'
  """

  def __init__(self, **settings):
    global _global
    unknown = sorted(set(settings) - set(FIELDS))
    if unknown:
      raise TypeError(f"config() got unexpected keyword arguments {unknown}; its settings are "
                      f"{sorted(FIELDS)}")
    self._changes = {name: FIELDS[name].check(value, name) for name, value in settings.items()
                     if value is not None}
    self._before = _global
    self._set = _global = _global.updated(self._changes)
    self._token = None

  def __enter__(self):
    global _global
    if _global is self._set:   # as a block: the change is this context's, not the process's
      _global = self._before
    self._token = _scoped.set((*_scoped.get(), self._changes))
    return self

  def __exit__(self, *exc):
    global _global
    if self._token is not None:
      _scoped.reset(self._token)
      self._token = None
    else:   # undoing a plain call
      _global = self._before
    return False


def override(primitive: str):
  """The algorithm "auto" is overridden to for ``primitive`` (``jaxcoll.config``'s, else
  ``JAXCOLL_ALGORITHM``'s), or None."""
  return dict(setting("algorithm")).get(primitive)
