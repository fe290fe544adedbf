"""Two processes x four CPU devices over gloo, started by ``jaxcoll.launch``: the collectives
across a real process boundary, and a failing rank."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from jaxcoll.launch import MALLOC_ENV, launch, rank_env

pytestmark = pytest.mark.quick   # also on the oldest supported jax (.ci/run)

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mp_worker.py")


def run_worker(mode: str, timeout: float) -> tuple[subprocess.CompletedProcess, float]:
  start = time.monotonic()
  done = subprocess.run(
      [sys.executable, "-m", "jaxcoll.launch", "-n", "2", "--devices-per-process", "4",
       "--timeout", str(timeout), "--", sys.executable, WORKER, mode],
      capture_output=True, text=True, timeout=timeout + 60)
  return done, time.monotonic() - start


def test_every_algorithm_equals_lax_across_two_processes():
  done, _ = run_worker("collectives", timeout=600)
  assert done.returncode == 0, done.stdout[-6000:]
  for rank in (0, 1):
    assert f"[{rank}] rank {rank}: " in done.stdout, done.stdout[-3000:]


def test_link_classes_are_read_from_the_devices_of_two_processes():
  done, _ = run_worker("topology", timeout=240)
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  assert "[0] rank 0: topology ok" in done.stdout and "[1] rank 1: topology ok" in done.stdout


def test_hosts_are_found_in_a_job_joined_by_jax_distributed_alone():
  """Most jobs call jax.distributed.initialize themselves: no jaxcoll host table, so the two
  processes' host comes from the boot ids jax's backend published (one host here)."""
  done, _ = run_worker("plain_topology", timeout=240)
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  assert "[0] rank 0: topology ok" in done.stdout and "[1] rank 1: topology ok" in done.stdout


def test_sorted_moe_across_processes_joined_by_jax_distributed_alone():
  done, _ = run_worker("plain_moe_sorted", timeout=300)
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  for rank in (0, 1):
    assert f"[{rank}] rank {rank}: sorted moe ok" in done.stdout, done.stdout[-3000:]


def test_a_rank_that_raises_fails_the_launch_fast_with_its_traceback():
  done, elapsed = run_worker("fail", timeout=300)
  assert done.returncode == 1, done.stdout[-3000:]
  lines = done.stdout.splitlines()
  assert any(line.startswith("[1] Traceback") for line in lines), done.stdout[-3000:]
  assert "[1] ValueError: rank 1 fails on purpose" in lines
  assert "rank 1 exited with code 1 first" in done.stdout
  assert "finished a collective" not in done.stdout   # rank 0 was stopped, not released
  assert elapsed < 60, elapsed


def test_ranks_keep_freed_memory_unless_the_environment_says_otherwise():
  """Each rank's environment tells glibc to keep what XLA frees (MALLOC_ENV); a value the
  user set wins; the rank really runs with it."""
  env = rank_env(0, 2, 4, "127.0.0.1:1", base={"MALLOC_TOP_PAD_": "0"})
  assert env["MALLOC_TOP_PAD_"] == "0"
  assert env["MALLOC_TRIM_THRESHOLD_"] == MALLOC_ENV["MALLOC_TRIM_THRESHOLD_"]
  assert env["MALLOC_MMAP_THRESHOLD_"] == str(32 << 20)
  lines = []
  code = launch([sys.executable, "-c", "import os; print(os.environ['MALLOC_TRIM_THRESHOLD_'])"],
                processes=2, devices_per_process=1, timeout=60, out=Lines(lines))
  assert code == 0 and sorted(lines) == [f"[{r}] {4 << 30}\n" for r in range(2)]


class Lines:
  def __init__(self, lines):
    self.lines = lines

  def write(self, text):
    self.lines.append(text)

  def flush(self):
    pass


def test_launch_errors_name_the_argument():
  with pytest.raises(ValueError, match="processes=0"):
    launch(["true"], processes=0)
  with pytest.raises(ValueError, match="rank_prefix has 1 entries"):
    launch(["true"], processes=2, rank_prefix=[["env"]])
  done = subprocess.run([sys.executable, "-m", "jaxcoll.launch", "-n", "2"],
                        capture_output=True, text=True, timeout=60)
  assert done.returncode == 2 and "after --" in done.stderr


def test_launch_times_out_and_kills_every_rank():
  with open(os.devnull, "w") as sink:
    start = time.monotonic()
    code = launch([sys.executable, "-c", "import time; time.sleep(600)"], processes=2,
                  timeout=2.0, out=sink)
  assert code == 124 and time.monotonic() - start < 30


def test_bench_runs_under_launch_and_checks_clean(tmp_path):
  out = tmp_path / "rows.json"
  done = subprocess.run(
      [sys.executable, "-m", "jaxcoll.launch", "-n", "2", "--timeout", "300", "--",
       sys.executable, "-m", "jaxcoll.bench", "-b", "4K", "-e", "4K", "--op",
       "all_reduce,all_to_all", "--algorithm", "hierarchical,native,auto", "-n", "2", "-w", "1",
       "--check", "--mesh", "2x4", "--axes", "node,local", "--json", str(out), "--no-progress"],
      capture_output=True, text=True, timeout=400)
  assert done.returncode == 0, done.stdout[-4000:]
  data = json.loads(out.read_text())
  assert "2 process(es), 8 devices" in data["title"]
  assert {(r["op"], r["algorithm"].split(" -> ")[0]) for r in data["rows"]} == {
      (op, a) for op in ("all_reduce", "all_to_all") for a in ("hierarchical", "native", "auto")}
  assert all(r["wrong"] == 0 for r in data["rows"])
