"""Auto out of the box: default settings, no calibration, against the lax collective.

  python benchmarks/bench_auto.py --processes 2             # 2 processes x 4 CPU devices, gloo
  python benchmarks/bench_auto.py --processes 2 --init jax  # joined by jax.distributed alone
  python benchmarks/bench_auto.py --processes 1             # 8 CPU devices in one process

Every collective is written as a user writes it (``jaxcoll.all_reduce(x, axes)``: auto,
default profile, no ``jaxcoll.config``) on meshes of the same 8 devices (``--meshes``,
default one flat axis "x" and ("node", "local") 2 x 4 over the tuple; also ("data",
"model") and a flat "devices"). ``--init jax`` starts the ranks the way most programs do,
``jax.distributed.initialize`` alone, without jaxcoll's host table. For each size, auto's
program and ``lax.psum``'s are timed side by side (``jaxcoll.tools.interleaved``: rounds in
rotated order; medians). Auto's pick comes from ``jaxcoll.explain``, which prices as the
trace does. Process 0 prints a table of auto / native per mesh and size.
"""

from __future__ import annotations

import argparse
import statistics

from jaxcoll.tools import format_size, parse_size

MESHES = {"x": (("x",), (8,)), "node,local": (("node", "local"), (2, 4)),
          "data,model": (("data", "model"), (2, 4)), "devices": (("devices",), (8,))}


def child(args) -> int:
  import jax
  import numpy as np
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import jaxcoll

  main = jax.process_index() == 0
  sizes = [parse_size(s) for s in args.sizes.split(",")]
  table = []
  for names, shape in (MESHES[m] for m in args.meshes.split(";")):
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
      native_predicted = next(r.predicted_s for r in why.rows if r.algorithm == "native")
      table.append((names, s, why.chosen, why.links, auto, native, why.predicted_s,
                    native_predicted))
      if main:
        print(f"{names} {format_size(s, compact=True)}: auto -> {why.chosen} "
              f"{auto * 1e3:.3f} ms, native {native * 1e3:.3f} ms", flush=True)
  if main:
    joined = "" if jax.process_count() == 1 else (
        f", joined by {'jax' if args.init == 'jax' else 'jaxcoll'}.distributed.initialize")
    print(f"\n## all_reduce, float32, default settings, {jax.process_count()} process(es) x "
          f"{jax.local_device_count()} devices{joined}; medians of >= {args.reps} interleaved "
          "rounds\n")
    print("| mesh (over all its axes) | links | size | auto picks | auto | native "
          "| auto / native | predicted / measured: auto | native |")
    print("|---|---|---:|---|---:|---:|---:|---:|---:|")
    for names, s, chosen, links, auto, native, predicted, native_predicted in table:
      print(f"| {', '.join(names)} | {links} | {format_size(s, compact=True)} | {chosen} "
            f"| {auto * 1e3:.3f} ms | {native * 1e3:.3f} ms | {auto / native:.2f} "
            f"| {predicted / auto:.2f} | {native_predicted / native:.2f} |")
  return 0


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--sizes", default="4K,16K,64K,256K,1M,4M,16M,64M")
  parser.add_argument("--meshes", default="x;node,local",
                      help=f"';'-separated, of {', '.join(MESHES)}")
  parser.add_argument("--reps", type=int, default=9, help="fewest timed rounds per size")
  parser.add_argument("--min-seconds", type=float, default=3.0,
                      help="more rounds per size until they take this long")
  from jaxcoll.launch import benchmark
  return benchmark(parser, child, __file__, argv)


if __name__ == "__main__":
  raise SystemExit(main())
