"""jaxcoll compiled by XLA's whole GPU pipeline for compile-only H100s (one host of 8, two
of 8), no GPU needed: ``python benchmarks/gpu_check.py --compile-only``, run as a user runs
it. Needs ``jax-cuda12-plugin`` of the installed jax's version (CI installs it on the
oldest-jax leg, after the quick tests: ``.ci/run``); skipped, by name, without one.

Every program compiles (every primitive x algorithm, hierarchical, the ring all_reduce on
every wire format, the training steps); the ring steps under ``use`` hold no collective but
the schedules' permutes; XLA's own data-parallel step overlaps its all-reduces with GEMMs
(the yardstick the overlap work measures against); ``use``'s data-parallel and FSDP steps
stay within 1.2x and 1.1x of jit's peak memory per device; the collective matmuls run
beside their GEMMs (tensor + sequence parallel, FSDP), and ``use(algorithm="ring")``'s
data-parallel and tensor-parallel sums have their reduce-scatter half beside them; the
prefetching ``fsdp.layers`` runs most of its gathers and reduce-scatters beside GEMMs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.join(HERE, "..", "benchmarks")
sys.path.insert(0, BENCH)
import gpu_compile  # noqa: E402

WHY = gpu_compile.available()
if WHY is not None and os.environ.get("JAXCOLL_GPU_COMPILE") == "required":   # CI's leg
  raise RuntimeError(f"JAXCOLL_GPU_COMPILE=required, and {WHY}")
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"compile-only GPU: {WHY}")


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
  out = tmp_path_factory.mktemp("gpu") / "gpu_check"
  done = subprocess.run([sys.executable, os.path.join(BENCH, "gpu_check.py"),
                         "--compile-only", "--out", str(out)],
                        capture_output=True, text=True, timeout=1200,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  with open(f"{out}.json") as f:
    result = json.load(f)["compile"]
  assert os.path.exists(f"{out}.md")
  return result["rows"]


def test_every_program_compiles_for_both_topologies(rows):
  failed = [(r["topology"], r["layout"], r["program"], r.get("error")) for r in rows
            if not r["ok"]]
  assert not failed, failed
  assert {r["topology"] for r in rows} == {"1x8", "2x8"}
  assert sum(r["layout"] == "collective" for r in rows) > 40


def test_ring_steps_under_use_hold_only_the_schedules_permutes(rows):
  for r in rows:
    if r["program"] == "use(ring)" or r["program"].endswith(" ring"):
      assert set(r["collectives"]) == {"collective-permute"}, r


def test_xlas_data_parallel_step_overlaps_its_all_reduces(rows):
  for r in rows:
    if (r["layout"], r["program"]) == ("DP", "jax.jit"):
      assert r["covered"] >= 0.5 and r["hidden"] > 0, r


# peak memory use(ring) may hold over jit's: DP's weight gradients reduce-scattered beside
# their matmuls layer by layer, then gathered, hold more at once than jit's all-reduces
# (measured 1.07x on 1x8, 1.17x on 2x8); FSDP 1.1x
PEAK_OVER_JIT = {"DP": 1.2, "FSDP": 1.1}


def test_use_stays_within_jits_peak_memory(rows):
  jit = {(r["topology"], r["layout"]): r["peak_bytes"] for r in rows
         if r["program"] == "jax.jit"}
  for r in rows:
    if r["program"] == "use(ring)" and r["layout"] in PEAK_OVER_JIT:
      assert r["peak_bytes"] <= PEAK_OVER_JIT[r["layout"]] * jit[r["topology"], r["layout"]], r


def test_collective_matmuls_run_beside_their_gemms(rows):
  """jaxcoll's all_gather_matmul / matmul_reduce_scatter (one direction), in shard_map code
  and as ``use`` runs a global step's gathers and reduce-scatters on a GPU: every transfer
  byte beside a GEMM, at least 0.9x jit's covered fraction and at least jit's estimated
  hidden time on the tensor + sequence parallel step; FSDP >= 0.75 covered (jit's own:
  about 0.04)."""
  jit = {(r["topology"], r["layout"]): r for r in rows if r["program"] == "jax.jit"}
  seen = set()
  for r in rows:
    fused = r["program"] == "all_gather_matmul" or (
        r["layout"] in ("TP-SP", "FSDP") and r["program"] in ("use", "use(ring)"))
    if fused:
      base = jit[r["topology"], r["layout"]]
      assert r["covered"] >= max(0.75, 0.9 * base["covered"]), (r, base)
      if r["layout"] == "TP-SP":
        assert r["hidden"] >= base["hidden"], (r, base)
      seen.add((r["layout"], r["program"]))
  assert seen == {("TP-SP", "all_gather_matmul"), ("TP-SP", "use"), ("TP-SP", "use(ring)"),
                  ("FSDP", "all_gather_matmul"), ("FSDP", "use(ring)")}, seen


def test_use_rings_on_matmul_sums_run_half_beside_the_matmul(rows):
  """``use(algorithm="ring")`` on the data-parallel and Megatron steps: each weight
  gradient's (and each row-parallel product's) sum is reduce-scattered beside the matmul's
  pieces, then gathered: about half the bytes beside GEMMs (a ring loop alone was 0.00),
  and the tensor-parallel step at least 0.9x jit's covered fraction."""
  jit = {(r["topology"], r["layout"]): r for r in rows if r["program"] == "jax.jit"}
  for r in rows:
    if r["program"] == "use(ring)" and r["layout"] in ("DP", "TP"):
      assert r["covered"] >= 0.45, r
      if r["layout"] == "TP":
        assert r["covered"] >= 0.9 * jit[r["topology"], "TP"]["covered"], r


def test_prefetching_fsdp_layers_run_their_transfers_beside_gemms(rows):
  """``fsdp.layers(prefetch=1)`` (XLA's own gathers and reduce-scatters, one layer ahead):
  most bytes beside GEMMs where ``fsdp.layer`` has almost none (measured 0.65 / 0.63 on
  1x8 / 2x8 against 0.02 / 0.01). XLA's GPU scheduler keeps one async collective in flight
  by default and a backward layer has two to hide; with two allowed (overlap_limit=2) at
  least 0.75 of the bytes and at least jit's estimated hidden time under the same option
  (measured 0.78 / 0.76, hidden 0.32 / 0.19 against jit's 0.18 / 0.11)."""
  by = {(r["topology"], r["program"]): r for r in rows if r["layout"] == "FSDP"}
  for topology in ("1x8", "2x8"):
    one, ahead = by[topology, "fsdp.layer(auto)"], by[topology, "fsdp.layers(prefetch=1)"]
    assert ahead["covered"] >= max(0.5, 10 * one["covered"]), (ahead, one)
    assert ahead["collectives"].get("reduce-scatter") == gpu_compile.LAYERS, ahead
    two = by[topology, f"fsdp.layers(prefetch=1) {gpu_compile.OVERLAP_2}"]
    jit = by[topology, f"jax.jit {gpu_compile.OVERLAP_2}"]
    assert two["covered"] >= 0.75 and two["hidden"] >= jit["hidden"], (two, jit)
    assert two["peak_bytes"] <= jit["peak_bytes"], (two, jit)


def test_pipeline_schedules_compile_and_1f1b_keeps_fewer_inputs_than_gpipe(rows):
  """jaxcoll.pipeline.run over 8 stages, M = 32: every schedule compiles; GPipe's
  temporaries exceed 1F1B's by the ring-buffer slots it keeps more (M inputs and its
  cotangent slots against PP's), one microbatch's activation each, to within the tick
  tables' own bytes."""
  from jaxcoll._src.pipeline.run import _plan
  got = {r["program"]: r for r in rows if r["layout"] == "PP"}
  assert set(got) == {"gpipe", "1f1b", "interleaved", "zero_bubble"}, set(got)
  assert all(r["ok"] for r in got.values()), got
  slots = {s: sum(_plan(s, 8, 32, 1).slots) for s in ("gpipe", "1f1b")}
  activation = gpu_compile.PP_ROWS * gpu_compile.PP_WIDTH * 4
  assert got["1f1b"]["temp_bytes"] < got["gpipe"]["temp_bytes"]
  more = got["gpipe"]["temp_bytes"] - got["1f1b"]["temp_bytes"]
  # within the tick tables' bytes (measured 512: the two tables' lengths differ)
  assert abs(more - (slots["gpipe"] - slots["1f1b"]) * activation) <= 65536, more
