"""Hierarchical collectives on a 2 x 4 mesh ("node", "local"): what crosses the slow axis.

Run with:  python examples/hierarchical.py

Eight CPU devices stand for 2 nodes of 4 accelerators. For every algorithm of
all_reduce and all_to_all over the tuple ("node", "local") the script prints,
for a 64 MiB message per device, the steps and the most bytes any device sends
across "node" (between nodes) and across "local" (inside a node), from the
schedule's ``traffic()`` (the tests check these equal the bytes the traced
program sends through ppermute). Each algorithm is then run on a 1 MiB message
and compared with jax.lax (``psum`` / ``all_to_all``); the script exits
non-zero on a mismatch.
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

SHAPE, AXES = (2, 4), ("node", "local")
PRICED_BYTES = 64 << 20
CHECK_ELEMENTS = (1 << 20) // 4
TOLERANCE = 1e-4


def collective(primitive, algorithm):
  """Per device: v is [1, CHECK_ELEMENTS]; all_to_all sends block j of v[0] to device j."""
  if primitive == "all_reduce":
    return lambda v: jaxcoll.all_reduce(v, AXES, algorithm=algorithm)
  return lambda v: jaxcoll.all_to_all(v[0], AXES, 0, 0, tiled=True, algorithm=algorithm)[None]


def reference(primitive):
  if primitive == "all_reduce":
    return lambda v: jax.lax.psum(v, AXES)
  return lambda v: jax.lax.all_to_all(v[0], AXES, 0, 0, tiled=True)[None]


def main() -> None:
  devices = jax.devices()
  if len(devices) < 8:
    raise SystemExit(f"need 8 devices, found {len(devices)} (XLA_FLAGS not applied?)")
  mesh = jax.sharding.Mesh(np.array(devices[:8]).reshape(SHAPE), AXES)
  spec = P(AXES)
  host = np.random.default_rng(0).standard_normal((8, CHECK_ELEMENTS), dtype=np.float32)
  x = jax.device_put(host, NamedSharding(mesh, spec))
  run = lambda body: np.asarray(jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec,
                                                      out_specs=spec))(x))
  failed = []
  for primitive in ("all_reduce", "all_to_all"):
    want = run(reference(primitive))
    rows = []
    for algo in jaxcoll.algorithms(primitive):
      err = float(np.max(np.abs(run(collective(primitive, algo)) - want)))
      if algo == "native":
        node = local = ("-", "-")
      else:
        options = {"axis_sizes": SHAPE} if algo == "hierarchical" else {}
        sched = jaxcoll.schedule(primitive, algo, 8, **options)
        node, local = ((t.steps, f"{t.bytes / 2**20:.1f}")
                       for t in sched.traffic(PRICED_BYTES, SHAPE))
      rows.append((algo, *node, *local, f"{err:.2g}"))
      if not err <= TOLERANCE:
        failed.append(f"{primitive}/{algo}={err:.3g}")
    jaxcoll.Table.of(
        f"{primitive} over {AXES} on a {SHAPE[0]}x{SHAPE[1]} mesh, 64 MiB per device",
        ("algorithm", "steps node", "MiB across node", "steps local", "MiB across local",
         "max err vs lax (1 MiB)"), rows).print()
  if failed:
    raise SystemExit("FAILED: " + ", ".join(failed))
  print("every algorithm matches jax.lax")


if __name__ == "__main__":
  main()
