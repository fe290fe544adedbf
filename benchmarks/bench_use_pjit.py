"""jaxcoll.use on a pjit-style training step against plain jax.jit, one process, side by side.

Two models, data parallel or sharded over 8 CPU devices, each in one run:

- ``mlp``: a transformer-like MLP stack (``--layers`` blocks of d x 4d x d weights, layer
  norm, optax Adam) written for global arrays, data parallel;
- ``decoder``: the MaxText-style decoder step of ``tests/maxtext_decoder.py`` (logical axis
  rules on a 2x2x2 data x fsdp x tensor mesh, RMSNorm, rotary embeddings, SwiGLU,
  ``checkpoint_name`` remat policies, AdamW after global-norm clipping, gradient
  accumulation), ``--layers`` layers scanned with ``nn.scan`` + ``nn.remat`` and unscanned.

Reported: the start-up seconds (trace + lower + compile, caches cleared before each; the
median of ``--compiles`` rounds, jit and use alternating) of ``jax.jit(step)`` and of
``jaxcoll.use(step)``, the step's median seconds (interleaved rounds) with the ratio to
jit for ``use(step)`` with auto and with ``algorithm="ring"``, and the bytes the ring
step's jaxcoll collectives carry per step (``jaxcoll.explain_step``).

  python benchmarks/bench_use_pjit.py [--model mlp,decoder] [--layers 12] [--reps 20]
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

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


def startup_seconds(fn, *args) -> float:
  """Trace + lower + compile of ``fn(*args)`` from cold caches (jax's and jaxcoll's)."""
  jax.clear_caches()
  jaxcoll.tools.clear_caches()
  start = time.perf_counter()
  fn.lower(*args).compile()
  return time.perf_counter() - start


def mlp_programs(layers: int, dim: int, batch: int):
  mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  params = jax.device_put(init(layers, dim), NamedSharding(mesh, P()))
  opt_state = optimizer.init(params)
  x = jax.device_put(np.random.default_rng(1).normal(size=(batch, dim)).astype(np.float32),
                     NamedSharding(mesh, P("data")))
  return mesh, step, (params, opt_state, x)


def decoder_programs(layers: int, scan: bool):
  import maxtext_decoder as mt
  mesh = jax.make_mesh((2, 2, 2), mt.MESH_AXES,
                       axis_types=(jax.sharding.AxisType.Auto,) * 3)
  jitted, args = mt.setup(mesh, mt.Config(layers=layers, scan_layers=scan))
  return mesh, jitted, args


def measure(title: str, mesh, fn, args, reps: int, compiles: int) -> None:
  jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
  with jax.set_mesh(mesh):
    programs = {"jit": jitted, "use (auto)": jaxcoll.use(fn),
                "use (ring)": jaxcoll.use(fn, algorithm="ring")}
    starts = {"jit": [], "use (auto)": []}
    for _ in range(compiles):
      for name in starts:
        starts[name].append(startup_seconds(programs[name], *args))
    report = jaxcoll.explain_step(programs["use (ring)"], *args)
    calls = [lambda fn=fn: jax.block_until_ready(fn(*args)) for fn in programs.values()]
    rounds = interleaved(calls, reps=reps)
  medians = {name: statistics.median(r) for name, r in zip(programs, rounds)}
  start = {name: statistics.median(t) for name, t in starts.items()}
  sent = report.bytes_by_kind()
  print(f"\n{title}: 8 CPU devices, {len(rounds[0])} interleaved rounds, start-up the median "
        f"of {compiles}")
  print("| program | start-up s | start-up / jit | step median ms | step / jit |")
  print("|---|---:|---:|---:|---:|")
  for name in programs:
    cells = (f"{start[name]:.2f} | {start[name] / start['jit']:.2f}" if name in start
             else "- | -")
    print(f"| {name} | {cells} | {medians[name] * 1e3:.2f} | "
          f"{medians[name] / medians['jit']:.2f} |")
  print("ring step's jaxcoll collectives per step: " + ", ".join(
      f"{what} {jaxcoll.tools.format_size(n)}" for what, n in sorted(sent.items())))


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", default="mlp,decoder")
  parser.add_argument("--layers", type=int, default=12)
  parser.add_argument("--dim", type=int, default=256)
  parser.add_argument("--batch", type=int, default=64)
  parser.add_argument("--reps", type=int, default=20)
  parser.add_argument("--compiles", type=int, default=3)
  args = parser.parse_args()
  models = args.model.split(",")
  if unknown := [m for m in models if m not in ("mlp", "decoder")]:
    parser.error(f"--model: {unknown} not among mlp, decoder")
  print(f"jax {jax.__version__}")
  for model in models:
    if model == "mlp":
      mesh, fn, inputs = mlp_programs(args.layers, args.dim, args.batch)
      measure(f"MLP stack, {args.layers} layers, d={args.dim}, data parallel", mesh, fn,
              inputs, args.reps, args.compiles)
    elif model == "decoder":
      for scan in (True, False):
        mesh, fn, inputs = decoder_programs(args.layers, scan)
        measure(f"MaxText-style decoder, {args.layers} layers "
                f"{'scanned (nn.scan + nn.remat)' if scan else 'unscanned'}, 2x2x2 mesh",
                mesh, fn, inputs, args.reps, args.compiles)


if __name__ == "__main__":
  main()
