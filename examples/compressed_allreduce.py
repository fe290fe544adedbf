"""Compressed all-reduce: error and bytes of every wire format, in one table.

Run with:  python examples/compressed_allreduce.py [--algorithm ring] [--values 65536]

Each of 8 CPU devices holds float32 values; ``jaxcoll.all_reduce(x, "x",
algorithm=..., wire_dtype=w)`` sums them with every message encoded in ``w``
(partial sums accumulate in float32 and are re-encoded before each send). For
each format the table gives the bytes one device sends (counted from the traced
program's ppermutes), that as a fraction of float32's, and the error against a
float64 NumPy sum: the largest, over blocks of 256 values, of the block's largest
error over its largest exact magnitude. Two inputs: standard normal, and "wide"
data whose blocks of 256 values are scaled by 10^U(-30, 30) (per-block scales keep
its relative error as small as the normal data's). It checks that every device
holds the same bits and that the error is within the documented bound, and exits
non-zero otherwise.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxcoll  # noqa: E402

N = 8


def inputs(values: int) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(0)
  normal = rng.standard_normal((N, values)).astype(np.float32)
  scale = 10.0 ** rng.uniform(-30, 30, (1, values // 256, 1))
  wide = (rng.standard_normal((N, values // 256, 256)) * scale).reshape(N, values)
  return {"normal": normal, "wide": wide.astype(np.float32)}


def ppermute_bytes(jaxpr) -> int:
  """Bytes one device sends: every ppermute operand, times the trip count of its loops."""
  total = 0
  def walk(jx, mult):
    nonlocal total
    for eqn in jx.eqns:
      if eqn.primitive.name == "ppermute":
        total += mult * eqn.invars[0].aval.size * eqn.invars[0].aval.dtype.itemsize
      inner = mult * eqn.params.get("length", 1) if eqn.primitive.name == "scan" else mult
      for v in eqn.params.values():
        for j in v if isinstance(v, (tuple, list)) else (v,):
          sub = getattr(j, "jaxpr", j)
          if hasattr(sub, "eqns"):
            walk(sub, inner)
  walk(jaxpr.jaxpr, 1)
  return total


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--algorithm", default="ring")
  parser.add_argument("--values", type=int, default=1 << 16, help="float32 values per device")
  args = parser.parse_args()
  mesh = jax.make_mesh((N,), ("x",))
  sharding = NamedSharding(mesh, P("x"))
  data = inputs(args.values)
  steps = jaxcoll.schedule("all_reduce", args.algorithm, N).num_steps
  rows, ok, uncompressed = [], True, None
  for wire in (None, *jaxcoll.WIRE_DTYPES):
    f = jax.shard_map(lambda v, w=wire: jaxcoll.all_reduce(v[0], "x", algorithm=args.algorithm,
                                                           wire_dtype=w)[None],
                      mesh=mesh, in_specs=P("x"), out_specs=P("x"))
    sent = ppermute_bytes(jax.make_jaxpr(f)(jax.ShapeDtypeStruct((N, args.values), np.float32,
                                                                 sharding=sharding)))
    uncompressed = uncompressed or sent
    errors, row_ok = [], True
    for x in data.values():
      y = np.asarray(jax.jit(f)(jax.device_put(x, sharding)))
      exact = x.astype(np.float64).sum(0)
      identical = all(np.array_equal(y[0].view(np.uint32), y[r].view(np.uint32))
                      for r in range(N))
      blocks = lambda v: np.abs(v).reshape(-1, 256).max(-1)   # noqa: E731
      err = np.max(blocks(y[0] - exact) / blocks(exact))
      eps = jaxcoll.WireFormat(wire).relative_error if wire else 2.0 ** -24
      # every partial sum's block max is at most the sum over devices of their block maxima
      amax = np.abs(x.astype(np.float64)).reshape(N, -1, 256).max(-1).sum(0)
      within = np.abs(y[0] - exact).reshape(-1, 256).max(-1) <= (steps + 1) * (
          eps + 2.0 ** -23) * amax
      row_ok &= identical and bool(within.all())
      errors.append(f"{err:.1e}")
    rows.append((wire or "float32 (uncompressed)", f"{sent / 2**10:.0f}",
                 f"{sent / uncompressed:.3f}", *errors,
                 "-" if wire is None else f"{jaxcoll.WireFormat(wire).relative_error:.1e}",
                 "yes" if row_ok else "NO"))
    ok &= row_ok
  jaxcoll.Table.of(
      f"all_reduce ({args.algorithm}) of {args.values} float32 values on {N} devices",
      ("wire format", "KiB sent / device", "of float32's", "rel err (normal)",
       "rel err (wide)", "eps per encode", "identical & in bound"), rows).print()
  return 0 if ok else 1


if __name__ == "__main__":
  raise SystemExit(main())
