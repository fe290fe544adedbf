"""Two emulated nodes joined by a slow link: collectives across a real (shaped) network.

  sudo python benchmarks/emulated_cluster.py --rate 250mbit
  sudo python benchmarks/emulated_cluster.py --rate 1gbit --calibrate 256K,1M,4M,16M
  sudo python benchmarks/emulated_cluster.py --rate 250mbit --ops all_reduce --sizes 64M \
      --algorithms ring,hierarchical,native --wire bfloat16,float8_e4m3fn,int8
  sudo python benchmarks/emulated_cluster.py --rate 250mbit -- COMMAND ...

Builds two network namespaces joined by a veth pair, each end rate-limited with
``tc qdisc tbf`` (``--rate``, default 1gbit; burst 512 KiB, latency 50 ms), runs one
process of 4 CPU devices in each (``jaxcoll.launch`` with a per-rank
``ip netns exec`` prefix, the coordinator on the first namespace's address and
gloo bound to each namespace's own address), and runs ``jaxcoll.bench`` across
them on the mesh ("node", "local") = 2x4. The namespaces are always deleted,
also on Ctrl-C or failure. Only addresses inside them (10.213.0.0/24) are used.

After the bench's own table it prints, per op, size and algorithm: the bytes one
direction of the link carries (from the schedules; native priced as gloo's ring /
pairwise exchange), the link utilisation (those bytes / time / rate), busbw as a
fraction of the link rate, and the ratio to native. ``--wire`` also runs every
scheduled algorithm with compressed messages (labelled ``ring [int8]``): the link
bytes shrink by the format's ratio, and the report adds each row's error relative
to the native result and the speedup over the uncompressed ring. With a command after
``--``, that command runs as the two ranks instead of the bench (it joins the job with
``jaxcoll.distributed.initialize()``; e.g. ``benchmarks/bench_grad_sync.py --child
--processes 2 --step``). Needs root (ip, tc).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile

SUBNET = "10.213.0"
RATE_UNITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}


def sh(*cmd: str) -> None:
  subprocess.run(cmd, check=True, capture_output=True, text=True)


def rate_bits(rate: str) -> float:
  m = re.fullmatch(r"(\d+(?:\.\d+)?)(kbit|mbit|gbit)", rate)
  if not m:
    raise SystemExit(f"--rate {rate!r}: expected a tc rate such as 250mbit or 1gbit")
  return float(m.group(1)) * RATE_UNITS[m.group(2)]


class Namespaces:
  """Two namespaces with a shaped veth pair; a context manager that always tears down."""

  def __init__(self, rate: str):
    tag = os.getpid() % 100000
    self.names = (f"jaxcoll{tag}a", f"jaxcoll{tag}b")
    self.links = (f"jx{tag}a", f"jx{tag}b")
    self.addresses = (f"{SUBNET}.1", f"{SUBNET}.2")
    self.rate = rate

  def __enter__(self):
    try:
      for ns in self.names:
        sh("ip", "netns", "add", ns)
      sh("ip", "link", "add", self.links[0], "netns", self.names[0], "type", "veth", "peer",
         "name", self.links[1], "netns", self.names[1])
      for ns, link, addr in zip(self.names, self.links, self.addresses):
        ip = ("ip", "netns", "exec", ns)
        sh(*ip, "ip", "link", "set", "lo", "up")
        sh(*ip, "ip", "addr", "add", f"{addr}/24", "dev", link)
        sh(*ip, "ip", "link", "set", link, "up")
        sh(*ip, "tc", "qdisc", "add", "dev", link, "root", "tbf", "rate", self.rate, "burst",
           "512kb", "latency", "50ms")
    except BaseException:
      self.__exit__()
      raise
    return self

  def __exit__(self, *exc):
    for ns in self.names:   # deleting a namespace deletes its end of the veth pair
      subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    return False

  def prefix(self, rank: int) -> list[str]:
    return ["ip", "netns", "exec", self.names[rank]]


def link_bytes(op: str, algorithm: str, nbytes: int, dtype: str = "float32") -> float:
  """Bytes one direction of the node link carries (node 0 -> node 1), from the schedule."""
  import jaxcoll
  name = algorithm.split(" -> ")[-1]
  m = re.fullmatch(r"(.*) \[(.*)\]", name)   # "ring [int8]": compressed messages
  if m:
    return link_bytes(op, m.group(1), nbytes) * jaxcoll.WireFormat(m.group(2)).ratio(dtype)
  options = {}
  if name.startswith("hierarchical"):
    m = re.fullmatch(r"hierarchical\((.*?)(?:; pieces (.*))?\)", name)
    stages = tuple(m.group(1).split(",")) if m else None
    pieces = tuple(int(p) for p in m.group(2).split(",")) if m and m.group(2) else None
    options = {"axis_sizes": (2, 4), "per_axis": stages}
    if pieces:
      options["stage_pieces"] = pieces
    name = "hierarchical"
  elif name == "native":   # gloo's ring all-reduce, pairwise all-to-all
    name = jaxcoll.tools.native_equivalents(op)[0]
  sched = jaxcoll.schedule(op, name, 8, **options)
  chunk = nbytes / sched.message_chunks
  total = 0.0
  for step in sched.steps:
    for t in step.transfers:
      total += sum(t.chunks_per_message for s, d in t.perm if s // 4 == 0 and d // 4 == 1)
  return total * chunk


def report(rows: list[dict], rate_bps: float) -> str:
  from jaxcoll.tools import spec
  lines = ["| op | size/device | algorithm | time | vs native | vs ring | link bytes/direction (M) "
           "| link util | busbw / link rate | rel err |",
           "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
  rate = rate_bps / 8
  for r in rows:
    same = {x["algorithm"]: x["time_us"] * 1e-6 for x in rows
            if x["op"] == r["op"] and x["size"] == r["size"]}
    on_link = link_bytes(r["op"], r["algorithm"], r["size"], r["dtype"])
    t = r["time_us"] * 1e-6
    busbw = r["size"] * spec(r["op"]).bus_factor(8) / t
    ratio = lambda name, t=t, same=same: f"{t / same[name]:.2f}" if name in same else "-"  # noqa: E731
    err = "-" if r.get("rel_err") is None else f"{r['rel_err']:.1e}"
    lines.append(f"| {r['op']} | {r['size'] >> 20} MiB | {r['algorithm']} | "
                 f"{t * 1e3:.0f} ms | {ratio('native')} | {ratio('ring')} | "
                 f"{on_link / r['size']:.2f} | {on_link / t / rate:.0%} | {busbw / rate:.0%} "
                 f"| {err} |")
  return "\n".join(lines)


def _interrupt(signum, frame):
  raise KeyboardInterrupt(f"signal {signum}")


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--rate", default="1gbit", help="tc tbf rate of each direction")
  parser.add_argument("--sizes", default="1M,16M,64M", help="bytes per device")
  parser.add_argument("--ops", default="all_reduce,all_to_all")
  parser.add_argument("--algorithms", default="ring,direct,hierarchical,native,auto",
                      help="names that do not apply to an op are skipped for it")
  parser.add_argument("--pieces", default="8,1",
                      help="also hierarchical with its node stage cut in pieces ('' for none)")
  parser.add_argument("--wire", default=None, metavar="W[,W...]",
                      help="also run every scheduled algorithm compressed (all_reduce, "
                           "reduce_scatter, all_gather), and check errors")
  parser.add_argument("--dtype", default="float32")
  parser.add_argument("--iters", type=int, default=5)
  parser.add_argument("--calibrate", default=None, metavar="SIZES",
                      help="calibrate on the emulated cluster first (auto uses that profile)")
  parser.add_argument("--devices-per-process", type=int, default=4,
                      help="CPU devices in each namespace's process (the bench's mesh is "
                           "2 x 4; a command after -- may take 1: one device a node)")
  parser.add_argument("--timeout", type=float, default=5400)
  parser.add_argument("command", nargs="*", help="after --: run this as the two ranks instead")
  args = parser.parse_args(argv)
  if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"):
    raise SystemExit("needs root and iproute2's ip and tc")
  rate_bps = rate_bits(args.rate)
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  import jaxcoll
  from jaxcoll.launch import launch

  signal.signal(signal.SIGTERM, _interrupt)   # so the namespaces are deleted on kill too
  rows = []
  with tempfile.TemporaryDirectory() as tmp, Namespaces(args.rate) as ns:
    ranks = dict(processes=2, devices_per_process=args.devices_per_process,
                 timeout=args.timeout,
                 coordinator=f"{ns.addresses[0]}:29500", rank_prefix=[ns.prefix(0), ns.prefix(1)],
                 local_addresses=list(ns.addresses))
    if args.command:
      print(f"## 2 nodes x {args.devices_per_process} CPU devices, link {args.rate} each "
            "way (tbf)", flush=True)
      return launch(args.command, **ranks)
    if args.devices_per_process != 4:
      raise SystemExit("--devices-per-process: the bench's 2 x 4 mesh needs 4; other counts "
                       "are for a command after --")
    for op in args.ops.split(","):
      valid = jaxcoll.algorithms(op, num_axes=2)
      algos = [a for a in args.algorithms.split(",") if a in valid or a == "auto"]
      out = os.path.join(tmp, f"{op}.json")
      bench = [sys.executable, "-m", "jaxcoll.bench", "--op", op, "--algorithm", ",".join(algos),
               "--mesh", "2x4", "--axes", "node,local", "-n", str(args.iters), "-w", "1",
               "-d", args.dtype,
               "--json", out, "--no-progress"]
      bench += ["--sizes", args.sizes]
      if args.pieces:
        bench += ["--pieces", args.pieces]
      if args.calibrate:
        bench += ["--calibrate", args.calibrate]
      if args.wire and jaxcoll.tools.spec(op).wire:
        bench += ["--wire", args.wire, "--check"]
      code = launch(bench, **ranks)
      if code:
        return code
      with open(out) as f:
        rows += json.load(f)["rows"]
  allocator = "jemalloc" if "jemalloc" in os.environ.get("LD_PRELOAD", "") else "glibc malloc"
  print(f"\n## 2 nodes x 4 CPU devices, link {args.rate} each way (tbf), medians of "
        f"{args.iters}; allocator {allocator}\n")
  print(report(rows, rate_bps))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
