"""Times every jaxcoll algorithm of one collective against the jax.lax collective.

Single process, 8 host-platform (CPU) devices. For each per-device message
size and algorithm the script compiles the collective first, then runs the
timed repetitions interleaved: every repetition loops over the sizes and,
within a size, over every algorithm in a rotated order, so slow drift and
noise (other processes, frequency scaling, the allocator) hit all algorithms
alike. Each call is timed with ``time.perf_counter()`` around
``fn(x).block_until_ready()``.

Bandwidths follow nccl-tests (PERFORMANCE.md): algbw = M / t and
busbw = algbw * factor, with factor 2(N-1)/N for all_reduce and (N-1)/N for
reduce_scatter, all_gather and all_to_all. M is the collective's buffer: the
per-device input for all_reduce, reduce_scatter and all_to_all, the gathered
per-device *output* for all_gather (each device contributes M / N). "x native" is the median time
divided by native's median time (> 1: slower than jax.lax).

Examples:
  python benchmarks/bench_collectives.py                     # full default sweep
  python benchmarks/bench_collectives.py --sizes 4K,1M --reps 3
  python benchmarks/bench_collectives.py --primitive all_gather --json ag.json
  python benchmarks/bench_collectives.py --primitive all_to_all --sizes 4K,64K,1M,16M,64M
  python benchmarks/bench_collectives.py --hlo               # HLO of the 16 MiB ring, then exit
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import collections  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jaxlib  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxcoll  # noqa: E402
from jaxcoll.tools import format_seconds, format_size, parse_size  # noqa: E402

N_DEVICES = 8
DTYPE = np.float32
BENCH_PRIMITIVES = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all")
DEFAULT_SIZES = "4K,16K,64K,256K,1M,4M,16M,64M"
# Sizes at or above this many bytes get --large-reps repetitions (default: --reps). Measured on
# 2 cores, one rep of the default sweep with all 7 all_reduce algorithms takes ~17 s (64 MiB:
# ~15 s of it), so the default 2 + 10 reps plus compiles take ~4-5 minutes; no reduction needed.
LARGE_BYTES = 16 << 20
HLO_OPS = ("collective-permute", "dynamic-update-slice", "dynamic-slice", "fusion", "copy",
           "while", "all-reduce")


# ----------------------------------------------------------------------------- sizes and units

def allocator() -> str:
  preload = os.environ.get("LD_PRELOAD", "")
  if "jemalloc" in preload:
    return f"jemalloc (LD_PRELOAD={preload})"
  return "glibc malloc"


# ----------------------------------------------------------------------------- the collectives

def make_case(primitive: str, algorithm: str, mesh, nbytes: int):
  """(jitted fn, global input shape) for one primitive / algorithm / message size.

  all_reduce:     each device has M bytes as [1, M/4]; out_specs=P() (replicated).
  reduce_scatter: each device has M bytes as [M/4], scatters dim 0 (tiled) -> [M/4/N].
  all_gather:     each device has M/N bytes, gathers (tiled) to the M-byte output.
  all_to_all:     each device has M bytes as [M/4], block j of dim 0 to device j (tiled).
  """
  n = mesh.devices.size
  ax = mesh.axis_names if len(mesh.axis_names) > 1 else mesh.axis_names[0]
  elems = nbytes // np.dtype(DTYPE).itemsize
  native = algorithm == "native"
  if primitive == "all_reduce":
    shape, out_specs = (n, elems), P()
    if native:
      body = lambda v: lax.psum(v, ax)
    else:
      body = lambda v: jaxcoll.all_reduce(v, ax, algorithm=algorithm)
  elif primitive == "reduce_scatter":
    shape, out_specs = (n * elems,), P(mesh.axis_names)
    if native:
      body = lambda v: lax.psum_scatter(v, ax, scatter_dimension=0, tiled=True)
    else:
      body = lambda v: jaxcoll.reduce_scatter(v, ax, scatter_dimension=0, tiled=True,
                                              algorithm=algorithm)
  elif primitive == "all_gather":
    shape, out_specs = (elems,), P(mesh.axis_names)
    if native:
      body = lambda v: lax.all_gather(v, ax, axis=0, tiled=True)
    else:
      body = lambda v: jaxcoll.all_gather(v, ax, axis=0, tiled=True, algorithm=algorithm)
  elif primitive == "all_to_all":
    shape, out_specs = (n * elems,), P(mesh.axis_names)
    if native:
      body = lambda v: lax.all_to_all(v, ax, 0, 0, tiled=True)
    else:
      body = lambda v: jaxcoll.all_to_all(v, ax, 0, 0, tiled=True, algorithm=algorithm)
  else:
    raise ValueError(primitive)
  fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(mesh.axis_names), out_specs=out_specs))
  return fn, shape


def check_size(primitive: str, nbytes: int, n: int) -> None:
  itemsize = np.dtype(DTYPE).itemsize
  unit = itemsize * (n if primitive in ("reduce_scatter", "all_gather", "all_to_all") else 1)
  if nbytes % unit:
    raise SystemExit(f"size {nbytes} B: {primitive} on {n} devices needs a multiple of {unit} B")


# ----------------------------------------------------------------------------- HLO report

_COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%?([\w.\-]+) = (\([^=]*?\)|[\w\[\],{}:]+) ([\w\-]+)\((.*)$")


def parse_hlo(text: str):
  """{computation: [(name, shape, opcode, rest)]}, the entry's name, fused computations."""
  comps: dict[str, list] = {}
  entry, current = None, None
  for line in text.splitlines():
    if current is None:
      m = _COMPUTATION.match(line)
      if m and "=" not in line.split("(")[0]:
        current = m.group(2)
        comps[current] = []
        if m.group(1):
          entry = current
      continue
    if line.strip() == "}":
      current = None
      continue
    m = _INSTRUCTION.match(line)
    if m:
      comps[current].append(m.groups())
  fused = {c for instrs in comps.values() for _, _, op, rest in instrs if op == "fusion"
           for c in re.findall(r"calls=%?([\w.\-]+)", rest)}
  return comps, entry, fused


def _shape_bytes(shape: str) -> int:
  total = 0
  for dtype, dims in re.findall(r"([a-z]+\d*)\[([\d,]*)\]", shape):
    bits = int(re.sub(r"\D", "", dtype) or 8)
    total += int(np.prod([int(d) for d in dims.split(",") if d] or [1])) * bits // 8
  return total


def _short(shape: str) -> str:
  return re.sub(r"\{[^}]*\}", "", shape)


def hlo_report(mesh, nbytes: int = 16 << 20) -> None:
  fn, shape = make_case("all_reduce", "ring", mesh, nbytes)
  x = jax.ShapeDtypeStruct(shape, DTYPE, sharding=NamedSharding(mesh, P("x")))
  text = fn.lower(x).compile().as_text()
  comps, entry, fused = parse_hlo(text)
  n = mesh.devices.size
  sched = jaxcoll.schedule("all_reduce", "ring", n)

  def count(names):
    c = collections.Counter(op for name in names for _, _, op, _ in comps[name])
    return {op: c.get(op, 0) + c.get(op + "-start", 0) for op in HLO_OPS}

  top = [c for c in comps if c not in fused]
  in_top, in_fused = count(top), count(fused)
  print(f"## Optimized HLO: ring all_reduce, {format_size(nbytes)} float32 per device, N={n}\n")
  print(f"schedule: {sched.num_steps} steps ({n - 1} reduce-scatter + {n - 1} all-gather), "
        f"chunk = {format_size(nbytes // n)}; HLO has {len(comps)} computations "
        f"({len(fused)} fused)\n")
  print("| op | unfused (entry, loop bodies) | inside fusions | total |")
  print("|---|---:|---:|---:|")
  for op in HLO_OPS:
    print(f"| {op} | {in_top[op]} | {in_fused[op]} | {in_top[op] + in_fused[op]} |")

  # One step = the instructions of the entry (or a while body) up to and including one
  # collective-permute; scalar index arithmetic, constants and bitcasts are left out.
  body = max(top, key=lambda c: sum(op == "collective-permute" for _, _, op, _ in comps[c]))
  steps, cur = [], []
  for name, shp, op, _ in comps[body]:
    if op in ("constant", "parameter", "bitcast", "partition-id") or _shape_bytes(shp) <= 8:
      continue
    cur.append((name, shp, op))
    if op == "collective-permute":
      steps.append(cur)
      cur = []
  if cur and steps:
    steps[-1] += cur

  def describe(step):
    parts = []
    for name, shp, op in step:
      label = re.sub(r"\.\d+$", "", name) if op == "fusion" else op
      parts.append(f"{label} {_short(shp)} ({format_size(_shape_bytes(shp))})")
    return " -> ".join(parts)

  # Whole-buffer copies, split into the copy of the (non-donated) input and the rest.
  aliases = {name for name, _, op, _ in comps[body] if op == "parameter"}
  for name, _, op, rest in comps[body]:
    if op == "bitcast" and re.match(r"%?([\w.\-]+)\)", rest).group(1) in aliases:
      aliases.add(name)
  copies = [(name, shp, re.match(r"%?([\w.\-]+)\)", rest).group(1))
            for name, shp, op, rest in comps[body] if op == "copy" and _shape_bytes(shp) >= nbytes]
  of_input = [c for c in copies if c[2] in aliases]
  between = [c for c in copies if c[2] not in aliases]
  loops = in_top["while"]
  print(f"\n{len(steps)} collective-permutes in `{body}`; "
        + (f"{loops} while loop(s)" if loops else
           f"no while loop (each ring phase has {n - 1} steps, fewer than the executor's "
           "LOOP_MIN_STEPS = 8, so it is unrolled)"))
  if len(steps) > n:
    print("Instructions between consecutive collective-permutes (the combine of the previous "
          "step, then the read for the next send):")
    print(f"- reduce-scatter, before step 2: {describe(steps[1])}")
    print(f"- all-gather, before step {n + 1}: {describe(steps[n])}")
  print("\nSummary: one ring step reads one chunk (M/N) of the [N, M/N] buffer (a fused"
        " dynamic-slice at a per-rank offset from a constant table), sends it to rank r+1 with one"
        " collective-permute, and writes the received chunk back in place with a"
        " dynamic-update-slice: reduce-scatter steps add it to the local chunk in the same fusion,"
        " all-gather steps overwrite.")
  if copies:
    size = format_size(_shape_bytes(copies[0][1]))
    print(f"Whole-buffer copies ({size} each): {len(of_input)} of the input (not donated), "
          f"{len(between)} between steps.")
  if between:
    rs = sum(1 for c in between
             if any(c[0] == name for step in steps[:n - 1] for name, _, _ in step))
    print(f"{rs} of those are in the reduce-scatter phase: XLA fuses the next send's read with a "
          "recomputation of the previous add+dynamic-update-slice "
          "(the `dynamic-update-slice_dynamic-slice_fusion`s), which keeps the old buffer live, "
          "so the in-place update has to copy the whole buffer first. Together: "
          f"{len(between)} x M of extra memory traffic per call beyond the ring's own.")

# ----------------------------------------------------------------------------- benchmark

def run_benchmark(args, mesh) -> int:
  primitive = args.primitive
  n = mesh.devices.size
  algos = list(jaxcoll.algorithms(primitive, num_axes=len(mesh.axis_names)))
  if args.algorithms:
    wanted = [a.strip() for a in args.algorithms.split(",") if a.strip()]
    unknown = sorted(set(wanted) - set(algos))
    if unknown:
      raise SystemExit(f"unknown {primitive} algorithm(s) {unknown}; choose from {algos}")
    algos = [a for a in algos if a in wanted]
    if "native" not in algos:
      algos.append("native")  # the baseline of the "x native" column
  sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
  for s in sizes:
    check_size(primitive, s, n)
  reps_for = {s: (args.large_reps if s >= LARGE_BYTES else args.reps) for s in sizes}

  print(f"# jaxcoll {primitive} benchmark\n")
  print(f"- jax {jax.__version__}, jaxlib {jaxlib.__version__}, "
        f"Python {platform.python_version()}, {platform.machine()}")
  cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
  print(f"- mesh: {dict(mesh.shape)}, collectives over {mesh.axis_names}")
  print(f"- devices: {n} x {jax.devices()[0].platform} (single process), CPU cores available: "
        f"{cores}")
  print(f"- allocator: {allocator()}")
  reps_note = f"{args.reps} timed reps"
  if any(r != args.reps for r in reps_for.values()):
    reps_note += f" ({args.large_reps} for sizes >= {format_size(LARGE_BYTES)}, --large-reps)"
  print(f"- {reps_note}, {args.warmup} warmup reps, interleaved (rotated algorithm order per "
        "rep); time = median")
  print(f"- dtype float32; busbw factor {jaxcoll.spec(primitive).bus_factor(n):.3f}; M = "
        + ("gathered output per device" if primitive == "all_gather" else "input per device"))
  print(f"- algorithms: {', '.join(algos)}\n")
  sys.stdout.flush()

  # Compile (and check) everything first.
  rng = np.random.default_rng(0)
  fns, inputs, errors, compile_s = {}, {}, {}, {}
  t_start = time.perf_counter()
  for s in sizes:
    ref = None
    for algo in ["native"] + [a for a in algos if a != "native"]:
      fn, shape = make_case(primitive, algo, mesh, s)
      if s not in inputs:
        host = rng.standard_normal(shape, dtype=DTYPE)
        inputs[s] = jax.device_put(host, NamedSharding(mesh, P(mesh.axis_names)))
        del host
      t0 = time.perf_counter()
      out = fn(inputs[s]).block_until_ready()  # compile + first run
      compile_s[s, algo] = time.perf_counter() - t0
      got = np.asarray(out)
      del out
      if ref is None:
        ref = got
      errors[s, algo] = float(np.max(np.abs(got - ref))) if got.size else 0.0
      fns[s, algo] = fn
    del ref, got
  print(f"compiled {len(fns)} (size, algorithm) pairs in {time.perf_counter() - t_start:.1f} s",
        file=sys.stderr)

  # Timed, interleaved repetitions.
  times = {key: [] for key in fns}
  max_reps = max(reps_for.values())
  t_start = time.perf_counter()
  for rep in range(-args.warmup, max_reps):
    for i, s in enumerate(sizes):
      if rep >= reps_for[s]:
        continue
      k = (rep + i) % len(algos)
      for algo in algos[k:] + algos[:k]:
        fn, x = fns[s, algo], inputs[s]
        t0 = time.perf_counter()
        fn(x).block_until_ready()
        dt = time.perf_counter() - t0
        if rep >= 0:
          times[s, algo].append(dt)
    elapsed = time.perf_counter() - t_start
    if rep == -1:
      eta = elapsed / args.warmup * max_reps
      print(f"warmup done ({elapsed:.1f} s); timed reps will take about {eta:.0f} s",
            file=sys.stderr)
    elif rep >= 0:
      print(f"rep {rep + 1}/{max_reps} done ({elapsed:.1f} s)", file=sys.stderr)

  # Report.
  factor = jaxcoll.spec(primitive).bus_factor(n)
  rows = []
  print("| size | algorithm | time | algbw GB/s | busbw GB/s | x native |")
  print("|---:|---|---:|---:|---:|---:|")
  for s in sizes:
    native_t = statistics.median(times[s, "native"])
    for algo in algos:
      t = statistics.median(times[s, algo])
      algbw = s / t / 1e9
      rows.append({"primitive": primitive, "size_bytes": s, "algorithm": algo,
                   "times_s": times[s, algo], "median_s": t, "algbw_GBps": algbw,
                   "busbw_GBps": algbw * factor, "x_native": t / native_t,
                   "first_call_s": compile_s[s, algo], "max_abs_err_vs_native": errors[s, algo]})
      print(f"| {format_size(s)} | {algo} | {format_seconds(t)} | {algbw:.3f} | "
            f"{algbw * factor:.3f} | {t / native_t:.2f} |")

  tol = 1e-4 * max(1.0, np.sqrt(n))
  bad = [(s, a, e) for (s, a), e in errors.items() if not e <= tol]
  if bad:
    print("\nWARNING: results differ from native by more than "
          f"{tol:g}: " + ", ".join(f"{a}@{format_size(s)}={e:.3g}" for s, a, e in bad))
  if args.json:
    meta = {"jax": jax.__version__, "devices": n, "platform": jax.devices()[0].platform,
            "allocator": allocator(), "reps": args.reps, "large_reps": args.large_reps,
            "large_bytes": LARGE_BYTES, "warmup": args.warmup, "primitive": primitive,
            "dtype": np.dtype(DTYPE).name, "bus_factor": factor, "cores": cores}
    with open(args.json, "w") as f:
      json.dump({"meta": meta, "results": rows}, f, indent=1)
    print(f"\nraw times written to {args.json}")
  return 1 if bad else 0


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--primitive", default="all_reduce", choices=BENCH_PRIMITIVES)
  parser.add_argument("--sizes", default=DEFAULT_SIZES,
                      help=f"comma list of per-device message sizes M (default {DEFAULT_SIZES})")
  parser.add_argument("--reps", type=int, default=10, help="timed repetitions (default 10)")
  parser.add_argument("--large-reps", type=int, default=None,
                      help=f"timed repetitions for sizes >= {format_size(LARGE_BYTES)} "
                      "(default: --reps)")
  parser.add_argument("--warmup", type=int, default=2, help="untimed repetitions (default 2)")
  parser.add_argument("--algorithms", default="",
                      help="comma list of algorithms (default: all; native is always added)")
  parser.add_argument("--json", default="", metavar="PATH", help="dump raw times to PATH")
  parser.add_argument("--mesh", default="8", choices=("8", "2x4", "4x2"),
                      help="8: one axis 'x'; 2x4 / 4x2: axes ('node', 'local'), every collective "
                      "over the tuple, hierarchical included (default 8)")
  parser.add_argument("--hlo", action="store_true",
                      help="print op counts of the optimized HLO of the 16 MiB ring all_reduce "
                      "and what one ring step does, then exit")
  args = parser.parse_args(argv)
  if args.large_reps is None:
    args.large_reps = args.reps
  if min(args.reps, args.large_reps) < 1 or args.warmup < 0:
    parser.error("--reps and --large-reps must be >= 1, --warmup >= 0")

  devices = jax.devices()
  if len(devices) < N_DEVICES:
    raise SystemExit(f"need {N_DEVICES} devices, found {len(devices)}")
  if args.mesh == "8":
    mesh = jax.sharding.Mesh(np.array(devices[:N_DEVICES]), ("x",))
  else:
    shape = tuple(int(d) for d in args.mesh.split("x"))
    mesh = jax.sharding.Mesh(np.array(devices[:N_DEVICES]).reshape(shape), ("node", "local"))
  if args.hlo:
    hlo_report(mesh)
    return 0
  return run_benchmark(args, mesh)


if __name__ == "__main__":
  raise SystemExit(main())
