"""jaxcoll.use on a pjit-style training step against plain jax.jit, one process, side by side.

A transformer-like MLP stack (``--layers`` blocks of d x 4d x d weights, layer norm,
optax Adam) written for global arrays, data parallel over 8 CPU devices. Reports, in one
run: compile seconds of ``jax.jit(step)`` and of ``jaxcoll.use(step)`` (``.lower`` and
``.compile``), and the step's median seconds (interleaved rounds) with the ratio to jit,
for ``use(step)`` with auto and with ``algorithm="ring"``.

  python benchmarks/bench_use_pjit.py [--layers 12] [--dim 256] [--reps 20]
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxcoll  # noqa: E402
from jaxcoll.tools import interleaved  # noqa: E402

optimizer = optax.adam(1e-3)


def init(layers: int, dim: int):
  rng = np.random.default_rng(0)
  return [{"w1": rng.normal(size=(dim, 4 * dim)).astype(np.float32) / np.sqrt(dim),
           "w2": rng.normal(size=(4 * dim, dim)).astype(np.float32) / np.sqrt(4 * dim),
           "scale": np.ones(dim, np.float32)} for _ in range(layers)]


def loss_fn(params, x):
  for p in params:
    h = x - x.mean(-1, keepdims=True)
    h = h * jax.lax.rsqrt((h * h).mean(-1, keepdims=True) + 1e-6) * p["scale"]
    x = x + jax.nn.gelu(h @ p["w1"]) @ p["w2"]
  return (x * x).mean()


def step(params, opt_state, x):
  loss, grads = jax.value_and_grad(loss_fn)(params, x)
  updates, opt_state = optimizer.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, loss


def compile_seconds(fn, *args) -> float:
  start = time.perf_counter()
  fn.lower(*args).compile()
  return time.perf_counter() - start


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--layers", type=int, default=12)
  parser.add_argument("--dim", type=int, default=256)
  parser.add_argument("--batch", type=int, default=64)
  parser.add_argument("--reps", type=int, default=20)
  args = parser.parse_args()
  mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  params = jax.device_put(init(args.layers, args.dim), NamedSharding(mesh, P()))
  opt_state = optimizer.init(params)
  x = jax.device_put(np.random.default_rng(1).normal(size=(args.batch, args.dim))
                     .astype(np.float32), NamedSharding(mesh, P("data")))
  with jax.set_mesh(mesh):
    programs = {"jit": jax.jit(step), "use (auto)": jaxcoll.use(step),
                "use (ring)": jaxcoll.use(step, algorithm="ring")}
    compiled = {name: compile_seconds(fn, params, opt_state, x) for name, fn in
                programs.items()}
    calls = [lambda fn=fn: jax.block_until_ready(fn(params, opt_state, x))
             for fn in programs.values()]
    rounds = interleaved(calls, reps=args.reps)
  medians = {name: statistics.median(r) for name, r in zip(programs, rounds)}
  grads_mib = sum(np.asarray(v).nbytes for v in jax.tree.leaves(params)) / 2**20
  print(f"{args.layers} layers, d={args.dim}, {grads_mib:.1f} MiB of float32 gradients, "
        f"8 CPU devices, {len(rounds[0])} interleaved rounds")
  print("| program | compile s | compile / jit | step median ms | step / jit |")
  print("|---|---:|---:|---:|---:|")
  for name in programs:
    print(f"| {name} | {compiled[name]:.2f} | {compiled[name] / compiled['jit']:.2f} | "
          f"{medians[name] * 1e3:.2f} | {medians[name] / medians['jit']:.2f} |")


if __name__ == "__main__":
  main()
