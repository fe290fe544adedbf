"""FSDP training steps: lax FSDP against jaxcoll's, plain and with ZeRO++'s options.

On the mesh ("node", "local") = 2x4: an MLP of LAYERS layers of WIDTH x WIDTH float32
(plus biases), parameters and Adam's state sharded 1/8 per device, every layer an FSDP
unit (gathered before use, re-gathered in backward, gradient reduce-scattered), TOKENS
tokens per device. Rows:

- ``lax FSDP``: JAX's shard_map tutorial: ``lax.all_gather(tiled=True)`` per layer under
  ``jax.checkpoint`` (its transpose, ``psum_scatter``, reduces the gradients);
- ``data parallel``: every device holds everything, gradients all-reduced
  (``jaxcoll.sync_gradients``, auto);
- ``FSDP``: ``jaxcoll.fsdp.layer`` with ``algorithm`` (default hierarchical);
- ``+ hpZ`` (its one-axis stages as rings), ``+ qwZ + qgZ`` (int8 gathers and
  reduce-scatter), and all three.

Timed side by side (``jaxcoll.tools.interleaved``, medians); "vs lax" is each row's time over lax
FSDP's. "MiB across node" is what one device sends across the node axis per step, counted
from the step's ppermutes (``jaxcoll.traffic``; "-" where lax collectives hide it). Across two
emulated nodes on a slow link:

  sudo python benchmarks/emulated_cluster.py --rate 250mbit -- \\
      python benchmarks/bench_fsdp.py --child --processes 2
"""

from __future__ import annotations

import argparse
import statistics


def child(args) -> int:
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax
  from jax import lax
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  import jaxcoll
  from jaxcoll import fsdp, tools

  axes = ("node", "local")
  mesh = Mesh(np.array(jax.devices()).reshape(2, 4), axes)
  n = mesh.size
  keys = jax.random.split(jax.random.key(0), args.layers)
  params = [{"w": jax.random.normal(k, (args.width, args.width)) / np.sqrt(args.width),
             "b": jnp.zeros(args.width)} for k in keys]
  kx, ky = jax.random.split(jax.random.key(1))
  batch = (jax.random.normal(kx, (n * args.tokens, args.width)),
           jax.random.normal(ky, (n * args.tokens, args.width)))
  batch = jax.device_put(batch, NamedSharding(mesh, P(axes)))
  tx = optax.adam(1e-3)

  def dense(p, h):
    return jnp.tanh(h @ p["w"] + p["b"])

  def loss_fn(layers, b, run_layer):
    x, y = b
    for p in layers:
      x = run_layer(dense, p, x)
    return jnp.mean((x - y) ** 2)

  def lax_layer(f, s, h):          # the shard_map tutorial's FSDP
    gather = lambda s: jax.tree.map(   # noqa: E731
        lambda v: lax.slice_in_dim(lax.all_gather(v.value, axes, axis=v.axis, tiled=True), 0,
                                   v.shape[v.axis], axis=v.axis).reshape(v.shape),
        s, is_leaf=lambda v: isinstance(v, fsdp.Sharded))
    return jax.checkpoint(lambda s, h: f(gather(s), h),
                          policy=jax.checkpoint_policies.dots_saveable)(s, h)

  def jaxcoll_layer(**options):
    # hpZ's stages run over one axis each: a ring there where the flat gather is hierarchical
    one_axis = "ring" if args.algorithm == "hierarchical" else args.algorithm
    algorithm = one_axis if "secondary_axis" in options else args.algorithm
    return lambda f, s, h: fsdp.layer(f, axes, algorithm=algorithm, **options)(s, h)

  def sharded_step(run_layer):
    step = fsdp.train_step(lambda s, b: loss_fn(s, b, run_layer), tx, mesh, axes,
                           gather_params=False, donate=False)
    state = step.init(params)
    grads = jax.shard_map(lambda s, b: jax.grad(loss_fn)(s, b, run_layer), mesh=mesh,
                          in_specs=(fsdp.specs(state.params, axes), P(axes)),
                          out_specs=fsdp.specs(state.params, axes), check_vma=False)
    return (lambda: jax.block_until_ready(step(state, batch))), (grads, state.params)

  def dp_step():
    def body(p, s, b):
      grads = jaxcoll.sync_gradients(jax.grad(loss_fn)(p, b, lambda f, q, h: f(q, h)), axes)
      updates, s = tx.update(grads, s, p)
      return optax.apply_updates(p, updates), s
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P(axes)),
                              out_specs=(P(), P()), check_vma=False))
    opt = tx.init(params)
    grads = jax.shard_map(
        lambda p, b: jaxcoll.sync_gradients(jax.grad(loss_fn)(p, b, lambda f, q, h: f(q, h)),
                                            axes),
        mesh=mesh, in_specs=(P(), P(axes)), out_specs=P(), check_vma=False)
    return (lambda: jax.block_until_ready(f(params, opt, batch))), (grads, params)

  zpp = {"hpZ": {"secondary_axis": "local"},
         "qwZ + qgZ": {"wire_dtype": "int8", "grad_wire_dtype": "int8"},
         "hpZ + qwZ + qgZ": {"secondary_axis": "local", "wire_dtype": "int8",
                             "grad_wire_dtype": "int8"}}
  ways = [("lax FSDP", sharded_step(lax_layer)), ("data parallel", dp_step()),
          (f"FSDP ({args.algorithm})", sharded_step(jaxcoll_layer()))]
  ways += [(f"FSDP + {name}", sharded_step(jaxcoll_layer(**o))) for name, o in zpp.items()]
  times = tools.interleaved([w[1][0] for w in ways], reps=args.reps,
                             min_seconds=args.min_seconds)
  med = [statistics.median(t) for t in times]
  if jax.process_index() == 0:
    param_mib = sum(v.nbytes for v in jax.tree.leaves(params)) / 2**20
    print(f"{jax.process_count()} process(es), mesh 2x4 (node, local), {args.layers} layers "
          f"{args.width}x{args.width} ({param_mib:.1f} MiB float32), {args.tokens} tokens per "
          f"device, Adam, jax {jax.__version__}; medians of {len(times[0])}")
    print("| step | time | vs lax | MiB across node | MiB within node |")
    print("|---|---:|---:|---:|---:|")
  for (name, (_, (grads, args_))), m in zip(ways, med):
    t = jaxcoll.traffic(grads, mesh, args_, batch)
    cells = ("-", "-") if t.collectives else (f"{t.bytes['node'] / 2**20:.2f}",
                                              f"{t.bytes['local'] / 2**20:.2f}")
    if jax.process_index() == 0:
      print(f"| {name} | {m * 1e3:.1f} ms | {m / med[0]:.2f} | {cells[0]} | {cells[1]} |",
            flush=True)
  return 0


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--layers", type=int, default=8)
  parser.add_argument("--width", type=int, default=1024)
  parser.add_argument("--tokens", type=int, default=64, help="tokens per device")
  parser.add_argument("--algorithm", default="hierarchical",
                      help="jaxcoll FSDP's gather algorithm")
  parser.add_argument("--reps", type=int, default=5)
  parser.add_argument("--min-seconds", type=float, default=0.0)
  from jaxcoll.launch import benchmark
  return benchmark(parser, child, __file__, argv)


if __name__ == "__main__":
  raise SystemExit(main())
