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

import dataclasses
import os
from collections.abc import Mapping

from jaxcoll._src import fused_combine
from jaxcoll._src.algorithms import check_algorithm
from jaxcoll._src.profile import Profile
from jaxcoll._src.spec import PRIMITIVES

ENV_ALGORITHM = "JAXCOLL_ALGORITHM"
FUSED_MIN_BYTES = 1 << 16   # "auto": smaller chunks stay in XLA's own fusion


@dataclasses.dataclass(frozen=True)
class Config:
  algorithm: tuple[tuple[str, object], ...] = ()
  profile: Profile | None = None
  fused_kernel: bool | str = "auto"
  debug: bool | None = None
  mesh: object = None


_current = Config()


def current() -> Config:
  return _current


def check_choice(primitive, algorithm, where: str):
  """``{primitive: algorithm}`` as config, ``use`` and ``JAXCOLL_ALGORITHM`` take it."""
  if primitive not in PRIMITIVES:
    raise ValueError(f"{where}: {primitive!r} is not a collective; expected one of {PRIMITIVES}")
  check_algorithm(primitive, algorithm, argument=f"{where}[{primitive!r}]")


class config:  # noqa: N801 (used like a function: jaxcoll.config(...))
  """Sets what ``algorithm="auto"`` uses; as a ``with`` block, only inside it.

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
    debug: log every choice auto makes (:mod:`jaxcoll._src.debug_log`); None defers to
      ``JAXCOLL_DEBUG=INFO``.
    mesh: the concrete ``jax.sharding.Mesh`` the program runs on, so that the cost model
      reads where its devices are (:mod:`jaxcoll._src.topology`) rather than deriving it
      from the standard, process-major, device order (a trace sees only the abstract mesh).

  ``jaxcoll.config(profile=p)`` sets it from now on; ``with jaxcoll.config(...):``
  restores the previous configuration on exit. Unnamed fields keep their value.
  """

  def __init__(self, *, algorithm: Mapping | None = None, profile: Profile | str | None = None,
               fused_kernel: bool | str | None = None, debug: bool | None = None, mesh=None):
    global _current
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
    if profile is not None:
      profile = Profile.resolve(profile, "config(profile=...)")
    self._previous = _current
    merged = dict(_current.algorithm)
    merged.update(algorithm or {})
    _current = Config(tuple(sorted(merged.items())),
                      profile if profile is not None else _current.profile,
                      fused_kernel if fused_kernel is not None else _current.fused_kernel,
                      debug if debug is not None else _current.debug,
                      mesh if mesh is not None else _current.mesh)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    global _current
    _current = self._previous
    return False


def env_algorithms() -> dict[str, str]:
  """``JAXCOLL_ALGORITHM`` parsed and checked: ``{primitive: algorithm}``."""
  text = os.environ.get(ENV_ALGORITHM, "").strip()
  out = {}
  for item in filter(None, (s.strip() for s in text.split(","))):
    primitive, sep, algorithm = item.partition("=")
    if not sep:
      raise ValueError(f"{ENV_ALGORITHM}={text!r}: expected primitive=algorithm pairs separated "
                       "by commas, e.g. all_reduce=ring,all_gather=bruck")
    check_choice(primitive.strip(), algorithm.strip(), ENV_ALGORITHM)
    out[primitive.strip()] = algorithm.strip()
  return out


def use_fused_kernel(chunk_bytes: int, dtype) -> bool:
  """Whether a reduce step on chunks of ``chunk_bytes`` runs the Pallas kernel (see config)."""
  if not fused_combine.combines(dtype):
    return False
  setting = _current.fused_kernel
  if setting == "auto":
    return fused_combine.backend_compiles() and chunk_bytes >= FUSED_MIN_BYTES
  return bool(setting)


def override(primitive: str):
  """The algorithm "auto" is overridden to for ``primitive``, or None."""
  configured = dict(_current.algorithm)
  if primitive in configured:
    return configured[primitive]
  return env_algorithms().get(primitive)
