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
from collections.abc import Mapping

from jaxcoll._src.auto.profile import Profile
from jaxcoll._src.schedules.algorithms import check_algorithm
from jaxcoll._src.spec import PRIMITIVES
from jaxcoll._src.wire import fused_combine

ENV_ALGORITHM = "JAXCOLL_ALGORITHM"
FUSED_MIN_BYTES = 1 << 16   # "auto": smaller chunks stay in XLA's own fusion


@dataclasses.dataclass(frozen=True)
class Config:
  """The configuration in effect (:func:`current`); see :class:`config` for each field."""

  algorithm: tuple[tuple[str, object], ...] = ()
  profile: Profile | None = None
  fused_kernel: bool | str = "auto"
  debug: bool | None = None
  mesh: object = None

  def updated(self, changes: Mapping) -> Config:
    """This configuration with ``changes`` (``{field: value}``; algorithms merged)."""
    fields = {k: v for k, v in changes.items() if k != "algorithm"}
    algorithm = {**dict(self.algorithm), **changes.get("algorithm", {})}
    return dataclasses.replace(self, algorithm=tuple(sorted(algorithm.items())), **fields)


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


def check_choice(primitive, algorithm, where: str):
  """``{primitive: algorithm}`` as config, ``use`` and ``JAXCOLL_ALGORITHM`` take it."""
  if primitive not in PRIMITIVES:
    raise ValueError(f"{where}: {primitive!r} is not a collective; expected one of {PRIMITIVES}")
  check_algorithm(primitive, algorithm, argument=f"{where}[{primitive!r}]")


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

  def __init__(self, *, algorithm: Mapping | None = None, profile: Profile | str | None = None,
               fused_kernel: bool | str | None = None, debug: bool | None = None, mesh=None):
    global _global
    if fused_kernel not in (None, True, False, "auto"):
      raise ValueError(f"config(fused_kernel={fused_kernel!r}): expected True, False or 'auto'")
    if debug not in (None, True, False):
      raise ValueError(f"config(debug={debug!r}): expected True or False")
    if mesh is not None and not (hasattr(mesh, "devices") and hasattr(mesh, "axis_names")):
      raise ValueError(f"config(mesh={mesh!r}): expected a jax.sharding.Mesh")
    if algorithm is not None:
      if not isinstance(algorithm, Mapping):
        raise ValueError(f"config(algorithm={algorithm!r}): expected a mapping "
                         "{primitive: algorithm}")
      for p, a in algorithm.items():
        check_choice(p, a, "config(algorithm=...)")
      algorithm = dict(algorithm)
    if profile is not None:
      profile = Profile.resolve(profile, "config(profile=...)")
    given = dict(algorithm=algorithm, profile=profile, fused_kernel=fused_kernel, debug=debug,
                 mesh=mesh)
    self._changes = {k: v for k, v in given.items() if v is not None}
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


def env_algorithms() -> dict[str, str]:
  """``JAXCOLL_ALGORITHM`` parsed and checked: ``{primitive: algorithm}`` (each value of
  the variable parsed once)."""
  return dict(_parse_env(os.environ.get(ENV_ALGORITHM, "").strip()))


@functools.cache
def _parse_env(text: str) -> tuple[tuple[str, str], ...]:
  out = {}
  for item in filter(None, (s.strip() for s in text.split(","))):
    primitive, sep, algorithm = item.partition("=")
    if not sep:
      raise ValueError(f"{ENV_ALGORITHM}={text!r}: expected primitive=algorithm pairs separated "
                       "by commas, e.g. all_reduce=ring,all_gather=bruck")
    check_choice(primitive.strip(), algorithm.strip(), ENV_ALGORITHM)
    out[primitive.strip()] = algorithm.strip()
  return tuple(out.items())


def use_fused_kernel(chunk_bytes: int, dtype) -> bool:
  """Whether a reduce step on chunks of ``chunk_bytes`` runs the Pallas kernel (see config)."""
  if not fused_combine.combines(dtype):
    return False
  setting = current().fused_kernel
  if setting == "auto":
    return fused_combine.backend_compiles() and chunk_bytes >= FUSED_MIN_BYTES
  return bool(setting)


def override(primitive: str):
  """The algorithm "auto" is overridden to for ``primitive``, or None."""
  configured = dict(current().algorithm)
  if primitive in configured:
    return configured[primitive]
  return env_algorithms().get(primitive)
