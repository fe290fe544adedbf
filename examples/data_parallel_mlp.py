"""Data-parallel training of an MLP with optax over 8 CPU devices, four ways.

Run with:  pip install -e '.[examples]' && python examples/data_parallel_mlp.py

The same model, data and optimizer (Adam), 100 steps, global batch 4096 split over 8
devices, with the gradients synced by:

  1. per-leaf ``jax.lax.pmean`` (the baseline);
  2. ``jaxcoll.sync_gradients`` (buckets, one all_reduce each);
  3. ``jaxcoll.optax.sync(wire_dtype="int8", error_feedback=False)``;
  4. ``jaxcoll.optax.sync(wire_dtype="int8")`` (error feedback on).

It prints the loss curves side by side, the bytes each device sends per step (ring
all-reduce: 2(N-1)/N times the gradient bytes, times the wire format's ratio), and each
run's final loss against the lax run's; it exits non-zero if sync_gradients drifts from
lax or int8 with error feedback ends more than 1% above it.
"""

from __future__ import annotations

import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

import jaxcoll  # noqa: E402

try:
  import optax  # noqa: E402
except ImportError:
  raise SystemExit(f"{__file__} needs optax: pip install -e '.[examples]'") from None


STEPS, BATCH, WIDTH, AXIS = 100, 4096, 32, "data"


def init_params(key):
  sizes = [(16, WIDTH), (WIDTH, WIDTH), (WIDTH, WIDTH), (WIDTH, 1)]
  keys = jax.random.split(key, len(sizes))
  return [{"w": jax.random.normal(k, s) / np.sqrt(s[0]), "b": jnp.zeros(s[1])}
          for k, s in zip(keys, sizes)]


def loss_fn(params, batch):
  x, y = batch
  for layer in params[:-1]:
    x = jax.nn.gelu(x @ layer["w"] + layer["b"])
  pred = x @ params[-1]["w"] + params[-1]["b"]
  return jnp.mean((pred - y) ** 2)


def make_data(key):
  kx, kw, kn = jax.random.split(key, 3)
  x = jax.random.normal(kx, (BATCH, 16))
  y = jnp.sin(x @ jax.random.normal(kw, (16, 1))) + 0.1 * x[:, :1] ** 2
  y = y + 0.3 * jax.random.normal(kn, y.shape)      # label noise: the loss has a floor
  return x, y


def step_with(tx, sync_grads=None):
  def step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    if sync_grads is not None:
      grads = sync_grads(grads)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, {"loss": loss}
  return step


def main() -> int:
  mesh = Mesh(np.array(jax.devices()), (AXIS,))
  n = mesh.size
  params = init_params(jax.random.key(0))
  batch = make_data(jax.random.key(1))
  adam = optax.adam(3e-3)
  runs = {
      "lax.pmean": (adam, lambda g: jax.tree.map(lambda v: lax.pmean(v, AXIS), g)),
      "sync_gradients": (adam, lambda g: jaxcoll.sync_gradients(g, AXIS)),
      "int8, no EF": (optax.chain(jaxcoll.optax.sync(AXIS, wire_dtype="int8",
                                                     error_feedback=False), adam), None),
      "int8 + EF": (optax.chain(jaxcoll.optax.sync(AXIS, wire_dtype="int8"), adam), None),
  }
  grad_bytes = sum(v.nbytes for v in jax.tree.leaves(params))
  ring = 2 * (n - 1) / n * grad_bytes
  wire = {"int8, no EF": jaxcoll.WireFormat("int8").ratio(np.float32),
          "int8 + EF": jaxcoll.WireFormat("int8").ratio(np.float32)}
  curves = {}
  for name, (tx, sync_grads) in runs.items():
    step = jaxcoll.data_parallel(step_with(tx, sync_grads), mesh, AXIS)
    p, s, losses = params, tx.init(params), []
    for _ in range(STEPS):
      p, s, m = step(p, s, batch)
      losses.append(float(m["loss"]))
    curves[name] = losses
  names = list(curves)
  print(f"{n} devices, {grad_bytes / 1024:.1f} KiB of float32 gradients, global batch {BATCH}")
  print("| step | " + " | ".join(names) + " |")
  print("|---:|" + "---:|" * len(names))
  for t in [0, 9, 19, 29, 49, 69, 89, STEPS - 1]:
    print(f"| {t + 1} | " + " | ".join(f"{curves[k][t]:.5f}" for k in names) + " |")
  base = curves["lax.pmean"][-1]
  print("\n| run | bytes sent per device per step | final loss | vs lax |")
  print("|---|---:|---:|---:|")
  for k in names:
    sent = ring * wire.get(k, 1.0)
    print(f"| {k} | {sent / 1024:.1f} KiB | {curves[k][-1]:.5f} | "
          f"{(curves[k][-1] - base) / base:+.2%} |")
  ok = (abs(curves["sync_gradients"][-1] - base) <= 1e-3 * base and
        curves["int8 + EF"][-1] <= 1.01 * base)
  print("\nOK" if ok else "\nFAILED: a run drifted from the lax baseline")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
