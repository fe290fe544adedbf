"""The nccl-tests-style CLI: size sweeps, bus factors, --check, output formats, errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxcoll
from jaxcoll import bench


def test_sizes_parse_like_nccl_tests():
  assert [bench.parse_size(s) for s in ("8", "64K", "16M", "1G", "2MiB")] == \
      [8, 65536, 16 << 20, 1 << 30, 2 << 20]
  assert bench.size_sweep(8, 64, 2) == [8, 16, 32, 64]
  assert bench.size_sweep(1024, 4096, 0, step=1024) == [1024, 2048, 3072, 4096]
  with pytest.raises(Exception, match="size '12Q'"):
    bench.parse_size("12Q")
  sizes = (8, 4096, 1 << 20, 3 << 30, 1000)
  compact = [jaxcoll.tools.format_size(v, compact=True) for v in sizes]   # the plot's axis
  assert compact == ["8", "4K", "1M", "3G", "1000"]
  assert [bench.parse_size(c) for c in compact] == list(sizes)
  assert [jaxcoll.tools.format_size(v) for v in (100, 1536, 3 << 30)] == \
      ["100 B", "1.5 KiB", "3 GiB"]
  with pytest.raises(ValueError, match="-f 1"):
    bench.size_sweep(8, 64, 1)


# nccl-tests' bus bandwidth factors (PERFORMANCE.md), written independently of jaxcoll.spec
NCCL_BUS_FACTOR = {"all_reduce": 2 * 7 / 8, "reduce_scatter": 7 / 8, "all_gather": 7 / 8,
                   "all_to_all": 7 / 8, "broadcast": 1.0, "reduce": 1.0}


def test_bench_measures_every_collective_nccl_tests_does():
  assert set(bench.OPS) == set(NCCL_BUS_FACTOR)


@pytest.mark.parametrize("op", bench.OPS)
def test_every_algorithm_checks_clean_and_busbw_uses_the_bus_factor(op):
  mesh = jax.make_mesh((2, 4), ("node", "local"))
  rows = bench.run(op, [100, 4096], "all", mesh=mesh, iters=1, warmup=1, check=True,
                   profile="cpu")
  algorithms = {r.algorithm.split(" -> ")[0] for r in rows}
  assert algorithms == {*jaxcoll.algorithms(op, num_axes=2), "auto"}
  for r in rows:
    assert r.wrong == 0, r
    assert r.size in (96, 4096)   # 100 rounds down to a multiple of 8 devices x 4 bytes
    assert r.busbw_gbs == pytest.approx(r.algbw_gbs * NCCL_BUS_FACTOR[op])
    assert r.predicted_us is not None and r.predicted_us > 0
    assert r.count * 4 * (8 if op == "all_gather" else 1) == r.size


@pytest.mark.quick
def test_cli_writes_json_and_csv(tmp_path, capsys):
  out = tmp_path / "rows.json"
  code = bench.main(["-b", "1K", "-e", "4K", "-f", "4", "--op", "all_gather",
                     "--algorithm", "ring,bruck,native", "-n", "2", "-w", "1", "-c",
                     "--mesh", "2x4", "--axes", "node,local", "--json", str(out),
                     "--csv", str(tmp_path / "rows.csv"), "--no-progress"])
  assert code == 0
  data = json.loads(out.read_text())
  assert [(r["size"], r["algorithm"]) for r in data["rows"]] == [
      (s, a) for s in (1024, 4096) for a in ("ring", "bruck", "native")]
  assert all(r["wrong"] == 0 for r in data["rows"])
  lines = (tmp_path / "rows.csv").read_text().splitlines()
  assert lines[0].startswith("op,size,count,dtype,algorithm,time_us") and len(lines) == 7
  out = capsys.readouterr().out
  assert "busbw" in out and "(GB/s)" in out


@pytest.mark.quick
def test_cli_errors_name_the_argument():
  with pytest.raises(SystemExit, match="--algorithm 'bruck' does not run all_reduce"):
    bench.main(["-b", "1K", "-e", "1K", "--algorithm", "bruck", "--no-progress"])
  with pytest.raises(SystemExit, match="--op 'psum'"):
    bench.main(["--op", "psum"])
  with pytest.raises(SystemExit, match="--mesh 3x3 needs 9 devices"):
    bench.main(["--mesh", "3x3", "--axes", "a,b"])


def test_interleaved_rounds_rotate_and_stretch_to_min_seconds():
  import time

  from jaxcoll._src import timing
  log = []
  calls = [lambda i=i: (log.append(i), time.sleep(0.002)) for i in range(3)]
  times = timing.interleaved(calls, reps=2, warmup=2)
  assert [len(t) for t in times] == [2, 2, 2]
  assert log[9:] == [0, 1, 2, 1, 2, 0]   # 2 warm-ups and 1 probe each, then rotated rounds
  assert all(t >= 0.002 for ts in times for t in ts)
  times = timing.interleaved(calls, reps=2, min_seconds=0.1, warmup=1)
  assert 2 < len(times[0]) <= 60         # ~6 ms a round: about 17 rounds make 0.1 s
  with pytest.raises(ValueError, match="reps=0"):
    timing.interleaved(calls, reps=0)


@pytest.mark.quick
def test_dtype_names_are_nccl_tests_names_and_64_bit_needs_x64():
  want = {"float": np.float32, "half": np.float16, "bfloat16": jnp.bfloat16, "bf16": jnp.bfloat16,
          "int8": np.int8, "int32": np.int32, "uint8": np.uint8, "float32": np.float32}
  for name, dtype in want.items():
    assert bench.parse_dtype(name) == np.dtype(dtype), name
  assert not jax.config.jax_enable_x64
  for name in ("double", "int64", "float64"):
    with pytest.raises(ValueError, match="64-bit type.*JAX_ENABLE_X64"):
      bench.parse_dtype(name)
  with pytest.raises(ValueError, match="-d/--dtype 'complex64': expected one of"):
    bench.parse_dtype("complex64")


@pytest.mark.quick
@pytest.mark.parametrize("name,itemsize", [("float", 4), ("half", 2), ("bf16", 2), ("int8", 1)])
def test_cli_times_the_dtype_it_names(tmp_path, name, itemsize):
  """-d float runs float32 (nccl-tests' float), so algbw and busbw count 4-byte elements."""
  out = tmp_path / "rows.json"
  assert bench.main(["-b", "4K", "-e", "4K", "-d", name, "--algorithm", "ring,native", "-n", "1",
                     "-w", "1", "-c", "1", "--json", str(out), "--no-progress"]) == 0
  rows = json.loads(out.read_text())["rows"]
  assert {r["dtype"] for r in rows} == {bench.parse_dtype(name).name}
  for r in rows:
    assert r["count"] * itemsize == r["size"] == 4096 and r["wrong"] == 0
    assert r["algbw_gbs"] == pytest.approx(r["size"] / (r["time_us"] * 1e-6) / 1e9)
  with pytest.raises(SystemExit, match="64-bit type"):
    bench.main(["-d", "double", "--no-progress"])


@pytest.mark.quick
def test_cli_output_has_nccl_tests_headers_and_average_bus_bandwidth(tmp_path, capsys):
  out = tmp_path / "rows.json"
  assert bench.main(["-b", "1K", "-e", "4K", "-f", "4", "--algorithm", "ring,native", "-n", "1",
                     "-w", "1", "--json", str(out), "--no-progress", "-o", "sum"]) == 0
  lines = capsys.readouterr().out.splitlines()
  rows = json.loads(out.read_text())["rows"]
  data = [ln for ln in lines if ln.strip() and not ln.startswith("#")]
  assert len(data) == len(rows) == 4          # every other line is a # comment
  assert all(ln.startswith("#") for ln in lines[:4])
  avg = next(ln for ln in lines if ln.startswith("# Avg bus bandwidth"))
  assert float(avg.split(":")[1]) == pytest.approx(np.mean([r["busbw_gbs"] for r in rows]),
                                                   rel=1e-3)
  assert "# Out of bounds values : 0 OK" in lines


@pytest.mark.quick
def test_cli_refuses_nccl_tests_flags_it_cannot_honour_with_a_pointer():
  with pytest.raises(SystemExit, match="-o max: the bench times sum only; jaxcoll.all_reduce"):
    bench.main(["-o", "max"])
  assert bench._parser().parse_args(["-g", "4"]).devices == 4
  assert bench._parser().parse_args(["-c", "0"]).check == 0


@pytest.mark.quick
def test_plot_checks_matplotlib_before_measuring(monkeypatch, tmp_path):
  monkeypatch.setitem(sys.modules, "matplotlib", None)     # as if not installed
  start = time.perf_counter()
  with pytest.raises(SystemExit, match="--plot needs matplotlib.*nothing was measured"):
    bench.main(["--plot", str(tmp_path / "p.png"), "-b", "1K", "-e", "64M"])
  assert time.perf_counter() - start < 5


def test_plot_is_log_log_with_human_sizes(tmp_path):
  pytest.importorskip("matplotlib")
  rows = bench.run("all_reduce", [1024, 4096, 1 << 20], ["ring", "native", "auto"], iters=1,
                   warmup=0)
  path = tmp_path / "p.png"
  title = "all_reduce float32, " + "a long title that would be cut off at the edge " * 3
  fig = bench.plot(rows, str(path), title=title)
  assert path.stat().st_size > 10_000
  ax = fig.axes[0]
  assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
  shown = ax.get_title()
  assert shown.replace("\n", " ") == title.strip() and max(map(len, shown.split("\n"))) <= 90
  lines = {line.get_label(): line for line in ax.get_lines()}
  assert lines["auto"].get_zorder() > lines["native"].get_zorder()   # auto over native
  assert lines["auto"].get_color() != lines["native"].get_color()


@pytest.mark.quick
def test_sizes_that_round_alike_are_measured_once_and_said(tmp_path, capsys):
  """8 devices x 4 bytes: -b 8 -e 32 is one size, 32 B (three rows all labelled 32 B)."""
  out = tmp_path / "rows.json"
  assert bench.main(["-b", "8", "-e", "32", "--algorithm", "native", "-n", "1", "-w", "0",
                     "--json", str(out), "--no-progress"]) == 0
  assert [r["size"] for r in json.loads(out.read_text())["rows"]] == [32]
  assert "# sizes are multiples of 32 B (8 devices x 4 B): 8 B, 16 B, 32 B measured as 32 B" \
      in capsys.readouterr().out
  assert bench.rounded_sizes([8, 100, 96, 4096], 32) == [32, 96, 4096]


@pytest.mark.quick
@pytest.mark.parametrize("flags,match", [
    (["-w", "-1"], "-w/--warmup_iters: -1 must be at least 0"),
    (["-n", "0"], "-n/--iters: 0 must be at least 1"),
    (["-g", "0"], "-g/--devices: 0 must be at least 1"),
    (["--min-seconds", "-2"], "--min-seconds: -2.0 must be >= 0"),
    (["-n", "two"], "-n/--iters: 'two' is not an int"),
])
def test_cli_counts_are_checked_before_anything_runs(flags, match, capsys):
  with pytest.raises(SystemExit):
    bench.main(flags)
  assert match in capsys.readouterr().err


ENV = {**os.environ, "PYTHONWARNINGS": "error::RuntimeWarning"}


def start_sweep(out, *sizes: str) -> subprocess.Popen:
  """``python -m jaxcoll.bench`` over ``sizes`` (-b, -e), ring and native, one round each."""
  return subprocess.Popen([sys.executable, "-m", "jaxcoll.bench", "-b", sizes[0], "-e",
                           sizes[1], "-f", "2", "--algorithm", "ring,native", "-n", "1", "-w",
                           "0", "--json", str(out), "--no-progress"], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, env=ENV)


def test_ctrl_c_keeps_the_rows_measured_and_the_json(tmp_path):
  """A sweep stopped by SIGINT after its first size still prints and saves that size. The
  bench takes SIGINT from its first line on (the header follows), so there is no race: the
  flag it sets is read before the next call of any program, within a measurement of the
  signal, never deferred to the end of the sweep (1 GiB here)."""
  out = tmp_path / "rows.json"
  proc = start_sweep(out, "1K", "1G")
  for line in proc.stdout:
    if not line.startswith("#"):       # the first row: measured and printed
      sent = time.monotonic()
      proc.send_signal(signal.SIGINT)
      break
  rest, err = proc.communicate(timeout=120)
  stopped_after = time.monotonic() - sent
  assert proc.returncode == 130, err
  rows = json.loads(out.read_text())
  assert rows["interrupted"] and len(rows["rows"]) >= 2
  assert max(r["size"] for r in rows["rows"]) < 64 << 20, "the sweep walked on"
  assert "# interrupted" in rest and "# Avg bus bandwidth" in rest
  assert stopped_after < 60, stopped_after


def test_a_second_ctrl_c_ends_the_bench_at_once(tmp_path):
  """The first SIGINT restores the default action: a second one ends the process whatever
  it is running (here compiling or timing a 256 MiB all_reduce)."""
  proc = start_sweep(tmp_path / "rows.json", "256M", "1G")
  assert proc.stdout.readline().startswith("#")   # the header: the handler is in place
  proc.send_signal(signal.SIGINT)
  time.sleep(0.5)
  proc.send_signal(signal.SIGINT)
  start = time.monotonic()
  proc.communicate(timeout=60)
  assert proc.returncode == -signal.SIGINT and time.monotonic() - start < 10


def test_interrupts_flag_the_first_signal_and_restore_the_handler():
  previous = signal.getsignal(signal.SIGINT)
  with bench.Interrupts() as interrupts:
    assert not interrupts.requested
    os.kill(os.getpid(), signal.SIGINT)   # delivered to this, the main, thread
    time.sleep(0.05)
    assert interrupts.requested and signal.getsignal(signal.SIGINT) is signal.SIG_DFL
  assert signal.getsignal(signal.SIGINT) is previous
  asked = []

  def stop():   # the first size's 6 calls run (warm-up, probe, one round), then: stop
    asked.append(1)
    return len(asked) > 6
  rows = bench.run("all_reduce", [1024, 4096, 16384], ["ring", "native"], iters=1, warmup=1,
                   stop=stop)
  assert [r.size for r in rows] == [1024, 1024]   # the first size; the second was dropped
  assert bench.run("all_reduce", [1024], ["native"], iters=1, stop=lambda: True) == []


@pytest.mark.quick
def test_launch_runs_as_a_module_and_a_console_script_without_warnings():
  script = os.path.join(os.path.dirname(sys.executable), "jaxcoll-launch")
  for cmd in ([sys.executable, "-m", "jaxcoll.launch"], [script]):
    done = subprocess.run(cmd + ["-n", "1", "--timeout", "60", "--", sys.executable, "-c",
                                 "print('ran')"], capture_output=True, text=True, env=ENV,
                          timeout=90)
    assert done.returncode == 0, done.stderr
    assert "[0] ran" in done.stdout and "RuntimeWarning" not in done.stderr
