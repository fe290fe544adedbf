"""Seconds to trace, lower and compile a program of many collectives, the first time in a
fresh process: what a training step pays once at start-up.

One jitted shard_map on N devices all_reduces a list of ``--leaves`` arrays of ``--elems``
values, cycling through float32, bfloat16, float16 and int32 (each leaf its own
collective, as a tree of gradients is). Every cell runs in a new Python process (nothing
warm: neither jax's caches nor jaxcoll's), ``--repeats`` times; the table gives medians.
With ``--compare DIR`` each cell also runs with the jaxcoll checkout in DIR first on the
path, side by side in the same run, and the table gives this tree's ratio to it.

Examples:
  python benchmarks/bench_trace.py
  git worktree add /tmp/old v0.1 && python benchmarks/bench_trace.py --compare /tmp/old
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DTYPES = ("float32", "bfloat16", "float16", "int32")


def cell(algorithm: str, n: int, leaves: int, elems: int) -> dict:
  """Runs in the child: one program, timed stage by stage."""
  import time

  import jax
  import numpy as np
  from jax import lax
  from jax.sharding import Mesh
  from jax.sharding import PartitionSpec as P

  import jaxcoll

  mesh = Mesh(np.array(jax.devices()[:n]), ("x",))
  xs = [jax.ShapeDtypeStruct((n, elems), DTYPES[i % len(DTYPES)]) for i in range(leaves)]

  def body(tree):
    if algorithm == "native":
      return lax.psum(tree, "x")
    return jaxcoll.all_reduce(tree, "x", algorithm=algorithm)

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
  t0 = time.perf_counter()
  traced = f.trace(xs)
  t1 = time.perf_counter()
  lowered = traced.lower()
  t2 = time.perf_counter()
  lowered.compile()
  t3 = time.perf_counter()
  return {"jaxcoll": os.path.dirname(os.path.dirname(jaxcoll.__file__)),
          "trace": t1 - t0, "lower": t2 - t1, "compile": t3 - t2}


def run_cell(root: str, algorithm: str, args) -> dict:
  env = {**os.environ, "PYTHONPATH": root, "JAX_PLATFORMS": "cpu",
         "XLA_FLAGS": f"--xla_force_host_platform_device_count={args.devices}"}
  done = subprocess.run([sys.executable, __file__, "--child", algorithm, "--devices",
                         str(args.devices), "--leaves", str(args.leaves), "--elems",
                         str(args.elems)], env=env, capture_output=True, text=True, check=True)
  out = json.loads(done.stdout.splitlines()[-1])
  if os.path.realpath(out["jaxcoll"]) != os.path.realpath(root):
    raise SystemExit(f"the child imported jaxcoll from {out['jaxcoll']}, not {root}")
  return out


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--algorithms", default="ring,halving_doubling,double_binary_tree,native",
                      help='comma list of all_reduce algorithms ("native": lax.psum)')
  parser.add_argument("--devices", type=int, default=8, help="N, fake CPU devices")
  parser.add_argument("--leaves", type=int, default=20, help="arrays in the reduced list")
  parser.add_argument("--elems", type=int, default=7, help="values per array and device")
  parser.add_argument("--repeats", type=int, default=3, help="fresh processes per cell")
  parser.add_argument("--compare", metavar="DIR",
                      help="a jaxcoll checkout to time side by side with this one")
  parser.add_argument("--child", metavar="ALGORITHM", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.child:
    print(json.dumps(cell(args.child, args.devices, args.leaves, args.elems)))
    return 0
  # this tree's jaxcoll, for the checks alone: every cell runs in a process of its own
  import jaxcoll

  algorithms = [a for a in args.algorithms.split(",") if a]
  for algorithm in algorithms:
    jaxcoll.extend.check_one_of(algorithm, tuple(jaxcoll.algorithms("all_reduce")),
                                "--algorithms")
  for name in ("devices", "leaves", "elems", "repeats"):
    jaxcoll.extend.check_int(getattr(args, name), f"--{name}", least=1)
  if args.compare and not os.path.isdir(os.path.join(args.compare, "jaxcoll")):
    parser.error(f"--compare {args.compare}: expected a jaxcoll checkout (a directory "
                 "holding jaxcoll/)")
  roots = {"this": HERE, **({"compare": os.path.abspath(args.compare)} if args.compare else {})}
  print(f"{args.leaves} arrays x {args.elems} values ({', '.join(DTYPES)} in turn), "
        f"N = {args.devices}, median of {args.repeats} fresh processes; seconds\n")
  print("| algorithm | tree | trace | lower | compile | total |"
        + (" total vs --compare |" if args.compare else ""))
  print("|---|---|---:|---:|---:|---:|" + ("---:|" if args.compare else ""))
  for algorithm in algorithms:
    runs = {name: [] for name in roots}
    for _ in range(args.repeats):   # the trees alternate within a repeat: side by side
      for name, root in roots.items():
        runs[name].append(run_cell(root, algorithm, args))
    totals = {}
    for name in reversed(roots):   # the baseline first
      med = {k: statistics.median(r[k] for r in runs[name]) for k in ("trace", "lower",
                                                                        "compile")}
      totals[name] = statistics.median(r["trace"] + r["lower"] + r["compile"]
                                       for r in runs[name])
      ratio = ""
      if args.compare:   # the ratio on this tree's row, an empty cell on the baseline's
        ratio = f" {totals['this'] / totals['compare']:.2f}x |" if name == "this" else " |"
      print(f"| {algorithm} | {name} | {med['trace']:.2f} | {med['lower']:.2f} | "
            f"{med['compile']:.2f} | {totals[name]:.2f} |{ratio}", flush=True)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
