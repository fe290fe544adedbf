"""A small local launcher for multi-process benchmarks (until ``jaxcoll.launch`` lands).

``run(script_args, processes=2, devices_per_process=4, timeout=...)`` starts
``python <script_args>`` P times on 127.0.0.1 with a free coordinator port,
passes ``JAXCOLL_COORDINATOR``, ``JAXCOLL_NUM_PROCESSES``, ``JAXCOLL_PROCESS_ID``
and the device count, prefixes every output line with its rank, kills every
rank when one fails or the timeout passes (SIGTERM, then SIGKILL: jax.distributed
installs a SIGTERM handler), and returns the first non-zero exit code.
``initialize()`` is the child side: gloo CPU collectives, then
``jax.distributed.initialize`` with what the launcher set.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _pump(stream, prefix: str):
  for line in iter(stream.readline, ""):
    sys.stdout.write(f"{prefix}{line}")
    sys.stdout.flush()


def run(script_args, processes: int = 2, devices_per_process: int = 4,
        timeout: float = 1800) -> int:
  port = free_port()
  procs, pumps = [], []
  for rank in range(processes):
    env = dict(os.environ,
               JAXCOLL_COORDINATOR=f"127.0.0.1:{port}",
               JAXCOLL_NUM_PROCESSES=str(processes),
               JAXCOLL_PROCESS_ID=str(rank),
               XLA_FLAGS=f"--xla_force_host_platform_device_count={devices_per_process}")
    p = subprocess.Popen([sys.executable, *script_args], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, start_new_session=True)
    procs.append(p)
    t = threading.Thread(target=_pump, args=(p.stdout, f"[{rank}] "), daemon=True)
    t.start()
    pumps.append(t)
  deadline = time.monotonic() + timeout
  code = 0
  while any(p.poll() is None for p in procs):
    failed = [p.returncode for p in procs if p.returncode not in (None, 0)]
    if failed or time.monotonic() > deadline:
      code = failed[0] if failed else 124
      break
    time.sleep(0.2)
  for p in procs:
    if p.poll() is None:
      os.killpg(p.pid, signal.SIGTERM)
  time.sleep(1.0)
  for p in procs:
    if p.poll() is None:
      os.killpg(p.pid, signal.SIGKILL)
    p.wait()
  for t in pumps:
    t.join(timeout=1)
  return code or next((p.returncode for p in procs if p.returncode), 0)


def initialize() -> None:
  """In a child: gloo collectives, then jax.distributed with the launcher's settings."""
  import jax
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=os.environ["JAXCOLL_COORDINATOR"],
                             num_processes=int(os.environ["JAXCOLL_NUM_PROCESSES"]),
                             process_id=int(os.environ["JAXCOLL_PROCESS_ID"]))
