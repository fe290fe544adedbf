"""Fully sharded (FSDP / ZeRO-3) training of an 8-layer MLP over 8 CPU devices, with ZeRO++.

Run with:  pip install -e '.[examples]' && python examples/fsdp_mlp.py

Parameters, gradients and Adam's state are split 1/8 per device (``jaxcoll.fsdp``); each
layer is an FSDP unit (``jaxcoll.fsdp.layer``): gathered just before use, gathered again in
backward, its gradient reduce-scattered. On the mesh ("node", "local") = 2x4 the script

1. trains 10 steps sharded and data-parallel (one device, the same per-device batches
   averaged) and prints the largest parameter difference (exits non-zero above 1e-5);
2. prints per-device peak memory of one training step, from the compiled program's
   ``memory_analysis()``: data parallel (every device holds everything) against FSDP;
3. prints the bytes one device sends across "node" and "local" per step
   (``jaxcoll.traffic``, counted from the step's ppermutes; every collective a ring or
   hierarchical schedule so that nothing is hidden in a lax collective) for data parallel,
   FSDP, FSDP + hpZ, FSDP + qwZ + qgZ, and all three ZeRO++ options;
4. trains 100 steps with all three options and prints the loss against the plain run's.
"""

from __future__ import annotations

import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxcoll  # noqa: E402
from jaxcoll import fsdp  # noqa: E402

try:
  import optax  # noqa: E402
except ImportError:
  raise SystemExit(f"{__file__} needs optax: pip install -e '.[examples]'") from None

LAYERS, WIDTH, BATCH, AXES = 8, 256, 256, ("node", "local")
# hpZ's stages run over one axis each ("node", then "local"): rings there; the flat
# gathers run hierarchically over both axes
OPTIONS = {
    "FSDP": {"algorithm": "hierarchical"},
    "FSDP + hpZ": {"secondary_axis": "local", "algorithm": "ring"},
    "FSDP + qwZ + qgZ": {"wire_dtype": "int8", "grad_wire_dtype": "int8",
                         "algorithm": "hierarchical"},
    "FSDP + hpZ + qwZ + qgZ": {"secondary_axis": "local", "wire_dtype": "int8",
                               "grad_wire_dtype": "int8", "algorithm": "ring"},
}


def init(key):
  keys = jax.random.split(key, LAYERS)
  return [{"w": jax.random.normal(k, (WIDTH, WIDTH)) / np.sqrt(WIDTH), "b": jnp.zeros(WIDTH)}
          for k in keys]


def dense(p, h):
  return jnp.tanh(h @ p["w"] + p["b"])


def loss_fn(params, batch, run_layer=lambda f, p, h: f(p, h)):
  x, y = batch
  for p in params:
    x = run_layer(dense, p, x)
  return jnp.mean((x - y) ** 2)


def sharded_loss(**options):
  """The loss over Sharded blocks, each layer an FSDP unit."""
  def run_layer(f, p, h):
    return fsdp.layer(f, AXES, **options)(p, h)
  return lambda shards, batch: loss_fn(shards, batch, run_layer=run_layer)


def data_parallel_step(tx, mesh):
  """Every device holds everything; gradients all-reduced (hierarchical)."""
  def body(params, opt_state, batch):
    grads = jax.grad(loss_fn)(params, batch)
    grads = jaxcoll.sync_gradients(grads, AXES, algorithm="hierarchical")
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P(AXES)),
                               out_specs=(P(), P()), check_vma=False), donate_argnums=(0, 1))


def peak_bytes(compiled) -> int:
  m = compiled.memory_analysis()
  return (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
          + m.temp_size_in_bytes)


def mib(b: float) -> str:
  return f"{b / 2**20:.2f}"


def main() -> int:
  mesh = Mesh(np.array(jax.devices()).reshape(2, 4), AXES)
  n = mesh.size
  params = init(jax.random.key(0))
  kx, ky = jax.random.split(jax.random.key(1))
  batch = (jax.random.normal(kx, (BATCH, WIDTH)), jax.random.normal(ky, (BATCH, WIDTH)))
  tx = optax.adam(1e-3)
  plain = fsdp.train_step(sharded_loss(**OPTIONS["FSDP"]), tx, mesh, AXES,
                          gather_params=False)

  # 1. equal to data-parallel training
  shares = jax.tree.map(lambda v: v.reshape((n, -1) + v.shape[1:]), batch)

  @jax.jit
  def reference_step(p, s):    # one device: each device's share of the batch, averaged
    grads = [jax.grad(loss_fn)(p, jax.tree.map(lambda v, i=i: v[i], shares)) for i in range(n)]
    updates, s = tx.update(jax.tree.map(lambda *g: sum(g) / n, *grads), s, p)
    return optax.apply_updates(p, updates), s

  ref, ref_state = params, tx.init(params)
  state = plain.init(params)
  for _ in range(10):
    ref, ref_state = reference_step(ref, ref_state)
    state, _ = plain(state, batch)
  diff = max(float(jnp.abs(a - b).max())
             for a, b in zip(jax.tree.leaves(plain.params(state)), jax.tree.leaves(ref)))
  print(f"{LAYERS}-layer MLP ({WIDTH}x{WIDTH}), {n} devices {dict(mesh.shape)}, Adam")
  print(f"10 steps: max |FSDP - data parallel| over the parameters = {diff:.2e}")

  # 2. memory
  param_bytes = sum(v.nbytes for v in jax.tree.leaves(params))
  layer_bytes = param_bytes // LAYERS
  dp = data_parallel_step(tx, mesh)
  dp_args = (params, tx.init(params), batch)
  dp_peak = peak_bytes(dp.lower(*dp_args).compile())
  fs_state = plain.init(params)
  fs_peak = peak_bytes(jax.jit(plain.__call__, donate_argnums=0).lower(fs_state, batch)
                       .compile())
  bound = 4 * param_bytes / n + 2 * layer_bytes
  print("\nPeak memory of one step per device (compiled memory_analysis: arguments + outputs "
        "- aliased + temporaries), MiB:")
  print("| | peak | params + grads + Adam (4 P) | one layer's params |")
  print("|---|---:|---:|---:|")
  print(f"| data parallel | {mib(dp_peak)} | {mib(4 * param_bytes)} | {mib(layer_bytes)} |")
  print(f"| FSDP | {mib(fs_peak)} | {mib(4 * param_bytes / n)} (1/{n}) | {mib(layer_bytes)} |")
  print(f"FSDP / data parallel = {fs_peak / dp_peak:.2f}; FSDP's bound 4P/N + 2 layers = "
        f"{mib(bound)} MiB (+ activations)")

  # 3. traffic per step
  sharded = fsdp.shard(params, n)
  specs = fsdp.specs(sharded, AXES)

  def grads_of(loss):
    return jax.shard_map(lambda s, b: jax.grad(loss)(s, b), mesh=mesh,
                         in_specs=(specs, P(AXES)), out_specs=specs, check_vma=False)

  dp_grads = jax.shard_map(
      lambda p, b: jaxcoll.sync_gradients(jax.grad(loss_fn)(p, b), AXES,
                                          algorithm="hierarchical"),
      mesh=mesh, in_specs=(P(), P(AXES)), out_specs=P(), check_vma=False)
  rows = [("data parallel", jaxcoll.traffic(dp_grads, mesh, params, batch))]
  rows += [(name, jaxcoll.traffic(grads_of(sharded_loss(**o)), mesh, sharded, batch))
           for name, o in OPTIONS.items()]
  base = dict(rows)["FSDP"].bytes["node"]
  print(f"\nBytes one device sends per step (parameters: {mib(param_bytes)} MiB float32), MiB:")
  print("| | across node | within node (local) | node vs FSDP |")
  print("|---|---:|---:|---:|")
  for name, t in rows:
    assert not t.collectives, f"{name}: lax collectives the count cannot see: {t.collectives}"
    print(f"| {name} | {mib(t.bytes['node'])} | {mib(t.bytes['local'])} | "
          f"{t.bytes['node'] / base:.2f} |")

  # 4. convergence with every option
  losses = {}
  for name in ("FSDP", "FSDP + hpZ + qwZ + qgZ"):
    step = fsdp.train_step(sharded_loss(**OPTIONS[name]), tx, mesh, AXES, gather_params=False)
    state = step.init(params)
    for _ in range(100):
      state, loss = step(state, batch)
    losses[name] = float(loss)
  ratio = losses["FSDP + hpZ + qwZ + qgZ"] / losses["FSDP"]
  print(f"\nloss after 100 steps: FSDP {losses['FSDP']:.5f}, all three ZeRO++ options "
        f"{losses['FSDP + hpZ + qwZ + qgZ']:.5f} ({ratio:.4f}x)")
  ok = diff < 1e-5 and fs_peak < dp_peak and abs(ratio - 1) < 0.02
  print("OK" if ok else "FAILED")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
