"""Quickstart: every jaxcoll all_reduce algorithm against jax.lax.psum on 8 CPU devices.

Run with:  python examples/quickstart.py

Each of the 8 devices holds 1000 random float32 values; every algorithm of
``jaxcoll.algorithms("all_reduce")`` sums them over the mesh axis inside
``jax.shard_map`` and the result is compared with ``jax.lax.psum``. The script
prints the number of communication steps of each schedule, the most bytes any
one device sends for this message size, and the max abs error vs lax; it exits
non-zero if any error exceeds the tolerance.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxcoll  # noqa: E402

N_DEVICES = 8
PER_DEVICE = 1000
TOLERANCE = 1e-4


def main() -> None:
  devices = jax.devices()
  if len(devices) < N_DEVICES:
    raise SystemExit(f"need {N_DEVICES} devices, found {len(devices)} (XLA_FLAGS not applied?)")
  mesh = jax.sharding.Mesh(np.array(devices[:N_DEVICES]), ("x",))
  sharding = NamedSharding(mesh, P("x"))

  rng = np.random.default_rng(0)
  host = rng.standard_normal((N_DEVICES, PER_DEVICE), dtype=np.float32)
  x = jax.device_put(host, sharding)

  def run(body):
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P()))(x)

  expected = np.asarray(run(lambda v: jax.lax.psum(v, "x")))
  np.testing.assert_allclose(expected[0], host.sum(axis=0), rtol=1e-5, atol=1e-5)

  nbytes = PER_DEVICE * np.dtype(np.float32).itemsize
  rows, failed = [], []
  for algo in jaxcoll.algorithms("all_reduce", num_axes=1):   # hierarchical: see hierarchical.py
    got = np.asarray(run(lambda v, algo=algo: jaxcoll.all_reduce(v, "x", algorithm=algo)))
    err = float(np.max(np.abs(got - expected)))
    if algo == "native":
      steps, sent = "-", "-"
    else:
      sched = jaxcoll.schedule("all_reduce", algo, N_DEVICES)
      steps, sent = sched.num_steps, f"{sched.bytes_per_rank(nbytes):,.0f}"
    rows.append((algo, steps, sent, f"{err:.3g}"))
    if not err <= TOLERANCE:  # also catches NaN
      failed.append((algo, err))

  print(f"jax {jax.__version__}, {N_DEVICES} x {devices[0].platform} devices, "
        f"message {nbytes:,} bytes per device")
  jaxcoll.Table.of(f"all_reduce on {N_DEVICES} devices, {PER_DEVICE} float32 per device",
                   ("algorithm", "steps", "bytes per rank", "max abs err vs lax"), rows).print()
  if failed:
    worst = ", ".join(f"{a}={e:.3g}" for a, e in failed)
    raise SystemExit(f"FAILED (error > {TOLERANCE:g}): {worst}")
  print(f"all {len(rows)} algorithms match jax.lax.psum within {TOLERANCE:g}")


if __name__ == "__main__":
  main()
