"""MoE dispatch + combine per algorithm against the lax.all_to_all implementation.

On the mesh ("node", "local") = 2x4, experts over both axes (E = 16, top-2, capacity
factor 1.25, d = 1024, float32), T tokens per device:
  --processes 1: 8 CPU devices in one process;
  --processes 2: 2 processes x 4 devices on loopback, gloo (jaxcoll.launch).
Each program runs ``jaxcoll.moe.dispatch`` then ``combine`` (no expert compute between, so
the figure is the exchange alone); "native" is the lax.all_to_all implementation (the
same routing, ``lax.all_to_all`` for both exchanges). Timed side by side
(``jaxcoll.tools.interleaved``, medians). Columns: time, ratio to native, and from the schedules
the bytes one device sends across the node axis for dispatch + combine and the messages
(steps) that cross it. Across two emulated nodes on a slow link:

  sudo python benchmarks/emulated_cluster.py --rate 250mbit -- \\
      python benchmarks/bench_moe.py --child --processes 2 --tokens 1024,4096
"""

from __future__ import annotations

import argparse
import statistics

E, K, D, FACTOR = 16, 2, 1024, 1.25


def child(args) -> int:
  import jax
  import numpy as np
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  import jaxcoll
  from jaxcoll import moe, tools

  axes = ("node", "local")
  mesh = Mesh(np.array(jax.devices()).reshape(2, 4), axes)
  n = mesh.size
  cut = jaxcoll.Hierarchical(pieces=tuple(int(p) for p in args.pieces.split(",")))
  cut_name = f"hierarchical(pieces {args.pieces})"
  exchanges = [("native", "native"), ("auto", "auto"), ("direct", "direct"), ("bruck", "bruck"),
               ("hierarchical", "hierarchical"), (cut_name, cut), ("allgather", "allgather")]
  wires = {"dispatch": (" [int8 dispatch]", "int8", None),
           "split": (" [int8 dispatch, bf16 combine]", "int8", "bfloat16"),   # DeepEP's split
           "both": (" [int8 both]", "int8", "int8")}
  wires = [wires[w] for w in args.wires.split(",") if w]
  # (label, algorithm, dispatch wire, combine wire)
  ways = [(name, a, None, None) for name, a in exchanges]
  ways += [(name + tag, a, w, b) for tag, w, b in wires for name, a in exchanges
           if name in ("direct", "hierarchical", cut_name)]
  ways = [w for w in ways if not args.only or any(o == w[0].split(" [")[0] for o in args.only)]
  if jax.process_index() == 0:
    print(f"{jax.process_count()} process(es), mesh 2x4 (node, local), E={E}, k={K}, d={D}, "
          f"capacity factor {FACTOR}, jax {jax.__version__}; dispatch + combine, medians")
    print("| tokens/device | algorithm | time | vs native | MiB across node | "
          "messages across node |")
    print("|---:|---|---:|---:|---:|---:|", flush=True)
  ratio = lambda w: jaxcoll.WireFormat(w).ratio(np.float32) if w else 1.0
  for t in (int(v) for v in args.tokens.split(",")):
    cap = moe.capacity(t, E, K, FACTOR)
    rng = np.random.default_rng(t)
    sharding = NamedSharding(mesh, P(axes))
    x = jax.device_put(rng.standard_normal((n * t, D)).astype(np.float32), sharding)
    logits = jax.device_put(rng.standard_normal((n * t, E)).astype(np.float32), sharding)
    plan = moe.explain(jax.ShapeDtypeStruct((t, D), np.float32), K, num_experts=E,
                       capacity=cap, mesh=mesh, axis_name=axes)
    gathered = n * n * t * D * 4      # every device's all-gathered tokens, in host memory
    todo = [w for w in ways if w[1] != "allgather" or gathered <= args.max_gathered * 2**30]
    if len(todo) < len(ways) and jax.process_index() == 0:
      print(f"| {t} | allgather | skipped: the devices' gathered tokens need "
            f"{gathered / 2**30:.0f} GiB (--max-gathered {args.max_gathered:g}) | | | |")
    programs = []
    for _, algorithm, wire, back in todo:
      def body(xb, lb, algorithm=algorithm, wire=wire, back=back, cap=cap):
        ids, gates = moe.route(lb, K)
        h, state = moe.dispatch(xb, ids, num_experts=E, capacity=cap, axis_name=axes,
                                algorithm=algorithm, wire_dtype=wire)
        return moe.combine(h, state, gates, wire_dtype=back)
      f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(axes), P(axes)),
                                out_specs=P(axes)))
      programs.append(lambda f=f, x=x, logits=logits: jax.block_until_ready(f(x, logits)))
    times = tools.interleaved(programs, reps=args.reps, min_seconds=args.min_seconds)
    med = [statistics.median(v) for v in times]
    buffer = E * cap * D * 4          # the [E, C, d] float32 buffer each exchange moves
    for (name, algorithm, wire, back), m in zip(todo, med):
      if algorithm == "auto":         # what auto ran: a formulation, then all_to_all's pick
        chosen = plan.chosen if plan.chosen == "allgather" else plan.calls[0].explanation.chosen
        algorithm, name = chosen.split("(")[0], f"auto -> {chosen}"
      if algorithm == "allgather":    # all_gather + reduce_scatter of T * d per device (ring)
        ag = jaxcoll.schedule("all_gather", "ring", n).traffic(t * D * 4 * n, (2, 4))
        rs = jaxcoll.schedule("reduce_scatter", "ring", n).traffic(t * D * 4 * n, (2, 4))
        across = ag[0].bytes * ratio(wire) + rs[0].bytes * ratio(back)
        msgs = ag[0].steps + rs[0].steps
      else:
        pieces = getattr(algorithm, "pieces", None)
        if pieces or algorithm == "hierarchical":
          sched = jaxcoll.schedule("all_to_all", "hierarchical", n, axis_sizes=(2, 4),
                                   stage_pieces=pieces)
        else:                         # native priced as the pairwise exchange
          sched = jaxcoll.schedule("all_to_all", "direct" if algorithm == "native" else algorithm,
                                   n)
        tr = sched.traffic(buffer, (2, 4))[0]
        across, msgs = tr.bytes * (ratio(wire) + ratio(back)), 2 * tr.steps
      if jax.process_index() == 0:
        print(f"| {t} | {name} | {m * 1e3:.2f} ms | {m / med[0]:.2f} | {across / 2**20:.2f} | "
              f"{msgs} |", flush=True)
  return 0


FFN = 2   # the layouts' experts: x @ w1 [d, FFN * d], gelu, @ w2 [FFN * d, d]


def layouts(args) -> int:
  """One MoE training step (route, dispatch, the experts' FFN, combine, and the gradients of
  tokens and expert weights) per layout, side by side: time, and memory from
  ``compiled.memory_analysis()``."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  from jaxcoll import moe, tools

  axes = ("node", "local")
  mesh = Mesh(np.array(jax.devices()).reshape(2, 4), axes)
  n, d = mesh.size, args.width
  # (label, capacity factor (None: dropless), layout, buffer factor)
  ways = [("capacity 1.25", 1.25, "buffers", None), ("dropless, buffers", None, "buffers", None),
          ("dropless, sorted", None, "sorted", None)]
  ways += [(f"sorted, buffer factor {f:g}", None, "sorted", f)
           for f in (float(v) for v in args.buffer_factors.split(",") if v)]
  if jax.process_index() == 0:
    print(f"{jax.process_count()} process(es), mesh 2x4 (node, local), k={K}, d={d}, FFN "
          f"{FFN * d}, float32, jax {jax.__version__}; a forward + backward step, medians; "
          f"memory per device from compiled.memory_analysis(): temp, and peak = temp + "
          f"arguments + outputs; ratios to capacity 1.25")
    print("| E | tokens/device | layout | time | vs capacity | temp MiB | peak MiB | peak vs "
          "capacity | dropped |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|---:|", flush=True)
  for e in (int(v) for v in args.experts.split(",")):
    for t in (int(v) for v in args.tokens.split(",")):
      rng = np.random.default_rng(t + e)
      put = lambda a: jax.device_put(a.astype(np.float32), NamedSharding(mesh, P(axes)))
      x = put(rng.standard_normal((n * t, d)))
      logits = put(rng.standard_normal((n * t, e)))
      w1 = put(rng.standard_normal((e, d, FFN * d)) / np.sqrt(d))
      w2 = put(rng.standard_normal((e, FFN * d, d)) / np.sqrt(FFN * d))
      programs, memory, drops = [], [], []
      for _, factor, layout, buffer_factor in ways:
        cap = None if factor is None else moe.capacity(t, e, K, factor)

        def body(xb, lb, w1b, w2b, cap=cap, layout=layout, buffer_factor=buffer_factor, e=e):
          def loss(xb, w1b, w2b):
            ids, gates = moe.route(lb, K)
            h, state = moe.dispatch(xb, ids, num_experts=e, capacity=cap, axis_name=axes,
                                    layout=layout, buffer_factor=buffer_factor)
            if layout == "sorted":
              gmm = lambda a, w: moe.grouped_matmul(a, w, state.group_sizes)
            else:
              gmm = lambda a, w: jnp.einsum("lcd,ldf->lcf", a, w)
            y = gmm(jax.nn.gelu(gmm(h, w1b)), w2b)
            return jnp.sum(moe.combine(y, state, gates) ** 2), moe.total_dropped(state)
          (_, dropped), grads = jax.value_and_grad(loss, (0, 1, 2), has_aux=True)(xb, w1b, w2b)
          return grads, dropped[None]
        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(axes),) * 4,
                                  out_specs=((P(axes),) * 3, P(axes))))
        inputs = (x, logits, w1, w2)
        mem = f.lower(*inputs).compile().memory_analysis()
        memory.append((mem.temp_size_in_bytes, mem.temp_size_in_bytes
                       + mem.argument_size_in_bytes + mem.output_size_in_bytes))
        drops.append(int(np.asarray(f(*inputs)[1].addressable_shards[0].data)[0]))
        programs.append(lambda f=f, inputs=inputs: jax.block_until_ready(f(*inputs)))
      times = tools.interleaved(programs, reps=args.reps, min_seconds=args.min_seconds)
      med = [statistics.median(v) for v in times]
      if jax.process_index() == 0:
        for (name, *_), m, (temp, peak), drop in zip(ways, med, memory, drops):
          print(f"| {e} | {t} | {name} | {m * 1e3:.1f} ms | {m / med[0]:.2f} | "
                f"{temp / 2**20:.1f} | {peak / 2**20:.1f} | {peak / memory[0][1]:.2f} | {drop} |",
                flush=True)
  return 0


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--tokens", default="256,1024,4096", help="tokens per device")
  parser.add_argument("--reps", type=int, default=5)
  parser.add_argument("--min-seconds", type=float, default=2.0)
  parser.add_argument("--only", nargs="*", default=[],
                      help="exchanges to run (native, auto, direct, bruck, hierarchical, "
                           "'hierarchical(pieces 8,1)', allgather), each with its compressed rows")
  parser.add_argument("--wires", default="dispatch,split,both",
                      help="compressed rows: dispatch (int8 dispatch), split (int8 dispatch, "
                           "bfloat16 combine: DeepEP's), both (int8 both ways); '' for none")
  parser.add_argument("--max-gathered", type=float, default=8.0,
                      help="GiB: skip allgather where the devices' gathered tokens need more")
  parser.add_argument("--pieces", default="8,1",
                      help="stage pieces of the cut hierarchical rows (node, local)")
  parser.add_argument("--layouts", action="store_true",
                      help="a training step per layout (capacity 1.25, dropless buffers, "
                           "sorted) instead: time and memory")
  parser.add_argument("--experts", default="16,64", help="--layouts: experts")
  parser.add_argument("--width", type=int, default=256, help="--layouts: d")
  parser.add_argument("--buffer-factors", default="1.25,1.5",
                      help="--layouts: the sorted layout's bounded rows also at these factors")
  from jaxcoll.launch import benchmark
  return benchmark(parser, lambda args: (layouts if args.layouts else child)(args), __file__,
                   argv)


if __name__ == "__main__":
  raise SystemExit(main())
