"""Calibrate on a GPU (or TPU) mesh in minutes, so that auto may replace the lax collective.

  python benchmarks/calibrate_gpu.py --out gpu.json                  # every local device
  python benchmarks/calibrate_gpu.py --mesh 2x4 --axes node,local --out gpu.json
  srun ... python benchmarks/calibrate_gpu.py --distributed --out gpu.json   # many hosts

then ``jaxcoll.config(profile=jaxcoll.Profile.load("gpu.json"))``. Under the data-sheet
presets (the default on GPU and TPU) auto keeps the lax collective wherever it applies; a
profile measured here carries ``basis="gpu"`` and is trusted on GPUs. The run times every
schedule the fit needs and every lax collective at 4 KiB-256 MiB per device (x4), at least
``--reps`` rounds each and half a second per size, prints what it took, the fitted figures,
and auto's all_reduce choices at 64 KiB, 4 MiB and 256 MiB. A collective over one device
sends nothing: it needs 2 devices or more.
"""

from __future__ import annotations

import argparse
import time

SIZES = tuple(1 << k for k in range(12, 29, 2))   # 4 KiB ... 256 MiB, x4


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out", default="gpu.json")
  parser.add_argument("--mesh", default=None, help="e.g. 2x4 (default: every device, one axis)")
  parser.add_argument("--axes", default="x", help="mesh axis names, e.g. node,local")
  parser.add_argument("--reps", type=int, default=5)
  parser.add_argument("--distributed", action="store_true",
                      help="join a multi-host job first (jaxcoll.distributed.initialize)")
  args = parser.parse_args()
  import jax
  import numpy as np

  import jaxcoll
  if args.distributed:
    jaxcoll.distributed.initialize()
  names = tuple(args.axes.split(","))
  shape = (tuple(int(d) for d in args.mesh.split("x")) if args.mesh else (jax.device_count(),))
  if jax.device_count() < 2:
    raise SystemExit(f"{jax.device_count()} device: a collective needs 2 or more")
  mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(shape), names)
  devices = mesh.devices.size
  sizes = [s for s in SIZES if s % (4 * devices) == 0]
  start = time.perf_counter()
  prof = jaxcoll.calibrate(mesh, sizes=sizes, reps=args.reps, min_seconds=0.5,
                           name=f"{jax.devices()[0].device_kind} x{devices}")
  took = time.perf_counter() - start
  if jax.process_index() == 0:
    prof.save(args.out)
    print(f"calibrated {dict(mesh.shape)} in {took:.0f} s; wrote {args.out}\n{prof.summary()}")
    for s in (64 << 10, 4 << 20, 256 << 20):
      print(jaxcoll.explain("all_reduce", jax.ShapeDtypeStruct((s // 4,), np.float32), mesh,
                            names if len(names) > 1 else names[0], profile=prof))


if __name__ == "__main__":
  main()
