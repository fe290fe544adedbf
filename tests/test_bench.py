"""The nccl-tests-style CLI: size sweeps, bus factors, --check, output formats, errors."""

from __future__ import annotations

import json

import jax
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
  with pytest.raises(ValueError, match="-f 1"):
    bench.size_sweep(8, 64, 1)


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
    assert r.busbw_gbs == pytest.approx(r.algbw_gbs * bench.BUS_FACTOR[op](8))
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
  assert "busbw (GB/s)" in capsys.readouterr().out


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
