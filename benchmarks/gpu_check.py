"""First evidence on a GPU: what jaxcoll runs on one device, compiled, checked and timed.

  python benchmarks/gpu_check.py                  # on a machine with one GPU: ~8 minutes
  python benchmarks/gpu_check.py --dry-run        # every stage on the CPU, small sizes (CI)
  python benchmarks/gpu_check.py --lower-only     # any machine: what a GPU would compile
  python benchmarks/gpu_check.py --compile-only   # any machine with jax-cuda12-plugin:
                                                  # compiled for 1x8 and 2x8 H100s

Writes ``<out>.json`` and ``<out>.md`` (default ``benchmarks/out/gpu_check``). Each stage runs
in a process of its own with a timeout of its own, so a stage that fails, hangs or crashes is
reported and the next still runs:

1. ``env``: jax/jaxlib versions, the device's kind and memory.
2. ``kernel``: the Pallas fused combine (``jaxcoll.kernels.fused_combine``) compiled with
   each GPU back end this jax has (Triton; Mosaic GPU) equals ``fused_combine_reference``
   bit for bit: every op, float32/bfloat16/float16/int32, odd lengths, an int8 block-scaled
   chunk, stochastic rounding to bfloat16 and float16 with a fixed key. A back end that
   fails to compile is recorded with its error.
3. ``bandwidth``: the kernel (in place, in a loop) against the same math in jax.numpy and
   against a plain copy, 1 MiB to 1 GiB: bytes moved (2 reads and 1 write of the chunk; the
   kernel docs' bound is 3 * bytes / HBM rate) over the median time, as a fraction of the
   copy's measured peak and of the data-sheet rate (``--hbm``, H200: 4.8 TB/s).
4. ``wire``: encode and decode bandwidth of every wire format (bytes of float32 in / time).
5. ``programs``: every collective with every algorithm on a 1-device mesh equals lax; and
   the trace, lowering and compile time and HLO size of a ring all_reduce for N = 8, 64,
   512 on an ``AbstractMesh`` (lowered where this jax can without devices): the program
   stays the same size as N grows (the executor loops over a ring's steps).
6. ``calibrate``: what ``benchmarks/calibrate_gpu.py`` measures needs 2 devices or more;
   on one it records that, and times a 1-device jaxcoll all_reduce against ``lax.psum``
   (the per-call overhead of a jaxcoll program when nothing moves).

7. ``lowering``: jaxcoll's programs lowered for an H200 (``--platform`` and ``--device-kind``
   name another) without one: every primitive x algorithm over 8 devices, hierarchical over
   2 x 4, the ring all_reduce on every wire format and rounding stochastically, the fused
   combine with each Pallas GPU back end, MoE's sorted layout with ``ragged_dot``, an FSDP
   layer's gradient, ``jaxcoll.use`` on the distributed-arrays notebook's MLP, and auto on
   the GPU preset. Per case: the collective-permutes, the lax collectives and the Pallas
   custom calls of the module.

8. ``compile``: jaxcoll's programs and training steps compiled by XLA's whole GPU pipeline
   for compile-only H100s, one host of 8 and two of 8 (``benchmarks/gpu_compile.py``): per
   program the scheduled module's collectives, memory per device and what each transfer
   runs beside (``jaxcoll.tools.overlap``). Needs ``jax-cuda12-plugin`` of jax's version;
   without it the stage says so and is skipped.

``--dry-run`` runs the same stages in interpret mode on the CPU at small sizes, so the
script cannot rot (``tests/test_gpu_check.py``). ``--lower-only`` runs ``env`` and
``lowering`` alone, on any machine; ``--compile-only`` ``env`` and ``compile``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
STAGES = ("env", "kernel", "bandwidth", "wire", "programs", "calibrate", "lowering",
          "compile")
TIMEOUT_S = {"env": 120, "kernel": 150, "bandwidth": 120, "wire": 60, "programs": 120,
             "calibrate": 60, "lowering": 240, "compile": 900}
LAX_OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
OPS = ("sum", "prod", "min", "max", "mean")


def median_seconds(fn, *args, reps: int) -> float:
  import jax
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(reps):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


# ------------------------------------------------------------------ the stages

def stage_env(dry: bool) -> dict:
  import jax
  import jaxlib
  device = jax.devices()[0]
  stats = device.memory_stats() or {}
  return {"jax": jax.__version__, "jaxlib": jaxlib.__version__, "backend": jax.default_backend(),
          "device_kind": device.device_kind, "devices": jax.device_count(),
          "memory_bytes": stats.get("bytes_limit"), "dry_run": dry}


def _compilers(dry: bool) -> list[str | None]:
  """The GPU back ends to try (``jaxcoll.kernels.gpu_compilers()``: those this jax lowers);
  on the CPU (dry run) the interpreter only."""
  if dry:
    return [None]
  from jaxcoll import kernels
  return list(kernels.gpu_compilers())


def stage_kernel(dry: bool) -> dict:
  import jax
  import jax.numpy as jnp
  import ml_dtypes
  import numpy as np

  import jaxcoll
  from jaxcoll import kernels
  rng = np.random.default_rng(0)
  lengths = (1, 1000, 70001) + (() if dry else (1 << 20,))
  results = {}
  for compiler in _compilers(dry):
    name = compiler or "interpret"
    kw = {"interpret": True} if compiler is None else {"interpret": False, "compiler": compiler}
    cases = failed = 0
    try:
      for dtype in (np.float32, ml_dtypes.bfloat16, np.float16, np.int32):
        for n in lengths:
          a = (rng.standard_normal(n) * 100).astype(dtype)
          b = (rng.standard_normal(n) * 100).astype(dtype)
          for op in OPS:
            got = kernels.fused_combine(a, b, op=op, **kw)
            want = kernels.fused_combine_reference(a, b, op=op)
            cases += 1
            failed += not np.array_equal(np.asarray(got).view(np.uint8),
                                         np.asarray(want).view(np.uint8))
      fmt = jaxcoll.WireFormat("int8")
      acc = jnp.asarray(rng.standard_normal((64, 4096)), jnp.float32)
      values, exps = fmt.encode(jnp.asarray(rng.standard_normal((64, 4096)), jnp.float32))
      got = kernels.fused_combine(acc, values, recv_exponents=exps, **kw)
      cases += 1
      failed += not np.array_equal(np.asarray(got), np.asarray(acc + fmt.decode(values, exps)))
      for out_dtype in (jnp.bfloat16, jnp.float16):
        key = jax.random.key(0)
        got = kernels.fused_combine(acc, acc, out_dtype=out_dtype, rounding="stochastic",
                                    key=key, **kw)
        want = kernels.fused_combine_reference(acc, acc, out_dtype=out_dtype,
                                               rounding="stochastic", key=key)
        cases += 1
        failed += not np.array_equal(np.asarray(got).view(np.uint16),
                                     np.asarray(want).view(np.uint16))
      results[name] = {"compiled": compiler is not None, "cases": cases, "differ": failed}
    except Exception as e:   # noqa: BLE001 (a back end that does not compile is a finding)
      results[name] = {"compiled": False, "cases": cases, "differ": failed,
                       "error": f"{type(e).__name__}: {str(e)[:2000]}"}
  return {"compilers": results}


def _copy_peak(n_bytes: int, reps: int) -> float:
  """Bytes per second of the device's best plain copy (read + write) at this size."""
  import jax
  import jax.numpy as jnp
  x = jnp.ones((n_bytes // 4,), jnp.float32)
  copy = jax.jit(lambda v: v + 0.0)   # XLA: one fused read and write
  return 2 * n_bytes / median_seconds(copy, x, reps=reps)


def stage_bandwidth(dry: bool, hbm: float) -> dict:
  import jax
  import jax.numpy as jnp

  from jaxcoll import kernels
  loop = 2 if dry else 10
  reps = 2 if dry else 10
  sizes_mib = (1, 4) if dry else (1, 4, 16, 64, 256, 1024)
  rows = []
  for mib in sizes_mib:
    peak = _copy_peak(mib << 20, reps)
    for dtype in (jnp.float32, jnp.bfloat16):
      n = (mib << 20) // jnp.dtype(dtype).itemsize
      acc, recv = jnp.ones((n,), dtype), jnp.full((n,), 0.5, dtype)
      fused = jax.jit(lambda a, r: jax.lax.fori_loop(
          0, loop, lambda i, a: kernels.fused_combine(a, r), a), donate_argnums=0)
      plain = jax.jit(lambda a, r: jax.lax.fori_loop(
          0, loop, lambda i, a: kernels.fused_combine_reference(a, r), a))
      moved = 3 * (mib << 20) * loop
      held = [jnp.ones((n,), dtype)]   # each call donates the last one's result: in place

      def in_place(r, fused=fused, held=held):
        held[0] = fused(held[0], r)
        return held[0]
      t_kernel = median_seconds(in_place, recv, reps=reps)
      t_plain = median_seconds(plain, acc, recv, reps=reps)
      rows.append({"mib": mib, "dtype": jnp.dtype(dtype).name,
                   "kernel_gbs": moved / t_kernel / 1e9, "jnp_gbs": moved / t_plain / 1e9,
                   "copy_peak_gbs": peak / 1e9, "datasheet_gbs": hbm})
  return {"rows": rows, "loop": loop}


def stage_wire(dry: bool) -> dict:
  import jax
  import jax.numpy as jnp

  import jaxcoll
  reps = 2 if dry else 10
  rows_n = 64 if dry else 4096
  rows = []
  for name in jaxcoll.WIRE_DTYPES:
    fmt = jaxcoll.WireFormat(name)
    x = jax.random.normal(jax.random.key(1), (rows_n, 4096), jnp.float32)
    encode = jax.jit(fmt.encode)
    values, exps = encode(x)
    decode = jax.jit(fmt.decode)
    t_enc = median_seconds(encode, x, reps=reps)
    t_dec = median_seconds(decode, values, exps, reps=reps)
    err = float(jnp.max(jnp.abs(decode(values, exps) - x)) / jnp.max(jnp.abs(x)))
    rows.append({"format": name, "mib": x.nbytes / 2**20, "encode_gbs": x.nbytes / t_enc / 1e9,
                 "decode_gbs": x.nbytes / t_dec / 1e9, "max_error": err,
                 "bound": fmt.relative_error})
  return {"rows": rows}


def stage_programs(dry: bool) -> dict:
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax import lax
  from jax.sharding import PartitionSpec as P

  import jaxcoll
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
  x = jnp.arange(4 * 6, dtype=jnp.float32).reshape(1, 24)
  lax_of = {"all_reduce": lambda v: lax.psum(v, "x"),
            "reduce_scatter": lambda v: lax.psum_scatter(v, "x", tiled=True),
            "all_gather": lambda v: lax.all_gather(v, "x", tiled=True),
            "all_to_all": lambda v: lax.all_to_all(v, "x", 0, 0, tiled=True),
            "broadcast": lambda v: lax.psum(v, "x"), "reduce": lambda v: lax.psum(v, "x"),
            "shift": lambda v: lax.ppermute(v, "x", [(0, 0)])}
  checked = []
  for primitive, want_fn in lax_of.items():
    for algorithm in jaxcoll.algorithms(primitive, num_axes=1):
      def ours(v, p=primitive, a=algorithm):
        return jaxcoll.tools.flat_call(p, v, "x", a)
      run = lambda f: np.asarray(jax.jit(jax.shard_map(   # noqa: E731
          lambda v: f(v[0])[None], mesh=mesh, in_specs=P("x"), out_specs=P("x"),
          check_vma=False))(x))
      same = bool(np.array_equal(run(ours), run(want_fn)))
      checked.append({"primitive": primitive, "algorithm": algorithm, "equal": same})
  growth = []
  for n in (8, 64, 512):
    abstract = jax.sharding.AbstractMesh((n,), ("x",))
    f = jax.jit(jax.shard_map(lambda v: jaxcoll.all_reduce(v, "x", algorithm="ring"),
                              mesh=abstract, in_specs=P("x"), out_specs=P("x")))
    arg = jax.ShapeDtypeStruct((n * 1024,), jnp.float32,
                               sharding=jax.sharding.NamedSharding(abstract, P("x")))
    start = time.perf_counter()
    traced = f.trace(arg)
    t_trace = time.perf_counter() - start
    row = {"n": n, "trace_s": t_trace, "jaxpr_chars": len(str(traced.jaxpr))}
    try:   # no devices of N: lowered for this platform by name
      start = time.perf_counter()
      lowered = traced.lower(lowering_platforms=(jax.default_backend(),))
      row["lower_s"] = time.perf_counter() - start
      row["hlo_chars"] = len(lowered.as_text())
    except Exception as e:   # noqa: BLE001 (recorded: a version that cannot lower abstractly)
      row["lower_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    growth.append(row)
  return {"collectives": checked, "growth": growth}


def stage_calibrate(dry: bool) -> dict:
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax import lax
  from jax.sharding import PartitionSpec as P

  import jaxcoll
  out = {"devices": jax.device_count()}
  if jax.device_count() < 2:
    out["calibrate"] = ("not run: a collective over one device sends nothing; "
                        "benchmarks/calibrate_gpu.py needs 2 devices or more")
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
  x = jnp.ones((1, (64 << 10) if dry else (4 << 20)), jnp.float32)
  progs = {name: jax.jit(jax.shard_map(lambda v, f=f: f(v), mesh=mesh, in_specs=P("x"),
                                       out_specs=P("x"), check_vma=False))
           for name, f in (("lax.psum", lambda v: lax.psum(v, "x")),
                           ("jaxcoll ring", lambda v: jaxcoll.all_reduce(v, "x",
                                                                         algorithm="ring")))}
  times = jaxcoll.tools.interleaved([lambda p=p: p(x).block_until_ready()
                                     for p in progs.values()], reps=3 if dry else 20)
  out["one_device_all_reduce_s"] = {name: statistics.median(t)
                                    for name, t in zip(progs, times)}
  return out


# ------------------------------------------------------------------ lowering without the device

def abstract_mesh(shape, names, platform: str = "cuda", device_kind: str = "NVIDIA H200"):
  """An abstract mesh of devices of ``device_kind`` on ``platform``, none of which need
  exist: programs traced under it are lowered as that platform compiles them."""
  import jax
  from jax.sharding import AbstractDevice, AbstractMesh
  return AbstractMesh(tuple(shape), tuple(names),
                      axis_types=(jax.sharding.AxisType.Auto,) * len(names),
                      abstract_device=AbstractDevice(device_kind=device_kind, num_cores=None,
                                                     platform=platform))


def lower_text(fn, specs, mesh) -> str:
  """``fn`` on ``specs`` (``ShapeDtypeStruct`` s) lowered for ``mesh``'s platform: StableHLO."""
  import jax
  with jax.sharding.use_abstract_mesh(mesh):
    return jax.jit(fn).trace(*specs).lower(
        lowering_platforms=(mesh.abstract_device.platform,)).as_text()


def count_ops(text: str) -> dict:
  """The module's collective-permutes, lax collectives and custom calls (by target), and
  whether it holds a construct only a CPU runs (a host callback)."""
  import re
  out = {op: len(re.findall(rf"stablehlo\.{op}\b", text))
         for op in ("collective_permute", *LAX_OPS)}
  for target in re.findall(r'stablehlo\.custom_call @([\w$.]+)|call_target_name = "([\w$.]+)"',
                           text):
    name = target[0] or target[1]
    out[name] = out.get(name, 0) + 1
  out["pallas"] = sum(n for k, n in out.items() if "triton" in k or "mosaic" in k)
  out["cpu_only"] = bool(re.search(r"cpu_callback|python_cpu", text))
  return out


def collective(primitive: str, algorithm, axes, **kw):
  """``primitive`` over ``axes`` as a function of one array (tiled, split and concatenated
  along dimension 0 where it splits)."""
  import jaxcoll
  fn = getattr(jaxcoll, primitive)
  if primitive == "all_to_all":
    return lambda v: fn(v, axes, 0, 0, tiled=True, algorithm=algorithm, **kw)
  if primitive in ("reduce_scatter", "all_gather"):
    return lambda v: fn(v, axes, tiled=True, algorithm=algorithm, **kw)
  return lambda v: fn(v, axes, algorithm=algorithm, **kw)


def lowering_cases(platform: str, device_kind: str):
  """``(name, fn, specs, mesh)`` of what :func:`stage_lowering` lowers."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import PartitionSpec as P

  import jaxcoll
  from jaxcoll import fsdp, kernels, moe
  mesh8 = abstract_mesh((8,), ("x",), platform, device_kind)
  mesh24 = abstract_mesh((2, 4), ("node", "local"), platform, device_kind)
  key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype)

  def on(mesh, body, *specs, in_specs=None):
    names = tuple(mesh.axis_names)
    spec = P(names if len(names) > 1 else names[0])
    return jax.shard_map(body, mesh=mesh, in_specs=in_specs or (spec,) * len(specs),
                         out_specs=spec, check_vma=False), specs, mesh

  x8 = jax.ShapeDtypeStruct((8 * 8 << 16,), jnp.float32)   # 2 MiB a device: the kernel runs
  for primitive in jaxcoll.PRIMITIVES:
    for algorithm in jaxcoll.algorithms(primitive, num_axes=1):
      yield (f"{primitive} {algorithm}", *on(mesh8, collective(primitive, algorithm, "x"), x8))
  for primitive in jaxcoll.PRIMITIVES:
    if "hierarchical" in jaxcoll.algorithms(primitive, num_axes=2):
      yield (f"{primitive} hierarchical 2x4",
             *on(mesh24, collective(primitive, "hierarchical", ("node", "local")), x8))
  for wire in jaxcoll.wire_dtypes():
    yield (f"all_reduce ring wire {wire}",
           *on(mesh8, collective("all_reduce", "ring", "x", wire_dtype=wire), x8))
  bf16 = jax.ShapeDtypeStruct(x8.shape, jnp.bfloat16)
  yield ("all_reduce ring stochastic", *on(
      mesh8, lambda v, k: jaxcoll.all_reduce(v, "x", algorithm="ring", rounding="stochastic",
                                             key=k), bf16, key, in_specs=(P("x"), P())))
  acc = jax.ShapeDtypeStruct((8, 4096), jnp.float32)
  mesh1 = abstract_mesh((1,), ("x",), platform, device_kind)
  for compiler in _compilers(False) if platform == "cuda" else [None]:
    yield (f"fused_combine {compiler or 'default'}",
           lambda a, c=compiler: kernels.fused_combine(a, a, compiler=c), (acc,), mesh1)
  yield ("fused_combine stochastic", lambda a, k: kernels.fused_combine(
      a, a, out_dtype=jnp.bfloat16, rounding="stochastic", key=k), (acc, key), mesh1)
  t, d, e = 64, 32, 16

  def sorted_moe(x, logits, w):
    ids, gates = moe.route(logits, 2)
    h, state = moe.dispatch(x, ids, num_experts=e, capacity=None, axis_name="x",
                            layout="sorted")
    return moe.combine(moe.grouped_matmul(h, w, state.group_sizes), state, gates)
  yield ("moe sorted + grouped_matmul", *on(
      mesh8, sorted_moe, jax.ShapeDtypeStruct((8 * t, d), jnp.float32),
      jax.ShapeDtypeStruct((8 * t, e), jnp.float32), jax.ShapeDtypeStruct((e, d, d), jnp.float32)))

  def fsdp_layer(w, x):
    def loss(w):
      full = fsdp.gather(fsdp.Sharded(w, (8 * 64, 64), 0), "x", algorithm="ring")
      return jnp.sum((x @ full.T) ** 2)
    return jax.grad(loss)(w)
  yield ("fsdp layer gradient", *on(mesh8, fsdp_layer,
                                    jax.ShapeDtypeStruct((8 * 64, 64), jnp.float32),
                                    jax.ShapeDtypeStruct((8 * 16, 64), jnp.float32)))
  yield ("auto all_reduce (GPU preset)", *on(mesh8, collective("all_reduce", "auto", "x"),
                                             jax.ShapeDtypeStruct((8 << 20,), jnp.float32)))


def stage_lowering(dry: bool, platform: str = "cuda", device_kind: str = "NVIDIA H200") -> dict:
  import jax
  rows = []
  for name, fn, specs, mesh in lowering_cases(platform, device_kind):
    start = time.perf_counter()
    try:
      found = count_ops(lower_text(fn, specs, mesh))
      rows.append({"case": name, "ok": True, "seconds": time.perf_counter() - start, **found})
    except Exception as e:   # noqa: BLE001 (a case this jax cannot lower is a finding)
      rows.append({"case": name, "ok": False, "error": f"{type(e).__name__}: {str(e)[:500]}"})
  return {"platform": platform, "device_kind": device_kind, "jax": jax.__version__,
          "rows": rows}


def run_stage(name: str, dry: bool, hbm: float) -> dict:
  import gpu_compile
  fn = {"env": stage_env, "kernel": stage_kernel, "bandwidth": stage_bandwidth,
        "wire": stage_wire, "programs": stage_programs, "calibrate": stage_calibrate,
        "lowering": stage_lowering, "compile": gpu_compile.stage_compile}[name]
  return fn(dry, hbm) if name == "bandwidth" else fn(dry)


# ------------------------------------------------------------------ driver and report

def run_all(dry: bool, hbm: float, stages=STAGES, timeouts=None) -> dict:
  """Each of ``stages`` in a process of its own, killed after its timeout (``timeouts``
  overrides :data:`TIMEOUT_S`); ``{stage: {"status", "seconds", ...}}``."""
  results = {}
  env = dict(os.environ)
  if dry:
    env.setdefault("JAX_PLATFORMS", "cpu")
  timeouts = {**TIMEOUT_S, **(timeouts or {})}
  for name in stages:
    with tempfile.NamedTemporaryFile("r", suffix=".json") as out:
      cmd = [sys.executable, os.path.abspath(__file__), "--stage", name, "--result", out.name,
             "--hbm", str(hbm)] + (["--dry-run"] if dry else [])
      start = time.perf_counter()
      try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeouts[name],
                              env=dict(env, JAX_PLATFORMS="cpu") if name == "compile" else env)
        body = out.read()
        result = json.loads(body) if body else {}
        if done.returncode != 0:   # the stage's own traceback, else what it printed
          result = {"error": (done.stderr or done.stdout)[-3000:], **result, "status": "error"}
      except subprocess.TimeoutExpired:
        result = {"status": "timeout"}
      result.setdefault("status", "ok")
      result["seconds"] = time.perf_counter() - start
      results[name] = result
      print(f"{name}: {result['status']} ({result['seconds']:.1f} s)", flush=True)
  return results


def markdown(results: dict) -> str:
  """The report: a line per stage, then a table for each stage's figures."""
  env = results.get("env", {})
  lines = [f"# gpu_check: {env.get('device_kind', '?')}, jax {env.get('jax', '?')}, "
           f"{'dry run on the CPU' if env.get('dry_run') else 'compiled'}", "",
           "| stage | status | seconds |", "|---|---|---:|"]
  lines += [f"| {name} | {r['status']} | {r['seconds']:.1f} |" for name, r in results.items()]
  kernel = results.get("kernel", {}).get("compilers", {})
  if kernel:
    lines += ["", "| fused combine back end | compiled | cases | differ from reference | error |",
              "|---|---|---:|---:|---|"]
    lines += [f"| {name} | {r['compiled']} | {r['cases']} | {r['differ']} | "
              f"{r.get('error', '').splitlines()[0] if r.get('error') else ''} |"
              for name, r in kernel.items()]
  bandwidth = results.get("bandwidth", {}).get("rows", [])
  if bandwidth:
    lines += ["", "| chunk | dtype | kernel GB/s | of copy peak | of data sheet | jnp GB/s | "
              "kernel / jnp | copy peak GB/s |", "|---:|---|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['mib']} MiB | {r['dtype']} | {r['kernel_gbs']:.1f} | "
              f"{r['kernel_gbs'] / r['copy_peak_gbs']:.0%} | "
              f"{r['kernel_gbs'] / r['datasheet_gbs']:.0%} | {r['jnp_gbs']:.1f} | "
              f"{r['kernel_gbs'] / r['jnp_gbs']:.2f} | {r['copy_peak_gbs']:.1f} |"
              for r in bandwidth]
  wire = results.get("wire", {}).get("rows", [])
  if wire:
    lines += ["", "| wire format | encode GB/s | decode GB/s | max error / max | bound |",
              "|---|---:|---:|---:|---:|"]
    lines += [f"| {r['format']} | {r['encode_gbs']:.1f} | {r['decode_gbs']:.1f} | "
              f"{r['max_error']:.2e} | {r['bound']:.2e} |" for r in wire]
  programs = results.get("programs", {})
  if programs.get("collectives"):
    equal = sum(c["equal"] for c in programs["collectives"])
    lines += ["", f"1-device mesh: {equal} of {len(programs['collectives'])} (collective, "
              "algorithm) programs equal lax.", "",
              "| N | trace s | jaxpr characters | lower s | HLO characters |",
              "|---:|---:|---:|---:|---:|"]
    lines += [f"| {g['n']} | {g['trace_s']:.3f} | {g['jaxpr_chars']} | "
              f"{g.get('lower_s', float('nan')):.3f} | {g.get('hlo_chars', '-')} |"
              for g in programs["growth"]]
    sized = [g for g in programs["growth"] if "hlo_chars" in g]
    if len(sized) >= 2:   # the exponent k of HLO size ~ N^k between the two largest N
      (a, b) = sized[-2:]
      k = math.log(b["hlo_chars"] / a["hlo_chars"]) / math.log(b["n"] / a["n"])
      lines += ["", f"HLO size grows as N^{k:.2f} from N={a['n']} to {b['n']} "
                f"({'flat' if k < 0.2 else 'not flat'})."]
  calibrate = results.get("calibrate", {})
  if calibrate.get("one_device_all_reduce_s"):
    lines += ["", f"calibrate: {calibrate.get('calibrate', 'run')}", "",
              "| 1-device all_reduce | median |", "|---|---:|"]
    lines += [f"| {k} | {v * 1e6:.0f} us |"
              for k, v in calibrate["one_device_all_reduce_s"].items()]
  lowering = results.get("lowering", {})
  if lowering.get("rows"):
    lines += ["", f"Lowered for {lowering['device_kind']} ({lowering['platform']}) with jax "
              f"{lowering['jax']}, no such device present:", "",
              "| program | lowered | collective-permutes | lax collectives | Pallas calls | "
              "CPU-only |", "|---|---|---:|---:|---:|---|"]
    for r in lowering["rows"]:
      if r["ok"]:
        lax_n = sum(r[op] for op in LAX_OPS)
        lines.append(f"| {r['case']} | yes | {r['collective_permute']} | {lax_n} | "
                     f"{r['pallas']} | {'yes' if r['cpu_only'] else 'no'} |")
      else:
        lines.append(f"| {r['case']} | no: {r['error'].splitlines()[0][:120]} | | | | |")
  if "compile" in results and "rows" in results["compile"] or \
      results.get("compile", {}).get("status") == "skipped":
    import gpu_compile
    lines += gpu_compile.markdown(results["compile"])
  for name, r in results.items():
    if r["status"] not in ("ok", "skipped"):
      lines += ["", f"## {name}: {r['status']}", "", "```", r.get("error", "")[-1500:], "```"]
  return "\n".join(lines) + "\n"


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--dry-run", action="store_true",
                      help="every stage on the CPU, interpreted, at small sizes")
  parser.add_argument("--out", default=os.path.join(HERE, "out", "gpu_check"),
                      help="writes OUT.json and OUT.md")
  parser.add_argument("--hbm", type=float, default=4800.0, help="data-sheet HBM GB/s (H200)")
  parser.add_argument("--stages", default=",".join(STAGES),
                      help=f"comma-separated, of {', '.join(STAGES)}")
  parser.add_argument("--timeout", action="append", default=[], metavar="STAGE=SECONDS",
                      help="a stage's timeout (default: " +
                      ", ".join(f"{k} {v} s" for k, v in TIMEOUT_S.items()) + ")")
  parser.add_argument("--lower-only", action="store_true",
                      help="env and lowering alone: what a GPU would compile, on any machine")
  parser.add_argument("--compile-only", action="store_true",
                      help="env and compile alone: compiled for H100s without one "
                      "(needs jax-cuda12-plugin)")
  parser.add_argument("--stage", choices=STAGES, help=argparse.SUPPRESS)
  parser.add_argument("--result", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.stage:   # one stage, in its own process
    try:
      result = run_stage(args.stage, args.dry_run, args.hbm)
    except Exception:   # noqa: BLE001 (recorded, with what was measured, for the report)
      with open(args.result, "w") as f:
        json.dump({"status": "error", "error": traceback.format_exc()[-3000:]}, f)
      return 1
    with open(args.result, "w") as f:
      json.dump(result, f)
    return 0
  stages = ("env", "lowering") if args.lower_only else ("env", "compile") \
      if args.compile_only else tuple(args.stages.split(","))
  for name in stages:
    if name not in STAGES:
      parser.error(f"--stages: {name!r} is not one of {STAGES}")
  timeouts = {}
  for item in args.timeout:
    name, _, seconds = item.partition("=")
    if name not in STAGES or not seconds.replace(".", "", 1).isdigit():
      parser.error(f"--timeout {item!r}: expected STAGE=SECONDS with STAGE one of {STAGES}")
    timeouts[name] = float(seconds)
  results = run_all(args.dry_run, args.hbm, stages, timeouts)
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out + ".json", "w") as f:
    json.dump(results, f, indent=1)
  with open(args.out + ".md", "w") as f:
    f.write(markdown(results))
  print(f"wrote {args.out}.json and {args.out}.md")
  return 0 if all(r["status"] in ("ok", "skipped") for r in results.values()) else 1


if __name__ == "__main__":
  raise SystemExit(main())
