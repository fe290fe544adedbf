"""Link profiles: what one step over each mesh axis costs, and what the lax collectives cost.

A :class:`Link` prices one ppermute step with the alpha-beta model:
``alpha + beta * bytes`` (bytes: the most any device sends in the step). A
:class:`Profile` maps link classes to links (``"process"``, ``"host"``,
``"network"``: where the two devices are, :mod:`jaxcoll._src.auto.topology`), and
optionally mesh axis names to links (an explicit override for messages over that
axis), ``"*"`` covering whatever is not named; it adds ``gamma`` (seconds per
byte a device combines locally), ``overhead`` (seconds per collective call,
paid once), ``mu`` and ``nu``
(seconds of per-message and per-byte work a ppermute costs when every device
sends; devices that share CPUs do it one after another), ``delta`` (seconds per
buffer byte per ppermute), ``fresh`` (seconds per byte of buffers of at least
``fresh_threshold`` bytes made anew: page faults), ``codec`` (seconds per byte a device
encodes and decodes for a compressed wire), and optionally measured
times of the jax.lax collectives (``native``), which :func:`jaxcoll.calibrate`
records. The formula that uses them is in :mod:`jaxcoll._src.auto.cost`. Profiles
are frozen, hashable, and saved and loaded as JSON.

Presets (``Profile.preset(name)``): per-direction link rates from vendor data
sheets, alpha an estimate of one XLA collective-permute step (launch plus wire
latency), gamma from HBM bandwidth (a combine reads two bytes and writes one):

- "cpu": measured on the 2-core CPU testbed, 8 devices in one process, by
  ``python benchmarks/calibrate_cpu.py`` (``jaxcoll/presets/cpu.json``).
- "h100-nvlink", "h200-nvlink": NVLink 4, 900 GB/s per GPU both directions
  together = 450 GB/s per direction (NVIDIA H100 and H200 data sheets); NCCL
  reaches about 80% of it, so beta = 1/370 GB/s; alpha 8 us. HBM: H100 SXM
  3.35 TB/s, H200 4.8 TB/s.
- "infiniband-ndr400": 400 Gb/s per port = 50 GB/s per direction (NVIDIA
  ConnectX-7 / Quantum-2 NDR data sheets), about 90% reached: beta = 1/45 GB/s;
  alpha 12 us (a few us of wire and switch latency plus the launch).
- "tpu-v5p-ici": 4,800 Gb/s of ICI per chip over 6 links of its 3D torus
  (Google Cloud TPU v5p documentation) = 100 GB/s per link and direction;
  alpha 5 us; HBM 2.76 TB/s.
- "dcn": the data-center network between TPU slices or hosts, 200 Gb/s per host
  shared by its 4 chips (Google Cloud multislice documentation) = 6.25 GB/s
  per chip; alpha 30 us (TCP/IP stack and switch hops).

Without a measured native time a profile prices "native" as what NCCL would
run on the same links (see :mod:`jaxcoll._src.auto.cost`). The data-sheet presets were never
measured (per-ppermute launch costs on an accelerator are unknown to them), so under them
auto keeps native wherever native applies (``basis``); schedules still run when named,
when a wire format needs one, or under a profile from :func:`jaxcoll.calibrate`.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.resources
import json
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

from jaxcoll._src.auto.topology import CLASSES

ANY_AXIS = "*"
GIVEN, DATASHEET = "given", "datasheet"
FRESH_THRESHOLD = float(32 << 20)   # glibc's largest mmap threshold


@dataclasses.dataclass(frozen=True)
class Link:
  """One ppermute step over a mesh axis costs ``alpha + beta * bytes`` seconds."""

  alpha: float
  beta: float

  def __post_init__(self):
    for name in ("alpha", "beta"):
      v = getattr(self, name)
      if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
        raise ValueError(f"Link {name}={v!r} must be a finite number >= 0 (seconds"
                         f"{' per byte' if name == 'beta' else ''})")

  def time(self, nbytes: float) -> float:
    return self.alpha + self.beta * nbytes


@dataclasses.dataclass(frozen=True)
class NativeTimes:
  """Measured times of one collective over axes of sizes ``axis_sizes``, the jax.lax one
  (``algorithm="native"``) or a schedule: ``seconds[i]`` at ``sizes[i]`` bytes per device
  (M, as in :meth:`Schedule.bytes_per_rank`), on a mesh whose slowest link is of class
  ``span``."""

  primitive: str
  axis_sizes: tuple[int, ...]
  sizes: tuple[float, ...]
  seconds: tuple[float, ...]
  span: str = ""   # the slowest link class the measured mesh spans ("": not recorded)
  algorithm: str = "native"   # the lax collective, or the schedule that was timed

  def __post_init__(self):
    if len(self.sizes) != len(self.seconds) or not self.sizes:
      raise ValueError("NativeTimes needs one time per size (at least one)")
    if list(self.sizes) != sorted(self.sizes):
      raise ValueError("NativeTimes sizes must be increasing")

  def time(self, nbytes: float) -> float:
    """Piecewise-linear in the measured points; linear extrapolation past the ends."""
    xs, ys = self.sizes, self.seconds
    if len(xs) == 1:
      return ys[0]
    i = min(max(sum(x <= nbytes for x in xs) - 1, 0), len(xs) - 2)
    slope = (ys[i + 1] - ys[i]) / (xs[i + 1] - xs[i])
    return max(ys[i] + slope * (nbytes - xs[i]), min(ys))


def _frozen_links(links) -> tuple[tuple[str, Link], ...]:
  items = links.items() if isinstance(links, Mapping) else links
  out = []
  for axis, link in items:
    if not isinstance(axis, str):
      raise ValueError(f"Profile links: axis {axis!r} must be a mesh axis name or '*'")
    if not isinstance(link, Link):
      raise ValueError(f"Profile links[{axis!r}] = {link!r} must be a jaxcoll.Link")
    out.append((axis, link))
  return tuple(sorted(out))


@dataclasses.dataclass(frozen=True)
class Profile:
  """Costs the dispatcher prices schedules with.

  Args:
    links: ``{name: Link}``: a link class ("process", "host", "network"), a mesh axis name
      (overrides the class for messages over that axis), or ``"*"`` (everything else).
    gamma: seconds per byte a device combines locally (reduce steps).
    overhead: seconds per collective call (launch), added to every schedule.
    delta: seconds per byte of the whole buffer per ppermute (what a transfer
      costs beyond its messages as the buffer grows: loop carries).
    mu: seconds of per-message work in a ppermute in which every device sends
      (``mu * messages / devices``): what devices sharing CPUs or a NIC do one
      after another. 0 where every device has its own engine.
    nu: seconds per byte of every device's messages in a ppermute, over the devices
      (``nu * bytes * messages / devices``): bytes that devices sharing CPUs move
      one after another (TCP through the same cores). 0 where links are separate.
    fresh: seconds per byte of the buffers of at least ``fresh_threshold`` bytes a
      schedule makes anew (received messages, unrolled steps' copies): the first
      touch of fresh pages, on the CPU above glibc's mmap threshold.
    fresh_threshold: bytes; default 32 MiB (glibc's largest mmap threshold).
    codec: seconds per byte of a message sent on a compressed wire (counted uncompressed)
      that its sender encodes and decodes and its receiver decodes (:mod:`wire`); 0 where
      never measured.
    native: measured :class:`NativeTimes` of the jax.lax collectives.
    name: a label (the preset's name).
    spans: ``{class: Profile}``: the figures measured on meshes whose slowest link is of that
      class ("host", "network"), for the collectives that span such links
      (:meth:`for_span`). Every term may differ there, not only the links: on the CPU every
      message of a multi-process job goes through gloo.
    basis: where the figures come from, which decides whether auto may trust them to
      replace the lax collective: ``"given"`` (written by the user: trusted),
      ``"datasheet"`` (the vendor-figure presets: never measured, so auto keeps native
      wherever native applies), or the backend they were measured on (``"cpu"``,
      ``"gpu"``, ``"tpu"``: :func:`jaxcoll.calibrate` records it; trusted there only).
  """

  links: Any = ()
  gamma: float = 0.0
  overhead: float = 0.0
  delta: float = 0.0
  mu: float = 0.0
  nu: float = 0.0
  fresh: float = 0.0
  fresh_threshold: float = FRESH_THRESHOLD
  codec: float = 0.0
  native: tuple[NativeTimes, ...] = ()
  name: str = ""
  basis: str = GIVEN
  spans: Any = ()

  def __post_init__(self):
    object.__setattr__(self, "links", _frozen_links(self.links))
    object.__setattr__(self, "native", tuple(self.native))
    spans = tuple(sorted((self.spans.items() if isinstance(self.spans, Mapping)
                          else self.spans), key=lambda kv: CLASSES.index(kv[0])
                         if kv[0] in CLASSES else -1))
    for span, sub in spans:
      if span not in CLASSES[1:] or not isinstance(sub, Profile):
        raise ValueError(f"Profile spans: {span!r}: expected a jaxcoll.Profile under one of "
                         f"{CLASSES[1:]}")
    object.__setattr__(self, "spans", spans)
    for field in ("gamma", "overhead", "delta", "mu", "nu", "fresh", "fresh_threshold",
                  "codec"):
      v = getattr(self, field)
      if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
        raise ValueError(f"Profile {field}={v!r} must be a finite number >= 0")

  def for_span(self, span: str) -> Profile:
    """The figures for a collective whose slowest link is of class ``span``: those measured
    on the slowest span not slower than it (this profile's own are the fastest class's)."""
    pick = self
    for measured, sub in self.spans:
      if CLASSES.index(measured) <= CLASSES.index(span):
        pick = sub
    return pick

  def trusted(self, backend: str) -> bool:
    """Whether auto may replace the lax collective on ``backend`` by these figures."""
    return self.basis in (GIVEN, backend)

  def link(self, axis: str, link_class: str = CLASSES[0]) -> Link:
    """The link of a message over mesh axis ``axis`` between devices linked by class
    ``link_class``: the axis's own link if the profile names it, else the class's, else
    the ``"*"`` link. (A key that is a class name always means the class: an axis named
    "host" is priced by where its devices are.)"""
    found = dict(self.links)
    for key in ((axis,) if axis not in CLASSES else ()) + (link_class, ANY_AXIS):
      if key in found:
        return found[key]
    raise ValueError(f"profile {self.name or ''!s} has no link for axis {axis!r}, class "
                     f"{link_class!r} or '*'; it has {sorted(found)}")

  def native_times(self, primitive: str, axis_sizes: Sequence[int],
                   span: str | None = None, algorithm: str = "native") -> NativeTimes | None:
    """Measured times of ``algorithm`` (default: the lax collective) for these axis sizes,
    else for the same number of devices, else (the lax collective only) for the nearest
    number of devices measured; None if never measured. Only times on links of class
    ``span`` (or unrecorded): times measured within one process do not price a collective
    across processes."""
    mine = [t for t in self.native if t.primitive == primitive and t.algorithm == algorithm
            and (span is None or t.span in ("", span))]
    if algorithm != "native":
      mine = [t for t in mine if math.prod(t.axis_sizes) == math.prod(axis_sizes)]
    n = math.prod(axis_sizes)
    exact = [t for t in mine if t.axis_sizes == tuple(axis_sizes)]
    near = sorted(mine, key=lambda t: abs(math.log(math.prod(t.axis_sizes) / n)))
    return (exact or near or [None])[0]

  def summary(self) -> str:
    """The fitted numbers in one line (links, then the per-call and per-byte terms)."""
    links = ", ".join(f"{a}: alpha {link.alpha * 1e6:.0f} us, beta {link.beta * 1e9:.3f} ns/B"
                      for a, link in self.links)
    return (f"{links}; overhead {self.overhead * 1e6:.0f} us, mu {self.mu * 1e6:.0f} us, "
            f"nu {self.nu * 1e9:.3f} ns/B, "
            f"gamma {self.gamma * 1e9:.3f} ns/B, delta {self.delta * 1e9:.3f} ns/B, "
            f"fresh {self.fresh * 1e9:.3f} ns/B, codec {self.codec * 1e9:.3f} ns/B"
            + "".join(f"; across {span}: {sub.summary()}" for span, sub in self.spans))

  # -------------------------------------------------------------- presets and JSON

  @staticmethod
  def preset_names() -> tuple[str, ...]:
    """The names :meth:`preset` takes, sorted.

    Example:
      >>> import jaxcoll
      >>> "cpu" in jaxcoll.Profile.preset_names()
      True
    """
    return PRESET_NAMES

  @staticmethod
  def preset(name: str) -> Profile:
    """A built-in profile: one of :meth:`preset_names` (sources in the module docstring)."""
    if name in MEASURED:
      return _measured(name)
    if name not in PRESETS:
      raise ValueError(f"profile preset {name!r} is unknown; expected one of {PRESET_NAMES}")
    return PRESETS[name]

  @classmethod
  def resolve(cls, profile, where: str = "profile") -> Profile:
    """``profile`` as a :class:`Profile`, the one place a profile argument is read: a
    Profile as it is, a preset's name (:meth:`preset`; a preset wins over a file of the same
    name), or the path (``str`` or path-like) of a JSON file :meth:`save` wrote
    (:meth:`load`). Anything else is a ValueError that names ``where`` (the argument, as
    ``"config(profile=...)"``) and the accepted forms."""
    if isinstance(profile, Profile):
      return profile
    forms = (f"expected a jaxcoll.Profile, a preset name (one of {', '.join(PRESET_NAMES)}) "
             "or the path of a profile JSON (Profile.save)")
    if isinstance(profile, str) and profile in PRESET_NAMES:
      return cls.preset(profile)
    if not isinstance(profile, (str, os.PathLike)):
      raise ValueError(f"{where}: got {profile!r}; {forms}")
    if not os.path.isfile(profile):
      raise ValueError(f"{where}: no preset {os.fspath(profile)!r} and no file of that name; "
                       f"{forms}")
    try:
      return cls.load(profile)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
      raise ValueError(f"{where}: {os.fspath(profile)!r} is not a profile JSON "
                       f"({type(e).__name__}: {e}); {forms}") from e

  def to_json(self) -> dict:
    return {"name": self.name, "gamma": self.gamma, "overhead": self.overhead,
            "delta": self.delta, "mu": self.mu, "nu": self.nu, "fresh": self.fresh,
            "fresh_threshold": self.fresh_threshold, "codec": self.codec,
            "links": {a: dataclasses.asdict(link) for a, link in self.links},
            "native": [dataclasses.asdict(t) for t in self.native], "basis": self.basis,
            "spans": {span: sub.to_json() for span, sub in self.spans}}

  @classmethod
  def from_json(cls, data: dict) -> Profile:
    return cls(links={a: Link(**v) for a, v in data.get("links", {}).items()},
               gamma=data.get("gamma", 0.0), overhead=data.get("overhead", 0.0),
               delta=data.get("delta", 0.0), mu=data.get("mu", 0.0), nu=data.get("nu", 0.0),
               fresh=data.get("fresh", 0.0),
               fresh_threshold=data.get("fresh_threshold", FRESH_THRESHOLD),
               codec=data.get("codec", 0.0),
               native=tuple(NativeTimes(t["primitive"], tuple(t["axis_sizes"]), tuple(t["sizes"]),
                                        tuple(t["seconds"]), t.get("span", ""),
                                        t.get("algorithm", "native"))
                            for t in data.get("native", ())),
               name=data.get("name", ""), basis=data.get("basis", GIVEN),
               spans={span: cls.from_json(sub) for span, sub in data.get("spans", {}).items()})

  def save(self, path) -> None:
    with open(path, "w") as f:
      json.dump(self.to_json(), f, indent=1)

  @classmethod
  def load(cls, path) -> Profile:
    with open(path) as f:
      return cls.from_json(json.load(f))


def _gpu(name: str, hbm_bytes_per_s: float, link_bytes_per_s: float, alpha: float) -> Profile:
  return Profile(links={ANY_AXIS: Link(alpha, 1 / link_bytes_per_s)},
                 gamma=3 / hbm_bytes_per_s, name=name, basis=DATASHEET)


PRESETS: dict[str, Profile] = {
    "h100-nvlink": _gpu("h100-nvlink", 3.35e12, 370e9, 8e-6),
    "h200-nvlink": _gpu("h200-nvlink", 4.8e12, 370e9, 8e-6),
    "infiniband-ndr400": _gpu("infiniband-ndr400", 3.35e12, 45e9, 12e-6),
    "tpu-v5p-ici": _gpu("tpu-v5p-ici", 2.76e12, 100e9, 5e-6),
    "dcn": _gpu("dcn", 2.76e12, 6.25e9, 30e-6),
}

MEASURED = ("cpu",)
PRESET_NAMES = tuple(sorted((*PRESETS, *MEASURED)))


@functools.cache
def _measured(name: str) -> Profile:
  path = importlib.resources.files("jaxcoll.presets").joinpath(f"{name}.json")
  return Profile.from_json(json.loads(path.read_text()))
