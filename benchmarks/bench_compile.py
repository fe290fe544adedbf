"""Compile time and program size of the ring all_reduce vs jax.lax.psum for N = 8, 64, 128.

The script fakes 128 host-platform (CPU) devices, so meshes of 8, 64 and 128
devices can be compiled in one process (only compiled; on 2 cores running a
128-device program is slow and not the point). For every N and algorithm it
reports:

  compile s          median wall time of ``jax.jit(f).lower(x).compile()`` over
                     3 fresh compiles, each of a new function object, with
                     ``jax.clear_caches()`` before each (tracing + lowering +
                     XLA compile);
  ppermutes in jaxpr ``ppermute`` equations in ``jax.make_jaxpr`` output,
                     counted recursively through sub-jaxprs (shard_map, loops,
                     conds, pjit) - each equation counted once, not per trip;
  collective-permutes in HLO
                     ``collective-permute`` ops in the optimized HLO text;
  while in HLO       ``while`` ops in the optimized HLO;
  steps              the schedule's communication rounds, 2(N-1) for the ring.

The executor runs phases of >= 8 identical steps as a ``lax.fori_loop``
(``LOOP_MIN_STEPS``), so a ring on N >= 9 ranks has 2 ppermutes and 2 loops
however large N is, while N = 8 (phases of 7 steps) unrolls to 14.
Finally the compiled N = 64 ring is run once and checked against lax.psum.

Usage:  python benchmarks/bench_compile.py [--elems 4096] [--sizes 8,64,128] [--repeats 3]
"""

from __future__ import annotations

import os

MAX_DEVICES = 128
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + f" --xla_force_host_platform_device_count={MAX_DEVICES}").strip()

import argparse  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxcoll  # noqa: E402

ALGORITHMS = ("ring", "native")
CHECK_N = 64


def make_fn(algorithm: str, mesh):
  """A brand-new jitted function object (so no jit/trace cache can be shared between calls)."""
  if algorithm == "native":
    def body(v):
      return lax.psum(v, "x")
  else:
    def body(v):
      return jaxcoll.all_reduce(v, "x", algorithm=algorithm)
  return jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P())


def _subjaxprs(value):
  """The jaxprs inside one equation parameter (ClosedJaxpr, Jaxpr, or tuples/lists of them)."""
  if hasattr(value, "eqns"):
    yield value
  elif hasattr(value, "jaxpr") and hasattr(value.jaxpr, "eqns"):
    yield value.jaxpr
  elif isinstance(value, (tuple, list)):
    for v in value:
      yield from _subjaxprs(v)


def count_eqns(jaxpr, name: str) -> int:
  jaxpr = jaxpr.jaxpr if hasattr(jaxpr, "consts") else jaxpr
  total = 0
  for eqn in jaxpr.eqns:
    total += eqn.primitive.name == name
    for value in eqn.params.values():
      for sub in _subjaxprs(value):
        total += count_eqns(sub, name)
  return total


def count_hlo(text: str, opcode: str) -> int:
  """Instructions ``%x = <shape> opcode(`` (and ``opcode-start(``) in HLO text."""
  return len(re.findall(rf"= (?:\([^=]*?\)|\S+) {re.escape(opcode)}(?:-start)?\(", text))


def measure(algorithm: str, mesh, x, repeats: int):
  times, compiled = [], None
  for _ in range(repeats):
    jax.clear_caches()
    fn = make_fn(algorithm, mesh)
    t0 = time.perf_counter()
    compiled = jax.jit(fn).lower(x).compile()
    times.append(time.perf_counter() - t0)
  jaxpr = jax.make_jaxpr(make_fn(algorithm, mesh))(x)
  text = compiled.as_text()
  return {"compile_s": statistics.median(times), "all_s": times,
          "ppermute": count_eqns(jaxpr, "ppermute"),
          "collective_permute": count_hlo(text, "collective-permute"),
          "while": count_hlo(text, "while"), "compiled": compiled}


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--sizes", default="8,64,128", help="comma list of axis sizes N")
  parser.add_argument("--elems", type=int, default=4096,
                      help="float32 elements per device (default 4096 = 16 KiB)")
  parser.add_argument("--repeats", type=int, default=3, help="fresh compiles per cell")
  args = parser.parse_args()
  sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
  devices = jax.devices()
  if max(sizes) > len(devices):
    raise SystemExit(f"need {max(sizes)} devices, found {len(devices)}")

  print(f"jax {jax.__version__}, {len(devices)} fake {devices[0].platform} devices, "
        f"{args.elems} float32 per device, median of {args.repeats} fresh compiles "
        "(jax.clear_caches() before each)\n")
  print("| N | algorithm | compile s | ppermutes in jaxpr | collective-permutes in HLO "
        "| while in HLO | steps |")
  print("|---:|---|---:|---:|---:|---:|---:|")
  results = {}
  for n in sizes:
    mesh = jax.sharding.Mesh(np.array(devices[:n]), ("x",))
    x = jax.ShapeDtypeStruct((n, args.elems), np.float32, sharding=NamedSharding(mesh, P("x")))
    for algo in ALGORITHMS:
      r = measure(algo, mesh, x, args.repeats)
      results[n, algo] = r
      steps = "-" if algo == "native" else jaxcoll.schedule("all_reduce", algo, n).num_steps
      print(f"| {n} | {algo} | {r['compile_s']:.3f} | {r['ppermute']} | "
            f"{r['collective_permute']} | {r['while']} | {steps} |", flush=True)

  status = 0
  if (CHECK_N, "ring") in results:
    mesh = jax.sharding.Mesh(np.array(devices[:CHECK_N]), ("x",))
    host = np.random.default_rng(0).standard_normal((CHECK_N, args.elems), dtype=np.float32)
    xs = jax.device_put(host, NamedSharding(mesh, P("x")))
    t0 = time.perf_counter()
    got = np.asarray(results[CHECK_N, "ring"]["compiled"](xs))
    t_run = time.perf_counter() - t0
    want = np.asarray(results[CHECK_N, "native"]["compiled"](xs))
    err = float(np.max(np.abs(got - want)))
    err_np = float(np.max(np.abs(got[0] - host.sum(axis=0, dtype=np.float64))))
    ok = err <= 1e-4 * np.sqrt(CHECK_N)
    print(f"\nN={CHECK_N} ring, run once ({t_run:.2f} s): max abs err vs lax.psum {err:.3g}, "
          f"vs float64 numpy sum {err_np:.3g} -> {'OK' if ok else 'MISMATCH'}")
    status = 0 if ok else 1
  return status


if __name__ == "__main__":
  raise SystemExit(main())
