"""Every program jaxcoll builds, lowered for a GPU and a TPU this machine does not have.

No accelerator has run jaxcoll's code, but JAX lowers for a platform it lacks: under
``jax.sharding.use_abstract_mesh(AbstractMesh(..., abstract_device=AbstractDevice(
device_kind="NVIDIA H200", platform="cuda")))``, ``jax.jit(f).trace(*specs).lower(
lowering_platforms=("cuda",))`` gives the StableHLO a GPU would compile. jaxcoll reads the
platform being lowered for (``compat.target_backend``), so the module is the one a GPU would
run: the Pallas kernel compiled (a Triton or Mosaic GPU custom call) rather than
interpreted, ``ragged_dot`` for MoE's grouped matmul, auto on the GPU preset.

Each case checks what the lowered module shows: the collective-permutes of a schedule and no
lax collective where a schedule runs (and the lax collective where native runs), the Pallas
custom call where the kernel should run, and no CPU-only construct (a host callback, a CPU
custom call). A case a jax version cannot lower is skipped by name with the reason
(:data:`CANNOT_LOWER`), never silently.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxcoll
from benchmarks import gpu_check
from jaxcoll import fsdp, kernels, moe
from jaxcoll._src import compat
from tests import pjit_models

pytestmark = pytest.mark.quick

H200 = ("cuda", "NVIDIA H200")
H100 = ("cuda", "NVIDIA H100 80GB HBM3")
TPU = ("tpu", "TPU v5p")
LAX_OPS = gpu_check.LAX_OPS
# (jax version, case) -> why this jax cannot lower it; anything else that fails is a bug
CANNOT_LOWER: dict[tuple[tuple[int, int], str], str] = {
    ((0, 10), "fused_combine mosaic_gpu stochastic"):
        "Mosaic GPU has no lowering for floor (NotImplementedError), which stochastic "
        "rounding's split of a value at its power of two uses",
    ((0, 10), "fused_combine mosaic_gpu block-scaled int8"):
        "Mosaic GPU copies only arrays whose strides but the last are multiples of 16 bytes, "
        "and the receive's per-row scales ([rows, 1] float32) have 4",
}


def abstract_mesh(shape, names, target=H200):
  return gpu_check.abstract_mesh(shape, names, *target)


def lower(fn, specs, mesh, case: str) -> str:
  """``fn`` on ``specs`` lowered for ``mesh``'s platform (StableHLO text), or the test
  skipped by name where this jax is known not to lower ``case``."""
  why = CANNOT_LOWER.get((compat.JAX_VERSION[:2], case))
  if why is not None:
    pytest.skip(f"jax {jax.__version__} cannot lower {case}: {why}")
  return gpu_check.lower_text(fn, specs, mesh)


def ops(text: str) -> dict:
  found = gpu_check.count_ops(text)
  assert not found["cpu_only"], "a construct only a CPU runs"
  return found


# ---- every primitive x algorithm, one axis, two axes, hierarchical; wires; rounding ----

MESHES = {"8": ((8,), ("x",)), "2x4": ((2, 4), ("node", "local"))}


def _cases():
  for mesh_name, (_, names) in MESHES.items():
    for primitive in jaxcoll.PRIMITIVES:
      for algorithm in jaxcoll.algorithms(primitive, num_axes=len(names)):
        if len(names) > 1 and algorithm != "hierarchical" and algorithm != "native":
          continue   # over two axes: the flattened schedules are the one-axis ones
        yield pytest.param(mesh_name, primitive, algorithm,
                           id=f"{primitive}-{algorithm}-{mesh_name}")


def _variants(primitive, algorithm):
  """(name, dtype, keyword arguments): plain, each wire format the primitive sends, and
  stochastic rounding for the reductions."""
  spec = jaxcoll.spec(primitive)
  out = [("plain", jnp.float32, {})]
  if algorithm != "native" and spec.wire:
    out += [(f"wire {w}", jnp.float32, {"wire_dtype": w}) for w in jaxcoll.WIRE_DTYPES]
  if spec.reduces:
    out.append(("stochastic", jnp.bfloat16, {"rounding": "stochastic"}))
  return out


@pytest.mark.parametrize("mesh_name,primitive,algorithm", list(_cases()))
def test_every_collective_lowers_for_a_gpu(mesh_name, primitive, algorithm):
  """Each algorithm of each primitive, plain, on every wire format and rounding
  stochastically, in one module: a schedule is collective-permutes with no lax collective
  and the Pallas kernel for its reduce steps; native is the lax collective."""
  shape, names = MESHES[mesh_name]
  mesh = abstract_mesh(shape, names)
  axes = names if len(names) > 1 else names[0]
  n = int(np.prod(shape))
  variants = _variants(primitive, algorithm)

  def body(xs, key):
    out = {}
    for (name, _, kw), v in zip(variants, xs):
      if name == "stochastic":
        kw = dict(kw, key=key)
      out[name] = gpu_check.collective(primitive, algorithm, axes, **kw)(v)
    return out

  spec = P(names)
  f = jax.shard_map(body, mesh=mesh, in_specs=(spec, P()), out_specs=spec, check_vma=False)
  xs = [jax.ShapeDtypeStruct((n * n * 512,), dtype) for _, dtype, _ in variants]
  with jaxcoll.config(fused_kernel=True):
    text = lower(f, (xs, jax.ShapeDtypeStruct((), jax.random.key(0).dtype)), mesh,
                 f"{primitive} {algorithm}")
  found = ops(text)
  if algorithm == "native":
    assert sum(found[op] for op in LAX_OPS) + found["collective_permute"] > 0, found
    return
  assert found["collective_permute"] > 0, found
  assert not any(found[op] for op in LAX_OPS), found
  if jaxcoll.spec(primitive).reduces and n > 1:
    assert found["pallas"] > 0, found   # the reduce steps' fused combine, compiled


# ---- the fused combine kernel ----

def _kernel_cases():
  """(name, function of (acc, bf16, codes, exponents, key), Pallas calls it makes)."""
  ops_ = ("sum", "prod", "min", "max")
  yield "every op", lambda acc, bf16, c, e, k, **kw: [
      kernels.fused_combine(x, x, op=op, **kw) for op in ops_ for x in (acc, bf16)], 8
  yield "stochastic", lambda acc, bf16, c, e, k, **kw: kernels.fused_combine(
      acc, acc, out_dtype=jnp.bfloat16, rounding="stochastic", key=k, **kw), 1
  yield "block-scaled int8", lambda acc, bf16, c, e, k, **kw: kernels.fused_combine(
      acc, c, recv_exponents=e, **kw), 1


@pytest.mark.parametrize("compiler", kernels.fused_combine.__globals__["GPU_COMPILERS"])
@pytest.mark.parametrize("case,fn,calls", list(_kernel_cases()),
                         ids=[c[0] for c in _kernel_cases()])
def test_the_fused_combine_is_a_pallas_call_for_a_gpu(compiler, case, fn, calls):
  """Every op on float32 and bfloat16, stochastic rounding to bfloat16 and a block-scaled
  int8 receive: Pallas custom calls of the back end asked for, nothing interpreted."""
  if compiler not in kernels.gpu_compilers():
    with jax.sharding.use_abstract_mesh(abstract_mesh((1,), ("x",))), \
        pytest.raises(ValueError, match="has no Mosaic GPU lowering; use 'triton'"):
      kernels.fused_combine(jnp.ones(8), jnp.ones(8), compiler=compiler)
    pytest.skip(f"jax {jax.__version__}'s pallas_call has no {compiler} lowering "
                "(kernels.gpu_compilers(); the error is checked above)")
  acc = jax.ShapeDtypeStruct((8, 1024), jnp.float32)
  specs = (acc, jax.ShapeDtypeStruct(acc.shape, jnp.bfloat16),
           jax.ShapeDtypeStruct(acc.shape, jnp.int8), jax.ShapeDtypeStruct((8, 4), jnp.int8),
           jax.ShapeDtypeStruct((), jax.random.key(0).dtype))
  text = lower(lambda *a: fn(*a, compiler=compiler), specs, abstract_mesh((1,), ("x",)),
               f"fused_combine {compiler} {case}")
  assert ops(text)["pallas"] == calls


def test_the_kernel_runs_interpreted_only_where_no_backend_compiles_it():
  """On this CPU the kernel is interpreted (no custom call); for the GPU it is compiled."""
  acc = jax.ShapeDtypeStruct((8, 1024), jnp.float32)
  here = jax.jit(lambda a: kernels.fused_combine(a, a)).trace(acc).lower().as_text()
  assert ops(here)["pallas"] == 0
  there = lower(lambda a: kernels.fused_combine(a, a), (acc,), abstract_mesh((1,), ("x",)),
                "fused_combine")
  assert ops(there)["pallas"] == 1


# ---- MoE, FSDP, use ----

def test_moe_grouped_matmul_is_ragged_dot_and_the_sorted_layout_lowers():
  mesh = abstract_mesh((8,), ("x",))
  t, d, e, k = 64, 32, 16, 2
  x = jax.ShapeDtypeStruct((8 * t, d), jnp.float32)
  logits = jax.ShapeDtypeStruct((8 * t, e), jnp.float32)
  w = jax.ShapeDtypeStruct((e, d, d), jnp.float32)

  def body(x, logits, w):
    ids, gates = moe.route(logits, k)
    h, state = moe.dispatch(x, ids, num_experts=e, capacity=None, axis_name="x",
                            layout="sorted")
    h = moe.grouped_matmul(h, w, state.group_sizes)
    return moe.combine(h, state, gates)
  f = jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P("x"), P("x")), out_specs=P("x"),
                    check_vma=False)
  text = lower(f, (x, logits, w), mesh, "moe sorted")
  ops(text)
  assert "ragged_dot" in text   # the grouped matmul a GPU runs, not the CPU's tiled loop


def test_an_fsdp_layer_lowers_as_gathers_and_reduce_scatters():
  mesh = abstract_mesh((8,), ("x",))
  w = jax.ShapeDtypeStruct((8 * 64, 64), jnp.float32)
  x = jax.ShapeDtypeStruct((8 * 16, 64), jnp.float32)

  def body(w, x):
    def loss(w):
      full = fsdp.gather(fsdp.Sharded(w, (8 * 64, 64), 0), "x", algorithm="ring")
      return jnp.sum((x @ full.T) ** 2)
    return jax.grad(loss)(w)
  f = jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P("x")), out_specs=P("x"),
                    check_vma=False)
  text = lower(f, (w, x), mesh, "fsdp layer")
  found = ops(text)
  assert found["collective_permute"] > 0 and not any(found[op] for op in LAX_OPS), found


@pytest.mark.parametrize("target", [H200, H100], ids=["H200", "H100"])
def test_use_on_a_pjit_model_lowers_with_jaxcoll_s_collectives(target):
  """The distributed-arrays notebook's MLP step under ``use(algorithm="ring")``: the
  partitioner's collectives become jaxcoll's collective-permutes."""
  mesh = abstract_mesh((8,), ("x",), target)
  params = jax.eval_shape(lambda: pjit_models.init_model(jax.random.key(0), [16, 32, 8], 64)[0])
  batch = (jax.ShapeDtypeStruct((64, 16), jnp.float32),
           jax.ShapeDtypeStruct((64, 8), jnp.float32))
  step = jaxcoll.use(pjit_models.notebook_step, algorithm="ring",
                     in_shardings=(jax.tree.map(lambda _: P(), params), (P("x"), P("x"))))
  text = lower(step, (params, batch), mesh, "use notebook")
  found = ops(text)
  assert found["collective_permute"] > 0 and not any(found[op] for op in LAX_OPS), found


# ---- auto on a GPU ----

@pytest.mark.parametrize("primitive", ["all_reduce", "all_gather", "reduce_scatter"])
def test_auto_keeps_the_lax_collective_on_a_gpu_it_has_no_measurements_for(primitive):
  """On uncalibrated data-sheet figures (the GPU preset), auto never leaves NCCL: the
  lowered module holds the lax collective and no collective-permute."""
  mesh = abstract_mesh((8,), ("x",))
  f = jax.shard_map(gpu_check.collective(primitive, "auto", "x"), mesh=mesh, in_specs=P("x"),
                    out_specs=P("x"), check_vma=False)
  text = lower(f, (jax.ShapeDtypeStruct((8 << 20,), jnp.float32),), mesh, f"auto {primitive}")
  found = ops(text)
  assert found["collective_permute"] == 0 and found[primitive] == 1, found


# ---- a TPU ----

@pytest.mark.parametrize("algorithm", ["ring", "native"])
def test_an_all_reduce_lowers_for_a_tpu(algorithm):
  mesh = abstract_mesh((8,), ("x",), TPU)
  f = jax.shard_map(lambda v: jaxcoll.all_reduce(v, "x", algorithm=algorithm), mesh=mesh,
                    in_specs=P("x"), out_specs=P("x"), check_vma=False)
  text = lower(f, (jax.ShapeDtypeStruct((8 * 4096,), jnp.float32),), mesh,
               f"tpu all_reduce {algorithm}")
  found = ops(text)
  if algorithm == "native":
    assert found["all_reduce"] == 1, found
  else:
    assert found["collective_permute"] > 0 and found["all_reduce"] == 0, found


def test_the_fused_combine_lowers_as_a_mosaic_tpu_kernel_for_a_tpu():
  acc = jax.ShapeDtypeStruct((8, 1024), jnp.float32)
  text = lower(lambda a: kernels.fused_combine(a, a), (acc,), abstract_mesh((1,), ("x",), TPU),
               "tpu fused_combine")
  assert ops(text).get("tpu_custom_call", 0) == 1, ops(text)
