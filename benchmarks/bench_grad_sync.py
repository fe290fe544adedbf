"""Gradient sync of a 200-leaf model: per-leaf lax.pmean against jaxcoll's bucketed sync.

The model's gradients: 150 leaves of 256 floats, 46 of 64x64, 4 of 512x512 (4.8 MB of
float32), on 8 devices over one axis "data":
  --processes 1: 8 CPU devices in one process;
  --processes 2: 2 processes x 4 devices on loopback, gloo (jaxcoll.launch).
Timed side by side (``jaxcoll.tools.interleaved``: rounds in rotated order,
medians): per-leaf ``lax.pmean``; ``lax.pmean`` of DDP's buckets (1 MiB, then 25 MiB);
``jaxcoll.sync_gradients`` (auto, native, ring, int8 wire);
per-leaf ``jaxcoll.all_reduce(op="mean")`` (auto, ring). Columns: collectives in the
compiled HLO (all-reduce ops + collective-permutes, loops counted once), median time, and
the ratio to per-leaf lax.pmean. Process 0 prints a markdown table.

  python benchmarks/bench_grad_sync.py --processes 1
  python benchmarks/bench_grad_sync.py --processes 2

``--step`` times whole data-parallel training steps instead (gradient, sync, SGD update) of
a model of ``--step-mib`` MiB of float32 weights (default 16: layers of 1024x1024) on the
mesh ("node", "local") = 2x4, the sync over both axes: per-leaf lax.pmean against
jaxcoll's sync (auto; hierarchical; ring and hierarchical with int8 on the wire, error
feedback on). Across two emulated nodes on a slow link:

  sudo python benchmarks/emulated_cluster.py --rate 250mbit -- \
      python benchmarks/bench_grad_sync.py --child --processes 2 --step

``--pjit`` times the same models written for global arrays (plain ``jax.jit`` over a batch
split across the devices, no shard_map): plain ``jit`` against ``jaxcoll.use(step)`` (auto;
ring; with ``--step`` also hierarchical and int8 on the wire), and for the 200-leaf model
the shard_map step with ``sync_gradients(algorithm="ring")``:

  python benchmarks/bench_grad_sync.py --pjit
  sudo python benchmarks/emulated_cluster.py --rate 250mbit -- \
      python benchmarks/bench_grad_sync.py --child --processes 2 --step --pjit
"""

from __future__ import annotations

import argparse
import re
import statistics

SHAPES = [(256,)] * 150 + [(64, 64)] * 46 + [(512, 512)] * 4


def per_bucket_pmean(leaves, axis):
  """``lax.pmean`` of DDP's buckets (sync_gradients' defaults): the leaves, last first,
  packed flat into a first bucket of 1 MiB and then buckets of 25 MiB, one pmean each."""
  import jax.numpy as jnp
  from jax import lax
  order, buckets, size = list(reversed(range(len(leaves)))), [[]], 0
  for i in order:
    limit = 2**20 if len(buckets) == 1 else 25 * 2**20
    if buckets[-1] and size + leaves[i].nbytes > limit:
      buckets.append([])
      size = 0
    buckets[-1].append(i)
    size += leaves[i].nbytes
  out = [None] * len(leaves)
  for bucket in buckets:
    flat = lax.pmean(jnp.concatenate([leaves[i].ravel() for i in bucket]), axis)
    start = 0
    for i in bucket:
      out[i] = flat[start:start + leaves[i].size].reshape(leaves[i].shape)
      start += leaves[i].size
  return out


def child(args) -> int:
  import jax
  import numpy as np
  from jax import lax
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  import jaxcoll
  from jaxcoll import tools

  if args.pjit:
    return pjit_child(args, jax, np, jaxcoll, tools)
  if args.step:
    return step_child(args, jax, np, lax, jaxcoll, tools)
  mesh = Mesh(np.array(jax.devices()), ("data",))
  n = mesh.size
  rng = np.random.default_rng(0)
  host = [rng.standard_normal((n, *s)).astype(np.float32) for s in SHAPES]
  sharding = NamedSharding(mesh, P("data"))
  grads = [jax.make_array_from_callback(g.shape, sharding, lambda idx, g=g: g[idx])
           for g in host]
  nbytes = sum(g[0].nbytes for g in host)

  ways = {
      "per-leaf lax.pmean": lambda t: [lax.pmean(g, "data") for g in t],
      "per-bucket lax.pmean": lambda t: per_bucket_pmean(t, "data"),
      "sync_gradients (auto)": lambda t: jaxcoll.sync_gradients(t, "data"),
      "sync_gradients (native)": lambda t: jaxcoll.sync_gradients(t, "data",
                                                                  algorithm="native"),
      "sync_gradients (ring)": lambda t: jaxcoll.sync_gradients(t, "data", algorithm="ring"),
      "sync_gradients (ring, int8 wire)": lambda t: jaxcoll.sync_gradients(
          t, "data", algorithm="ring", wire_dtype="int8"),
      "per-leaf jaxcoll.all_reduce (auto)": lambda t: [
          jaxcoll.all_reduce(g, "data", op="mean") for g in t],
      "per-leaf jaxcoll.all_reduce (ring)": lambda t: [
          jaxcoll.all_reduce(g, "data", op="mean", algorithm="ring") for g in t],
  }
  ways = {k: v for k, v in ways.items() if not args.only or any(o in k for o in args.only)}
  programs, counts = {}, {}
  for name, fn in ways.items():
    f = jax.jit(jax.shard_map(lambda t, fn=fn: [g[None] for g in fn([g[0] for g in t])],
                              mesh=mesh, in_specs=P("data"), out_specs=P("data")))
    compiled = f.lower(grads).compile()
    text = compiled.as_text()
    counts[name] = (len(re.findall(r"\ball-reduce(?:-start)?\(", text)),
                    len(re.findall(r"\bcollective-permute(?:-start)?\(", text)))
    programs[name] = compiled

  def call(c):
    return lambda: jax.block_until_ready(c(grads))

  times = tools.interleaved([call(programs[k]) for k in ways], reps=args.reps,
                             min_seconds=args.min_seconds)
  med = {k: statistics.median(t) for k, t in zip(ways, times)}
  if jax.process_index() == 0:
    base = med.get("per-leaf lax.pmean")
    print(f"{jax.process_count()} process(es), {n} devices, {len(SHAPES)} leaves, "
          f"{nbytes / 2**20:.2f} MiB of float32 gradients per device, jax {jax.__version__}; "
          f"medians of {len(times[0])} interleaved rounds")
    print("| sync | all-reduces in HLO | collective-permutes in HLO | time "
          "| per-leaf pmean / this |")
    print("|---|---:|---:|---:|---:|")
    for k in ways:
      ratio = f"{base / med[k]:.2f}x" if base else "-"
      print(f"| {k} | {counts[k][0]} | {counts[k][1]} | {med[k] * 1e3:.2f} ms | {ratio} |")
  return 0


def step_child(args, jax, np, lax, jaxcoll, tools) -> int:
  import jax.numpy as jnp
  import optax
  from jax.sharding import Mesh
  from jax.sharding import PartitionSpec as P

  axes = ("node", "local")
  mesh = Mesh(np.array(jax.devices()).reshape(2, 4), axes)
  layers = max(1, round(args.step_mib * 2**20 / (1024 * 1024 * 4)))
  rng = np.random.default_rng(0)
  params = [rng.standard_normal((1024, 1024)).astype(np.float32) / 32 for _ in range(layers)]
  x = rng.standard_normal((8 * 16, 1024)).astype(np.float32)

  def loss(ps, xb):
    for w in ps:
      xb = jnp.tanh(xb @ w)
    return jnp.mean(xb ** 2)

  hier = jaxcoll.Hierarchical()
  syncs = {
      "per-leaf lax.pmean": None,
      "sync_gradients (auto)": dict(algorithm="auto"),
      "sync_gradients (hierarchical)": dict(algorithm=hier),
      "optax.sync (ring, int8 + EF)": dict(algorithm="ring", wire_dtype="int8"),
      "optax.sync (hierarchical, int8 + EF)": dict(algorithm=hier, wire_dtype="int8"),
  }
  programs = {}
  for name, opts in syncs.items():
    sgd = optax.sgd(1e-3)
    tx = sgd if opts is None else optax.chain(jaxcoll.optax.sync(axes, **opts), sgd)

    def body(ps, state, xb, tx=tx, opts=opts):
      grads = jax.grad(loss)(ps, xb)
      if opts is None:
        grads = [lax.pmean(g, axes) for g in grads]
      local = jax.tree.map(lambda v: v[0], state)
      updates, local = tx.update(grads, local, ps)
      return optax.apply_updates(ps, updates), jax.tree.map(lambda v: v[None], local)

    state = jax.tree.map(lambda v: np.broadcast_to(v, (8, *v.shape)), tx.init(params))
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P(axes), P(axes)),
                              out_specs=(P(), P(axes)), check_vma=False))
    programs[name] = (f, state)

  def call(f, state):
    return lambda: jax.block_until_ready(f(params, state, x))

  times = tools.interleaved([call(*programs[k]) for k in syncs], reps=args.reps,
                             min_seconds=args.min_seconds)
  med = {k: statistics.median(t) for k, t in zip(syncs, times)}
  if jax.process_index() == 0:
    base = med["per-leaf lax.pmean"]
    print(f"{jax.process_count()} process(es), mesh 2x4 (node, local), {layers} layers of "
          f"1024x1024: {layers * 4} MiB of float32 gradients per device, jax "
          f"{jax.__version__}; whole training steps, medians of {len(times[0])} rounds")
    print("| sync | step time | per-leaf pmean / this |")
    print("|---|---:|---:|")
    for k in syncs:
      print(f"| {k} | {med[k] * 1e3:.1f} ms | {base / med[k]:.2f}x |")
  return 0


def pjit_child(args, jax, np, jaxcoll, tools) -> int:
  """Whole training steps written for global arrays (no shard_map: plain ``jax.jit`` over
  a batch split across the devices, parameters replicated, SGD): plain ``jax.jit`` (XLA's
  partitioner inserts the gradient all-reduces) against ``jaxcoll.use`` of the same step,
  and, for the 200-leaf model, against the shard_map step that syncs with
  ``sync_gradients``. ``--step``: the 16 MiB model of 1024x1024 layers on the 2x4 mesh."""
  import jax.numpy as jnp
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  rng = np.random.default_rng(0)
  if args.step:
    axes = ("node", "local")
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), axes)
    layers = max(1, round(args.step_mib * 2**20 / (1024 * 1024 * 4)))
    shapes = [(1024, 1024)] * layers
    width = 1024

    def loss(ps, xb):
      for w in ps:
        xb = jnp.tanh(xb @ w)
      return jnp.mean(xb ** 2)
  else:
    axes = ("data",)
    mesh = Mesh(np.array(jax.devices()), axes)
    shapes = SHAPES
    width = 512

    def loss(ps, xb):   # every leaf's gradient a sum over the batch
      total = 0.0
      for w in ps:
        if w.ndim == 1:
          total += jnp.mean(jnp.tanh(xb[:, :w.shape[0]] * w))
        else:
          total += jnp.mean(jnp.tanh(xb[:, :w.shape[0]] @ w))
      return total

  def put(host, spec):
    sharding = NamedSharding(mesh, spec)
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])

  params = [put((rng.standard_normal(s) / np.sqrt(s[0])).astype(np.float32), P())
            for s in shapes]
  x = put(rng.standard_normal((8 * 16, width)).astype(np.float32), P(axes))

  def step(ps, xb):
    grads = jax.grad(loss)(ps, xb)
    return [w - 1e-3 * g for w, g in zip(ps, grads)]

  def synced(ps, xb):   # the shard_map step: per-device gradients, then sync_gradients
    grads = jaxcoll.sync_gradients(jax.grad(loss)(ps, xb), axes, algorithm="ring")
    return [w - 1e-3 * g for w, g in zip(ps, grads)]

  with jax.set_mesh(mesh):
    programs = {"plain jax.jit": jax.jit(step),
                "jaxcoll.use (auto)": jaxcoll.use(step),
                "jaxcoll.use (ring)": jaxcoll.use(step, algorithm="ring")}
    if args.step:
      programs["jaxcoll.use (hierarchical)"] = jaxcoll.use(step, algorithm="hierarchical")
      programs["jaxcoll.use (ring, int8 wire)"] = jaxcoll.use(step, algorithm="ring",
                                                              wire_dtype="int8")
      programs["jaxcoll.use (hierarchical, int8 wire)"] = jaxcoll.use(
          step, algorithm="hierarchical", wire_dtype="int8")
    else:
      programs["shard_map + sync_gradients (ring)"] = jax.jit(jax.shard_map(
          synced, mesh=mesh, in_specs=(P(), P(axes)), out_specs=P(), check_vma=False))
    counts = {}
    for name, f in programs.items():
      text = f.lower(params, x).compile().as_text()
      counts[name] = (len(re.findall(r"\ball-reduce(?:-start)?\(", text)),
                      len(re.findall(r"\bcollective-permute(?:-start)?\(", text)))
    calls = [lambda f=f: jax.block_until_ready(f(params, x)) for f in programs.values()]
    times = tools.interleaved(calls, reps=args.reps, min_seconds=args.min_seconds)
  med = {k: statistics.median(t) for k, t in zip(programs, times)}
  if jax.process_index() == 0:
    mib = sum(int(np.prod(s)) for s in shapes) * 4 / 2**20
    print(f"{jax.process_count()} process(es), mesh {'x'.join(map(str, mesh.devices.shape))} "
          f"{axes}, {len(shapes)} leaves, {mib:.2f} MiB of float32 gradients, pjit-style "
          f"steps, jax {jax.__version__}; medians of {len(times[0])} interleaved rounds")
    print("| step | all-reduces in HLO | collective-permutes in HLO | time | jit / this |")
    print("|---|---:|---:|---:|---:|")
    base = med["plain jax.jit"]
    for k in programs:
      print(f"| {k} | {counts[k][0]} | {counts[k][1]} | {med[k] * 1e3:.2f} ms | "
            f"{base / med[k]:.2f}x |")
  return 0


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--reps", type=int, default=10, help="fewest timed rounds")
  parser.add_argument("--min-seconds", type=float, default=5.0,
                      help="more rounds until they take about this long")
  parser.add_argument("--only", nargs="*", default=[], help="run the ways whose name has this")
  parser.add_argument("--step", action="store_true", help="time whole data-parallel steps")
  parser.add_argument("--step-mib", type=float, default=16.0)
  parser.add_argument("--pjit", action="store_true",
                      help="steps written for global arrays: jax.jit against jaxcoll.use")
  from jaxcoll.launch import benchmark
  return benchmark(parser, child, __file__, argv)


if __name__ == "__main__":
  raise SystemExit(main())
