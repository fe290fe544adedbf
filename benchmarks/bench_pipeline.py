"""Time per training step of each pipeline schedule against the unpipelined step.

One process, 8 CPU devices: a model of 8 tanh layers (``--width``), ``--microbatches``
microbatches of ``--rows`` rows. Pipelined: ``jaxcoll.pipeline.run`` over 4 stages x 2
data replicas (GPipe, 1F1B, zero-bubble: 2 layers a stage; interleaved: 2 chunks of one
layer a device), gradients synced over "data". Unpipelined: ``jax.jit`` of
``jax.value_and_grad`` with the batch split over all 8 devices (data parallel), the same
model and batch. Timed side by side (``jaxcoll.tools.interleaved``), medians; the table
gives each schedule's bubble fraction and its time over the unpipelined step's.

  python benchmarks/bench_pipeline.py
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import statistics  # noqa: E402


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--width", type=int, default=512)
  parser.add_argument("--rows", type=int, default=128, help="rows a microbatch")
  parser.add_argument("--microbatches", type=int, default=8)
  parser.add_argument("--reps", type=int, default=10)
  parser.add_argument("--min-seconds", type=float, default=3.0)
  args = parser.parse_args()

  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  import jaxcoll
  layers, stages, m, d = 8, 4, args.microbatches, args.width
  keys = jax.random.split(jax.random.key(0), layers)
  weights = [jax.random.normal(k, (d, d)) / np.sqrt(d) for k in keys]
  x = jax.random.normal(jax.random.key(1), (m, 2 * args.rows, d))
  y = jax.random.normal(jax.random.key(2), (m, 2 * args.rows, d))

  def stage_fn(p, h):   # p: [layers of this stage, d, d]
    for i in range(p.shape[0]):
      h = jnp.tanh(h @ p[i])
    return h

  def loss_fn(out, t):
    return jnp.mean((out - t) ** 2)

  def whole(ws, x, y):
    return jnp.mean(jax.vmap(lambda a, b: loss_fn(stage_fn(jnp.stack(ws), a), b))(x, y))

  flat = Mesh(np.array(jax.devices()), ("data",))
  split = NamedSharding(flat, P(None, "data"))
  programs = {"unpipelined (jit, data parallel over 8)": (
      jax.jit(jax.value_and_grad(whole)), (weights, jax.device_put(x, split),
                                           jax.device_put(y, split)))}
  mesh = Mesh(np.array(jax.devices()).reshape(2, stages), ("data", "stage"))
  bubbles = {}
  for schedule in jaxcoll.pipeline.SCHEDULES:
    v = 2 if schedule == "interleaved" else 1
    per = layers // (stages * v)
    stage_params = [jnp.stack(weights[k * per:(k + 1) * per]) for k in range(stages * v)]

    def step(w, x, y, schedule=schedule, v=v):
      loss, grads = jaxcoll.pipeline.run(stage_fn, w, x, y, "stage", loss_fn=loss_fn,
                                         schedule=schedule, virtual_stages=v)
      return jaxcoll.all_reduce(loss, "data", op="mean"), jaxcoll.sync_gradients(grads, "data")
    f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P("stage"), P(None, "data"),
                                                         P(None, "data")),
                              out_specs=(P(), P("stage"))))
    programs[schedule] = (f, (jaxcoll.pipeline.stack(stage_params, stages), x, y))
    bubbles[schedule] = jaxcoll.pipeline.schedule(schedule, stages, m, v).bubble

  values = {}
  for name, (f, a) in programs.items():
    values[name] = float(jax.block_until_ready(f(*a))[0])   # compile, and the loss
  times = jaxcoll.tools.interleaved(
      [lambda f=f, a=a: jax.block_until_ready(f(*a)) for f, a in programs.values()],
      reps=args.reps, min_seconds=args.min_seconds)
  med = {k: statistics.median(t) for k, t in zip(programs, times)}
  base = med["unpipelined (jit, data parallel over 8)"]
  print(f"8 layers of {d} x {d}, {m} microbatches of {2 * args.rows} rows, one process of 8 "
        f"CPU devices, jax {jax.__version__}; medians of {len(times[0])} interleaved rounds")
  print("| step | bubble | loss | time | / unpipelined |")
  print("|---|---:|---:|---:|---:|")
  for k in programs:
    bubble = f"{bubbles[k]:.3f}" if k in bubbles else "-"
    print(f"| {k} | {bubble} | {values[k]:.6f} | {med[k] * 1e3:.1f} ms | {med[k] / base:.2f} |")


if __name__ == "__main__":
  main()
