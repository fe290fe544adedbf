"""Measures the "cpu" preset: ``jaxcoll.calibrate`` on 8 CPU devices in one process.

  python benchmarks/calibrate_cpu.py            # writes jaxcoll/presets/cpu.json

One axis "x" of 8 devices; every native collective at 1 KiB to 64 MiB per device.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import dataclasses  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

import jaxcoll  # noqa: E402

SIZES = tuple(1 << k for k in range(10, 27, 2))   # 1 KiB ... 64 MiB, x4


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--out", default=os.path.join(os.path.dirname(jaxcoll.__file__),
                                                    "presets", "cpu.json"))
  parser.add_argument("--reps", type=int, default=5)
  args = parser.parse_args()
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("x",))
  prof = jaxcoll.calibrate(mesh, sizes=SIZES, reps=args.reps, name="cpu")
  # the preset prices every axis name with the measured link
  prof = dataclasses.replace(prof, links={"*": dict(prof.links)["x"]})
  prof.save(args.out)
  print(f"wrote {args.out}: {prof.summary()}")


if __name__ == "__main__":
  main()
