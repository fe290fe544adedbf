"""benchmarks/gpu_check.py, the one script a lent GPU runs, in its CPU dry run: every stage
runs (interpreted, small), the report holds each stage's figures, and a stage that fails is
reported while the next still runs. Reads jax internals through jaxcoll (abstract lowering):
on every supported jax."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks",
                      "gpu_check.py")
ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}


def check(tmp_path, *flags):
  out = tmp_path / "gpu_check"
  done = subprocess.run([sys.executable, SCRIPT, "--dry-run", "--out", str(out), *flags],
                        capture_output=True, text=True, env=ENV, timeout=900)
  return done, json.loads((tmp_path / "gpu_check.json").read_text()), \
      (tmp_path / "gpu_check.md").read_text()


# The dry run and the failing stage run in the full suite; on the oldest jax the lowering they
# share is tests/test_lowering.py's and test_lower_only_runs_on_any_machine's (quick).
def test_the_dry_run_runs_every_stage_and_reports_each(tmp_path):
  done, results, report = check(tmp_path)
  assert done.returncode == 0, done.stdout + done.stderr
  assert list(results) == ["env", "kernel", "bandwidth", "wire", "programs", "calibrate",
                           "lowering", "compile"]
  compiled = results.pop("compile")   # skipped, by name, without the CUDA plugin
  assert all(r["status"] == "ok" for r in results.values()), results
  assert compiled["status"] == "ok" and all(r["ok"] for r in compiled["rows"]) or \
      compiled["status"] == "skipped" and "Compiled for a GPU: skipped (" in report, compiled
  assert results["env"]["dry_run"] and results["env"]["backend"] == "cpu"
  (interpreted,) = results["kernel"]["compilers"].values()
  assert interpreted["cases"] >= 60 and interpreted["differ"] == 0
  assert {r["dtype"] for r in results["bandwidth"]["rows"]} == {"float32", "bfloat16"}
  for row in results["wire"]["rows"]:        # every format within its documented bound
    assert row["max_error"] <= row["bound"], row
  programs = results["programs"]
  assert programs["collectives"] and all(c["equal"] for c in programs["collectives"])
  assert [g["n"] for g in programs["growth"]] == [8, 64, 512]
  assert all("hlo_chars" in g for g in programs["growth"]), programs["growth"]
  for title in ("| fused combine back end", "| chunk | dtype | kernel GB/s", "| wire format",
                "| N | trace s", "HLO size grows as N^", "| 1-device all_reduce",
                "Lowered for NVIDIA H200 (cuda)"):
    assert title in report, title
  check_lowering(results["lowering"])


def check_lowering(lowering):
  """Every program lowered for the H200: schedules as collective-permutes and no lax
  collective, the reductions' and the kernel's Pallas calls, auto on native, nothing only a
  CPU runs."""
  rows = {r["case"]: r for r in lowering["rows"]}
  assert all(r["ok"] and not r["cpu_only"] for r in rows.values()), rows
  lax_ops = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
  for name, r in rows.items():
    if " native" in name or name.startswith(("auto", "moe")):
      continue
    if name.startswith("fused_combine"):
      assert r["pallas"] == 1, r
    else:
      assert r["collective_permute"] > 0 and not any(r[op] for op in lax_ops), r
  assert rows["all_reduce ring"]["pallas"] > 0   # the reduce steps' kernel, compiled
  assert rows["auto all_reduce (GPU preset)"]["all_reduce"] == 1


@pytest.mark.quick
def test_lower_only_runs_on_any_machine(tmp_path):
  out = tmp_path / "lower"
  done = subprocess.run([sys.executable, SCRIPT, "--lower-only", "--out", str(out)],
                        capture_output=True, text=True, env=ENV, timeout=600)
  assert done.returncode == 0, done.stdout + done.stderr
  results = json.loads((tmp_path / "lower.json").read_text())
  assert list(results) == ["env", "lowering"]
  check_lowering(results["lowering"])


def test_a_stage_that_fails_is_reported_and_the_next_still_runs(tmp_path):
  done, results, report = check(tmp_path, "--stages", "env,kernel,wire",
                                "--timeout", "kernel=1")
  assert done.returncode == 1
  assert [results[s]["status"] for s in ("env", "kernel", "wire")] == ["ok", "timeout", "ok"]
  assert "## kernel: timeout" in report and "| wire format" in report
