"""Does ``algorithm="auto"`` pick the fastest collective? Calibrate, then measure everything.

Runs on a 2 x 4 mesh ("node", "local"), every collective over the tuple:
  --processes 1: 8 CPU devices in one process;
  --processes 2: 2 processes x 4 devices on loopback, gloo (jaxcoll.launch).
First ``jaxcoll.calibrate`` measures the mesh at the benchmark's sizes. Then, for
every size, every algorithm of ``--primitive`` (default all_reduce; flat ones
over the tuple, hierarchical with auto's per-axis stages when auto picks it,
else the default) and native are timed side by side (``jaxcoll.tools.interleaved``:
rounds in rotated order, at least ``--reps``, more at small sizes; medians).
The table: auto's pick, auto / fastest measured, auto / native, predicted /
measured for auto's pick, and the fastest algorithm. Process 0 prints.

  python benchmarks/bench_dispatch.py --processes 1
  python benchmarks/bench_dispatch.py --processes 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from jaxcoll import tools
from jaxcoll.tools import format_seconds, format_size, parse_size

SIZES = "1K,4K,16K,64K,256K,1M,4M,16M,64M"


def _elements(primitive: str, nbytes: int) -> int:
  """float32 elements per device of an M-byte message (all_gather: M is the output)."""
  return int(tools.spec(primitive).input_bytes(nbytes, 8)) // 4


def child(args) -> int:
  import jax
  import numpy as np
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import jaxcoll

  main = jax.process_index() == 0
  say = (lambda *a: print(*a, flush=True)) if main else (lambda *a: None)
  devices = jax.devices()
  if len(devices) != 8:
    raise SystemExit(f"need 8 devices in all, found {len(devices)}")
  axes = ("node", "local")
  mesh = jax.sharding.Mesh(np.array(devices).reshape(2, 4), axes)
  sizes = [parse_size(s) for s in args.sizes.split(",")]
  start = time.perf_counter()
  profile = jaxcoll.calibrate(mesh, sizes=sizes, reps=args.reps, min_seconds=args.min_seconds,
                              progress=main, primitives=(args.primitive,),
                              name=f"{args.processes}-process")
  say(f"calibrated in {time.perf_counter() - start:.0f} s: {profile.summary()}")
  if args.save_profile and main:
    profile.save(args.save_profile)

  spec = P(axes)
  sharding = NamedSharding(mesh, spec)
  flat = list(jaxcoll.algorithms(args.primitive, num_axes=1))
  picks, median, predicted = {}, {}, {}
  for s in sizes:
    decision = tools.decide(tools.Call.of(args.primitive, axes, (2, 4), s),
                            pricing=tools.Pricing.of(axes, (2, 4), profile=profile,
                                                     mesh_shape=dict(mesh.shape)))
    pick = picks[s] = decision.chosen
    weighed = decision.candidates
    hier = (jaxcoll.Hierarchical(dict(pick.options)["per_axis"])
            if pick.algorithm == jaxcoll.Hierarchical.name else jaxcoll.Hierarchical())
    algos = {a: a for a in flat if a != jaxcoll.Hierarchical.name}
    algos[hier.label(args.primitive, len(axes))] = hier
    predicted.update({(s, c.label): c.predicted_s for c in weighed if c.label in algos})
    calls = []
    for algo in algos.values():
      body = lambda v, algo=algo: tools.flat_call(args.primitive, v[0], axes, algo)[None]
      fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))
      x = jax.device_put(np.ones((8, _elements(args.primitive, s)), np.float32), sharding)
      calls.append(lambda fn=fn, x=x: fn(x).block_until_ready())
    times = tools.interleaved(calls, reps=args.reps, min_seconds=args.min_seconds)
    for label, t in zip(algos, times):
      median[s, label] = statistics.median(t)
    say(f"{format_size(s)}: {len(times[0])} rounds")
  if not main:
    return 0
  print(f"\n## {args.primitive} over {axes} (2x4), {args.processes} process(es), float32, "
        f"medians of >= {args.reps} interleaved rounds; allocator "
        f"{'jemalloc' if 'jemalloc' in os.environ.get('LD_PRELOAD', '') else 'glibc malloc'}\n")
  print("| size | auto picks | auto | fastest (time) | auto / fastest | auto / native "
        "| predicted / measured |")
  print("|---:|---|---:|---|---:|---:|---:|")
  ratios = []
  for s in sizes:
    pick = picks[s]
    auto_label = pick.label
    auto_t = median[s, auto_label]
    best_label, best_t = min(((k[1], t) for k, t in median.items() if k[0] == s),
                             key=lambda kv: kv[1])
    ratios.append(auto_t / best_t)
    print(f"| {format_size(s)} | {auto_label} | {format_seconds(auto_t)} | {best_label} "
          f"({format_seconds(best_t)}) | {auto_t / best_t:.2f} | "
          f"{auto_t / median[s, 'native']:.2f} | {pick.predicted_s / auto_t:.2f} |")
  print(f"\nauto / fastest: median {statistics.median(ratios):.2f}, worst {max(ratios):.2f}")
  print("\nEvery algorithm (median time / native's):\n")
  labels = sorted({k[1] for k in median}, key=lambda a: (a != "native", a))
  print("| size | " + " | ".join(labels) + " |")
  print("|---:|" + "---:|" * len(labels))
  for s in sizes:
    cells = []
    for a in labels:
      t = median.get((s, a))
      cells.append("-" if t is None else (format_seconds(t) if a == "native"
                                          else f"{t / median[s, 'native']:.2f}x"))
    print(f"| {format_size(s)} | " + " | ".join(cells) + " |")
  print("\nEvery algorithm, predicted / measured time:\n")
  print("| size | " + " | ".join(labels) + " |")
  print("|---:|" + "---:|" * len(labels))
  for s in sizes:
    cells = [f"{predicted[s, a] / median[s, a]:.2f}" if (s, a) in median else "-" for a in labels]
    print(f"| {format_size(s)} | " + " | ".join(cells) + " |")
  return 0


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--sizes", default=SIZES)
  parser.add_argument("--primitive", default="all_reduce",
                      choices=("all_reduce", "reduce_scatter", "all_gather", "all_to_all"))
  parser.add_argument("--reps", type=int, default=5, help="fewest timed rounds per size")
  parser.add_argument("--min-seconds", type=float, default=2.0,
                      help="more rounds per size until they take this long (small sizes)")
  parser.add_argument("--save-profile", default="", metavar="PATH")
  from jaxcoll.launch import benchmark
  return benchmark(parser, child, __file__, argv)


if __name__ == "__main__":
  raise SystemExit(main())
