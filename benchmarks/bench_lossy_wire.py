"""What a lossy wire does to training under ``jaxcoll.use``: loss curves side by side.

The transformer language model the tests train (``tests/pjit_models.py``: embedding, layer
norm, causal attention, dropout, a ``lax.scan`` over layers, optax Adam), on a learnable
synthetic language (each token's successor drawn from a fixed sparse bigram table), run
for ``--steps`` steps from the same initial parameters and the same batches by plain
``jax.jit`` and by ``jaxcoll.use(step, algorithm="ring")`` with each ``--wires`` wire
format ("none": float32). Data parallel over 8 CPU devices, and data x model (2 x 4,
Megatron-split attention and MLP, whose activation sums cross the wire too). Prints the
mean loss of windows of steps and the final gap to jit; ``--plot`` writes the curves.

  python benchmarks/bench_lossy_wire.py [--steps 300] [--plot docs/_static/use_int8_training.png]
"""

from __future__ import annotations

import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import argparse  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pjit_models as models  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxcoll  # noqa: E402

SIZES = dict(vocab=64, dim=64, heads=4, hidden=128, layers=2, length=32)


def batches(steps: int, batch: int, seed: int = 0):
  """``steps`` batches of ``[batch, length + 1]`` tokens: a start token, then each
  successor drawn from 4 choices the token allows (a fixed random bigram table), so the
  best loss is about log(4) = 1.39."""
  rng = np.random.default_rng(seed)
  table = rng.integers(0, SIZES["vocab"], (SIZES["vocab"], 4))
  out = np.empty((steps, batch, SIZES["length"] + 1), np.int32)
  out[:, :, 0] = rng.integers(0, SIZES["vocab"], (steps, batch))
  for t in range(SIZES["length"]):
    out[:, :, t + 1] = table[out[:, :, t], rng.integers(0, 4, (steps, batch))]
  return out


def run(step, params, opt_state, tokens, mesh, key) -> np.ndarray:
  losses = []
  data = NamedSharding(mesh, P("data"))
  with jax.set_mesh(mesh):
    for i, batch in enumerate(tokens):
      params, opt_state, loss = step(params, opt_state, jax.device_put(batch, data),
                                     jax.random.fold_in(key, i))
      losses.append(float(loss))
  return np.array(losses)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--batch", type=int, default=64)
  parser.add_argument("--wires", default="none,bfloat16,int8")
  parser.add_argument("--layouts", default="dp,tp")
  parser.add_argument("--plot", default=None)
  args = parser.parse_args()
  tokens = batches(args.steps, args.batch)
  curves: dict = {}
  for layout in args.layouts.split(","):
    shape, names = ((8,), ("data",)) if layout == "dp" else ((2, 4), ("data", "model"))
    mesh = jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape))
    init = models.lm_init(jax.random.key(0), **SIZES)
    params = jax.tree.map(lambda x, s, m=mesh: jax.device_put(x, NamedSharding(m, s)), init,
                          models.lm_specs(init, layout))
    opt_state = models.lm_optimizer.init(params)
    key = jax.random.key(1)
    curves[(layout, "jit")] = run(jax.jit(models.lm_step), params, opt_state, tokens, mesh,
                                  key)
    for wire in args.wires.split(","):
      step = jaxcoll.use(models.lm_step, algorithm="ring",
                         wire_dtype=None if wire == "none" else wire)
      curves[(layout, f"use {wire}")] = run(step, params, opt_state, tokens, mesh, key)
  windows = [(0, 10), (90, 110), (190, 210), (args.steps - 20, args.steps)]
  print(f"mean loss over steps, {args.steps} steps of {args.batch} sequences "
        f"(jax {jax.__version__}); best possible about {np.log(4):.2f}")
  print("| layout | run | " + " | ".join(f"steps {a}-{b - 1}" for a, b in windows)
        + " | last 20 vs jit |")
  print("|---|---|" + "---:|" * (len(windows) + 1))
  for (layout, name), losses in curves.items():
    last = losses[-20:].mean() - curves[(layout, "jit")][-20:].mean()
    cells = " | ".join(f"{losses[a:b].mean():.4f}" for a, b in windows)
    print(f"| {layout} | {name} | {cells} | {last:+.4f} |")
  if args.plot:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    layouts = args.layouts.split(",")
    fig, axes = plt.subplots(1, len(layouts), figsize=(6 * len(layouts), 4), squeeze=False)
    for ax, layout in zip(axes[0], layouts):
      for (lay, name), losses in curves.items():
        if lay == layout:
          ax.plot(losses, label=name, linewidth=1)
      ax.set_title(f"{layout}: loss per step")
      ax.set_xlabel("step")
      ax.set_ylabel("loss")
      ax.set_yscale("log")
      ax.legend()
    fig.tight_layout()
    fig.savefig(args.plot, dpi=100)
    print(f"wrote {args.plot}")


if __name__ == "__main__":
  main()
