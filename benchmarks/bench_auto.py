"""Auto out of the box: default settings, no calibration, against the lax collective.

  python benchmarks/bench_auto.py --processes 2        # 2 processes x 4 CPU devices, gloo
  python benchmarks/bench_auto.py --processes 1        # 8 CPU devices in one process

Every collective is written as a user writes it (``jaxcoll.all_reduce(x, axes)``: auto,
default profile, no ``jaxcoll.config``) on four meshes of the same 8 devices: one flat axis
"x", ("node", "local") 2 x 4 over the tuple, ("data", "model") 2 x 4 over the tuple, and one
flat axis "devices". For each size, auto's program and ``lax.psum``'s are timed side by side
(``jaxcoll.tools.interleaved``: rounds in rotated order; medians). Auto's pick comes from
``jaxcoll.explain``, which prices as the trace does. Process 0 prints a table of auto /
native per mesh and size.
"""

from __future__ import annotations

import argparse
import statistics

from jaxcoll.tools import format_size, parse_size

MESHES = ((("x",), (8,)), (("node", "local"), (2, 4)), (("data", "model"), (2, 4)),
          (("devices",), (8,)))


def child(args) -> int:
  import jax
  import numpy as np
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import jaxcoll

  main = jax.process_index() == 0
  sizes = [parse_size(s) for s in args.sizes.split(",")]
  table = []
  for names, shape in MESHES:
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(shape), names)
    spec = P(names)
    axes = names if len(names) > 1 else names[0]
    for s in sizes:
      x = jax.device_put(np.ones((8, s // 4), np.float32), NamedSharding(mesh, spec))
      fns = [jax.jit(jax.shard_map(
          lambda v, a=a, axes=axes: jaxcoll.all_reduce(v[0], axes, algorithm=a)[None],
          mesh=mesh, in_specs=spec, out_specs=spec)) for a in ("auto", "native")]
      times = jaxcoll.tools.interleaved([lambda f=f, x=x: f(x).block_until_ready() for f in fns],
                                        reps=args.reps, min_seconds=args.min_seconds)
      auto, native = (statistics.median(t) for t in times)
      why = jaxcoll.explain("all_reduce", jax.ShapeDtypeStruct((s // 4,), np.float32), mesh,
                            axes)
      table.append((names, s, why.chosen, why.links, auto, native, why.predicted_s))
      if main:
        print(f"{names} {format_size(s, compact=True)}: auto -> {why.chosen} "
              f"{auto * 1e3:.3f} ms, native {native * 1e3:.3f} ms", flush=True)
  if main:
    print(f"\n## all_reduce, float32, default settings, {jax.process_count()} process(es) x "
          f"{jax.local_device_count()} devices; medians of >= {args.reps} interleaved rounds\n")
    print("| mesh (over all its axes) | links | size | auto picks | auto | native "
          "| auto / native | predicted / measured |")
    print("|---|---|---:|---|---:|---:|---:|---:|")
    for names, s, chosen, links, auto, native, predicted in table:
      print(f"| {', '.join(names)} | {links} | {format_size(s, compact=True)} | {chosen} "
            f"| {auto * 1e3:.3f} ms | {native * 1e3:.3f} ms | {auto / native:.2f} "
            f"| {predicted / auto:.2f} |")
  return 0


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--sizes", default="16K,16M")
  parser.add_argument("--reps", type=int, default=9, help="fewest timed rounds per size")
  parser.add_argument("--min-seconds", type=float, default=3.0,
                      help="more rounds per size until they take this long")
  from jaxcoll.launch import benchmark
  return benchmark(parser, child, __file__, argv)


if __name__ == "__main__":
  raise SystemExit(main())
