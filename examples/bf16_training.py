"""bfloat16 data-parallel training with four gradient syncs: how much the reduction's rounding
costs, and what stochastic rounding and float32 accumulation buy back.

Run with:  pip install -e '.[examples]' && python examples/bf16_training.py [--plot out.png]

An MLP regression (16 -> 64 -> 64 -> 1, a fixed random teacher plus noise) trained for
``--steps`` steps of SGD with momentum on 8 CPU devices, each with its own shard of the
batch. The data is not identically distributed: device r's inputs are scaled by 2**(r/2),
so a gradient's partial sums are dominated by the last devices, and the contributions of
the first ones (about 2**-7 of device 7's) are what a bfloat16 sum (8 significant bits)
rounds away. Mixed precision as most bfloat16 training runs it: the
optimizer keeps float32 master weights, the forward and backward pass compute in bfloat16,
and the bfloat16 gradients are synced by ``jaxcoll.sync_gradients`` (a ring all-reduce, whose
seven combines each round; what auto runs across processes, where the lax collective is
slower) in one of four ways:

  1. float32: the gradients cast to float32 and reduced exactly (the reference);
  2. bfloat16, round to nearest: every combine of the reduction rounded to bfloat16;
  3. bfloat16, ``accumulate_dtype="float32"``: float32 partial sums, one rounding at the end;
  4. bfloat16, ``rounding="stochastic"``: every combine rounded stochastically (unbiased),
     with a key split off per step.

Every run starts from the same weights and sees the same batches. It prints the loss every
``--steps // 10`` steps side by side and a table: the final loss (mean of the last 10% of
steps) over all devices and on device 0's data (the contributions rounding drops), each
with its gap to float32's. ``--plot`` writes both loss curves (matplotlib, the ``plot``
extra).
"""

from __future__ import annotations

import argparse
import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxcoll  # noqa: E402

AXIS, N, SIZES = "data", 8, [(16, 64), (64, 64), (64, 1)]
SYNCS = {   # every sync a ring all-reduce: each of its 7 combines rounds (lax's psum on one
            # CPU process reduces bfloat16 in float32, which row 3 shows)
    "float32": dict(cast=jnp.float32),
    "bfloat16, round to nearest": {},
    "bfloat16, float32 accumulation": dict(accumulate_dtype="float32"),
    "bfloat16, stochastic rounding": dict(rounding="stochastic"),
}


def init(key):
  keys = jax.random.split(key, len(SIZES))
  return [{"w": jax.random.normal(k, s) / np.sqrt(s[0]), "b": jnp.zeros(s[1])}
          for k, s in zip(keys, SIZES)]


def forward(params, x):
  for i, layer in enumerate(params):
    x = x @ layer["w"] + layer["b"]
    if i < len(params) - 1:
      x = jax.nn.gelu(x)
  return x


def batches(steps: int, batch: int, seed: int = 0):
  """``[steps, N, batch, 16]`` inputs (device r's scaled by 2**(r/2)) and targets of a fixed
  random teacher plus noise."""
  rng = np.random.default_rng(seed)
  teacher = init(jax.random.key(seed + 1))
  scale = 2.0 ** (np.arange(N) / 2)[None, :, None, None]
  x = (rng.standard_normal((steps, N, batch, 16)) * scale).astype(np.float32)
  y = np.asarray(jax.jit(jax.vmap(lambda v: forward(teacher, v)))(
      x.reshape(-1, batch, 16))).reshape(steps, N, batch, 1)
  return x, (y + 0.1 * rng.standard_normal(y.shape)).astype(np.float32)


def make_step(mesh, sync: dict, lr: float, momentum: float):
  """One jitted step: bfloat16 forward/backward per device, the sync, SGD with momentum on
  float32 master weights (replicated)."""
  cast = sync.get("cast")
  options = {k: v for k, v in sync.items() if k != "cast"}

  def per_device(params, velocity, x, y, key):
    low = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)
    loss, grads = jax.value_and_grad(lambda p: jnp.mean(
        (forward(p, x[0].astype(jnp.bfloat16)) - y[0]).astype(jnp.float32) ** 2))(low)
    if cast is not None:
      grads = jax.tree.map(lambda g: g.astype(cast), grads)
    if options.get("rounding") == "stochastic":
      options_now = dict(options, key=key)
    else:
      options_now = options
    grads = jaxcoll.sync_gradients(grads, AXIS, algorithm="ring", **options_now)
    velocity = jax.tree.map(lambda v, g: momentum * v + g.astype(jnp.float32), velocity, grads)
    params = jax.tree.map(lambda p, v: p - lr * v, params, velocity)
    return params, velocity, loss[None]

  return jax.jit(jax.shard_map(per_device, mesh=mesh,
                               in_specs=(P(), P(), P(AXIS), P(AXIS), P()),
                               out_specs=(P(), P(), P(AXIS)), check_vma=False))


def train(mesh, sync, x, y, *, lr: float, momentum: float, seed: int = 0):
  step = make_step(mesh, sync, lr, momentum)
  params = init(jax.random.key(seed))
  velocity = jax.tree.map(jnp.zeros_like, params)
  key, losses = jax.random.key(seed + 2), []
  for t in range(x.shape[0]):
    key, now = jax.random.split(key)
    params, velocity, loss = step(params, velocity, x[t], y[t], now)
    losses.append(np.asarray(loss))
  return np.array(losses), params   # losses: [steps, devices]


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--steps", type=int, default=400)
  parser.add_argument("--batch", type=int, default=64, help="rows per device per step")
  parser.add_argument("--lr", type=float, default=2e-3)
  parser.add_argument("--momentum", type=float, default=0.9)
  parser.add_argument("--plot", help="write the loss curves to this image file")
  args = parser.parse_args(argv)

  mesh = Mesh(np.array(jax.devices()[:N]), (AXIS,))
  x, y = batches(args.steps, args.batch)
  runs = {name: train(mesh, sync, x, y, lr=args.lr, momentum=args.momentum)
          for name, sync in SYNCS.items()}
  every = max(args.steps // 10, 1)
  names = list(runs)
  print(f"jax {jax.__version__}, {N} devices, {args.steps} steps, batch {args.batch}/device")
  print("| step | " + " | ".join(names) + " |")
  print("|---:|" + "---:|" * len(names))
  for t in list(range(0, args.steps, every)) + [args.steps - 1]:
    print(f"| {t} | " + " | ".join(f"{runs[k][0][t].mean():.4f}" for k in names) + " |")

  tail = max(args.steps // 10, 1)
  final = {k: runs[k][0][-tail:].mean() for k in names}
  first = {k: runs[k][0][-tail:, 0].mean() for k in names}
  print(f"\n| sync | final loss, all devices (last {tail} steps) | gap to float32 "
        "| final loss on device 0's data | gap to float32 |")
  print("|---|---:|---:|---:|---:|")
  for k in names:
    print(f"| {k} | {final[k]:.4f} | {final[k] / final['float32'] - 1:+.1%} "
          f"| {first[k]:.4f} | {first[k] / first['float32'] - 1:+.1%} |")

  if args.plot:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, (title, curve) in zip(axes, [("all devices", lambda v: v.mean(1)),
                                         ("device 0's data", lambda v: v[:, 0])]):
      for k in names:
        ax.plot(curve(runs[k][0]), label=k, lw=1)
      ax.set(yscale="log", xlabel="step", ylabel="training loss (MSE)", title=title)
    axes[0].legend()
    fig.suptitle(f"bfloat16 data parallel on {N} CPU devices: the gradient sync's rounding")
    fig.tight_layout()
    fig.savefig(args.plot, dpi=120)
    print(f"\nwrote {args.plot}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
