"""Resolving ``algorithm=`` for one call: "auto", a name, or an algorithm value.

An algorithm value (``jaxcoll.Hierarchical``) has a ``name`` and ``options()``, the
schedule options it adds; an algorithm registered over several axes also gets the axis
sizes (:func:`~jaxcoll._src.algorithms.registry.call_options`).

"auto" defers to the overrides of :mod:`jaxcoll._src.config`, then to the cost
model: the argmin of the predicted time (:mod:`jaxcoll._src.cost`) over every
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
import math
from collections.abc import Sequence

import jax

from jaxcoll._src import algorithms as algorithms_lib
from jaxcoll._src import config as config_lib
from jaxcoll._src import cost, debug_log
from jaxcoll._src import topology as topology_lib
from jaxcoll._src.algorithms import NATIVE, SCHEDULE, call_options, check_algorithm
from jaxcoll._src.profile import Profile
from jaxcoll._src.topology import Topology

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

  def beats(self, native: Candidate, margin: float) -> bool:
    """Whether it is ``margin`` times faster than ``native`` under every placement."""
    return all(t * margin < n for t, n in zip(self.placed_s, native.placed_s))


def profile_in_use(profile: Profile | str | None = None) -> Profile:
  """``profile`` (a preset's name or a profile JSON's path too: :meth:`Profile.resolve`), else
  the configured one, else the preset of the default backend."""
  if profile is not None:
    return Profile.resolve(profile)
  if config_lib.current().profile is not None:
    return config_lib.current().profile
  return Profile.preset(DEFAULT_PRESET.get(jax.default_backend(), "cpu"))


def candidates(primitive: str, axis_names: Sequence[str], axis_sizes: Sequence[int],
               nbytes: float, profile: Profile, *, partial_sum_scale: float = 1.0,
               topology: Topology | None = None):
  """Every algorithm "auto" weighs, native first, with its predicted time
  (:func:`cost.schedule_times`; ranks placed as ``topology`` says; default one process)."""
  placements = (topology, *topology.alternatives) if topology is not None else (None,)
  natives, priced = [], []
  for placed in placements:
    natives.append(cost.predict_native(primitive, profile, axis_names, axis_sizes,
                                       nbytes * partial_sum_scale, topology=placed))
    priced.append(cost.schedule_times(primitive, profile, axis_names, axis_sizes, nbytes,
                                      partial_sum_scale=partial_sum_scale, topology=placed))
  out = [Candidate(NATIVE, NATIVE, (), natives[0], None, tuple(natives[1:]))]
  for times in zip(*priced):   # one schedule under every placement
    label, algo, options, sched, t = times[0]
    out.append(Candidate(label, algo, tuple(sorted(options.items())), t, sched,
                         tuple(u[-1] for u in times[1:])))
  return out


def pick(weighed: Sequence[Candidate], *, native_allowed: bool = True,
         trusted: bool = True) -> Candidate:
  """Of ``candidates()``' result (native first): the schedule fastest against native (the
  least :meth:`Candidate.vs`: with one placement, the fastest predicted) if it beats native
  by ``NATIVE_MARGIN`` under every placement of the ranks consistent with what is known (or
  native is not allowed: a compressed wire), else native. Under a profile not ``trusted``
  on this backend (never measured there) native is kept wherever it is allowed."""
  native, *scheduled = weighed
  best = min(scheduled, key=lambda c: c.vs(native), default=native)
  if not native_allowed or (trusted and best.beats(native, NATIVE_MARGIN)):
    return best
  return native


def trusted(profile: Profile) -> bool:
  """Whether ``profile`` was measured on the default backend (or given by the user)."""
  return profile.trusted(jax.default_backend())


def choose(primitive, axis_names, axis_sizes, nbytes, profile, *, partial_sum_scale=1.0,
           native_allowed: bool = True, topology: Topology | None = None):
  """The candidate auto picks (:func:`pick` of every candidate)."""
  return pick(candidates(primitive, axis_names, axis_sizes, nbytes, profile,
                         partial_sum_scale=partial_sum_scale, topology=topology),
              native_allowed=native_allowed, trusted=trusted(profile))


def auto_label(primitive: str, axis_names: Sequence[str], axis_sizes: Sequence[int],
               nbytes: float, profile: Profile, *, partial_sum_scale: float = 1.0,
               weighed: Sequence[Candidate] | None = None, native_allowed: bool = True,
               topology: Topology | None = None) -> str:
  """What ``algorithm="auto"`` runs for this call (as :func:`resolve` decides), named as
  :func:`candidates` names it: an override, native on one device, else :func:`pick`.
  ``weighed``: the candidates, when already priced."""
  override = config_lib.override(primitive)
  if override is not None and override != NATIVE:   # checked as resolve checks it
    name = override if isinstance(override, str) else override.name
    call_options(primitive, name, axis_sizes)
    return (algorithms_lib.label(primitive, name, len(axis_names)) if isinstance(override, str)
            else override.label(primitive, len(axis_names)))
  if override is not None:
    return override
  if math.prod(axis_sizes) <= 1:
    return NATIVE
  return pick(weighed or candidates(primitive, axis_names, axis_sizes, nbytes, profile,
                                    partial_sum_scale=partial_sum_scale, topology=topology),
              native_allowed=native_allowed, trusted=trusted(profile)).label


def resolve(primitive: str, algorithm, *, axis_names: Sequence[str],
            axis_sizes: tuple[int, ...], nbytes: int,
            partial_sum_scale: float = 1.0, native_allowed: bool = True,
            call: str = "") -> tuple[str, dict]:
  """The concrete algorithm to run for one call and its schedule options (auto picks among
  the schedules only when not ``native_allowed``); logs the choice (:mod:`debug_log`;
  ``call`` describes the operand for it)."""
  if isinstance(algorithm, str) and algorithm == "auto":
    algorithm = config_lib.override(primitive) or "auto"
    if algorithm != "auto":
      debug_log.override(primitive, call, axis_names, str(algorithm))
  check_algorithm(primitive, algorithm, num_axes=len(axis_sizes))
  options = {}
  if not isinstance(algorithm, str):
    algorithm, options = algorithm.name, algorithm.options()
  if algorithm == SCHEDULE:
    algorithm, native_allowed = "auto", False
  if algorithm == "auto":
    if math.prod(axis_sizes) <= 1:
      return NATIVE, {}
    profile = profile_in_use()
    topo = topology_lib.current(axis_names, axis_sizes, config_lib.current().mesh)
    weighed = candidates(primitive, tuple(axis_names), tuple(axis_sizes), nbytes, profile,
                         partial_sum_scale=partial_sum_scale, topology=topo)
    measured_here = trusted(profile)
    chosen = pick(weighed, native_allowed=native_allowed, trusted=measured_here)
    debug_log.choice(primitive, call, axis_names, axis_sizes, chosen, weighed, profile, topo,
                     trusted=measured_here, native_allowed=native_allowed,
                     margin=NATIVE_MARGIN)
    return chosen.algorithm, dict(chosen.options)
  if algorithm == NATIVE:
    return NATIVE, {}
  return algorithm, call_options(primitive, algorithm, axis_sizes, options)
