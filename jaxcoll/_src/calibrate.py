"""``jaxcoll.calibrate``: a :class:`Profile` measured on the live mesh.

The cost model (:mod:`jaxcoll._src.auto.cost`) is linear in its parameters once a
schedule's loads are known (:func:`cost.features`): each ppermute charged to
the slowest class of link it uses (:mod:`topology`: where the mesh's devices
are) costs alpha_c + beta_c * B, plus mu per message
and nu per byte of all devices' messages over the devices, delta per buffer
byte, fresh per byte of large buffers made anew, gamma per byte touched
locally, codec per byte encoded for a compressed wire, plus one overhead per call. So
calibration times the schedules the dispatcher chooses among (all_reduce by ring,
recursive doubling, halving-doubling, binomial tree, and hierarchical over several axes;
all_gather ring; all_to_all direct and Bruck) at every size, the all_reduce ones once
more on an int8 wire (``CODEC_WIRE``: codec is what they take beyond their compressed
bytes), and fits every coefficient to those
times by non-negative least squares (``scipy.optimize.nnls``) weighted by 1/t
(relative error). Links come out per class, not per axis name, so a profile
measured on one mesh prices any other mesh of the same classes. Fitting
to whole schedules, not to one lone ppermute or one lone combine, folds in what
a step really costs in this runtime (its loop, its slices, the transport: in a
multi-process CPU job every pair goes through gloo). (A separately timed
combine ``v * 0.999 + v`` is no measure of gamma: its output is a fresh buffer,
and page faults put its slope far above the joint fit's gamma (measured:
docs/measurements.md#cost-model).) Every jax.lax collective jaxcoll calls "native" is
timed at every size too, over the whole tuple of axes and over each axis alone, recorded with
the class of the slowest link it spans (and so are the schedules timed for the
fit: measured beats modeled, :func:`cost.schedule_times`) (times in one process do not price a
collective across processes). :func:`measure` and :func:`fit` are the two
halves: ``benchmarks/calibrate_cpu.py`` fits the "cpu" preset to one run in one
process and one under ``jaxcoll.launch -n 2`` together.

All programs of one size are timed side by side (:func:`timing.interleaved`:
rounds in rotated order, medians), so none is measured on buffers left warm by
its own previous call (fresh-page faults dominate large CPU timings). In a
multi-process job every process runs the same programs and takes process 0's
numbers, so all processes hold the same profile and auto picks the same
algorithm everywhere (different picks would deadlock).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import sys
from collections.abc import Sequence

import jax
import numpy as np
import scipy.optimize
import tqdm
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcoll._src import checks, compat, timing
from jaxcoll._src import spec as spec_lib
from jaxcoll._src.auto import cost, topology
from jaxcoll._src.auto.profile import ANY_AXIS, FRESH_THRESHOLD, Link, NativeTimes, Profile
from jaxcoll._src.auto.topology import CLASSES
from jaxcoll._src.collectives import flat_call
from jaxcoll._src.schedules.algorithms import Algorithm, call_options, entries, schedule
from jaxcoll._src.wire import formats as wire_lib

# 4 MiB too: measured times are read piecewise-linearly between sizes (NativeTimes.time), and
# from 1 to 16 MiB the lax all_reduce is far from linear (2 processes: 6.0 ms read at 4 MiB
# where it takes 3.4; docs/measurements.md#cost-model). Gradient buckets live there.
DEFAULT_SIZES = (4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20)
CODEC_WIRE = "int8"   # the wire format the all_reduce schedules are timed on too (codec)
NATIVE_PRIMITIVES = spec_lib.primitives(timed=True)


def fit_algorithms(num_axes: int) -> tuple[Algorithm, ...]:
  """The schedules calibrate times and fits to over ``num_axes`` axes: those registered
  ``fit=True`` that run on them."""
  return tuple(a for p in spec_lib.PRIMITIVES for a in entries(p, num_axes=num_axes, fit=True))


def _fit(rows: Sequence[Sequence[float]], times: Sequence[float],
         scale: Sequence[float] | None = None) -> np.ndarray:
  """Non-negative least squares of rows @ coef = times (``scipy.optimize.nnls``), each row
  weighted by 1 / its scale (default: its time), so every point counts by its relative
  error."""
  a, t = np.asarray(rows, float), np.asarray(times, float)
  w = 1.0 / np.asarray(t if scale is None else scale, float)
  a, t = a * w[:, None], t * w
  norms = np.linalg.norm(a, axis=0)
  norms[norms == 0] = 1.0     # columns of different units: solve on unit columns
  return scipy.optimize.nnls(a / norms, t)[0] / norms


@dataclasses.dataclass(frozen=True)
class Measurements:
  """What :func:`measure` timed on one mesh: the feature rows and times of the schedules the
  model is fitted to, and the lax collectives' times. :func:`fit` turns one or more of them
  (say one process and two) into a :class:`Profile`; ``to_json`` keeps them for later."""

  rows: tuple[tuple[float, ...], ...]
  times: tuple[float, ...]
  native: tuple[NativeTimes, ...]
  classes: tuple[str, ...]     # the link classes the mesh uses
  platform: str

  @property
  def span(self) -> str:
    """The slowest class of link the mesh uses."""
    return max(self.classes, key=CLASSES.index)

  def to_json(self) -> dict:
    return {"rows": self.rows, "times": self.times, "classes": self.classes,
            "platform": self.platform, "native": Profile(native=self.native).to_json()["native"]}

  @classmethod
  def from_json(cls, data: dict) -> Measurements:
    native = Profile.from_json({"native": data["native"]}).native
    pad = lambda row: (*row, *(0.0,) * (cost.FEATURES - len(row)))   # kept before codec
    return cls(tuple(pad(r) for r in data["rows"]), tuple(data["times"]), native,
               tuple(data["classes"]), data["platform"])


def fit(measured: Sequence[Measurements], name: str = "calibrated") -> Profile:
  """The profile whose predictions best match the measurements (relative error), links per
  class measured; the ``"*"`` link (classes never measured) is the slowest measured one.
  Measurements of meshes that span slower links (another process) are fitted apart and kept
  as the profile's ``spans``: on the CPU every term differs there."""
  spans = sorted({m.span for m in measured}, key=CLASSES.index)
  if len(spans) > 1:
    own, *others = ([m for m in measured if m.span == s] for s in spans)
    return dataclasses.replace(_fit_one(own, name), spans={
        s: _fit_one(group, f"{name} across {s}") for s, group in zip(spans[1:], others)})
  return _fit_one(measured, name)


def _fit_one(measured: Sequence[Measurements], name: str) -> Profile:
  rows = [r for m in measured for r in m.rows]
  coef = _fit(rows, [t for m in measured for t in m.times])
  used = {c for m in measured for c in m.classes}
  links = {c: Link(alpha=float(coef[1 + 2 * i]), beta=float(coef[2 + 2 * i]))
           for i, c in enumerate(CLASSES) if c in used}
  links[ANY_AXIS] = links[max(used, key=CLASSES.index)]
  mu, nu, delta, fresh, gamma, codec = map(float, coef[-6:])
  return Profile(links=links, overhead=float(coef[0]), mu=mu, nu=nu, delta=delta, fresh=fresh,
                 fresh_threshold=FRESH_THRESHOLD, gamma=gamma, codec=codec,
                 native=tuple(t for m in measured for t in m.native), name=name,
                 basis=measured[0].platform)


def calibrate(mesh, axes: Sequence[str] | None = None, sizes: Sequence[int] = DEFAULT_SIZES, *,
              reps: int = 5, min_seconds: float = 1.0,
              primitives: Sequence[str] = NATIVE_PRIMITIVES, progress: bool = True,
              name: str = "calibrated") -> Profile:
  """Measures the cost model's coefficients (alpha and beta per link class the mesh uses,
  mu, nu, delta, fresh, gamma, codec, the call overhead) and the native collectives' times;
  returns a :class:`Profile` (``fit(measure(...))``).

  Args:
    mesh: the ``jax.sharding.Mesh`` to measure (all its devices take part).
    axes: the axes to measure (default: all of the mesh's).
    sizes: per-device message sizes M in bytes (multiples of 4 * devices).
    reps: the fewest timed rounds per size (medians; :func:`timing.interleaved`).
    min_seconds: more rounds per size until they have taken about this long
      (cheap, small sizes get more: that is where gloo's stalls hide the signal).
    primitives: the native collectives to time.
    progress: show a progress bar on stderr (tqdm).
    name: the profile's name.

  Runs programs on the mesh, so it must be called outside jit / shard_map.

  Returns:
    A :class:`Profile` trusted on this backend (``basis="measured"``): ``jaxcoll.config(
    profile=...)`` makes auto price with it; ``Profile.save`` keeps it.

  Raises:
    ValueError: an axis not in ``mesh``, a size below 4 bytes per device, a ``reps`` below
      1, a negative ``min_seconds``, a primitive that is not timed.
    RuntimeError: a call inside jit, shard_map or another transformation.

  Example:
    >>> import jax, numpy as np, jaxcoll
    >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("x",))
    >>> prof = jaxcoll.calibrate(mesh, sizes=(4096, 65536), reps=1, min_seconds=0.0,
    ...                          primitives=("all_reduce",), progress=False)
    >>> prof.trusted(jax.default_backend()), prof.name
    (True, 'calibrated')
  """
  return fit([measure(mesh, axes, sizes, reps=reps, min_seconds=min_seconds,
                      primitives=primitives, progress=progress)], name=name)


def measure(mesh, axes: Sequence[str] | None = None, sizes: Sequence[int] = DEFAULT_SIZES, *,
            reps: int = 5, min_seconds: float = 1.0,
            primitives: Sequence[str] = NATIVE_PRIMITIVES,
            progress: bool = True) -> Measurements:
  """The timings :func:`calibrate` fits (its arguments)."""
  if not compat.trace_state_clean():
    raise RuntimeError("calibrate() runs programs on the mesh; call it outside jit, shard_map "
                       "and other transformations, then pass the profile to jaxcoll.config")
  if not isinstance(mesh, jax.sharding.Mesh):
    raise TypeError(f"mesh={mesh!r}: expected the jax.sharding.Mesh to measure")
  axes, _ = checks.axes_in_mesh(mesh.axis_names if axes is None else axes, mesh, "axes")
  devices = mesh.devices.size
  sizes = tuple(checks.integer(s, "sizes", least=4 * devices) for s in sizes)
  for s in sizes:
    if s % (4 * devices):
      raise ValueError(f"sizes: {s} must be a positive multiple of 4 * {devices} bytes")
  if not sizes:
    raise ValueError("sizes=(): expected at least one size")
  checks.integer(reps, "reps", least=1)
  checks.number(min_seconds, "min_seconds", least=0)
  for p in primitives:
    if spec_lib.spec(p, argument="primitives").bus_factor is None:
      raise ValueError(f"primitives: {p!r} is not timed by calibrate; expected some of "
                       f"{NATIVE_PRIMITIVES}")
  spec = P(mesh.axis_names)
  sharding = NamedSharding(mesh, spec)
  _input_for = lambda primitive, s: int(spec_lib.spec(primitive).input_bytes(s, devices))
  groups = [axes] + ([(a,) for a in axes] if len(axes) > 1 else [])
  fitted = fit_algorithms(len(axes))

  def program(body):
    return jax.jit(jax.shard_map(lambda v: body(v[0])[None], mesh=mesh, in_specs=spec,
                                 out_specs=spec))

  axis_arg = axes if len(axes) > 1 else axes[0]
  coded = [a for a in fitted if a.primitive == "all_reduce"]
  programs = []   # (primitive, fn), in the order ``measured`` is read back below
  for algo, wire in [(a, None) for a in fitted] + [(a, CODEC_WIRE) for a in coded]:
    programs.append((algo.primitive, program(
        lambda v, p=algo.primitive, a=algo.name, w=wire: flat_call(p, v, axis_arg, a,
                                                                 wire_dtype=w))))
  for group in groups:
    for primitive in primitives:
      programs.append((primitive, program(
          lambda v, p=primitive, g=group: flat_call(p, v, g if len(g) > 1 else g[0], "native"))))
  bar = tqdm.tqdm(total=len(sizes), desc="calibrate", file=sys.stderr, leave=False,
                  disable=not progress)
  measured = np.zeros((len(programs), len(sizes)))
  for j, s in enumerate(sizes):
    inputs = {k: jax.device_put(np.zeros((devices, k // 4), np.float32), sharding)
              for k in {_input_for(p, s) for p, _ in programs}}   # shared: memory, not time
    args = [inputs[_input_for(p, s)] for p, _ in programs]
    calls = [lambda fn=fn, x=x: fn(x).block_until_ready() for (_, fn), x in zip(programs, args)]
    note = lambda r, k, s=s: bar.set_postfix_str(f"{s} B, round {r}/{k}", refresh=False)
    times = timing.interleaved(calls, reps=reps, min_seconds=min_seconds, on_round=note)
    measured[:, j] = [statistics.median(t) for t in times]
    bar.update()
  bar.close()
  if jax.process_count() > 1:   # every process prices with process 0's numbers
    from jax.experimental import multihost_utils
    measured = np.asarray(multihost_utils.broadcast_one_to_all(measured))

  shape = dict(mesh.shape)
  axis_sizes = tuple(shape[a] for a in axes)
  n = math.prod(axis_sizes)
  topo = {g: topology.of_devices(mesh.devices, mesh.axis_names, g) for g in groups}
  whole = topo[axes]
  ratio = wire_lib.wire_format(CODEC_WIRE, np.float32).ratio(np.float32)
  rows = []
  for algo, r in [(a, 1.0) for a in fitted] + [(a, ratio) for a in coded]:
    sched = schedule(algo.primitive, algo.name, n,
                     **call_options(algo.primitive, algo.name, axis_sizes))
    rows += [tuple(cost.features(sched, axis_sizes, s * r, FRESH_THRESHOLD, whole, r))
             for s in sizes]
  timed = len(fitted) + len(coded)
  native_rows = iter(measured[timed:])
  native = [NativeTimes(primitive, tuple(shape[a] for a in group), sizes,
                        tuple(float(t) for t in next(native_rows)), topo[group].span)
            for group in groups for primitive in primitives]
  native += [NativeTimes(algo.primitive, axis_sizes, sizes, tuple(map(float, times)),
                         whole.span, algo.name)
             for algo, times in zip(fitted, measured) if algo.num_axes == 1]
  return Measurements(tuple(rows), tuple(measured[:timed].reshape(-1).tolist()),
                      tuple(native), whole.used, mesh.devices.flat[0].platform)
