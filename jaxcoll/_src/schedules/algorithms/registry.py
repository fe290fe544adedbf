"""The algorithm registry: ``schedule(primitive, algorithm, axis_size)`` and ``register``.

Each module of this package builds the schedules of one family and registers them with
:func:`register`, together with what the rest of jaxcoll needs to know about them (an
:class:`Algorithm`): how many mesh axes they need, the options auto may try, whether they
can be one axis's stage of a multi-axis schedule, whether the lax collective is priced as
them, whether calibrate fits to them, and their cost formula. The package imports them all,
so adding an algorithm is one module plus its import. An algorithm is a pure function of
the axis size (and options such as the pipeline depth) returning a
:class:`~jaxcoll._src.schedules.schedule.Schedule` for root 0; schedules are cached, and those of
rooted primitives are relabelled for other roots.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable, Mapping, Sequence

from jaxcoll._src.schedules.schedule import Schedule
from jaxcoll._src.spec import PRIMITIVES, spec

NATIVE = "native"   # the jax.lax collective: no schedule of ours
SCHEDULE = "schedule"   # "auto" among the schedules only: never the lax collective

Variants = Callable[[str, tuple[int, ...]], list[tuple[str, dict]]]


@dataclasses.dataclass(frozen=True)
class Algorithm:
  """One registered schedule builder and its metadata.

  Attributes:
    primitive, name: what it is registered as.
    build: ``build(axis_size, **options) -> Schedule``.
    num_axes: the mesh axes it needs at least; more than one (hierarchical) means it also
      takes ``axis_sizes=`` (outermost first), which dispatch passes.
    tune: options auto weighs, ``{option: (value, ...)}``; the first value of each is the
      builder's default, and labels name the others: ``double_binary_tree(pipeline=8)``.
    stage: it may run as one axis's stage of a multi-axis schedule.
    native_like: the lax collective is priced as this schedule when never measured (what
      NCCL runs for it).
    fit: calibrate times it and fits the cost model to those times.
    formula: ``formula(N) -> (steps, bytes per rank / M)``, its cost formula;
      tests check every schedule against it.
    variants: for a multi-axis algorithm, ``variants(primitive, axis_sizes)`` lists the
      (label, options) auto weighs (replaces ``tune``).
    label: ``label(primitive, num_axes)``, the name the default variant is shown as.
    max_devices: auto weighs it (alone or as a stage) only on meshes of at most this many
      devices. The cost model reads each distinct permutation of a schedule once, so an
      algorithm with a permutation of its own every step (pairwise exchange: N - 1 of N
      messages) costs O(N^2) to price; a call that names it runs at any size.
  """

  primitive: str
  name: str
  build: Callable[..., Schedule]
  num_axes: int = 1
  tune: Mapping[str, tuple] = dataclasses.field(default_factory=dict)
  stage: bool = False
  native_like: bool = False
  fit: bool = False
  formula: Callable[[int], tuple[int, float]] | None = None
  variants: Variants | None = None
  label: Callable[[str, int], str] | None = None
  max_devices: int | None = None

  def choices(self, axis_sizes: tuple[int, ...]) -> list[tuple[str, dict]]:
    """(label, options) of every variant auto weighs on a mesh of ``axis_sizes``."""
    if self.variants is not None:
      return self.variants(self.primitive, tuple(axis_sizes))
    out = []
    for values in itertools.product(*self.tune.values()):
      changed = {k: v for k, v in zip(self.tune, values) if v != self.tune[k][0]}
      label = self.name + (f"({','.join(f'{k}={v}' for k, v in changed.items())})"
                           if changed else "")
      out.append((label, changed))
    return out or [(self.name, {})]


_REGISTRY: dict[str, dict[str, Algorithm]] = {p: {} for p in PRIMITIVES}
_changes = [0]   # how many times the registry changed: caches of what it offers key on it


def generation() -> int:
  """A number that changes whenever an algorithm is registered or removed."""
  return _changes[0]


def register(primitive: str, name: str, **metadata):
  """Decorator: registers ``builder(axis_size, **options) -> Schedule`` with the
  :class:`Algorithm` fields in ``metadata``."""
  spec(primitive)

  def wrap(builder):
    _REGISTRY[primitive][name] = Algorithm(primitive, name, builder, **metadata)
    _changes[0] += 1
    return builder
  return wrap


def unregister(primitive: str, name: str) -> None:
  """Removes what :func:`register` added as ``name``; ValueError if nothing was."""
  spec(primitive)
  if _REGISTRY[primitive].pop(name, None) is None:
    raise ValueError(f"name={name!r}: {primitive} has no algorithm of that name")
  _changes[0] += 1
  schedule.cache_clear()


def entry(primitive: str, name: str) -> Algorithm:
  """The :class:`Algorithm` registered as ``name`` for ``primitive``."""
  check_algorithm(primitive, name)
  if name not in _REGISTRY[primitive]:
    raise ValueError(f"algorithm={name!r} has no schedule; name a concrete algorithm")
  return _REGISTRY[primitive][name]


def entries(primitive: str, num_axes: int | None = None, *, devices: int | None = None,
            **metadata) -> tuple[Algorithm, ...]:
  """The registered algorithms of ``primitive`` (registration order) that run over
  ``num_axes`` mesh axes, that auto weighs on meshes of ``devices`` devices
  (``max_devices``), and that have every given metadata value, e.g. ``stage=True``."""
  spec(primitive)
  return tuple(a for a in _REGISTRY[primitive].values()
               if (num_axes is None or a.num_axes <= max(num_axes, 1))
               and (devices is None or a.max_devices is None or devices <= a.max_devices)
               and all(getattr(a, k) == v for k, v in metadata.items()))


def algorithms(primitive: str, num_axes: int | None = None) -> tuple[str, ...]:
  """The algorithm names valid for ``primitive``, ``"native"`` (the jax.lax collective) last.

  With ``num_axes``, only those that run over that many mesh axes ("hierarchical"
  needs a tuple of at least two; every other algorithm runs over any number).

  Args:
    primitive: one of ``jaxcoll.PRIMITIVES``.
    num_axes: keep only the algorithms that run over this many mesh axes.

  Returns:
    The names, registration order, "native" last (what ``algorithm=`` accepts besides
    "auto", "schedule" and algorithm values).

  Raises:
    ValueError: ``primitive`` is not a collective.

  Example:
    >>> import jaxcoll
    >>> jaxcoll.algorithms("broadcast")
    ('ring', 'binomial_tree', 'scatter_allgather', 'native')
  """
  return (*(a.name for a in entries(primitive, num_axes)), NATIVE)


def check_algorithm(primitive: str, algorithm, *, num_axes: int | None = None,
                    argument: str = "algorithm", extra: tuple[str, ...] = ()) -> None:
  """Raises unless ``algorithm`` is "auto", "schedule" (auto among the schedules), a name of
  ``algorithms(primitive)`` (one that runs over ``num_axes`` mesh axes when given), an algorithm
  value (``jaxcoll.Hierarchical``: ``.name`` and ``.options()``) whose name is one, or one of
  ``extra`` (an integration's own formulations). The one check of an ``algorithm=`` argument;
  errors name ``argument``."""
  if isinstance(algorithm, str):
    name = algorithm
  elif isinstance(getattr(algorithm, "name", None), str) and \
      callable(getattr(algorithm, "options", None)):
    name = algorithm.name
  else:
    raise TypeError(f"{argument}={algorithm!r}: expected a name or an algorithm value such as "
                    "jaxcoll.Hierarchical")
  if name in ("auto", SCHEDULE) or name in extra:
    return
  if name not in algorithms(primitive):
    raise ValueError(f"{argument}={name!r} does not apply to {primitive}; expected 'auto' or "
                     f"one of {(*extra, *algorithms(primitive))}")
  if num_axes is not None and name not in algorithms(primitive, num_axes=num_axes):
    need = next(a.num_axes for a in entries(primitive) if a.name == name)
    raise ValueError(f"{argument}={name!r} runs {primitive} over a tuple of at least {need} "
                     f"mesh axes (outer, ..., inner); axis_name names {num_axes}")


def call_options(primitive: str, name: str, axis_sizes: Sequence[int], options=None) -> dict:
  """The schedule options a call of ``name`` over axes of ``axis_sizes`` runs with: a
  multi-axis algorithm also gets ``axis_sizes``; ValueError if there are too few axes."""
  algo = entry(primitive, name)
  options = dict(options or {})
  if algo.num_axes > 1:
    if len(axis_sizes) < algo.num_axes:
      raise ValueError(f"algorithm={name!r} runs over a tuple of mesh axes (outer, ..., inner), "
                       f"at least {algo.num_axes}; axis_name names {len(axis_sizes)}, of "
                       f"size(s) {tuple(axis_sizes)}")
    options = {"axis_sizes": tuple(axis_sizes), **options}
  return options


def label(primitive: str, name: str, num_axes: int) -> str:
  """How explain, the benchmarks and auto name ``name``'s default variant."""
  algo = entry(primitive, name)
  return algo.label(primitive, num_axes) if algo.label else name


@functools.lru_cache(maxsize=4096)
def schedule(primitive: str, algorithm: str, axis_size: int, *, root: int = 0,
             **options) -> Schedule:
  """The schedule of ``algorithm`` for ``primitive`` over ``axis_size`` ranks.

  Args:
    primitive: one of ``PRIMITIVES``.
    algorithm: a name from :func:`algorithms`, except "native" (the jax.lax
      collective has no schedule of ours).
    axis_size: N >= 1.
    root: the root rank (broadcast, reduce).
    **options: algorithm options: ``pipeline=`` for "double_binary_tree";
      ``offset=``, ``wrap=`` for shift; ``axis_sizes=`` (outermost first) and
      ``per_axis=`` (one flat algorithm per axis) for "hierarchical".
  """
  algo = entry(primitive, algorithm)
  if not isinstance(axis_size, int) or axis_size < 1:
    raise ValueError(f"axis_size must be a positive int, got {axis_size!r}")
  if root and not spec(primitive).rooted:
    raise ValueError(f"root={root}: {primitive} has no root")
  if not 0 <= root < axis_size:
    raise ValueError(f"root={root} is out of range for an axis of size {axis_size}")
  built = algo.build(axis_size, **options)
  return built.relabel(root) if root else built
