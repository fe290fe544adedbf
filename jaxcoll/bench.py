"""Measure every collective, as nccl-tests does: ``python -m jaxcoll.bench`` (``jaxcoll-bench``).

  jaxcoll-bench -b 8 -e 64M -f 2 --op all_reduce --algorithm all --check
  python -m jaxcoll.launch -n 2 -- jaxcoll-bench --mesh 2x4 --axes node,local

For each message size (``-b`` to ``-e``, times ``-f``) every algorithm is timed
side by side (:func:`jaxcoll.tools.interleaved`: ``-w`` warm-up calls,
then ``-n`` rounds, each algorithm once per round in rotated order; medians).
Sizes are bytes per device as in :meth:`Schedule.bytes_per_rank`: the input
of all_reduce, reduce_scatter, broadcast, reduce and all_to_all, the output of
all_gather (nccl-tests' convention), rounded down to a multiple of
``devices x dtype size``. Columns: size, count (elements per device), dtype,
algorithm (``auto -> X``: what auto runs, which is X's program, timed once for both),
time (median, us), algbw = size /
time, busbw = algbw x nccl-tests' bus factor, #wrong (``--check``: elements
that differ from the native collective's result; the inputs are small integers,
so every algorithm's result is exact), and the time predicted by ``--profile``.

Bus factors (nccl-tests' PERFORMANCE.md): all_reduce 2(n-1)/n; reduce_scatter,
all_gather and all_to_all (n-1)/n; broadcast and reduce 1.

In one process ``--devices`` CPU devices are made (default 8); under
:mod:`jaxcoll.launch` (or any multi-host launcher) the job's devices are used,
and process 0 prints.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import io
import json
import math
import os
import signal
import statistics
import sys
import textwrap
import threading
from collections.abc import Callable, Sequence

import tqdm

from jaxcoll import tools, wire_dtypes
from jaxcoll.tools import NATIVE, format_size, parse_size

OPS = tools.primitives(timed=True)   # the collectives with a bus factor
# nccl-tests' -d names (and numpy's): "float" is float32 there, float64 in numpy
DTYPES = {"int8": "int8", "char": "int8", "uint8": "uint8", "int32": "int32", "int": "int32",
          "uint32": "uint32", "int64": "int64", "uint64": "uint64", "half": "float16",
          "float16": "float16", "fp16": "float16", "float": "float32", "float32": "float32",
          "fp32": "float32", "double": "float64", "float64": "float64", "fp64": "float64",
          "bfloat16": "bfloat16", "bf16": "bfloat16"}


def parse_dtype(name) -> object:
  """``-d``: an nccl-tests type name (float, half, bfloat16, int8, ...) or numpy's, as the numpy
  dtype JAX will really run. 64-bit types need x64 (JAX runs them as 32-bit otherwise)."""
  import jax
  import jax.numpy as jnp
  key = str(getattr(name, "name", name)).strip().lower()
  if key not in DTYPES:
    raise ValueError(f"-d/--dtype {name!r}: expected one of {', '.join(sorted(DTYPES))}")
  dt = jnp.dtype(DTYPES[key])
  if dt.itemsize == 8 and not jax.config.jax_enable_x64:
    raise ValueError(f"-d/--dtype {name!r} is a 64-bit type; JAX computes it as 32-bit unless "
                     "x64 is on (JAX_ENABLE_X64=1), which would halve the bytes timed")
  return dt


def size_sweep(begin: int, end: int, factor: float, step: int = 0) -> list[int]:
  """Sizes from ``begin`` to ``end``: times ``factor`` (nccl-tests' -f), or plus ``step``."""
  if begin <= 0 or end < begin:
    raise ValueError(f"sizes: -b {begin} and -e {end} must satisfy 0 < begin <= end")
  if not step and factor <= 1:
    raise ValueError(f"-f {factor} must be > 1 (or give -i, a step in bytes)")
  out, s = [], begin
  while s <= end:
    out.append(int(s))
    s = s + step if step else s * factor
  return out


def rounded_sizes(sizes: Sequence[int], unit: int) -> list[int]:
  """The sizes the bench measures: each rounded down to a multiple of ``unit`` (devices x
  dtype size; at least one unit), each once, in order."""
  return list(dict.fromkeys(max(unit, int(s) // unit * unit) for s in sizes))


def _count(least: int):
  """argparse type: an int of at least ``least`` (argparse names the flag in the error)."""
  def parse(text: str) -> int:
    try:
      value = int(text)
    except ValueError:
      raise argparse.ArgumentTypeError(f"{text!r} is not an int") from None
    if value < least:
      raise argparse.ArgumentTypeError(f"{value} must be at least {least}")
    return value
  return parse


def _seconds(text: str) -> float:
  try:
    value = float(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
  if not value >= 0:
    raise argparse.ArgumentTypeError(f"{value} must be >= 0")
  return value


class Interrupts:
  """A sweep's Ctrl-C, as a ``with`` block: the first SIGINT asks the sweep to stop before
  its next call (:attr:`requested`, which :func:`run` checks before every call of every
  program, so it stops within the measurement under way) and restores the default action,
  so a second one ends the process at once, whatever it is running. A flag rather than
  Python's KeyboardInterrupt, which is lost when it lands in a finalizer and waits for
  every library frame it unwinds. Outside the main thread (where Python takes no signal
  handler) it only holds the flag."""

  def __init__(self):
    self.requested = False
    self._previous = None

  def _first(self, signum, frame) -> None:
    self.requested = True
    signal.signal(signal.SIGINT, signal.SIG_DFL)

  def __enter__(self) -> Interrupts:
    if threading.current_thread() is threading.main_thread():
      self._previous = signal.signal(signal.SIGINT, self._first)
    return self

  def __exit__(self, *exc) -> bool:
    if self._previous is not None:
      signal.signal(signal.SIGINT, self._previous)
    return False


class Stopped(Exception):
  """Raised inside :func:`run` when its ``stop`` says so; run returns the rows measured."""


@dataclasses.dataclass(frozen=True)
class Row:
  """One measurement: an algorithm at a size."""

  op: str
  size: int            # bytes per device (all_gather: output)
  count: int           # elements per device (input)
  dtype: str
  algorithm: str       # what ran ("auto -> ring" for auto)
  time_us: float       # median
  algbw_gbs: float
  busbw_gbs: float
  wrong: int | None    # None without --check
  predicted_us: float | None
  rounds: int
  rel_err: float | None = None   # --check with --wire: max |y - native| / max |native|


def run(op: str, sizes: Sequence[int], algorithms: Sequence[str] | str = "all", *,
        mesh=None, axes: Sequence[str] | None = None, dtype="float32", iters: int = 20,
        warmup: int = 5, check: bool = False, profile=None, min_seconds: float = 0.0,
        progress: bool = False, wire: Sequence[str] = (),
        on_rows: Callable[[list[Row]], None] | None = None,
        stop: Callable[[], bool] | None = None) -> list[Row]:
  """Measures ``op`` at every size with every algorithm; returns one :class:`Row` each.

  Args:
    op: one of :data:`OPS`.
    sizes: bytes per device, each rounded down to a multiple of devices x itemsize
      (:func:`rounded_sizes`; sizes that round alike are measured once).
    algorithms: names of ``jaxcoll.algorithms(op)`` plus "auto", or "all" (every
      algorithm that runs over ``axes``, and auto); :class:`jaxcoll.Hierarchical`
      values too (labelled ``hierarchical(ring,ring; pieces 8,1)``).
    mesh: the mesh (default: every device on one axis "x").
    axes: the axes the collective runs over (default: all of the mesh's).
    dtype: the element type.
    iters: timed rounds (each algorithm once per round); medians.
    warmup: untimed calls of each algorithm first.
    check: count the elements that differ from the native collective's result.
    profile: a :class:`jaxcoll.Profile` (or preset name, or profile JSON path:
      :meth:`jaxcoll.Profile.resolve`): auto prices with it, and
      every row gets its predicted time.
    min_seconds: more rounds per size until they have taken this long.
    progress: a progress bar on stderr (process 0, tqdm).
    wire: compressed wire formats (all_reduce, reduce_scatter, all_gather, all_to_all): every
      scheduled algorithm also runs with each, labelled ``ring [int8]``. The
      inputs are then standard normal (not small integers), and ``check`` records
      each row's largest error relative to the native result's largest magnitude.
    on_rows: called with each size's rows as soon as they are measured.
    stop: asked before every call of every program (``Interrupts.requested``); when it says
      True the size under way is dropped and the rows of the sizes done are returned.
  """
  import jax
  import numpy as np
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import jaxcoll

  if op not in OPS:
    raise ValueError(f"op={op!r}: expected one of {OPS}")
  mesh = mesh or jax.make_mesh((jax.device_count(),), ("x",))
  axes, axis_sizes = tools.axes_in_mesh(tuple(axes or mesh.axis_names), mesh, "axes")
  n = math.prod(axis_sizes)
  if profile is not None:
    profile = jaxcoll.Profile.resolve(profile, "--profile / run(profile=...)")
  valid = jaxcoll.algorithms(op, num_axes=len(axes))
  if algorithms == "all" or algorithms == ["all"]:
    algorithms = [*valid, "auto"]
  for a in algorithms:
    if not isinstance(a, str):   # an algorithm value: jaxcoll.Hierarchical(...)
      if a.name not in valid:
        raise ValueError(f"{a} does not run {op} over {len(axes)} axis(es)")
    elif a != "auto" and a not in valid:
      raise ValueError(f"--algorithm {a!r} does not run {op} over {len(axes)} axis(es); "
                       f"expected 'auto', 'all' or some of {valid}")
  if wire and not tools.spec(op).wire:
    raise ValueError(f"--wire compresses {', '.join(tools.primitives(wire=True))}, not {op}")
  dt = parse_dtype(dtype)
  spec = P(mesh.axis_names)
  sharding = NamedSharding(mesh, spec)
  devices = mesh.devices.size
  axis_arg = axes if len(axes) > 1 else axes[0]
  prof = tools.profile_in_use(profile)
  measured_sizes = rounded_sizes(sizes, n * dt.itemsize)
  bar = tqdm.tqdm(total=len(measured_sizes), desc=op, file=sys.stderr, leave=False,
                  disable=not (progress and jax.process_index() == 0))

  with jaxcoll.config(profile=profile) if profile is not None else contextlib.nullcontext():
    rows = []
    for nbytes in measured_sizes:
      count = int(tools.spec(op).input_bytes(nbytes, n)) // dt.itemsize   # all_gather: M / n
      if wire:   # compression errs on every value; small integers would hide that
        host = np.random.default_rng(nbytes).standard_normal((devices, count)).astype(dt)
      else:   # small integers, different on every device: every algorithm's result is exact
        host = (np.arange(devices * count).reshape(devices, count) % 7
                + np.arange(devices)[:, None] % 3).astype(dt)
      x = jax.device_put(host, sharding)
      pricing = tools.Pricing.of(axes, axis_sizes, profile=prof, mesh_shape=dict(mesh.shape))
      decision = tools.decide(tools.Call.of(op, axes, axis_sizes, nbytes), pricing=pricing,
                              weigh=True)
      keys, labels, runs = [], [], {}   # what each row runs: (candidate label, wire)
      for a in algorithms:
        key = label = a
        if not isinstance(a, str):   # an algorithm value
          key = label = a.label(op, len(axes))
        elif a == "auto":
          key = decision.label
          label = f"auto -> {key}"
        elif a != NATIVE:   # its default variant, as auto names it: hierarchical(ring,ring)
          key = tools.label(op, a, len(axes))
        for w in (None, *(wire if a not in ("auto", NATIVE) else ())):
          keys.append((key, w))
          labels.append(label if w is None else f"{label} [{w}]")
          runs.setdefault((key, w), a)   # auto's pick is the same program as that algorithm's
      fns = {k: jax.jit(jax.shard_map(
          lambda v, a=a, w=k[1]: tools.flat_call(op, v[0], axis_arg, a, wire_dtype=w)[None],
          mesh=mesh, in_specs=spec, out_specs=spec)) for k, a in runs.items()}
      def timed(f, x=x):
        def call():
          if stop is not None and stop():
            raise Stopped
          f(x).block_until_ready()
        return call
      try:
        times = dict(zip(fns, tools.interleaved([timed(f) for f in fns.values()], reps=iters,
                                                warmup=warmup, min_seconds=min_seconds)))
      except Stopped:
        break
      wrong, errors = dict.fromkeys(fns), dict.fromkeys(fns)
      if check:
        native = jax.jit(jax.shard_map(lambda v: tools.flat_call(op, v[0], axis_arg, NATIVE)[None],
                                       mesh=mesh, in_specs=spec, out_specs=spec))
        want = _local(native(x))
        for k, f in fns.items():
          if wire:
            errors[k] = _relative_error(_local(f(x)), want)
          else:
            wrong[k] = _count_wrong(_local(f(x)), want)
      weighed = {c.label: c.predicted_s for c in decision.candidates}
      measured = []
      for key, label in zip(keys, labels):
        med = statistics.median(times[key])
        algbw = nbytes / med / 1e9
        predicted = weighed.get(key[0]) if profile is not None and key[1] is None else None
        measured.append(Row(op, nbytes, int(count), dt.name, label, med * 1e6, algbw,
                            algbw * tools.spec(op).bus_factor(n), wrong[key],
                            None if predicted is None else predicted * 1e6, len(times[key]),
                            errors[key]))
      rows += measured
      bar.update()
      if on_rows is not None:
        on_rows(measured)
  bar.close()
  return rows


def _local(y):
  """This process's shards of ``y``, in device order."""
  import numpy as np
  return [np.asarray(s.data) for s in sorted(y.addressable_shards, key=lambda s: s.device.id)]


def _count_wrong(got, want) -> int:
  """Elements that differ, summed over every process's shards."""
  import jax
  import numpy as np
  mine = sum(int(np.sum(g != w)) for g, w in zip(got, want))
  if jax.process_count() == 1:
    return mine
  from jax.experimental import multihost_utils
  return int(np.sum(multihost_utils.process_allgather(np.int64(mine))))


def _relative_error(got, want) -> float:
  """max |got - want| / max |want|, over every process's shards."""
  import jax
  import numpy as np
  err = max(float(np.max(np.abs(g.astype(np.float64) - w))) for g, w in zip(got, want))
  top = max(float(np.max(np.abs(w.astype(np.float64)))) for w in want)
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils
    err, top = (float(np.max(multihost_utils.process_allgather(np.float64(v))))
                for v in (err, top))
  return err / top if top else err


# ------------------------------------------------------------------ output

def to_csv(rows: Sequence[Row]) -> str:
  out = io.StringIO()
  fields = [f.name for f in dataclasses.fields(Row)]
  writer = csv.DictWriter(out, fieldnames=fields)
  writer.writeheader()
  for r in rows:
    writer.writerow(dataclasses.asdict(r))
  return out.getvalue()


COLUMNS = (("size", "(B)", 12), ("count", "(elements)", 12), ("type", "", 9),
           ("algorithm", "", 34), ("time", "(us)", 11), ("algbw", "(GB/s)", 8),
           ("busbw", "(GB/s)", 8), ("vs native", "", 10), ("#wrong", "", 7),
           ("rel err", "", 8), ("predicted", "(us)", 10))


def header_lines(title: str) -> list[str]:
  """nccl-tests' header: every line starts with ``#``."""
  names = " ".join(f"{n:>{w}}" if i != 3 else f"  {n:<{w - 2}}" for i, (n, _, w)
                   in enumerate(COLUMNS))
  units = " ".join(f"{u:>{w}}" if i != 3 else f"  {u:<{w - 2}}" for i, (_, u, w)
                   in enumerate(COLUMNS))
  return [f"# {title}", "#", "#" + names[1:], "#" + units[1:]]


def row_lines(rows: Sequence[Row]) -> list[str]:
  """One size's rows, as measured (the columns of :func:`header_lines`); "vs native": time
  over the native row's of the same op and size."""
  native = {(r.op, r.size): r.time_us for r in rows if r.algorithm == NATIVE}
  out = []
  for r in rows:
    ratio = native.get((r.op, r.size))
    cells = (r.size, r.count, r.dtype, r.algorithm, f"{r.time_us:.1f}", f"{r.algbw_gbs:.3f}",
             f"{r.busbw_gbs:.3f}", "-" if ratio is None else f"{r.time_us / ratio:.2f}",
             "-" if r.wrong is None else r.wrong,
             "-" if r.rel_err is None else f"{r.rel_err:.1e}",
             "-" if r.predicted_us is None else f"{r.predicted_us:.1f}")
    out.append(" ".join(f"{c:>{w}}" if i != 3 else f"  {c:<{w - 2}}"
                        for i, (c, (_, _, w)) in enumerate(zip(cells, COLUMNS))))
  return out


def footer_lines(rows: Sequence[Row]) -> list[str]:
  """nccl-tests' closing lines: wrong values, and the average bus bandwidth (over every row;
  then per algorithm)."""
  wrong = sum(r.wrong or 0 for r in rows)
  out = [f"# Out of bounds values : {wrong} {'OK' if not wrong else 'FAILED'}",
         f"# Avg bus bandwidth    : {statistics.mean(r.busbw_gbs for r in rows):.4g}"
         if rows else "# Avg bus bandwidth    : -"]
  for algo in dict.fromkeys(r.algorithm.split(" -> ")[0] for r in rows):
    mine = [r.busbw_gbs for r in rows if r.algorithm.split(" -> ")[0] == algo]
    out.append(f"#   {algo:<32} : {statistics.mean(mine):.4g}")
  return out


def require_matplotlib() -> None:
  """``--plot``'s check, made before any measuring."""
  try:
    import matplotlib  # noqa: F401
  except ImportError as e:
    raise SystemExit("--plot needs matplotlib: pip install 'jaxcoll[plot]' "
                     "(nothing was measured)") from e


def plot(rows: Sequence[Row], path: str, title: str = ""):
  """busbw against size, log-log, one line per (op, algorithm), native in black, auto drawn
  over it (it often runs native), the title wrapped to fit. Returns the (closed) figure."""
  require_matplotlib()
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  from matplotlib.ticker import FuncFormatter
  fig, ax = plt.subplots(figsize=(7.5, 4.8))
  ops = sorted({r.op for r in rows})
  for op in ops:
    for algo in dict.fromkeys(r.algorithm.split(" -> ")[0] for r in rows if r.op == op):
      mine = [r for r in rows if r.op == op and r.algorithm.split(" -> ")[0] == algo]
      label = algo if len(ops) == 1 else f"{op} {algo}"
      style = (dict(color="black", linewidth=2.5, zorder=4) if algo == NATIVE else   # auto
               dict(linestyle="--", color="tab:red", marker="x", markersize=7, linewidth=1.5,
                    zorder=6) if algo == "auto" else {})   # on top: it often runs native
      style.setdefault("marker", "o")
      ax.plot([r.size for r in mine], [max(r.busbw_gbs, 1e-9) for r in mine],
              **{"markersize": 3, **style}, label=label)
  ax.set_xscale("log", base=2)
  ax.set_yscale("log")
  ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: format_size(v, compact=True)))
  ax.set_xlabel("message size per device")
  ax.set_ylabel("busbw (GB/s)")
  ax.set_title("\n".join(textwrap.wrap(title, 90)), fontsize=9)   # whole, however long
  ax.grid(True, which="both", alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return fig


def _write(text: str, path: str) -> None:
  if path == "-":
    sys.stdout.write(text)
  else:
    with open(path, "w") as f:
      f.write(text)


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="jaxcoll-bench", description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("-b", "--minbytes", type=parse_size, default=parse_size("8"))
  p.add_argument("-e", "--maxbytes", type=parse_size, default=parse_size("64M"))
  p.add_argument("-f", "--stepfactor", type=float, default=2.0)
  p.add_argument("-i", "--stepbytes", type=parse_size, default=0,
                 help="fixed increment instead of -f")
  p.add_argument("--sizes", default=None, metavar="S[,S...]",
                 help="these sizes instead of the -b/-e sweep (e.g. 1M,16M,64M)")
  p.add_argument("--op", default="all_reduce",
                 help=f"one or more (comma-separated) of {', '.join(OPS)}")
  p.add_argument("--algorithm", default="all",
                 help="comma-separated names of jaxcoll.algorithms(op) and 'auto', or 'all'")
  p.add_argument("-d", "--datatype", "--dtype", dest="dtype", default="float",
                 help="nccl-tests' names (float, half, bfloat16, int8, int32, ...) or numpy's "
                      "(default float: float32)")
  p.add_argument("-o", "--op-reduce", dest="redop", default="sum",
                 help="nccl-tests' reduction op; the bench times sum (jaxcoll.all_reduce takes "
                      "op='prod', 'min', 'max', 'mean' in your program)")
  p.add_argument("-n", "--iters", type=_count(1), default=20, help="timed rounds (default 20)")
  p.add_argument("-w", "--warmup_iters", type=_count(0), default=5,
                 help="warm-up calls (default 5)")
  p.add_argument("--min-seconds", type=_seconds, default=0.0,
                 help="more rounds per size until they take this long")
  p.add_argument("--wire", default=None, metavar="W[,W...]",
                 help="also run each scheduled algorithm with these compressed wire formats "
                      f"({', '.join(wire_dtypes())})")
  p.add_argument("-c", "--check", type=int, nargs="?", const=1, default=0, choices=(0, 1),
                 help="count elements that differ from the native collective's result "
                      "(-c, -c 1; nccl-tests' form)")
  p.add_argument("--mesh", default=None, help="mesh shape, e.g. 2x4 (default: all devices)")
  p.add_argument("--axes", default=None, help="mesh axis names, e.g. node,local")
  p.add_argument("--over", default=None,
                 help="the axes the collective runs over (default: all of --axes)")
  p.add_argument("--pieces", default=None, metavar="P[,P...]",
                 help="also run hierarchical with its stages cut into these pieces, outermost "
                      "axis first (e.g. 8,1; jaxcoll.Hierarchical(pieces=...))")
  p.add_argument("--profile", default=None,
                 help="a preset name or a profile JSON: auto uses it; adds predicted times")
  p.add_argument("--calibrate", default=None, metavar="SIZES",
                 help="first run jaxcoll.calibrate on the mesh at these sizes (e.g. 1M,16M) "
                      "and use that profile (instead of --profile)")
  p.add_argument("--save-profile", default=None, metavar="PATH",
                 help="write the profile --calibrate measured")
  p.add_argument("-g", "--devices", type=_count(1), default=8,
                 help="CPU devices in a single-process run (default 8; nccl-tests' -g, GPUs "
                      "per thread); for several processes use jaxcoll-launch")
  p.add_argument("--json", default=None, metavar="PATH", help="rows as JSON ('-': stdout)")
  p.add_argument("--csv", default=None, metavar="PATH", help="rows as CSV ('-': stdout)")
  p.add_argument("--plot", default=None, metavar="PNG", help="busbw vs size (matplotlib)")
  p.add_argument("--no-progress", action="store_true")
  return p


def main(argv: Sequence[str] | None = None) -> int:
  """``jaxcoll-bench``; Ctrl-C (:class:`Interrupts`) stops the sweep and keeps what it
  measured (exit code 130)."""
  with Interrupts() as interrupts:
    return _main(argv, interrupts)


def _main(argv: Sequence[str] | None, interrupts: Interrupts) -> int:
  args = _parser().parse_args(argv)
  if args.redop != "sum":
    raise SystemExit(f"-o {args.redop}: the bench times sum only; jaxcoll.all_reduce(x, axis, "
                     "op='prod'|'min'|'max'|'mean') runs the others in your program")
  if args.plot:
    require_matplotlib()
  from jaxcoll import distributed
  if distributed.launched():
    distributed.initialize()
  else:   # read when the CPU backend starts, which has not happened yet
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
      os.environ["XLA_FLAGS"] = (flags + f" --xla_force_host_platform_device_count="
                                 f"{args.devices}").strip()
  import jax
  import numpy as np
  ops = [o.strip() for o in args.op.split(",")]
  for op in ops:
    if op not in OPS:
      raise SystemExit(f"--op {op!r}: expected one of {', '.join(OPS)}")
  try:
    dtype = parse_dtype(args.dtype)
    sizes = ([parse_size(v) for v in args.sizes.split(",")] if args.sizes else
             size_sweep(args.minbytes, args.maxbytes, args.stepfactor, args.stepbytes))
  except (ValueError, argparse.ArgumentTypeError) as e:
    raise SystemExit(str(e)) from e
  names = tuple(a.strip() for a in (args.axes or "x").split(","))
  shape = (tuple(int(d) for d in args.mesh.lower().split("x")) if args.mesh
           else (jax.device_count(),))
  if len(shape) != len(names):
    raise SystemExit(f"--mesh {args.mesh} has {len(shape)} axes but --axes names {len(names)}")
  if math.prod(shape) != jax.device_count():
    raise SystemExit(f"--mesh {'x'.join(map(str, shape))} needs {math.prod(shape)} devices; "
                     f"this job has {jax.device_count()}")
  mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(shape), names)
  over = tuple(a.strip() for a in args.over.split(",")) if args.over else names
  algorithms = "all" if args.algorithm == "all" else [a.strip() for a in
                                                       args.algorithm.split(",")]
  main_process = jax.process_index() == 0
  to_stdout = args.json == "-" or args.csv == "-"
  say = (lambda lines: print("\n".join(lines), flush=True)) \
      if main_process and not to_stdout else (lambda lines: None)
  profile = args.profile
  if args.calibrate:
    import jaxcoll
    profile = jaxcoll.calibrate(mesh, over, [parse_size(v) for v in args.calibrate.split(",")],
                                primitives=ops, progress=not args.no_progress and main_process,
                                name="calibrated")
    say([f"# calibrated: {profile.summary()}"])
    if args.save_profile and main_process:
      profile.save(args.save_profile)
  allocator = "jemalloc" if "jemalloc" in os.environ.get("LD_PRELOAD", "") else "system malloc"
  title = (f"{', '.join(ops)}, {dtype.name}: {jax.process_count()} process(es), "
           f"{jax.device_count()} devices ({jax.default_backend()}), mesh {dict(mesh.shape)}, "
           f"over {over}, medians of {args.iters} rounds; allocator {allocator}")
  say(header_lines(title))
  unit = math.prod(dict(mesh.shape)[a] for a in over) * dtype.itemsize
  if rounded_sizes(sizes, unit) != sizes:
    say([f"# sizes are multiples of {unit} B ({unit // dtype.itemsize} devices x "
         f"{dtype.itemsize} B): {', '.join(map(format_size, sizes))} measured as "
         f"{', '.join(map(format_size, rounded_sizes(sizes, unit)))}"])
  rows: list[Row] = []

  def took(measured: list[Row]) -> None:   # each size's rows, as soon as they are measured
    rows.extend(measured)
    say(row_lines(measured))

  for op in ops:
    chosen = algorithms
    if args.pieces and op != "all_to_all":   # all_to_all stages forward whole blocks
      import jaxcoll
      chosen = [*([*jaxcoll.algorithms(op, num_axes=len(over)), "auto"]
                  if algorithms == "all" else algorithms),
                jaxcoll.Hierarchical(pieces=tuple(int(v) for v in args.pieces.split(",")))]
    try:
      run(op, sizes, chosen, mesh=mesh, axes=over, dtype=dtype, iters=args.iters,
          warmup=args.warmup_iters, check=bool(args.check), profile=profile,
          min_seconds=args.min_seconds, progress=not args.no_progress,
          wire=tuple(w.strip() for w in args.wire.split(",")) if args.wire else (),
          on_rows=took, stop=lambda: interrupts.requested)
    except ValueError as e:
      raise SystemExit(str(e)) from e
    if interrupts.requested:
      break
  interrupted = interrupts.requested
  if not main_process:
    return 130 if interrupted else 0
  say(footer_lines(rows) + (["# interrupted: the rows above were measured"]
                            if interrupted else []))
  if args.json:
    _write(json.dumps({"title": title, "interrupted": interrupted,
                       "rows": [dataclasses.asdict(r) for r in rows]}, indent=1) + "\n",
           args.json)
  if args.csv:
    _write(to_csv(rows), args.csv)
  if args.plot:
    plot(rows, args.plot, title)
  if interrupted:
    return 130
  bad = sum(r.wrong or 0 for r in rows)
  if bad:
    print(f"{bad} wrong elements", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
