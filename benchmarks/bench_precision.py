"""Reduction error of every all_reduce algorithm for bfloat16/float16, against float64.

Single process, 8 CPU devices. Each device holds ``--length`` values drawn from
U(0.5, 1.5) (same sign, so rounding errors accumulate rather than cancel). For
every algorithm the script reports the mean and max absolute error of the sum
against a float64 NumPy reference, relative to one unit in the last place of
the result, next to a sequential sum rounded at each step (the ring's worst
case), ``jax.lax.psum`` (XLA's CPU all-reduce promotes to float32), and each
algorithm with ``accumulate_dtype="float32"`` and with ``rounding="stochastic"``. The last
column is the error of the mean of ``--keys`` results (each with its own key): round to
nearest is deterministic, so it stays; stochastic rounding is unbiased, so it shrinks about
as 1/sqrt(keys).

  python benchmarks/bench_precision.py
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402

import jax  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxcoll  # noqa: E402


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--length", type=int, default=1 << 16)
  parser.add_argument("--keys", type=int, default=16)
  args = parser.parse_args()
  n = 8
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:n]), ("x",))
  print(f"jax {jax.__version__}, N={n}, {args.length} values per device, U(0.5, 1.5)\n")
  print(f"| dtype | algorithm | mean abs err (ulp) | max abs err (ulp) "
        f"| mean abs err of the mean of {args.keys} keys (ulp) |")
  print("|---|---|---:|---:|---:|")
  for dtype in (ml_dtypes.bfloat16, np.float16):
    report(mesh, n, args.length, dtype, args.keys)


def report(mesh, n: int, length: int, dtype, keys: int) -> None:
  rng = np.random.default_rng(0)
  host = rng.uniform(0.5, 1.5, (n, length)).astype(dtype)
  exact = host.astype(np.float64).sum(0)
  mantissa = {"bfloat16": 7, "float16": 10}[np.dtype(dtype).name]
  ulp = 2.0 ** (np.floor(np.log2(np.abs(exact))) - mantissa)  # one ulp of the result
  x = jax.device_put(host, NamedSharding(mesh, P("x")))

  def run(body, keys: int = 1):
    """body's results with keys 0..keys-1 (``[keys, length]``; body(v, key))."""
    f = jax.jit(jax.shard_map(lambda v, k: body(v[0], k)[None], mesh=mesh,
                              in_specs=(P("x"), P()), out_specs=P("x")))
    return np.stack([np.asarray(f(x, jax.random.key(s)))[0].astype(np.float64)
                     for s in range(keys)])

  def row(name, got):
    err = np.abs(got[0] - exact) / ulp
    of_mean = np.abs(got.mean(0) - exact) / ulp
    print(f"| {np.dtype(dtype).name} | {name} | {err.mean():.3f} | {err.max():.2f} "
          f"| {of_mean.mean():.3f} |")

  acc = host[0].astype(np.float32)
  for v in host[1:]:
    acc = (acc + v.astype(np.float32)).astype(dtype).astype(np.float32)
  row("sequential, rounded each step", acc.astype(np.float64)[None])
  row("jax.lax.psum", run(lambda v, k: jax.lax.psum(v, "x")))
  algorithms = jaxcoll.algorithms("all_reduce", num_axes=1)[:-1]
  for algo in algorithms:
    row(algo, run(lambda v, k, a=algo: jaxcoll.all_reduce(v, "x", algorithm=a)))
  for algo in algorithms:
    row(f"{algo}, accumulate_dtype=float32",
        run(lambda v, k, a=algo: jaxcoll.all_reduce(v, "x", algorithm=a,
                                                   accumulate_dtype="float32")))
  for algo in algorithms:
    row(f"{algo}, rounding=stochastic",
        run(lambda v, k, a=algo: jaxcoll.all_reduce(v, "x", algorithm=a,
                                                   rounding="stochastic", key=k), keys))
  row("ring, accumulate_dtype=float32, rounding=stochastic",
      run(lambda v, k: jaxcoll.all_reduce(v, "x", algorithm="ring", accumulate_dtype="float32",
                                          rounding="stochastic", key=k), keys))

if __name__ == "__main__":
  main()
