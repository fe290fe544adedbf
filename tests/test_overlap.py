"""``jaxcoll.tools.overlap``: what each transfer of a compiled step runs beside.

On this CPU machine the compiled modules are real (8 CPU devices) and their collectives
synchronous, so nothing is covered and every transfer's bytes and runs are checked against
the schedule's cost formula; the reading of asynchronous pairs, GEMMs between them and
loops' trip counts is checked on a GPU-style module written here (the form XLA's GPU
compiler prints, ``tests/test_gpu_compile.py`` reads real ones where the CUDA plugin is
installed)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcoll
from jaxcoll._src import hlo

pytestmark = pytest.mark.quick   # reads compiled modules: on every supported jax


@pytest.mark.parametrize("n", [2, 4, 8])
def test_a_ring_all_reduce_moves_its_cost_formulas_bytes(n):
  """A ring all_reduce of M bytes over n devices: 2(n-1) permutes of M/n (one in a loop's
  body, run by its trip count); on the CPU each is synchronous, nothing beside it."""
  mesh = jax.make_mesh((n,), ("x",), axis_types=(jax.sharding.AxisType.Auto,),
                       devices=jax.devices()[:n])
  values = 1024 * n
  f = jax.jit(jax.shard_map(lambda v: jaxcoll.all_reduce(v, "x", algorithm="ring"),
                            mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False))
  x = jax.device_put(jnp.ones(values * n), NamedSharding(mesh, P("x")))
  found = jaxcoll.tools.overlap(f.lower(x).compile())
  assert {t.kind for t in found.transfers} == {"collective-permute"}
  assert found.nbytes == 2 * (n - 1) * values * 4 // n
  assert sum(t.runs for t in found.transfers) == 2 * (n - 1)
  assert found.covered == found.covered_by_any == found.hidden == 0.0
  assert not any(t.asynchronous for t in found.transfers)


def test_xlas_all_reduce_of_a_data_parallel_step_is_read_with_its_group():
  mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  w = jax.device_put(jnp.ones((64, 32)), NamedSharding(mesh, P()))
  x = jax.device_put(jnp.ones((128, 64)), NamedSharding(mesh, P("data")))
  step = jax.jit(lambda w, x: w - jax.grad(lambda w: jnp.mean(jnp.tanh(x @ w) ** 2))(w))
  found = jaxcoll.tools.overlap(step.lower(w, x).compile())
  (t,) = found.transfers
  assert (t.kind, t.n, t.nbytes) == ("all-reduce", 8, 64 * 32 * 4)
  link = jaxcoll.Profile.preset("h100-nvlink").link("*")
  assert t.seconds == pytest.approx(2 * 7 * (link.alpha + link.beta * t.nbytes / 8))


GPU_STYLE = """HloModule m, is_scheduled=true

%body (p: (s32[], f32[256,512])) -> (s32[], f32[256,512]) {
  %p = (s32[], f32[256,512]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %v = f32[256,512]{1,0} get-tuple-element(%p), index=1
  %cp = (f32[256,512], f32[256,512]) collective-permute-start(%v), source_target_pairs={{0,1}}
  %f = f32[256,512]{1,0} fusion(%v), kind=kLoop, calls=%add
  %cpd = f32[256,512]{1,0} collective-permute-done(%cp)
  ROOT %t = (s32[], f32[256,512]{1,0}) tuple(%i, %cpd)
}

%gemm (a: f32[128,256], b: f32[256,64]) -> f32[128,64] {
  %a = f32[128,256]{1,0} parameter(0)
  %b = f32[256,64]{1,0} parameter(1)
  ROOT %d = f32[128,64]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%add (x: f32[256,512]) -> f32[256,512] {
  %x = f32[256,512]{1,0} parameter(0)
  ROOT %y = f32[256,512]{1,0} add(%x, %x)
}

ENTRY %main (a: f32[128,256], b: f32[256,64], g: f32[1024]) -> f32[128,64] {
  %a = f32[128,256]{1,0} parameter(0)
  %b = f32[256,64]{1,0} parameter(1)
  %g = f32[1024]{0} parameter(2)
  %ars = f32[1024]{0} all-reduce-start(%g), channel_id=1, replica_groups=[2,4]<=[8], to_apply=%add
  %mm = f32[128,64]{1,0} fusion(%a, %b), kind=kCustom, calls=%gemm
  %ard = f32[1024]{0} all-reduce-done(%ars)
  %sync = f32[1024]{0} all-reduce(%ard), channel_id=3, replica_groups={{0,1}}, to_apply=%add
  %w = (s32[], f32[256,512]) while(%t0), body=%body, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %r = f32[128,64]{1,0} copy(%mm)
}
"""


def test_a_gpu_style_module_reads_pairs_gemms_and_trip_counts():
  """The module above: an asynchronous all-reduce with a GEMM (a fusion calling a dot)
  between its start and done, a synchronous one with nothing beside it, and a permute in a
  loop of 3 trips with a loop fusion beside it."""
  found = jaxcoll.tools.overlap(GPU_STYLE)
  by = {t.name: t for t in found.transfers}
  assert set(by) == {"ars", "sync", "cp"}
  ars, sync, cp = by["ars"], by["sync"], by["cp"]
  assert (ars.n, ars.nbytes, ars.asynchronous, ars.gemms, ars.kernels) == (4, 4096, True, 1, 0)
  flops = 2 * 128 * 64 * 256
  assert ars.gemm_seconds == pytest.approx(flops / jaxcoll.tools.H100_PEAK_FLOPS["f32"])
  assert (sync.n, sync.asynchronous, sync.gemms, sync.kernels) == (2, False, 0, 0)
  assert (cp.runs, cp.nbytes, cp.gemms, cp.kernels) == (3, 256 * 512 * 4, 0, 1)
  total = 4096 + 4096 + 3 * cp.nbytes
  assert found.nbytes == total
  assert found.covered == pytest.approx(4096 / total)
  assert found.covered_by_any == pytest.approx((4096 + 3 * cp.nbytes) / total)
  hidden = min(ars.seconds, ars.gemm_seconds)
  assert found.hidden == pytest.approx(
      hidden / (ars.seconds + sync.seconds + 3 * cp.seconds))
  assert "covered by GEMMs" in str(found)


def test_the_reader_refuses_what_is_no_module():
  with pytest.raises(ValueError, match="ENTRY"):
    hlo.parse("not HLO")
  assert np.isclose(hlo.nbytes("(f32[2,3]{1,0}, bf16[4])"), 24 + 8)


def test_bad_arguments_are_errors_naming_them():
  with pytest.raises(TypeError, match="compiled="):
    jaxcoll.tools.overlap(42)
  with pytest.raises(TypeError, match="peak_flops="):
    jaxcoll.tools.overlap(GPU_STYLE, peak_flops=1e15)
  with pytest.raises(ValueError, match=r"peak_flops\['f32'\]"):
    jaxcoll.tools.overlap(GPU_STYLE, peak_flops={"f32": 0})
  with pytest.raises(ValueError, match="profile"):
    jaxcoll.tools.overlap(GPU_STYLE, profile="no-such-preset")
  twice = jaxcoll.tools.overlap(GPU_STYLE, peak_flops={"f32": 2 * 494.7e12})
  once = jaxcoll.tools.overlap(GPU_STYLE)
  assert sum(t.gemm_seconds for t in twice.transfers) == pytest.approx(
      sum(t.gemm_seconds for t in once.transfers) / 2)
