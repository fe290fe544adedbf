"""Start a multi-process JAX job on this machine: ``python -m jaxcoll.launch``.

  python -m jaxcoll.launch -n 2 --devices-per-process 4 -- python script.py ARGS
  jaxcoll-launch -n 2 -- python script.py ARGS      # the same, as a console script

starts the command P times, as processes 0..P-1 of one ``jax.distributed`` job
on 127.0.0.1 (a free coordinator port, CPU collectives over gloo, the CPU device
count set, ``JAX_PLATFORMS=cpu`` unless the environment names a platform), the
way the same script runs across real hosts; glibc's malloc keeps the memory XLA frees
for the next step (``MALLOC_ENV``, unless set). Inside the script,
:func:`jaxcoll.distributed.initialize` reads what the launcher set. Every line a
rank prints comes out prefixed with ``[rank]``. When a rank exits non-zero the
others are killed and the launcher exits with that rank's code; when the
timeout passes it kills every rank and exits 124. (A ``jax.distributed`` process
ignores SIGTERM, it installs a preemption handler, and a rank whose peer died
waits in gloo for XLA's collective timeout, half an hour: so ranks get SIGTERM,
then SIGKILL after a grace period, and every launch has a timeout.)

:func:`launch` is the same from Python, with per-rank command prefixes and
addresses (``benchmarks/emulated_cluster.py`` runs each rank in its own network
namespace with it).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence

from jaxcoll._src.launch_env import (  # noqa: F401 (re-exported)
  ENV_COORDINATOR,
  ENV_LOCAL_ADDRESS,
  ENV_NUM_PROCESSES,
  ENV_PROCESS_ID,
)

TIMED_OUT = 124
GRACE_SECONDS = 2.0
# glibc keeps what XLA:CPU frees for the next step (XLA allocates every step's buffers
# anew); by default it hands large freed blocks back to the OS and faults them in again.
# Measured, 2 ranks, the 16 MiB MLP of benchmarks/bench_vs_ddp.py: the sync's time in the
# step 21-27 ms with these against 35-52 ms without. A rank's own setting wins.
MALLOC_ENV = {"MALLOC_TRIM_THRESHOLD_": str(4 << 30), "MALLOC_TOP_PAD_": str(64 << 20),
              "MALLOC_MMAP_THRESHOLD_": str(32 << 20)}


def free_port(host: str = "127.0.0.1") -> int:
  """A TCP port the OS reports free on ``host`` now."""
  with socket.socket() as s:
    s.bind((host, 0))
    return s.getsockname()[1]


def rank_env(rank: int, processes: int, devices_per_process: int, coordinator: str,
             local_address: str | None = None, base: Mapping[str, str] | None = None
             ) -> dict[str, str]:
  """The environment of rank ``rank``: the job's shape, gloo, the CPU device count, and
  glibc's malloc told to keep freed memory (``MALLOC_ENV``, unless the environment sets
  them: as torchrun sets ``OMP_NUM_THREADS``)."""
  env = dict(os.environ if base is None else base)
  flags = [f for f in env.get("XLA_FLAGS", "").split()
           if not f.startswith("--xla_force_host_platform_device_count")]
  env.update({ENV_COORDINATOR: coordinator, ENV_NUM_PROCESSES: str(processes),
              ENV_PROCESS_ID: str(rank),
              "XLA_FLAGS": " ".join(flags + [
                  f"--xla_force_host_platform_device_count={devices_per_process}"]),
              "JAX_CPU_COLLECTIVES_IMPLEMENTATION": "gloo",
              "PYTHONUNBUFFERED": "1"})
  env.setdefault("JAX_PLATFORMS", "cpu")
  for name, value in MALLOC_ENV.items():
    env.setdefault(name, value)
  if local_address:
    env[ENV_LOCAL_ADDRESS] = local_address
  else:
    env.pop(ENV_LOCAL_ADDRESS, None)
  return env


def _pump(stream, prefix: str, out) -> None:
  for line in iter(stream.readline, ""):
    out.write(f"{prefix}{line}")
    out.flush()


def _kill(procs: Sequence[subprocess.Popen]) -> None:
  for sig in (signal.SIGTERM, signal.SIGKILL):
    for p in procs:
      if p.poll() is None:
        try:
          os.killpg(p.pid, sig)
        except ProcessLookupError:
          pass
    deadline = time.monotonic() + GRACE_SECONDS
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
      time.sleep(0.05)
  for p in procs:
    p.wait()


def launch(command: Sequence[str], processes: int = 2, devices_per_process: int = 4, *,
           timeout: float = 1800.0, coordinator: str | None = None,
           rank_prefix: Sequence[Sequence[str]] | None = None,
           local_addresses: Sequence[str] | None = None,
           out=None) -> int:
  """Runs ``command`` as ranks 0..processes-1 of one job; returns the job's exit code.

  Args:
    command: the program and its arguments (each rank runs the same).
    processes: P, the number of ranks.
    devices_per_process: CPU devices each rank exposes.
    timeout: seconds before every rank is killed (exit code 124).
    coordinator: ``host:port`` of rank 0's coordinator (default 127.0.0.1 and a
      free port).
    rank_prefix: per rank, words put before ``command`` (``["ip", "netns",
      "exec", "ns0"]``).
    local_addresses: per rank, the address its gloo transport binds to and
      advertises (default: what the host name resolves to).
    out: where the prefixed lines go (default ``sys.stdout``).

  Returns:
    0 if every rank exited 0; else the code of the first rank that failed, or
    124 on timeout.
  """
  if processes < 1 or devices_per_process < 1:
    raise ValueError(f"processes={processes} and devices_per_process={devices_per_process} "
                     "must be >= 1")
  if not command:
    raise ValueError("command is empty: give the program to run after --")
  for name, per_rank in (("rank_prefix", rank_prefix), ("local_addresses", local_addresses)):
    if per_rank is not None and len(per_rank) != processes:
      raise ValueError(f"{name} has {len(per_rank)} entries; expected one per rank "
                       f"({processes})")
  out = out or sys.stdout
  coordinator = coordinator or f"127.0.0.1:{free_port()}"
  procs, pumps = [], []
  try:
    for rank in range(processes):
      env = rank_env(rank, processes, devices_per_process, coordinator,
                     local_addresses[rank] if local_addresses else None)
      argv = [*(rank_prefix[rank] if rank_prefix else ()), *command]
      p = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, start_new_session=True)
      procs.append(p)
      pump = threading.Thread(target=_pump, args=(p.stdout, f"[{rank}] ", out), daemon=True)
      pump.start()
      pumps.append(pump)
    deadline = time.monotonic() + timeout
    code = failed_rank = None
    while code is None:
      failed = [r for r, p in enumerate(procs) if p.poll() not in (None, 0)]
      if failed:
        failed_rank = failed[0]
        code = procs[failed_rank].returncode
      elif all(p.returncode == 0 for p in procs):
        code = 0
      elif time.monotonic() > deadline:
        out.write(f"[launch] timed out after {timeout:g} s; killing every rank\n")
        code = TIMED_OUT
      else:
        time.sleep(0.05)
  finally:
    _kill(procs)
    for pump in pumps:
      pump.join(timeout=5)
  if failed_rank is not None:
    out.write(f"[launch] rank {failed_rank} exited with code {code} first; the other ranks "
              "were stopped\n")
  return code


def launch_script(script: str, argv: Sequence[str] | None = None, processes: int = 2,
                  devices_per_process: int = 4, *, timeout: float = 1800.0,
                  child_flag: str = "--child") -> int:
  """Runs ``python script argv... --child`` as the ranks of a local job: how a benchmark
  re-runs itself under the launcher (``argv`` defaults to this process's arguments)."""
  forwarded = list(argv if argv is not None else sys.argv[1:])
  return launch([sys.executable, os.path.abspath(script), *forwarded, child_flag],
                processes=processes, devices_per_process=devices_per_process, timeout=timeout)


def benchmark(parser, child, script: str, argv: Sequence[str] | None = None) -> int:
  """What every benchmark with ``--processes 1|2`` shares: adds ``--processes``, ``--init``,
  ``--devices-per-process``, ``--timeout`` and the hidden ``--child`` to ``parser``; with 1
  process runs ``child(args)`` here on 8 CPU devices; with 2, re-runs ``script`` as 2 ranks
  x ``--devices-per-process`` devices (default 4)
  (:func:`launch_script`), each of which joins the job and runs ``child(args)``: through
  :func:`jaxcoll.distributed.initialize` (``--init jaxcoll``), or as most programs do, by
  calling ``jax.distributed.initialize`` alone with the job's coordinator, size and rank
  (``--init jax``: no jaxcoll host table). Call it before JAX touches a device."""
  parser.add_argument("--processes", type=int, default=1, choices=(1, 2))
  parser.add_argument("--init", default="jaxcoll", choices=("jaxcoll", "jax"),
                      help="how each rank joins the job: jaxcoll.distributed.initialize, or "
                           "plain jax.distributed.initialize")
  parser.add_argument("--devices-per-process", type=int, default=None,
                      help="CPU devices each of the 2 ranks has (default 4)")
  parser.add_argument("--timeout", type=float, default=3000)
  parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.devices_per_process is not None and (args.processes == 1
                                               or args.devices_per_process < 1):
    parser.error(f"--devices-per-process {args.devices_per_process}: a positive count, for "
                 "--processes 2 (one process has 8 devices)")
  if args.processes > 1 and not args.child:
    return launch_script(script, argv, processes=2,
                         devices_per_process=args.devices_per_process or 4,
                         timeout=args.timeout)
  if args.processes > 1 and args.init == "jax":
    import jax
    jax.distributed.initialize(coordinator_address=os.environ[ENV_COORDINATOR],
                               num_processes=int(os.environ[ENV_NUM_PROCESSES]),
                               process_id=int(os.environ[ENV_PROCESS_ID]))
  elif args.processes > 1:
    from jaxcoll import distributed
    distributed.initialize()
  else:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()
  return child(args)


def main(argv: Sequence[str] | None = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  if "--" not in argv:
    argv_opts, command = argv, []
  else:
    cut = argv.index("--")
    argv_opts, command = argv[:cut], argv[cut + 1:]
  parser = argparse.ArgumentParser(
      prog="python -m jaxcoll.launch",
      description="Run a command as the ranks of one local jax.distributed job (gloo on CPU).",
      usage="python -m jaxcoll.launch [-n P] [--devices-per-process D] [--timeout S] "
            "-- command ...")
  parser.add_argument("-n", "--processes", type=int, default=2, help="ranks (default 2)")
  parser.add_argument("--devices-per-process", type=int, default=4,
                      help="CPU devices per rank (default 4)")
  parser.add_argument("--timeout", type=float, default=1800.0,
                      help="seconds before every rank is killed (default 1800)")
  parser.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                      help="rank 0's coordinator address (default 127.0.0.1:<free port>)")
  args = parser.parse_args(argv_opts)
  if not command:
    parser.error("give the command to run after --")
  try:
    return launch(command, args.processes, args.devices_per_process, timeout=args.timeout,
                  coordinator=args.coordinator)
  except ValueError as e:
    parser.error(str(e))
  return 2


if __name__ == "__main__":
  raise SystemExit(main())
