"""How long schedules take to build, simulate and price at thousands of ranks (no JAX run).

For every all_reduce, reduce_scatter and all_gather schedule at each rank count N: the
seconds to build it (``jaxcoll.schedule``, uncached; steps of a run and chunk rows are made
when first read, so this is mostly what pricing pays) and to run it in the NumPy simulator
on one float32 per chunk and rank (which makes every step and row). Then, for meshes of up
to 16,384 devices and every collective, the seconds auto takes to choose at trace time
(every candidate built and priced: ``jaxcoll.tools.decide``, the first
call in a fresh process, caches cleared between repetitions) for a 64 MiB message over
every axis of the mesh, how many candidates it weighed, and the peak memory NumPy allocated
meanwhile (tracemalloc, in a pass of its own). Median of ``--reps``.

Examples:
  python benchmarks/bench_schedule_scale.py                 # N = 1024, 4096; meshes to 16,384
  python benchmarks/bench_schedule_scale.py --sizes 4096 --meshes 16384,64x256
"""

from __future__ import annotations

import argparse
import functools
import gc
import math
import multiprocessing
import statistics
import time
import tracemalloc
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
  parser.add_argument("--sizes", default="1024,4096", help="rank counts N (empty: skip)")
  parser.add_argument("--meshes", default="4x256,16x256,16384,64x256,16x1024,4x64x64",
                      help="meshes auto prices, AxB (empty: skip)")
  parser.add_argument("--reps", type=int, default=1)
  args = parser.parse_args()
  print("| primitive | algorithm | N | steps | build s | simulate s |")
  print("|---|---|---:|---:|---:|---:|")
  for n in (int(s) for s in args.sizes.split(",") if s):
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
  if args.meshes:
    print("\n| mesh | devices | " + " | ".join(jaxcoll.PRIMITIVES) + " |")
    print("|---|---:|" + "---:|" * len(jaxcoll.PRIMITIVES))
    for mesh in args.meshes.split(","):
      shape = tuple(map(int, mesh.split("x")))
      cells = []
      for primitive in jaxcoll.PRIMITIVES:   # each in a fresh process: nothing cached before
        with futures.ProcessPoolExecutor(
            1, mp_context=multiprocessing.get_context("spawn")) as pool:
          count, took, peak = pool.submit(time_auto, primitive, shape, args.reps).result()
        cells.append(f"{took:.2f} s, {count}, {peak / 2**20:.0f} MiB")
      print(f"| {shape} | {math.prod(shape):,} | " + " | ".join(cells) + " |", flush=True)


def time_auto(primitive: str, shape: tuple[int, ...], reps: int) -> tuple[int, float, int]:
  """(candidates, seconds, peak bytes) of auto's first choice for a 64 MiB ``primitive``
  over every axis of ``shape``: median of ``reps`` cold runs (caches cleared between)."""
  names = tuple(f"axis{i}" for i in range(len(shape)))
  profile = jaxcoll.Profile.preset("cpu")

  def choose():
    jaxcoll.tools.clear_caches()
    return jaxcoll.tools.decide(jaxcoll.tools.Call(primitive, names, shape, 64 << 20),
                                pricing=jaxcoll.tools.Pricing(profile)).candidates

  took, weighed = seconds(choose, reps)
  tracemalloc.start()
  choose()
  peak = tracemalloc.get_traced_memory()[1]
  tracemalloc.stop()
  return len(weighed), took, peak


if __name__ == "__main__":
  main()
