"""Resolving ``algorithm=`` for one call: "auto", a name, or an algorithm value.

An algorithm value (``jaxcoll.Hierarchical``) has a ``name`` and ``options()``, the
schedule options it adds; an algorithm registered over several axes also gets the axis
sizes (:func:`~jaxcoll._src.schedules.algorithms.registry.call_options`).

"auto" defers to the overrides of :mod:`jaxcoll._src.config`, then to the cost
model: the argmin of the predicted time (:mod:`jaxcoll._src.auto.cost`) over every
algorithm of the primitive that runs on these axes, native included, with
hierarchical's per-axis stages chosen too. Native, the reference, is kept
unless a schedule is predicted ``NATIVE_MARGIN`` times faster, and always under a
profile never measured on this backend (the data-sheet presets: ``Profile.basis``): a
pick slower than the lax collective is the one mistake auto must not make, and a
calibrated model still predicts single schedules only approximately (measured:
docs/measurements.md#cost-model). Ties go to the order of ``algorithms()``. The choice
is a pure function of static information (primitive, message bytes, axis names
and sizes, profile), so every process of a multi-process job picks the same
algorithm.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence

from jaxcoll._src import compat, ops
from jaxcoll._src import config as config_lib
from jaxcoll._src.auto import cost, debug_log
from jaxcoll._src.auto import topology as topology_lib
from jaxcoll._src.auto.profile import Profile
from jaxcoll._src.auto.topology import Topology
from jaxcoll._src.schedules import algorithms as algorithms_lib
from jaxcoll._src.schedules.algorithms import NATIVE, SCHEDULE, call_options, check_algorithm
from jaxcoll._src.spec import PRIMITIVES
from jaxcoll._src.units import format_ms

NATIVE_MARGIN = 1.25
DEFAULT_PRESET = {"cpu": "cpu", "gpu": "h100-nvlink", "cuda": "h100-nvlink", "rocm": "h100-nvlink",
                  "tpu": "tpu-v5p-ici"}


@dataclasses.dataclass(frozen=True)
class Candidate:
  """One algorithm auto weighs: its label, name, schedule options and predicted seconds
  (``elsewhere_s``: under the other placements of the ranks consistent with what is known,
  where hosts are unknown: ``Topology.alternatives``)."""

  label: str
  algorithm: str
  options: tuple
  predicted_s: float
  schedule: object = None   # None for native
  elsewhere_s: tuple[float, ...] = ()

  @property
  def placed_s(self) -> tuple[float, ...]:
    """Predicted seconds under every placement, the first the one ``predicted_s`` is for."""
    return (self.predicted_s, *self.elsewhere_s)

  def vs(self, native: Candidate) -> float:
    """Its time over ``native``'s under the placement least favourable to it."""
    return max(t / max(n, 1e-30) for t, n in zip(self.placed_s, native.placed_s))



def profile_in_use(profile: Profile | str | None = None) -> Profile:
  """``profile`` (a preset's name or a profile JSON's path too: :meth:`Profile.resolve`), else
  the configured one, else the preset of the default backend."""
  if profile is not None:
    return Profile.resolve(profile)
  if config_lib.current().profile is not None:
    return config_lib.current().profile
  return Profile.preset(DEFAULT_PRESET.get(compat.target_backend(), "cpu"))


def candidates(primitive: str, axis_names: Sequence[str], axis_sizes: Sequence[int],
               nbytes: float, profile: Profile, *, partial_sum_scale: float = 1.0,
               native_scale: float | None = None, wire_ratio: float = 1.0,
               topology: Topology | None = None) -> tuple[Candidate, ...]:
  """Every algorithm "auto" weighs, native first, with its predicted time
  (:func:`cost.schedule_times`; ranks placed as ``topology`` says; default one process).
  ``native_scale``: the lax collective's bytes over M where they differ from the schedules'
  partial sums (stochastic rounding: it reduces float32). ``wire_ratio``: a compressed
  wire's bytes over the data's (``nbytes`` is then the compressed M).

  A pure function of its (hashable) arguments, priced once per distinct call: a step of
  many collectives of few shapes prices each shape once."""
  return _candidates(primitive, tuple(axis_names), tuple(int(n) for n in axis_sizes),
                     float(nbytes), profile, float(partial_sum_scale),
                     None if native_scale is None else float(native_scale), float(wire_ratio),
                     topology, algorithms_lib.registry.generation())


@functools.lru_cache(maxsize=4096)
def _candidates(primitive, axis_names, axis_sizes, nbytes, profile, partial_sum_scale,
                native_scale, wire_ratio, topology, generation) -> tuple[Candidate, ...]:
  del generation   # in the key: an algorithm registered since is priced too
  placements = (topology, *topology.alternatives) if topology is not None else (None,)
  natives, priced = [], []
  native_scale = partial_sum_scale if native_scale is None else native_scale
  for placed in placements:
    natives.append(cost.predict_native(primitive, profile, axis_names, axis_sizes,
                                       nbytes * native_scale, topology=placed))
    priced.append(cost.schedule_times(primitive, profile, axis_names, axis_sizes, nbytes,
                                      partial_sum_scale=partial_sum_scale,
                                      wire_ratio=wire_ratio, topology=placed))
  out = [Candidate(NATIVE, NATIVE, (), natives[0], None, tuple(natives[1:]))]
  for times in zip(*priced):   # one schedule under every placement
    label, algo, options, sched, t = times[0]
    out.append(Candidate(label, algo, tuple(sorted(options.items())), t, sched,
                         tuple(u[-1] for u in times[1:])))
  return tuple(out)


def clear_caches() -> None:
  """Forgets every schedule built, priced and planned, and every call priced, in this
  process (what auto's first choice in a fresh process starts from)."""
  cost.clear_caches()
  _candidates.cache_clear()


def pick(weighed: Sequence[Candidate], *, native_allowed: bool = True,
         trusted: bool = True) -> Candidate:
  """Of ``candidates()``' result (native first): the schedule fastest against native (the
  least :meth:`Candidate.vs`: with one placement, the fastest predicted) if it beats native
  by ``NATIVE_MARGIN`` under every placement of the ranks consistent with what is known (or
  native is not allowed: a compressed wire), else native. Under a profile not ``trusted``
  on this backend (never measured there) native is kept wherever it is allowed."""
  native, *scheduled = weighed
  best = min(scheduled, key=lambda c: c.vs(native), default=native)
  if not native_allowed or replaces(best.placed_s, native.placed_s, trusted=trusted):
    return best
  return native


def replaces(challenger_s: Sequence[float], default_s: Sequence[float], *,
             trusted: bool = True) -> bool:
  """The margin rule, the one place it is applied: a challenger (a schedule against the lax
  collective; MoE's allgather formulation against its all_to_all) replaces the default only
  under a profile ``trusted`` on this backend, and only where it is predicted
  ``NATIVE_MARGIN`` times faster under every placement of the ranks (seconds per placement,
  the same placements in the same order).

  Example:
    >>> from jaxcoll.extend import replaces
    >>> replaces([1.0], [1.2]), replaces([1.0], [1.3]), replaces([1.0], [1.3], trusted=False)
    (False, True, False)
  """
  return trusted and all(t * NATIVE_MARGIN < d for t, d in zip(challenger_s, default_s))


def offered(primitive: str, algorithm, num_axes: int):
  """``algorithm`` for a call of ``primitive`` over ``num_axes`` axes where a name applies to
  several primitives (``use(algorithm="ring")``, FSDP's gather and its gradient's
  reduce-scatter): the name where the primitive offers it over that many axes; "auto" for
  "auto" and "native"; for a schedule's name the primitive lacks, "schedule" (auto among
  jaxcoll's schedules: a schedule asked for keeps the call off the lax collective). An
  algorithm value (not a name) is returned as it is. The one place this fallback is
  decided.

  Example:
    >>> from jaxcoll.extend import offered_algorithm
    >>> offered_algorithm("all_reduce", "ring", 1), offered_algorithm("all_to_all", "ring", 1)
    ('ring', 'schedule')
  """
  if not isinstance(algorithm, str) or algorithm in algorithms_lib.algorithms(
      primitive, num_axes=num_axes):
    return algorithm
  return "auto" if algorithm in ("auto", NATIVE) else SCHEDULE


def trusted(profile: Profile) -> bool:
  """Whether ``profile`` was measured on the backend the program is for
  (:func:`compat.target_backend`), or given by the user."""
  return profile.trusted(compat.target_backend())


def choose(primitive, axis_names, axis_sizes, nbytes, profile, *, partial_sum_scale=1.0,
           native_allowed: bool = True, topology: Topology | None = None):
  """The candidate the model picks (:func:`pick` of every candidate), overrides aside."""
  return pick(candidates(primitive, axis_names, axis_sizes, nbytes, profile,
                         partial_sum_scale=partial_sum_scale, topology=topology),
              native_allowed=native_allowed, trusted=trusted(profile))


# --------------------------------------------------------------------------- the decision

@dataclasses.dataclass(frozen=True)
class Call:
  """One collective call as auto prices it, made once per call.

  ``nbytes`` is the message M (:meth:`CollectiveSpec.message_bytes`) of the data's dtype;
  :attr:`priced_bytes` what the schedules send of it (a wire format's ``ratio``).
  ``native_allowed`` is False under a compressed wire (the lax collective cannot send one).
  ``native_scale``: the lax collective's partial sums over M where they differ from the
  schedules' (stochastic rounding without ``accumulate``: it reduces float32).
  """

  primitive: str
  axis_names: tuple[str, ...]
  axis_sizes: tuple[int, ...]
  nbytes: float
  partial_sum_scale: float = 1.0
  wire_ratio: float = 1.0
  native_allowed: bool = True
  description: str = ""
  native_scale: float | None = None

  @classmethod
  def of(cls, primitive: str, axis_names: Sequence[str], axis_sizes: Sequence[int],
         nbytes: float, dtype=None, *, accumulate=None, wire=None, stochastic: bool = False,
         description: str = "") -> Call:
    """The call of ``primitive`` on data of ``dtype`` whose message is ``nbytes``, with
    float32 partial sums (``accumulate``) or a :class:`WireFormat` (``wire``: compressed
    wherever there is more than one device; ``description`` then names it too), and
    whether it rounds stochastically (then the lax collective reduces float32)."""
    compressed = wire is not None and math.prod(axis_sizes) > 1
    scale = 1.0 if dtype is None else ops.partial_sum_scale(dtype, accumulate)
    native_scale = None
    if stochastic:
      description += " stochastic"
      if accumulate is None:
        native_scale = ops.partial_sum_scale(dtype, "float32")
    if compressed:
      description += f" wire {wire.name}"
    return cls(primitive, tuple(axis_names), tuple(int(s) for s in axis_sizes), nbytes, scale,
               wire.ratio(dtype) if compressed else 1.0, not compressed, description,
               native_scale)

  @property
  def priced_bytes(self) -> float:
    return self.nbytes * self.wire_ratio


@dataclasses.dataclass(frozen=True)
class Pricing:
  """What a call is priced under: the profile, where the ranks sit (``topology``), and
  whether the profile was measured on this backend (``trusted``)."""

  profile: Profile
  topology: Topology | None = None

  @property
  def trusted(self) -> bool:
    return trusted(self.profile)

  @classmethod
  def of(cls, axis_names: Sequence[str], axis_sizes: Sequence[int], *, profile=None,
         mesh_shape: dict | None = None) -> Pricing:
    """:func:`profile_in_use` (``profile``) and the topology of the axes: on a mesh of
    ``mesh_shape`` (``{axis: size}``) when given, else on the mesh traced now
    (:func:`topology.current`); placed by ``jaxcoll.config(mesh=...)`` when it is that mesh."""
    mesh = config_lib.current().mesh
    if mesh_shape is None:
      topo = topology_lib.current(axis_names, axis_sizes, mesh)
    else:
      topo = topology_lib.of_mesh_shape(tuple(mesh_shape), tuple(mesh_shape.values()),
                                        tuple(axis_names), mesh)
    return cls(profile_in_use(profile), topo)


@dataclasses.dataclass(frozen=True)
class Decision:
  """What one call runs and why: :func:`decide`'s result.

  ``algorithm`` and ``options`` run (:func:`schedule`); ``label`` names it as
  :func:`candidates` does; ``candidates`` were weighed (empty where nothing was priced);
  ``overridden`` when ``jaxcoll.config`` / ``JAXCOLL_ALGORITHM`` chose; ``reason`` in words.
  """

  call: Call
  algorithm: str
  options: tuple
  label: str
  reason: str
  candidates: tuple[Candidate, ...] = ()
  pricing: Pricing | None = None
  overridden: bool = False

  @property
  def chosen(self) -> Candidate | None:
    """The weighed candidate that runs (None where nothing was weighed)."""
    return next((c for c in self.candidates if c.label == self.label), None)


def decide(call: Call, algorithm="auto", pricing: Pricing | None = None, *,
           weigh: bool = False) -> Decision:
  """What ``call`` runs with ``algorithm=``: the one place "auto" is decided, for the
  collectives, :func:`jaxcoll.explain`, the debug log and the benchmarks.

  "auto" defers to an override (``jaxcoll.config`` / ``JAXCOLL_ALGORITHM``), then runs native
  on one device, else :func:`pick` of the :func:`candidates` priced under ``pricing``
  (default :meth:`Pricing.of` the call's axes as traced now). "schedule" is auto without
  native. A name or an algorithm value runs as given. ``weigh``: price the candidates even
  where the choice does not need them (explain lists them).

  Raises:
    ValueError / TypeError: an algorithm that does not run this primitive on these axes.
  """
  primitive, axes, sizes = call.primitive, call.axis_names, call.axis_sizes
  overridden = False
  if isinstance(algorithm, str) and algorithm == "auto":
    override = config_lib.override(primitive)
    if override is not None:
      algorithm, overridden = override, True
  check_algorithm(primitive, algorithm, num_axes=len(sizes))
  options, label = {}, None
  if not isinstance(algorithm, str):
    label = algorithm.label(primitive, len(axes))
    algorithm, options = algorithm.name, algorithm.options()
  native_allowed = call.native_allowed
  if algorithm == SCHEDULE:
    algorithm, native_allowed = "auto", False
  one_device = math.prod(sizes) <= 1
  weighed = ()
  if weigh or (algorithm == "auto" and not one_device):
    pricing = pricing or Pricing.of(axes, sizes)
    weighed = tuple(candidates(primitive, axes, sizes, call.priced_bytes, pricing.profile,
                               partial_sum_scale=call.partial_sum_scale,
                               native_scale=call.native_scale, wire_ratio=call.wire_ratio,
                               topology=pricing.topology))
  given = "overridden by jaxcoll.config / " + config_lib.ENV_ALGORITHM if overridden else \
      "the algorithm= argument"
  if algorithm == "auto" and one_device:
    return Decision(call, NATIVE, (), NATIVE, "one device: the lax collective", weighed,
                    pricing, overridden)
  if algorithm == "auto":
    chosen = pick(weighed, native_allowed=native_allowed, trusted=pricing.trusted)
    reason = why(chosen, weighed, trusted=pricing.trusted, native_allowed=native_allowed,
                 profile_name=pricing.profile.name)
    return Decision(call, chosen.algorithm, chosen.options, chosen.label, reason, weighed,
                    pricing, overridden)
  if algorithm == NATIVE:
    return Decision(call, NATIVE, (), NATIVE, given, weighed, pricing, overridden)
  options = call_options(primitive, algorithm, sizes, options)
  label = label or algorithms_lib.label(primitive, algorithm, len(axes))
  return Decision(call, algorithm, tuple(sorted(options.items())), label, given, weighed,
                  pricing, overridden)


def why(chosen: Candidate, weighed: Sequence[Candidate], *, trusted: bool,
        native_allowed: bool, profile_name: str) -> str:
  """The reason the model picked ``chosen`` out of ``weighed`` (native first), in words."""
  native, *scheduled = weighed
  best = min(scheduled, key=lambda c: c.vs(native), default=native)
  if not native_allowed:
    return (f"native cannot send a wire format (or algorithm='schedule' excludes it); "
            f"fastest schedule {best.label}")
  if not trusted:
    return (f"profile {profile_name or 'custom'} was not measured on this backend: native "
            f"kept (fastest schedule {best.label}, predicted {format_ms(best.predicted_s)})")
  ratio = 1 / max(best.vs(native), 1e-30)
  placed = "" if not best.elsewhere_s else " under every placement of the hosts"
  if chosen is native:
    return (f"fastest schedule {best.label} predicted {format_ms(best.predicted_s)}, {ratio:.2f}x "
            f"native's speed{placed}; a schedule must be {NATIVE_MARGIN:g}x faster")
  return (f"{ratio:.2f}x faster than native{placed}; a schedule must be {NATIVE_MARGIN:g}x "
          "faster")


def resolve(call: Call, algorithm) -> tuple[str, dict]:
  """The algorithm one traced call runs and its schedule options (:func:`decide`), logged
  (:mod:`debug_log`)."""
  decision = decide(call, algorithm)
  debug_log.decision(decision)
  return decision.algorithm, dict(decision.options)


# ---- the settings auto reads (jaxcoll.config, one declaration each) ----

def check_choice(primitive, algorithm, where: str):
  """``{primitive: algorithm}`` as config, ``use`` and ``JAXCOLL_ALGORITHM`` take it."""
  if primitive not in PRIMITIVES:
    raise ValueError(f"{where}: {primitive!r} is not a collective; expected one of {PRIMITIVES}")
  check_algorithm(primitive, algorithm, argument=f"{where}[{primitive!r}]")


def _check_algorithm(algorithm, name):
  """``{primitive: algorithm}`` kept as sorted pairs; a variable's text parsed to pairs."""
  where = "config(algorithm=...)" if name == "algorithm" else name
  if isinstance(algorithm, tuple):
    algorithm = dict(algorithm)
  if not isinstance(algorithm, Mapping):
    raise ValueError(f"config(algorithm={algorithm!r}): expected a mapping "
                     "{primitive: algorithm}")
  for p, a in algorithm.items():
    check_choice(p, a, where)
  return tuple(sorted(algorithm.items()))


def _parse_algorithm(text: str) -> tuple[tuple[str, str], ...]:
  """``JAXCOLL_ALGORITHM``: ``all_reduce=ring,all_gather=bruck``."""
  out = {}
  for item in filter(None, (s.strip() for s in text.split(","))):
    primitive, sep, algorithm = item.partition("=")
    if not sep:
      raise ValueError(f"{config_lib.ENV_ALGORITHM}={text!r}: expected primitive=algorithm "
                       "pairs separated by commas, e.g. all_reduce=ring,all_gather=bruck")
    out[primitive.strip()] = algorithm.strip()
  return tuple(out.items())


def _merge_algorithm(outer, inner):
  return tuple(sorted({**dict(outer), **dict(inner)}.items()))


def _check_mesh(mesh, name):
  if not (hasattr(mesh, "devices") and hasattr(mesh, "axis_names")):
    raise ValueError(f"config(mesh={mesh!r}): expected a jax.sharding.Mesh")
  return mesh


config_lib.config_field("algorithm", default=(), check=_check_algorithm,
                        env=config_lib.ENV_ALGORITHM, parse=_parse_algorithm,
                        merge=_merge_algorithm, built_in=True)
config_lib.config_field("profile", check=lambda p, name: Profile.resolve(p, "config(profile=...)"),
                        built_in=True)
config_lib.config_field("mesh", check=_check_mesh, built_in=True)
