"""Gradient sync against PyTorch DDP: whole data-parallel training steps, side by side.

  python benchmarks/bench_vs_ddp.py                          # loopback: 2 and 8 ranks
  sudo python benchmarks/bench_vs_ddp.py --netns             # also two nodes, 250 Mbit
  python benchmarks/bench_vs_ddp.py --torch-python PY        # torch in another venv
  python benchmarks/bench_vs_ddp.py --calibrate              # + calibrated predictions

The same two models in both frameworks (benchmarks/ddp/ddpcommon.py: an MLP of 4 x
1024x1024, 16 MiB of gradients; the 200-leaf tree of bench_grad_sync.py, 4.87 MiB), batch
64 per rank, SGD. torch: ``DistributedDataParallel`` with its defaults (gloo, 25 MiB
buckets, ``OMP_NUM_THREADS=1`` as torchrun sets it) against the same step without sync
(benchmarks/ddp/bench_ddp_torch.py). JAX: ``jaxcoll.data_parallel`` with
``jaxcoll.sync_gradients`` at its defaults, and ``jaxcoll.optax.sync`` with int8 on the
wire and error feedback, against the same step without sync (benchmarks/ddp/bench_dp_jax.py).

Topologies: loopback, 2 ranks (torch 2 processes; JAX 2 processes x 1 device) and 8 ranks
(torch 8 processes; JAX 2 processes x 4 devices, every device a gloo rank); with
``--netns`` (root) the same across two network namespaces joined by a veth pair shaped to
``--rate`` each way (emulated_cluster.py's: tbf, burst 512 KiB), half the ranks in each.
Jobs of one round run one after another, rounds alternate their order so drift hits both
frameworks alike. A job times every variant in rotated rounds, each step after an untimed
barrier, a step's time the max over ranks.

Table: the sync time is a job's synced step minus its own no-sync step (pooled medians
over all rounds), as a ratio to DDP's in the same topology (< 1: less time syncing than
DDP), then the same ratio from each round alone. Then every bucket's all_reduce alone:
the cost model's prediction for what auto ran (``jaxcoll.explain``) over the measured
median (``--calibrate``: also with the profile ``jaxcoll.calibrate`` measured on the
topology, in its first JAX job once the first model's steps have run), and the sum of
the predictions beside the synced step's sync time. torch absent: the JAX jobs run and
the ratios are left out.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
WORKERS = os.path.join(HERE, "ddp")
TOPOLOGIES = (  # (key, title, ranks, torch processes per node, JAX devices per process)
    ("loopback2", "loopback, 2 ranks", 2, 1, 1),
    ("loopback8", "loopback, 8 ranks (JAX 2 x 4)", 8, 4, 4),
    ("netns2", "2 nodes, {rate}, 2 ranks", 2, 1, 1),
    ("netns8", "2 nodes, {rate}, 8 ranks (2 x 4)", 8, 4, 4),
)
MODELS = {"mlp": "MLP 4 x 1024² (16 MiB)", "leaf200": "200 leaves (4.87 MiB)"}
SYNCED = (("torch", "ddp", "torch DDP"), ("jax", "sync", "jaxcoll.sync_gradients (defaults)"),
          ("jax", "int8_ef", "jaxcoll.optax.sync (int8 + error feedback)"))
NOSYNC = {"torch": "local", "jax": "nosync"}


def has_torch(python: str) -> bool:
  try:
    return subprocess.run([python, "-c", "import torch.distributed"],
                          capture_output=True).returncode == 0
  except OSError:   # no such python
    return False


def run_torch(python, ranks, json_path, log, worker_args, prefixes=None, ifnames=None,
              coordinator="127.0.0.1", timeout=1200.0) -> int:
  """``ranks`` torch workers (rank i under ``prefixes[i]`` with gloo on ``ifnames[i]``);
  rank 0 writes ``json_path``. Returns the first failing exit code, else 0."""
  from jaxcoll.launch import free_port
  coord = f"{coordinator}:{free_port()}"
  procs = []
  with open(log, "a") as out:
    for i in range(ranks):
      env = dict(os.environ, OMP_NUM_THREADS="1")
      if ifnames:
        env["GLOO_SOCKET_IFNAME"] = ifnames[i]
      cmd = [*(prefixes[i] if prefixes else ()), python, "bench_ddp_torch.py",
             "--num-processes", str(ranks), "--process-id", str(i), "--coord", coord,
             *worker_args, *(["--json", json_path] if i == 0 else [])]
      procs.append(subprocess.Popen(cmd, cwd=WORKERS, env=env, start_new_session=True,
                                    stdout=out if i == 0 else subprocess.DEVNULL,
                                    stderr=subprocess.STDOUT))
    code = 0
    try:
      for p in procs:
        rc = p.wait(timeout=timeout)
        code = code or rc
    except subprocess.TimeoutExpired:
      code = 124
    finally:
      for p in procs:
        if p.poll() is None:
          p.kill()
  return code


def run_jax(python, devices, json_path, log, worker_args, launch_kwargs, timeout=1200.0) -> int:
  from jaxcoll.launch import launch
  with open(log, "a") as out:
    cwd = os.getcwd()
    os.chdir(WORKERS)
    try:
      return launch([python, "bench_dp_jax.py", "--local-devices", str(devices), *worker_args,
                     "--json", json_path], processes=2, devices_per_process=devices,
                    timeout=timeout, out=out, **launch_kwargs)
    finally:
      os.chdir(cwd)


def load(out_dir):
  runs = {}   # (framework, topology) -> [json per round]
  for f in sorted(glob.glob(os.path.join(out_dir, "*_r*.json"))):
    fw, topo, _ = os.path.basename(f).split("_", 2)
    with open(f) as fh:
      runs.setdefault((fw, topo), []).append(json.load(fh))
  return runs


def pooled(runs, fw, topo, model, variant, rounds=None):
  """Median step time over the steps of all rounds (or of the rounds at ``rounds``)."""
  times = [t for r, js in enumerate(runs.get((fw, topo), ())) if rounds is None or r in rounds
           for row in js["rows"] if row["model"] == model and row["variant"] == variant
           for t in row["times_s"]]
  return statistics.median(times) if times else None


def sync_time(runs, fw, topo, model, variant, rounds=None):
  step, base = (pooled(runs, fw, topo, model, v, rounds) for v in (variant, NOSYNC[fw]))
  return None if step is None or base is None else step - base


def ratio(runs, topo, model, variant, rounds=None):
  s, ddp = (sync_time(runs, fw, topo, model, v, rounds)
            for fw, v in (("jax", variant), ("torch", "ddp")))
  return None if s is None or not ddp else s / ddp


def tables(runs, topologies, rate) -> str:
  out = ["| model | sync | " + " | ".join(t[1].format(rate=rate) for t in topologies) + " |",
         "|---|---|" + "---:|" * len(topologies)]
  measured = {row["model"] for jobs in runs.values() for js in jobs for row in js["rows"]}
  for model, title in MODELS.items():
    if model not in measured:
      continue
    for fw, variant, name in SYNCED:
      cells = []
      for key, *_ in topologies:
        s, r = sync_time(runs, fw, key, model, variant), ratio(runs, key, model, variant)
        if s is None:
          cells.append("-")
        elif variant == "ddp" or r is None:
          cells.append(f"{s * 1e3:.0f} ms")
        else:
          each = [ratio(runs, key, model, variant, {i})
                  for i in range(len(runs.get(("jax", key), ())))]
          rounds = ", ".join("-" if x is None else f"{x:.2f}" for x in each)
          cells.append(f"**{r:.2f}** ({s * 1e3:.0f} ms; rounds {rounds})")
      out.append(f"| {title} | {name} | " + " | ".join(cells) + " |")
  cal = any("calibrated_s" in b for jobs in runs.values() for js in jobs
            for b in js.get("buckets", ()))
  out += ["", "Every bucket alone, timed in each round: the cost model's prediction for what "
          "auto ran over the median of the rounds' measured medians, with the ratio to each "
          "round's in brackets" + (" (the defaults' profile, then the profile "
          "jaxcoll.calibrate measured on the topology)" if cal else "") + "; the sum of a "
          "step's predictions against its measured sync time (step - no-sync step).", "",
          "| topology | model | sync | bucket | algorithm | predicted | measured alone "
          "(rounds) | predicted / measured |" + (" calibrated | calibrated / measured |"
                                                  if cal else ""),
          "|---|---|---|---:|---|---:|---:|---:|" + ("---:|---:|" if cal else "")]
  within = {"predicted_s": [], "calibrated_s": []}

  def fits(pred, alone, which):   # "r (lo-hi)": over the median, and over each round's
    r = pred / statistics.median(alone)
    within[which].append(1 / 1.3 <= r <= 1.3)
    return f"{r:.2f} ({pred / max(alone):.2f}-{pred / min(alone):.2f})"

  same = lambda a, b: all(a[k] == b[k] for k in ("model", "variant", "nbytes", "algorithm"))
  for key, title, *_ in topologies:
    jobs = runs.get(("jax", key), ())
    if not jobs:
      continue
    sums = {}
    for i, b in enumerate(jobs[0].get("buckets", ())):   # every round runs them in this order
      times = [js["buckets"][i]["measured_s"] for js in jobs
               if i < len(js.get("buckets", ())) and same(js["buckets"][i], b)]
      c = b.get("calibrated_s")
      rounds = ", ".join(f"{t * 1e3:.1f}" for t in times)
      out.append(f"| {title.format(rate=rate)} | {b['model']} | {b['variant']} | "
                 f"{b['nbytes'] / 2**20:.2f} MiB | {b['algorithm']} | "
                 f"{b['predicted_s'] * 1e3:.1f} ms | {statistics.median(times) * 1e3:.1f} ms "
                 f"({rounds}) | {fits(b['predicted_s'], times, 'predicted_s')} |"
                 + (f" {c * 1e3:.1f} ms | {fits(c, times, 'calibrated_s')} |"
                    if c is not None else " - | - |" if cal else ""))
      old = sums.get((b["model"], b["variant"]), (0.0, 0.0))
      sums[(b["model"], b["variant"])] = (old[0] + b["predicted_s"], old[1] + (c or 0.0))
    for (model, variant), (pred, cpred) in sums.items():
      s = sync_time(runs, "jax", key, model, variant)
      if s:
        out.append(f"| {title.format(rate=rate)} | {model} | {variant} | whole step | - | "
                   f"{pred * 1e3:.1f} ms | {s * 1e3:.1f} ms (in the step) | {pred / s:.2f} |"
                   + (f" {cpred * 1e3:.1f} ms | {cpred / s:.2f} |" if cal else ""))
  for which, name in (("predicted_s", "the defaults' profile"),
                      ("calibrated_s", "the calibrated profiles")):
    if within[which]:
      out.append(f"\nWithin 1.3x of the median measured ({name}): {sum(within[which])} of "
                 f"{len(within[which])} buckets.")
  out += ["", "Checks (first round of each job):", ""]
  for (fw, key), js in sorted(runs.items()):
    for k, v in js[0].get("checks", {}).items():
      if "per rank" not in k:
        out.append(f"- {fw} {key}: {k} = {v}")
  return "\n".join(out)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--torch-python", default=sys.executable,
                      help="a python with torch (default: this one)")
  parser.add_argument("--netns", action="store_true",
                      help="also two emulated nodes on a shaped link (root)")
  parser.add_argument("--loopback", action=argparse.BooleanOptionalAction, default=True)
  parser.add_argument("--rate", default="250mbit", help="tc tbf rate of the link, each way")
  parser.add_argument("--rounds", type=int, default=2)
  parser.add_argument("--models", default="mlp,leaf200")
  parser.add_argument("--budget", type=float, default=3.0,
                      help="seconds of timed steps per variant and model (sets the reps)")
  parser.add_argument("--calibrate", action="store_true",
                      help="also price every bucket with jaxcoll.calibrate's profile of each "
                           "topology (measured once, in the first round's JAX job after its "
                           "first model's steps; the steps keep the default settings)")
  parser.add_argument("--out", default=None, help="folder for every job's JSON and log")
  parser.add_argument("--markdown", default=None, help="also write the tables here")
  args = parser.parse_args(argv)
  sys.path.insert(0, os.path.dirname(HERE))
  out_dir = os.path.abspath(args.out or tempfile.mkdtemp(prefix="bench_vs_ddp_"))
  os.makedirs(out_dir, exist_ok=True)
  torch_ok = has_torch(args.torch_python)
  if not torch_ok:
    print(f"torch not found in {args.torch_python}: skipping the DDP jobs (pip install torch, "
          "or --torch-python a python that has it); the JAX jobs run, without ratios",
          flush=True)
  topologies = [t for t in TOPOLOGIES if (t[0].startswith("loopback") and args.loopback)
                or (t[0].startswith("netns") and args.netns)]
  if args.netns and (os.geteuid() != 0 or not shutil.which("tc")):
    raise SystemExit("--netns needs root and iproute2's ip and tc")
  worker = ["--models", args.models, "--budget", str(args.budget)]
  netns_worker = [*worker, "--min-reps", "5", "--max-reps", "20", "--warmup", "2"]
  from emulated_cluster import Namespaces

  def jobs(ns):
    for key, _, ranks, per_node, devices in topologies:
      net = key.startswith("netns")
      wa = netns_worker if net else worker
      if torch_ok:
        kw = {}
        if net:
          kw = dict(prefixes=[ns.prefix(i // per_node) for i in range(ranks)],
                    ifnames=[ns.links[i // per_node] for i in range(ranks)],
                    coordinator=ns.addresses[0])
        yield (f"torch_{key}", lambda p, log, wa=wa, ranks=ranks, kw=kw: run_torch(
            args.torch_python, ranks, p, log, [*wa, "--variants", "local,ddp"], **kw))
      kw = {}
      if net:
        kw = dict(coordinator=f"{ns.addresses[0]}:29500", rank_prefix=[ns.prefix(0),
                  ns.prefix(1)], local_addresses=list(ns.addresses))
      if args.calibrate:
        wa = [*wa, "--calibrate", os.path.join(out_dir, f"profile_{key}.json")]
      yield (f"jax_{key}", lambda p, log, wa=wa, devices=devices, kw=kw: run_jax(
          sys.executable, devices, p, log, wa, kw))

  def run_rounds(ns):
    todo = list(jobs(ns))
    for r in range(1, args.rounds + 1):
      for name, job in (todo if r % 2 else todo[::-1]):
        path = os.path.join(out_dir, f"{name}_r{r}.json")
        print(f"{datetime.datetime.now():%H:%M:%S} {name} round {r}", flush=True)
        if job(path, os.path.join(out_dir, f"{name}_r{r}.log")):
          raise SystemExit(f"{name} round {r} failed: see {out_dir}/{name}_r{r}.log")

  if args.netns:
    with Namespaces(args.rate) as ns:
      run_rounds(ns)
  else:
    run_rounds(None)
  text = (f"## Sync time vs DDP ({datetime.date.today()}, {args.rounds} rounds; "
          f"`python benchmarks/bench_vs_ddp.py {' '.join(argv or sys.argv[1:])}`)\n\n"
          + tables(load(out_dir), topologies, args.rate))
  print(text)
  if args.markdown:
    with open(args.markdown, "w") as f:
      f.write(text + "\n")
  print(f"\n(every job's JSON and log: {out_dir})")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
