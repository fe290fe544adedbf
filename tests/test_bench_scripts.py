"""Benchmark scripts run as their docs say (tiny sizes, one round), and their baselines are
the computations they name: ``bench_overlap.py`` prints its table in one process and across
two (one device each, as on the emulated link); ``bench_grad_sync``'s per-bucket pmean
equals per-leaf ``lax.pmean``."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.join(HERE, "..", "benchmarks")
TINY = ["--width", "32", "--gemms", "1", "--permutes", "1", "--mib", "1", "--layers", "1",
        "--rows", "8", "--reps", "1", "--min-seconds", "0"]


def _run(*args):
  done = subprocess.run([sys.executable, os.path.join(BENCH, "bench_overlap.py"), *TINY, *args],
                        capture_output=True, text=True, timeout=600,
                        env={k: v for k, v in os.environ.items() if k != "XLA_FLAGS"})
  assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
  rows = [line for line in done.stdout.splitlines() if "| probe |" in line or "| DP step" in line]
  assert len(rows) == 3, done.stdout
  return done.stdout


def test_bench_overlap_prints_its_table_in_one_process():
  assert "1 process(es), 8 CPU devices" in _run()


def test_bench_overlap_runs_two_processes_of_one_device():
  assert "2 process(es), 2 CPU devices" in _run("--processes", "2", "--devices-per-process", "1")


def test_per_bucket_pmean_is_per_leaf_pmean():
  sys.path.insert(0, BENCH)
  from bench_grad_sync import per_bucket_pmean
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
  shapes = [(300,)] * 5 + [(256, 512)] * 3 + [(7, 3)]
  leaves = [jax.random.normal(jax.random.key(i), (8, *s)) for i, s in enumerate(shapes)]

  def run(fn):
    return jax.jit(jax.shard_map(lambda t: [g[None] for g in fn([g[0] for g in t])],
                                 mesh=mesh, in_specs=P("data"), out_specs=P("data")))(leaves)
  got = run(lambda t: per_bucket_pmean(t, "data"))
  want = run(lambda t: [jax.lax.pmean(g, "data") for g in t])
  for g, w in zip(got, want, strict=True):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    assert g.dtype == w.dtype == jnp.float32


def test_devices_per_process_without_a_second_process_is_refused_by_name():
  done = subprocess.run([sys.executable, os.path.join(BENCH, "bench_overlap.py"),
                         "--devices-per-process", "2"], capture_output=True, text=True,
                        timeout=120)
  assert done.returncode == 2 and "--devices-per-process 2" in done.stderr, done.stderr
