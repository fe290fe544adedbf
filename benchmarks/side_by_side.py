"""Two jaxcoll checkouts timed side by side in one run: this tree and ``--compare DIR``.

Runs ``bench_collectives.py`` (this tree's copy, so both sides run the same benchmark) with
each checkout first on ``PYTHONPATH``, in alternating rounds (A, B, B, A, ...: drift and
other load hit both alike), and tabulates each cell's median over the rounds of its
``x native`` (time / the lax collective's time in the same process) and time, and the ratio
of this tree's to the other's. A regression shows as a ratio above 1.

  git worktree add /tmp/start <commit> && \\
      python benchmarks/side_by_side.py --compare /tmp/start --rounds 2 -- \\
      --sizes 64K,1M,16M --reps 5 --algorithms ring,halving_doubling,bidirectional_ring
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def run(tree: str, bench_args: list[str]) -> list[dict]:
  """One bench_collectives run with ``tree`` first on the path: its result rows."""
  with tempfile.TemporaryDirectory() as tmp:
    out = os.path.join(tmp, "rows.json")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [tree] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    done = subprocess.run([sys.executable, os.path.join(HERE, "bench_collectives.py"),
                           *bench_args, "--json", out], env=env, capture_output=True,
                          text=True)
    if done.returncode != 0 or not os.path.exists(out):
      raise RuntimeError(f"bench_collectives with {tree}: {done.stdout[-2000:]}"
                         f"{done.stderr[-2000:]}")
    with open(out) as f:
      return json.load(f)["results"]


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--compare", required=True, help="the other jaxcoll checkout")
  parser.add_argument("--rounds", type=int, default=2, help="runs of each tree")
  parser.add_argument("bench_args", nargs=argparse.REMAINDER,
                      help="after --: bench_collectives.py's arguments")
  args = parser.parse_args()
  bench_args = [a for a in args.bench_args if a != "--"]
  trees = {"this": ROOT, "other": os.path.abspath(args.compare)}
  cells: dict = {}
  for r in range(args.rounds):
    for name in (("this", "other") if r % 2 == 0 else ("other", "this")):
      for row in run(trees[name], bench_args):
        key = (row["primitive"], row["size_bytes"], row["algorithm"])
        cells.setdefault(key, {"this": [], "other": []})[name].append(
            (row["x_native"], row["median_s"]))
      print(f"round {r + 1}: {name} done", file=sys.stderr, flush=True)
  print(f"{args.rounds} rounds of each tree, alternating; this = {trees['this']}, "
        f"other = {trees['other']}; bench_collectives {' '.join(bench_args)}")
  print("| primitive | size | algorithm | x native, this | x native, other | this / other "
        "| time, this | time, other |")
  print("|---|---:|---|---:|---:|---:|---:|---:|")
  for (primitive, size, algorithm), got in sorted(cells.items()):
    if algorithm == "native":
      continue
    xa, xb = (statistics.median(x for x, _ in got[k]) for k in ("this", "other"))
    ta, tb = (statistics.median(t for _, t in got[k]) for k in ("this", "other"))
    print(f"| {primitive} | {size >> 10} KiB | {algorithm} | {xa:.2f} | {xb:.2f} | "
          f"{xa / xb:.2f} | {ta * 1e3:.2f} ms | {tb * 1e3:.2f} ms |")


if __name__ == "__main__":
  main()
