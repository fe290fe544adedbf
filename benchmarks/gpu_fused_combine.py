"""Fused reduce kernel on a GPU: correctness, then bandwidth against HBM and against XLA.

  python benchmarks/gpu_fused_combine.py            # on a machine with one GPU

1. The compiled kernel (``interpret=False``) equals ``fused_combine_reference`` bit for
   bit: every op, float32/bfloat16/float16/int32, odd lengths, a block-scaled int8
   chunk, stochastic rounding with a fixed key.
2. Bandwidth, 1 MiB to 256 MiB accumulators: the kernel in place (the accumulator
   donated) against the same math as plain jax.numpy under jit (what XLA fuses by
   itself). Bytes moved = read acc + read recv + write acc (3x the chunk; plus 1/256
   of a float per value for int8's scales). GB/s = bytes / median time; "of HBM"
   against ``--hbm`` (H200: 4.8 TB/s). Target: >= 80% of HBM at 64 MiB.

Prints a markdown table for the README. Needs no network; under 5 minutes on an H200.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

import jaxcoll
from jaxcoll import kernels

LOOP = 10


def check() -> None:
  rng = np.random.default_rng(0)
  for dtype in (np.float32, ml_dtypes.bfloat16, np.float16, np.int32):
    for n in (1, 1000, 70001, 1 << 20):
      a = (rng.standard_normal(n) * 100).astype(dtype)
      b = (rng.standard_normal(n) * 100).astype(dtype)
      for op in ("sum", "prod", "min", "max"):
        got = kernels.fused_combine(a, b, op=op, interpret=False)
        want = kernels.fused_combine_reference(a, b, op=op)
        assert np.array_equal(np.asarray(got).view(np.uint8), np.asarray(want).view(np.uint8)), (
            dtype, n, op)
  fmt = jaxcoll.WireFormat("int8")
  acc = jnp.asarray(rng.standard_normal((64, 4096)), jnp.float32)
  values, exps = fmt.encode(jnp.asarray(rng.standard_normal((64, 4096)), jnp.float32))
  got = kernels.fused_combine(acc, values, recv_exponents=exps, interpret=False)
  assert np.array_equal(np.asarray(got), np.asarray(acc + fmt.decode(values, exps)))
  key = jax.random.key(0)
  got = kernels.fused_combine(acc, acc, out_dtype=jnp.bfloat16, rounding="stochastic", key=key,
                              interpret=False)
  want = kernels.fused_combine_reference(acc, acc, out_dtype=jnp.bfloat16,
                                         rounding="stochastic", key=key)
  assert np.array_equal(np.asarray(got).view(np.uint16), np.asarray(want).view(np.uint16))
  print("compiled kernel == reference, bit for bit: ok")


def median_seconds(fn, *args, reps: int = 20) -> float:
  out = fn(*args)
  jax.block_until_ready(out)
  times = []
  for _ in range(reps):
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t)
  return statistics.median(times)


def bandwidth(hbm: float) -> None:
  print("\n| chunk | dtype | kernel GB/s | of HBM | jnp (XLA) GB/s | kernel / jnp |")
  print("|---:|---|---:|---:|---:|---:|")
  for mib in (1, 4, 16, 64, 256):
    for dtype in (jnp.float32, jnp.bfloat16):
      n = (mib << 20) // jnp.dtype(dtype).itemsize
      acc = jnp.ones((n,), dtype)
      recv = jnp.full((n,), 0.5, dtype)
      # LOOP combines into a loop-carried accumulator: updated in place, no copies
      fused = jax.jit(lambda a, r: jax.lax.fori_loop(
          0, LOOP, lambda i, a: kernels.fused_combine(a, r, interpret=False), a))
      plain = jax.jit(lambda a, r: jax.lax.fori_loop(
          0, LOOP, lambda i, a: kernels.fused_combine_reference(a, r), a))
      moved = 3 * (mib << 20) * LOOP
      t_kernel = median_seconds(fused, acc, recv)
      t_plain = median_seconds(plain, acc, recv)
      k_gbs, p_gbs = moved / t_kernel / 1e9, moved / t_plain / 1e9
      print(f"| {mib} MiB | {jnp.dtype(dtype).name} | {k_gbs:.0f} | {k_gbs / hbm:.0%} | "
            f"{p_gbs:.0f} | {t_plain / t_kernel:.2f} |")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--hbm", type=float, default=4800.0, help="HBM GB/s (H200: 4800)")
  args = parser.parse_args()
  print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}")
  check()
  bandwidth(args.hbm)


if __name__ == "__main__":
  main()
