"""Measures the "cpu" preset: in one process, across two, and one fit of both.

  python benchmarks/calibrate_cpu.py            # writes jaxcoll/presets/cpu.json

runs the two halves and fits them together (``jaxcoll.tools.fit``):
  --part process: 8 CPU devices in one process, one axis "x" (every link "process");
  --part host: under ``jaxcoll.launch -n 2 --devices-per-process 4``, a ("node", "local")
    mesh of 2 x 4 over the two processes (links "process" and "host": gloo on loopback),
    the lax collectives over both axes, and over each alone;
  --part pairs: under ``jaxcoll.launch -n 2``, one device a process, one axis of 2: the
    usual CPU data-parallel job. Only its times are kept (``with_pairs``): the 2 x 4 mesh's
    "node" axis is 2 devices too, but four such pairs share the 2 cores there, and its
    times (54.8 ms for the lax all_reduce of 16 MiB) priced a 2-process job (16.6 ms) 3.3x
    too slow, and the schedules 2x, so auto ran recursive doubling where the lax
    all_reduce was faster inside a training step (benchmarks/bench_vs_ddp.py);
each at 1 KiB to 64 MiB per device, every size timed side by side (medians of at least 5
rounds, more until a size has taken 4 s: gloo's latency is bimodal). The
measurements are kept in benchmarks/out/calibrate-<part>.json; ``--fit`` refits them.
No second host was measured: the preset's "network" span is the "host" one with a prior
for the link between hosts, 1 Gbit/s Ethernet (``NETWORK``: alpha 50 us, beta 8 ns/B, the
slowest network a CPU cluster commonly has) and no lax times (priced as NCCL would run them
on these links). Without it, auto priced a network link as loopback TCP and picked
schedules that ship 1.75 M across it where one ships M (benchmarks/bench_vs_ddp.py --netns);
``jaxcoll.calibrate`` on a cluster measures its own.

The kept measurements predate the codec term (the cost of encoding for a compressed wire):
``CODEC`` holds the figures ``jaxcoll.calibrate(mesh, primitives=("all_reduce",))`` fitted
on the same two configurations on 2026-12-04 (8 devices in one process; 2 processes x 4
over gloo, one axis of 8), and ``with_codec`` sets them; a new measurement fits its own.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "out")
SIZES = tuple(1 << k for k in range(10, 27, 2))   # 1 KiB ... 64 MiB, x4
PRESET = os.path.join(HERE, "..", "jaxcoll", "presets", "cpu.json")
NETWORK = {"alpha": 50e-6, "beta": 8e-9}   # prior: 1 Gbit/s Ethernet between CPU hosts
CODEC = {"process": 1.874e-9, "host": 1.628e-9}   # s/B, fitted by jaxcoll.calibrate (above)


def part_path(part: str) -> str:
  return os.path.join(OUT, f"calibrate-{part}.json")


def measure(part: str, reps: int, min_seconds: float) -> None:
  if part == "process":
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()
  import jax
  import numpy as np

  import jaxcoll
  if part in ("host", "pairs"):
    jaxcoll.distributed.initialize()
  devices = np.array(jax.devices()[:8])
  mesh = (jax.sharding.Mesh(devices, ("x",)) if part in ("process", "pairs") else
          jax.sharding.Mesh(devices.reshape(2, 4), ("node", "local")))
  measured = jaxcoll.tools.measure(mesh, sizes=SIZES, reps=reps, min_seconds=min_seconds,
                                   progress=jax.process_index() == 0)
  if jax.process_index() == 0:
    os.makedirs(OUT, exist_ok=True)
    with open(part_path(part), "w") as f:
      json.dump(measured.to_json(), f)
    print(f"{part}: links {measured.classes}; wrote {part_path(part)}", flush=True)


def with_network(prof):
  """``prof`` with a "network" span: its "host" figures, the ``NETWORK`` prior for links
  between hosts, no lax times."""
  import jaxcoll
  host = prof.for_span("host")
  network = dataclasses.replace(
      host, name="cpu across network (host figures; link: prior, 1 Gbit/s Ethernet)",
      links={**dict(host.links), "network": jaxcoll.Link(**NETWORK)}, native=(), spans=())
  return dataclasses.replace(prof, spans={**dict(prof.spans), "network": network})


def with_codec(prof):
  """``prof`` with ``CODEC``'s figures where its own fit had no compressed schedules to
  fit codec to (the host span's also for the network span: the same CPUs encode)."""
  def keep(p, span):
    return p if p.codec else dataclasses.replace(p, codec=CODEC[span])
  return dataclasses.replace(keep(prof, "process"),
                             spans={s: keep(sub, "host") for s, sub in prof.spans})


def with_pairs(prof, pairs):
  """``prof`` whose "host" span prices 2 devices by the ``pairs`` measurements' times (the
  lax collectives' and the schedules'), in place of those of the 2 x 4 mesh's "node" axis."""
  host = prof.for_span("host")
  native = (*pairs.native, *(t for t in host.native if t.axis_sizes != (2,)))
  return dataclasses.replace(prof, spans={**dict(prof.spans),
                                          "host": dataclasses.replace(host, native=native)})


def fit(out: str) -> None:
  from jaxcoll import tools
  parts = {}
  for part in ("process", "host", "pairs"):
    with open(part_path(part)) as f:
      parts[part] = tools.Measurements.from_json(json.load(f))
  prof = with_pairs(tools.fit([parts["process"], parts["host"]], name="cpu"), parts["pairs"])
  prof = with_codec(with_network(prof))
  prof.save(out)
  print(f"wrote {out}: {prof.summary()}")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--part", choices=("process", "host", "pairs"))
  parser.add_argument("--fit", action="store_true", help="only refit the kept measurements")
  parser.add_argument("--out", default=PRESET)
  parser.add_argument("--reps", type=int, default=5)
  parser.add_argument("--min-seconds", type=float, default=4.0,
                      help="more rounds per size until they take this long: gloo's latency is "
                           "bimodal, so small sizes need many rounds for a steady median")
  args = parser.parse_args()
  if args.part:
    measure(args.part, args.reps, args.min_seconds)
    return
  if not args.fit:
    me = [sys.executable, os.path.abspath(__file__), "--reps", str(args.reps),
          "--min-seconds", str(args.min_seconds), "--part"]
    subprocess.run(me + ["process"], check=True)
    for part, per_process in (("host", "4"), ("pairs", "1")):
      subprocess.run([sys.executable, "-m", "jaxcoll.launch", "-n", "2", "--devices-per-process",
                      per_process, "--timeout", "3600", "--"] + me + [part], check=True)
  fit(args.out)


if __name__ == "__main__":
  main()
