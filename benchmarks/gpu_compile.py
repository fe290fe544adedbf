"""jaxcoll compiled for GPU clusters this machine is not: XLA's whole GPU pipeline (the
latency-hiding scheduler included) on compile-only H100s, no GPU needed.

  python benchmarks/gpu_check.py --compile-only      # writes benchmarks/out/gpu_check.md

``jax.experimental.topologies.get_topology_desc(platform="cuda", target_config=<spec>,
topology="1x1x8")`` gives 8 H100s of one host (``"1x2x8"``: two hosts of 8) from the device
description in ``benchmarks/targets/h100_sxm.txtpb`` (openxla/xla's, see its README); it
needs ``jax-cuda12-plugin`` of the installed jax's version (``pip install
"jax-cuda12-plugin==<jax version>" "jax-cuda12-pjrt==<jax version>" nvidia-cuda-nvcc-cu12
nvidia-nvjitlink-cu12``, or ``jax[cuda12]``) and ``JAX_PLATFORMS=cpu``. Without one it says
so and compiles nothing.

Per program, on each topology: compiled or the error; compile seconds; the scheduled
module's collectives by kind; memory per device (``memory_analysis()``: arguments, outputs,
temporaries); and what each transfer runs beside (:func:`jaxcoll.tools.overlap`: bytes
covered by GEMMs, and the estimated hidden time). Programs: every primitive x algorithm
over one axis, hierarchical over two, the ring all_reduce on every wire format (the fused
combine in its reduce steps), and training steps under plain ``jax.jit``, under
``jaxcoll.use(algorithm="ring")`` and ``use(wire_dtype="int8")``, ``sync_in_backward``,
``fsdp.layer`` and ``fsdp.layers(prefetch=1)``: a data-parallel MLP, a Megatron data x model
MLP, an FSDP MLP (the FSDP rows also with XLA's overlap limit at 2, "overlap_limit=2").
"""

from __future__ import annotations

import os
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TARGET = os.path.join(HERE, "targets", "h100_sxm.txtpb")
TOPOLOGIES = {"1x8": ("1x1x8", 8), "2x8": ("1x2x8", 16)}
LAYERS, WIDTH, ROWS = 8, 2048, 1024   # the MLP: ROWS batch rows per device


def available() -> str | None:
  """Why nothing can compile for a GPU here (None: it can): no CUDA plugin, or one of
  another version than jax's."""
  import jax
  try:
    import jax_plugins.xla_cuda12 as plugin  # noqa: F401
  except ImportError:
    return (f"no jax-cuda12-plugin for jax {jax.__version__} installed (pip install "
            f"jax-cuda12-plugin=={jax.__version__} jax-cuda12-pjrt=={jax.__version__} "
            "nvidia-cuda-nvcc-cu12 nvidia-nvjitlink-cu12)")
  from importlib.metadata import PackageNotFoundError, version
  try:
    found = version("jax-cuda12-plugin")
  except PackageNotFoundError:
    found = "?"
  if found != jax.__version__:
    return f"jax-cuda12-plugin {found} does not match jax {jax.__version__}"
  return None


def topology_mesh(topology: str, shape, names):
  """A mesh of compile-only H100s (``topology``: "1x1x8", "1x2x8")."""
  from jax.experimental import topologies
  with open(TARGET) as f:
    topo = topologies.get_topology_desc(platform="cuda", target_config=f.read(),
                                        topology=topology)
  return topologies.make_mesh(topo, tuple(shape), tuple(names))


def _typed(mesh, shape, spec, dtype=None):
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding
  return jax.ShapeDtypeStruct(shape, dtype or jnp.float32, sharding=NamedSharding(mesh, spec))


def collective_cases(mesh, two_level):
  """``(name, fn, args)``: every primitive x algorithm over one axis, hierarchical over
  two, the ring all_reduce on every wire format: 2 MiB a device."""
  import jax
  from gpu_check import collective
  from jax.sharding import PartitionSpec as P

  import jaxcoll

  def on(m, body):
    names = tuple(m.axis_names)
    spec = P(names if len(names) > 1 else names[0])
    return jax.jit(jax.shard_map(body, mesh=m, in_specs=spec, out_specs=spec,
                                 check_vma=False)), (_typed(m, (m.size << 19,), spec),)

  for primitive in jaxcoll.PRIMITIVES:
    for algorithm in jaxcoll.algorithms(primitive, num_axes=1):
      yield (f"{primitive} {algorithm}", *on(mesh, collective(primitive, algorithm, "x")))
  for primitive in jaxcoll.PRIMITIVES:
    if "hierarchical" in jaxcoll.algorithms(primitive, num_axes=2):
      yield (f"{primitive} hierarchical", *on(two_level, collective(
          primitive, "hierarchical", tuple(two_level.axis_names))))
  for wire in jaxcoll.wire_dtypes():
    yield (f"all_reduce ring wire {wire}",
           *on(mesh, collective("all_reduce", "ring", "x", wire_dtype=wire)))


def mlp(params, x):
  """The steps' model: ``tanh(x @ w)`` for each w, the mean square as the loss."""
  import jax.numpy as jnp
  for w in params:
    x = jnp.tanh(x @ w)
  return jnp.mean(x ** 2)


def _sgd(loss):
  """A step of SGD on ``loss(params, x)``, ``params`` any pytree: (new params, loss)."""
  import jax

  def step(params, x):
    value, grads = jax.value_and_grad(loss)(params, x)
    return jax.tree.map(lambda w, g: w - 0.01 * g, params, grads), value
  return step


def step_cases(topology: str, n: int):
  """``(layout, program, fn, args)`` of the training steps on ``topology``'s ``n`` devices."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import PartitionSpec as P

  import jaxcoll
  dp = topology_mesh(topology, (n,), ("data",))
  tp = topology_mesh(topology, (n // 4, 4), ("data", "model"))
  fsdp_mesh = topology_mesh(topology, (n,), ("fsdp",))
  step = _sgd(mlp)
  ws = lambda mesh, specs: [_typed(mesh, (WIDTH, WIDTH), s) for s in specs]   # noqa: E731

  dp_args = (ws(dp, [P()] * LAYERS), _typed(dp, (n * ROWS, WIDTH), P("data")))
  yield "DP", "jax.jit", jax.jit(step), dp_args
  yield "DP", "use", jaxcoll.use(step), dp_args
  yield "DP", "use(ring)", jaxcoll.use(step, algorithm="ring"), dp_args
  yield "DP", "use(int8)", jaxcoll.use(step, wire_dtype="int8"), dp_args

  def synced(params, x):   # each layer's gradient all-reduced as backward reaches it
    def loss(params, x):
      return mlp([jaxcoll.sync_in_backward(w, "data", algorithm="ring") for w in params], x)
    grads = jax.grad(loss)(params, x)
    return [w - 0.01 * g for w, g in zip(params, grads)]
  yield "DP", "sync_in_backward(ring)", jax.jit(jax.shard_map(
      synced, mesh=dp, in_specs=([P()] * LAYERS, P("data")), out_specs=[P()] * LAYERS,
      check_vma=False)), dp_args

  megatron = [P(None, "model") if i % 2 == 0 else P("model", None) for i in range(LAYERS)]
  tp_args = (ws(tp, megatron), _typed(tp, (n * ROWS // 4, WIDTH), P("data")))
  yield "TP", "jax.jit", jax.jit(step), tp_args
  yield "TP", "use(ring)", jaxcoll.use(step, algorithm="ring"), tp_args
  yield "TP", "use(int8)", jaxcoll.use(step, wire_dtype="int8"), tp_args

  fsdp_args = (ws(fsdp_mesh, [P("fsdp", None)] * LAYERS),
               _typed(fsdp_mesh, (n * ROWS, WIDTH), P("fsdp")))
  yield "FSDP", "jax.jit", jax.jit(step), fsdp_args
  yield "FSDP", "use(ring)", jaxcoll.use(step, algorithm="ring"), fsdp_args
  yield "FSDP", "use(int8)", jaxcoll.use(step, wire_dtype="int8"), fsdp_args

  def layered(run):   # FSDP units: gathers, reduce-scatters
    def train(blocks, x):
      def loss(blocks):
        blocks = [jaxcoll.fsdp.Sharded(b, (WIDTH, WIDTH), 0) for b in blocks]
        return jax.lax.pmean(jnp.mean(run(blocks, x) ** 2), "fsdp")
      grads = jax.grad(loss)(blocks)
      return [b - 0.01 * g for b, g in zip(blocks, grads)]
    return jax.jit(jax.shard_map(
        train, mesh=fsdp_mesh, in_specs=([P("fsdp", None)] * LAYERS, P("fsdp")),
        out_specs=[P("fsdp", None)] * LAYERS, check_vma=False))

  dense = lambda w, h: jnp.tanh(h @ w)   # noqa: E731

  def one_by_one(algorithm):
    def run(blocks, h):
      for b in blocks:
        h = jaxcoll.fsdp.layer(dense, "fsdp", algorithm=algorithm)(b, h)
      return h
    return run
  for algorithm in ("ring", "auto"):
    yield "FSDP", f"fsdp.layer({algorithm})", layered(one_by_one(algorithm)), fsdp_args
  prefetching = layered(jaxcoll.fsdp.layers(dense, "fsdp", prefetch=1))
  yield "FSDP", "fsdp.layers(prefetch=1)", prefetching, fsdp_args
  # XLA's GPU scheduler keeps one async collective in flight by default; FSDP's backward
  # has two to hide per layer (the next layer's gather, this one's reduce-scatter)
  yield "FSDP", f"jax.jit {OVERLAP_2}", _Overlap2(jax.jit(step)), fsdp_args
  yield "FSDP", f"fsdp.layers(prefetch=1) {OVERLAP_2}", _Overlap2(prefetching), \
      fsdp_args


OVERLAP_2 = "overlap_limit=2"   # the rows compiled with this XLA option (_Overlap2)


class _Overlap2:
  """``fn`` compiled with XLA's ``--xla_gpu_experimental_parallel_collective_overlap_limit=2``
  (per program: ``Lowered.compile(compiler_options=...)``, as a user may pass it)."""

  def __init__(self, fn):
    self.fn = fn

  def lower(self, *args):
    lowered = self.fn.lower(*args)

    class Lowered:
      @staticmethod
      def compile():
        return lowered.compile(compiler_options={
            "xla_gpu_experimental_parallel_collective_overlap_limit": 2})
    return Lowered


SP_LAYERS, SP_WIDTH, SP_HIDDEN, SP_TOKENS = 4, 4096, 16384, 8192   # the TP-SP blocks


def collective_matmul_cases(topology: str, n: int):
  """``(layout, program, fn, args)``: tensor parallelism with sequence parallelism (Megatron
  blocks, tokens split over "model" between blocks) under jit, under ``use`` (its gathers
  and reduce-scatters run as collective matmuls on a GPU), as lax's all_gather and
  psum_scatter in shard_map, and as jaxcoll's collective matmuls; and the FSDP MLP of
  :func:`step_cases` with each layer an ``all_gather_matmul`` of its row-split weight."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import jaxcoll
  mesh = topology_mesh(topology, (n,), ("model",))
  col, row = P(None, "model"), P("model", None)
  blocks = ([col] * SP_LAYERS, [row] * SP_LAYERS)   # (w1 column-, w2 row-parallel)
  args = (([_typed(mesh, (SP_WIDTH, SP_HIDDEN), col)] * SP_LAYERS,
           [_typed(mesh, (SP_HIDDEN, SP_WIDTH), row)] * SP_LAYERS),
          _typed(mesh, (SP_TOKENS, SP_WIDTH), P("model")))

  def jitted(params, x):
    for a, b in zip(*params):
      x = jax.lax.with_sharding_constraint(jnp.tanh(x @ a) @ b,
                                           NamedSharding(mesh, P("model")))
    return jnp.mean(x ** 2)

  def manual(gather_matmul, matmul_scatter):
    def loss(params, x):
      for a, b in zip(*params):
        x = matmul_scatter(jnp.tanh(gather_matmul(x, a)), b)
      return jax.lax.pmean(jnp.mean(x ** 2), "model")
    return jax.jit(jax.shard_map(_sgd(loss), mesh=mesh, in_specs=(blocks, P("model")),
                                 out_specs=(blocks, P()), check_vma=False))

  yield "TP-SP", "jax.jit", jax.jit(_sgd(jitted)), args
  yield "TP-SP", "use", jaxcoll.use(_sgd(jitted)), args
  yield "TP-SP", "use(ring)", jaxcoll.use(_sgd(jitted), algorithm="ring"), args
  yield "TP-SP", "lax all_gather, psum_scatter", manual(
      lambda x, a: jax.lax.all_gather(x, "model", tiled=True) @ a,
      lambda h, b: jax.lax.psum_scatter(h @ b, "model", tiled=True)), args
  for bidirectional in (False, True):
    yield "TP-SP", "all_gather_matmul" + (" bidirectional" if bidirectional else ""), manual(
        lambda x, a, d=bidirectional: jaxcoll.all_gather_matmul(
            "sk,kn->sn", x, a, "model", dim="s", bidirectional=d),
        lambda h, b, d=bidirectional: jaxcoll.matmul_reduce_scatter(
            "sf,fn->sn", h, b, "model", dim="s", bidirectional=d)), args

  fsdp_mesh = topology_mesh(topology, (n,), ("fsdp",))

  def fsdp(params, x):
    def loss(params):
      h = x
      for w in params:
        h = jnp.tanh(jaxcoll.all_gather_matmul("bk,kn->bn", h, w, "fsdp", dim="k", operand=1))
      return jax.lax.pmean(jnp.mean(h ** 2), "fsdp")
    return [w - 0.01 * g for w, g in zip(params, jax.grad(loss)(params))]
  yield "FSDP", "all_gather_matmul", jax.jit(jax.shard_map(
      fsdp, mesh=fsdp_mesh, in_specs=([P("fsdp", None)] * LAYERS, P("fsdp")),
      out_specs=[P("fsdp", None)] * LAYERS, check_vma=False)), (
          [_typed(fsdp_mesh, (WIDTH, WIDTH), P("fsdp", None))] * LAYERS,
          _typed(fsdp_mesh, (n * ROWS, WIDTH), P("fsdp")))


PP_WIDTH, PP_ROWS = 2048, 1024   # the pipeline's stage: tanh(h @ w), a microbatch's rows


def pipeline_cases(topology: str, n: int):
  """``(layout, program, fn, args)``: ``jaxcoll.pipeline.run`` over the n devices as n
  stages (one GEMM of PP_WIDTH a stage, PP_ROWS rows a microbatch, M = 4 PP), each
  schedule: its stage transfers and its temporaries (GPipe keeps M microbatches' inputs,
  1F1B PP)."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import PartitionSpec as P

  import jaxcoll
  mesh = topology_mesh(topology, (n,), ("stage",))
  m = 4 * n
  for schedule in jaxcoll.pipeline.SCHEDULES:
    v = 2 if schedule == "interleaved" else 1
    step = jax.jit(jax.shard_map(
        lambda w, x, y, s=schedule, v=v: jaxcoll.pipeline.run(
            lambda p, h: jnp.tanh(h @ p), w, x, y, "stage",
            loss_fn=lambda out, t: jnp.mean((out - t) ** 2), schedule=s, virtual_stages=v),
        mesh=mesh, in_specs=(P("stage"), P(), P()), out_specs=(P(), P("stage"))))
    yield "PP", schedule, step, (_typed(mesh, (n * v, PP_WIDTH, PP_WIDTH), P("stage")),
                                 _typed(mesh, (m, PP_ROWS, PP_WIDTH), P()),
                                 _typed(mesh, (m, PP_ROWS, PP_WIDTH), P()))


def model_cases(topology: str, n: int):
  """``(layout, program, fn, args)``: the MaxText-style decoder step of
  ``tests/maxtext_decoder.py`` (logical axis rules, ``nn.scan`` + ``nn.remat``, AdamW) on
  data x fsdp x tensor, and an MoE layer (``jaxcoll.moe``: dispatch, grouped matmul,
  combine) forward and backward over 8 or 16 experts' devices."""
  import sys

  import jax
  import jax.numpy as jnp
  from jax.sharding import PartitionSpec as P

  import jaxcoll
  sys.path.insert(0, os.path.join(HERE, "..", "tests"))
  import maxtext_decoder as mt
  mesh = topology_mesh(topology, (2, n // 4, 2), mt.MESH_AXES)
  step, args = mt.setup(mesh, mt.Config(scan_layers=True), abstract=True)
  yield "decoder", "jax.jit", step, args
  yield "decoder", "use(ring)", jaxcoll.use(step, algorithm="ring"), args

  experts = topology_mesh(topology, (n,), ("x",))
  t, d, e = 256, 512, n

  def moe_grad(x, logits, w):
    def loss(w):
      ids, gates = jaxcoll.moe.route(logits, 2)
      h, state = jaxcoll.moe.dispatch(x, ids, num_experts=e, capacity=None, axis_name="x",
                                      layout="sorted")
      out = jaxcoll.moe.combine(jaxcoll.moe.grouped_matmul(h, w, state.group_sizes), state,
                                gates)
      return jnp.sum(out ** 2)
    return jax.grad(loss)(w)
  yield "MoE", "sorted, all_to_all auto", jax.jit(jax.shard_map(
      moe_grad, mesh=experts, in_specs=(P("x"), P("x"), P("x")), out_specs=P("x"),
      check_vma=False)), (_typed(experts, (n * t, d), P("x")),
                          _typed(experts, (n * t, e), P("x")),
                          _typed(experts, (e, d, d), P("x")))


def compiled_facts(compiled) -> dict:
  """What the report keeps of a compiled program."""
  import jaxcoll
  memory = compiled.memory_analysis()
  found = jaxcoll.tools.overlap(compiled)
  return {"collectives": {k: n for k, n in found.counts().items() if n},
          "argument_bytes": memory.argument_size_in_bytes,
          "output_bytes": memory.output_size_in_bytes,
          "temp_bytes": memory.temp_size_in_bytes,
          "peak_bytes": memory.argument_size_in_bytes + memory.output_size_in_bytes
          + memory.temp_size_in_bytes - memory.alias_size_in_bytes,
          "transfer_bytes": found.nbytes, "covered": found.covered,
          "covered_by_any": found.covered_by_any, "hidden": found.hidden}


def _compile(fn, args) -> dict:
  start = time.perf_counter()
  try:
    compiled = fn.lower(*args).compile()
    return {"ok": True, "seconds": time.perf_counter() - start, **compiled_facts(compiled)}
  except Exception as e:   # noqa: BLE001 (a program that does not compile is a finding)
    return {"ok": False, "seconds": time.perf_counter() - start,
            "error": f"{type(e).__name__}: {str(e)[:400]}"}


def stage_compile(dry: bool, topologies=tuple(TOPOLOGIES), steps: bool = True,
                  collectives: bool = True) -> dict:
  """Every program compiled on each topology (``dry``: the 1x8 steps alone)."""
  import jax
  why = available()
  if why is not None:
    return {"status": "skipped", "reason": why, "jax": jax.__version__}
  rows = []
  for name in topologies[:1] if dry else topologies:
    topology, n = TOPOLOGIES[name]
    if collectives and not dry:
      mesh = topology_mesh(topology, (n,), ("x",))
      two = topology_mesh(topology, (2, n // 2), ("node", "local"))
      for case, fn, args in collective_cases(mesh, two):
        rows.append({"topology": name, "layout": "collective", "program": case,
                     **_compile(fn, args)})
    if steps:
      for layout, program, fn, args in (*step_cases(topology, n),
                                         *collective_matmul_cases(topology, n),
                                         *(pipeline_cases(topology, n) if n == 8 else ()),
                                         *(() if dry else model_cases(topology, n))):
        rows.append({"topology": name, "layout": layout, "program": program,
                     **_compile(fn, args)})
  return {"jax": jax.__version__, "target": "NVIDIA H100 SXM (benchmarks/targets)",
          "model": f"MLP {LAYERS} layers x {WIDTH}, {ROWS} rows a device, float32",
          "rows": rows}


def markdown(result: dict) -> list[str]:
  """The report's lines for the compile stage."""
  if result.get("status") == "skipped":
    return ["", f"Compiled for a GPU: skipped ({result['reason']})."]
  lines = ["", f"Compiled for {result['target']} without one, jax {result['jax']}; "
           f"steps: {result['model']}:", "",
           "| topology | layout | program | compiled | s | collectives | temp MiB/device | "
           "peak MiB/device | peak / jit's | transfer MiB | covered by GEMMs | by any kernel "
           "| est. hidden |", "|---|---|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
  jit = {(r["topology"], r["layout"]): r for r in result["rows"]
         if r["program"] == "jax.jit" and r["ok"]}
  for r in result["rows"]:
    if not r["ok"]:
      lines.append(f"| {r['topology']} | {r['layout']} | {r['program']} | no: "
                   f"{r['error'].splitlines()[0][:100]} | | | | | | | | | |")
      continue
    kinds = ", ".join(f"{v} {k}" for k, v in r["collectives"].items()) or "none"
    base = jit.get((r["topology"], r["layout"]))
    ratio = f"{r['peak_bytes'] / base['peak_bytes']:.2f}" if base else "-"
    lines.append(f"| {r['topology']} | {r['layout']} | {r['program']} | yes | "
                 f"{r['seconds']:.1f} | {kinds} | {r['temp_bytes'] / 2**20:.1f} | "
                 f"{r['peak_bytes'] / 2**20:.1f} | {ratio} | "
                 f"{r['transfer_bytes'] / 2**20:.1f} | {r['covered']:.2f} | "
                 f"{r['covered_by_any']:.2f} | {r['hidden']:.2f} |")
  return lines
