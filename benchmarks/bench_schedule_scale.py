"""How long schedules take to build, simulate and price at thousands of ranks (no JAX run).

For every all_reduce, reduce_scatter and all_gather schedule at each rank count N: the
seconds to build it (``jaxcoll.schedule``, uncached) and to run it in the NumPy simulator
on one float32 per chunk and rank. Then the seconds ``jaxcoll.explain`` (what auto weighs at
trace time) takes for a 4 MiB all_reduce over both axes of a (N/256, 256) mesh (every flat
and hierarchical candidate built and priced; first call in the process, cached afterwards),
and over the 256- or 1,024-device axis of a 16,384-device mesh.
Median of ``--reps``.

Examples:
  python benchmarks/bench_schedule_scale.py                 # N = 1024, 4096
  python benchmarks/bench_schedule_scale.py --sizes 4096 --explain 1024,4096
"""

from __future__ import annotations

import argparse
import functools
import gc
import multiprocessing
import statistics
import time
from concurrent import futures

import numpy as np

import jaxcoll

PRIMITIVES = ("all_reduce", "reduce_scatter", "all_gather")


def seconds(fn, reps: int) -> tuple[float, object]:
  times, out = [], None
  for _ in range(reps):
    gc.collect()
    start = time.perf_counter()
    out = fn()
    times.append(time.perf_counter() - start)
  return statistics.median(times), out


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--sizes", default="1024,4096", help="rank counts N")
  parser.add_argument("--explain", default="1024,4096",
                      help="device counts of the meshes explain prices (empty: skip)")
  parser.add_argument("--reps", type=int, default=1)
  args = parser.parse_args()
  print("| primitive | algorithm | N | steps | build s | simulate s |")
  print("|---|---|---:|---:|---:|---:|")
  for n in map(int, args.sizes.split(",")):
    for primitive in PRIMITIVES:
      for algorithm in jaxcoll.algorithms(primitive):
        if algorithm == "native":
          continue
        options = {"axis_sizes": (n // 64, 64)} if algorithm == "hierarchical" else {}
        build, sched = seconds(functools.partial(jaxcoll.schedule.__wrapped__, primitive,
                                                 algorithm, n, **options), args.reps)
        xs = list(np.ones((n, n if primitive != "all_gather" else 1), np.float32))
        simulate, _ = seconds(functools.partial(sched.simulate, xs), args.reps)
        print(f"| {primitive} | {algorithm} | {n} | {sched.num_steps} | {build:.2f} "
              f"| {simulate:.2f} |", flush=True)
        del sched, xs
  if args.explain:
    print("\n| mesh | devices | over | candidates | explain s (first call) |")
    print("|---|---:|---|---:|---:|")
    cases = [((n // 256, 256), ("pod", "chip")) for n in map(int, args.explain.split(","))]
    cases += [((64, 256), ("chip",)), ((16, 1024), ("chip",))]   # one axis of 16,384 devices
    for shape, over in cases:   # each in a fresh process: nothing cached from the others
      with futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        rows, took = pool.submit(time_explain, shape, over).result()
      print(f"| {shape} | {shape[0] * shape[1]} | {', '.join(over)} | {rows} | {took:.2f} |",
            flush=True)


def time_explain(shape: tuple[int, int], over: tuple[str, ...]) -> tuple[int, float]:
  """(rows, seconds) of the first explain of a 4 MiB all_reduce in this process."""
  mesh = dict(zip(("pod", "chip"), shape))
  start = time.perf_counter()
  table = jaxcoll.explain("all_reduce", np.zeros(1 << 20, np.float32), mesh, over,
                          profile="cpu")
  return len(table.rows), time.perf_counter() - start


if __name__ == "__main__":
  main()
