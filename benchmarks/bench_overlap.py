"""Whether this machine runs a transfer beside compute: a probe, and a data-parallel step.

Two programs in ``jax.shard_map`` over all devices (axis "x"), each timed against its two
halves alone, side by side (``jaxcoll.tools.interleaved``, medians):

- probe: a chain of ``--gemms`` matmuls of ``--width`` x ``--width`` float32 on one input,
  and, independent of it, a chain of ``--permutes`` ring ``lax.ppermute``s of ``--mib`` MiB
  on another; "both" runs the two in one program;
- step: a data-parallel step of ``gpu_compile.mlp`` (``--layers`` x ``--width``, ``--rows``
  rows a device),
  its gradients summed with ``lax.pmean`` per leaf (XLA's own) or with
  ``jaxcoll.sync_gradients`` (auto); "compute" is the step without the sum, "comm" the sum
  of gradient-shaped buffers alone.

overlap = (compute + comm - both) / min(compute, comm): 0 when the runtime runs the two
one after the other, 1 when the shorter is hidden entirely.

  python benchmarks/bench_overlap.py                         # 8 CPU devices, one process
  python benchmarks/bench_overlap.py --processes 2 --devices-per-process 1   # gloo, loopback
  sudo python benchmarks/emulated_cluster.py --rate 1gbit --devices-per-process 1 -- \\
      python benchmarks/bench_overlap.py --child --processes 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_compile import mlp  # noqa: E402  (the model of the compiled steps)


def child(args) -> int:
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax import lax
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  import jaxcoll
  from jaxcoll import tools

  mesh = Mesh(np.array(jax.devices()), ("x",))
  n = mesh.size
  ring = [(i, (i + 1) % n) for i in range(n)]
  split = NamedSharding(mesh, P("x"))
  rng = np.random.default_rng(0)

  def put(shape, scale=1.0):
    host = (rng.standard_normal((n, *shape)) * scale).astype(np.float32)
    return jax.make_array_from_callback(host.shape, split, lambda idx: host[idx])

  def per_device(fn, *args):
    body = jax.shard_map(lambda *a: jax.tree.map(lambda v: v[None], fn(*(v[0] for v in a))),
                         mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False)
    return jax.jit(body).lower(*args).compile(), args

  a = put((args.width, args.width), 1.0 / args.width ** 0.5)
  b = put((args.mib * 2**18,))

  def gemms(v):
    for _ in range(args.gemms):
      v = jnp.tanh(v @ v)
    return v

  def permutes(v):
    for _ in range(args.permutes):
      v = lax.ppermute(v, "x", ring)
    return v

  rows = {"probe": {"compute": per_device(lambda u, v: (gemms(u), v), a, b),
                    "comm": per_device(lambda u, v: (u, permutes(v)), a, b),
                    "both": per_device(lambda u, v: (gemms(u), permutes(v)), a, b)}}

  params = [put((args.width, args.width), 1.0 / args.width ** 0.5)
            for _ in range(args.layers)]
  x = put((args.rows, args.width))

  def grads(ws, x):
    return jax.grad(mlp)(ws, x)

  syncs = {"lax.pmean per leaf": lambda g: [lax.pmean(v, "x") for v in g],
           "jaxcoll.sync_gradients (auto)": lambda g: jaxcoll.sync_gradients(g, "x")}
  for name, sync in syncs.items():
    rows[f"DP step, {name}"] = {
        "compute": per_device(grads, params, x),
        "comm": per_device(lambda ws, x, sync=sync: sync(ws), params, x),
        "both": per_device(lambda ws, x, sync=sync: sync(grads(ws, x)), params, x)}

  calls = [(row, part, lambda c=c, v=v: jax.block_until_ready(c(*v)))
           for row, parts in rows.items() for part, (c, v) in parts.items()]
  times = tools.interleaved([f for _, _, f in calls], reps=args.reps,
                             min_seconds=args.min_seconds)
  med = {(row, part): statistics.median(t) for (row, part, _), t in zip(calls, times)}
  if jax.process_index() == 0:
    print(f"{jax.process_count()} process(es), {n} CPU devices, jax {jax.__version__}; medians "
          f"of {len(times[0])} interleaved rounds; probe: {args.gemms} matmuls of "
          f"{args.width}^2 beside {args.permutes} permutes of {args.mib} MiB; step: "
          f"{args.layers} layers of {args.width}^2, {args.rows} rows a device")
    print("| program | compute alone | comm alone | both | compute + comm | overlap |")
    print("|---|---:|---:|---:|---:|---:|")
    for row in rows:
      c, m, both = med[row, "compute"], med[row, "comm"], med[row, "both"]
      print(f"| {row} | {c * 1e3:.1f} ms | {m * 1e3:.1f} ms | {both * 1e3:.1f} ms | "
            f"{(c + m) * 1e3:.1f} ms | {(c + m - both) / min(c, m):.2f} |")
  return 0


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--width", type=int, default=512)
  parser.add_argument("--gemms", type=int, default=8)
  parser.add_argument("--permutes", type=int, default=4)
  parser.add_argument("--mib", type=int, default=8)
  parser.add_argument("--layers", type=int, default=4)
  parser.add_argument("--rows", type=int, default=256)
  parser.add_argument("--reps", type=int, default=10, help="fewest timed rounds")
  parser.add_argument("--min-seconds", type=float, default=5.0)
  from jaxcoll.launch import benchmark
  return benchmark(parser, child, __file__, argv)


if __name__ == "__main__":
  raise SystemExit(main())
