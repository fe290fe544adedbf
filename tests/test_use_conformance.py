"""Public programs under ``jaxcoll.use(..., strict=True)``: nothing refused, nothing run on
whole inputs, values as plain ``jax.jit``'s, per-device flops at most 1.1x jit's, and
collectives that send no more than jit's compiled step's (``helpers.report_bytes``, 1%).

Each program is public code copied into the tests (the file named beside it says from where)
or written as its project writes it:

- JAX's distributed-arrays notebook training step, data parallel, data x model and FSDP
  (``pjit_models``: jax-ml/jax ``docs/notebooks/Distributed_arrays_and_automatic_
  parallelization.md``);
- JAX's ``examples/spmd_mnist_classifier_fromscratch.py`` step (``pjit_models``), Auto and
  Explicit meshes;
- JAX's shard_map tutorial (``docs/notebooks/shard_map.md``): the neural networks' losses
  and gradients (data parallel, FSDP, tensor parallel, FSDP + TP: ``test_use_grad``), and
  the "implicit pcast" example on a mesh of Explicit axes, called as written, inside a
  global program, and closed over;
- MaxText's collective matmul (``maxtext_collective_matmul``: its
  ``src/maxtext/examples/shmap_collective_matmul.py`` unchanged but for sizes), a shard_map
  over ``(dp, fsdp, tp)`` whose size-1 axes no input is split on;
- flax's lm1b train step (``flax_lm1b``, google/flax ``examples/lm1b``);
- a MaxText-style decoder step (``maxtext_decoder``): logical axis rules, RMSNorm, rotary
  embeddings, SwiGLU, ``nn.scan`` + ``nn.remat`` with ``checkpoint_name`` policies, AdamW
  after ``clip_by_global_norm``, gradient accumulation; scanned and unscanned.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pjit_models as models
import pytest
from helpers import assert_like_jit_with_permutes_only, hlo_collective_bytes, report_bytes
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcoll

FLOPS_RATIO = 1.1
BYTES_RATIO = 1.01
# flax's lm1b: XLA's dot partitioner splits the attention's projections eight ways (tokens
# over "data", embed over "fsdp", heads over "tensor", which no input of theirs splits: a
# partial sum all-reduced and a collective-permute a projection); use splits them four
# ways (tokens over "data" and "fsdp", the weights gathered over "fsdp") and leaves work on
# values whole over "tensor" whole, as it leaves all replicated work unless a reader wants
# it split: 1.146x jit's flops for 0.78x jit's bytes (docs/guide/training.md, "What use
# keeps from jit").
FLOPS_RATIOS = {"flax_lm1b": 1.2}
# The shard_map tutorial's steps run the collectives their authors wrote; jax 0.10.2's XLA
# merges the FSDP steps' rematerialized all_gathers (their remat policy recomputes them) with
# the forward ones, which schedules (loops of permutes) do not allow: those are not compared.
AS_WRITTEN = {"shard_map_dp", "shard_map_fsdp", "shard_map_tp", "shard_map_fsdp_tp"}


def _mesh(shape, names, explicit=False):
  types = (AxisType.Explicit if explicit else AxisType.Auto,) * len(shape)
  return jax.make_mesh(shape, names, axis_types=types)


def _put(tree, mesh, spec):
  return jax.device_put(tree, NamedSharding(mesh, spec))


# ---- the programs: each a function giving (mesh, step, args) ----

def notebook(layout):
  def case():
    params, batch = models.init_model(jax.random.key(0), [784, 64, 64, 64, 10], 64)
    if layout == "dp":
      mesh = _mesh((8,), ("batch",))
      return mesh, models.notebook_step, (_put(params, mesh, P()), _put(batch, mesh, P("batch")))
    if layout == "dp_tp":
      mesh = _mesh((4, 2), ("batch", "model"))
      specs = [(P(), P()), (P(None, "model"), P("model")), (P("model", None), P()), (P(), P())]
      params = [tuple(_put(x, mesh, s) for x, s in zip(layer, spec))
                for layer, spec in zip(params, specs)]
      return mesh, models.notebook_step, (params, _put(batch, mesh, P("batch", None)))
    mesh = _mesh((8,), ("batch",))
    params = [(_put(w, mesh, P("batch")), _put(b, mesh, P())) for w, b in params]
    return mesh, models.notebook_step, (params, _put(batch, mesh, P("batch")))
  return case


def mnist(explicit):
  def case():
    mesh = _mesh((8,), ("batch",), explicit=explicit)
    params = _put(models.init_random_params(0.1, [784, 128, 128, 10]), mesh, P())
    rng = np.random.RandomState(0)
    images = rng.rand(64, 784).astype(np.float32)
    labels = np.eye(10, dtype=np.float32)[rng.randint(0, 10, 64)]
    return mesh, models.mnist_step, (params, _put((images, labels), mesh, P("batch")))
  return case


def shard_map_tutorial(name):
  def case():
    import test_use_grad
    mesh, loss, args = test_use_grad.CASES[name](True)
    return mesh, jax.value_and_grad(loss, argnums=(0, 1)), args
  return case


def implicit_pcast(form):
  """``docs/notebooks/shard_map.md``: "JAX implicitly inserts jax.lax.pcast(..., to=
  'varying') calls in many cases, especially for binary operations", on the mesh
  ``jax.make_mesh`` makes (Explicit axes), with ``y`` made under ``jax.set_mesh``."""
  def case():
    mesh = jax.make_mesh((2,), ("i",), devices=jax.devices()[:2],
                         axis_types=(AxisType.Explicit,))
    with jax.set_mesh(mesh):
      @jax.shard_map(in_specs=(P("i"), P()), out_specs=P("i"))
      def f(x, y):
        return x * y

      x = jax.device_put(jnp.arange(6.), P("i"))
      y = jnp.arange(3.)
    if form == "as_written":
      return mesh, f, (x, y)
    if form == "closed_over":
      return mesh, lambda x: f(x, y), (x,)
    return mesh, jax.value_and_grad(lambda x, y: jnp.sum(f(x, y) * 2), argnums=(0, 1)), (x, y)
  return case


def collective_matmul(run):
  """As the example's ``main`` runs it: under ``with global_mesh``, the data from its
  ``data_fn``, ``collective_matmul`` jitted inside a jitted ``run_collective``."""
  def case():
    import maxtext_collective_matmul as cm
    with cm.global_mesh:
      activations, weights = cm.data_fn()

    @jax.jit
    def run_collective(_activations, _weights):
      return jax.jit(cm.collective_matmul)(_activations, _weights)

    @jax.jit
    def both(_activations, _weights):   # beside main's run_naive, in one program
      return cm.jit_matmul(_activations, _weights), run_collective(_activations, _weights)
    return _in_mesh_context(cm.global_mesh), {"collective": run_collective,
                                               "both": both}[run], (activations, weights)
  return case


class _in_mesh_context:
  """The example's ``with global_mesh:`` (its ``pjit`` reads that context) and
  ``jax.set_mesh`` together."""

  def __init__(self, mesh):
    self.mesh, self.stack = mesh, contextlib.ExitStack()

  def __enter__(self):
    self.stack.enter_context(self.mesh)
    self.stack.enter_context(jax.set_mesh(self.mesh))

  def __exit__(self, *exc):
    return self.stack.__exit__(*exc)


def lm1b():
  import test_use_flax
  mesh, step, args = test_use_flax.lm1b_setup((2, 2, 2))
  return mesh, step, args


def decoder(scan):
  def case():
    import maxtext_decoder as mt
    mesh = _mesh((2, 2, 2), mt.MESH_AXES)
    step, args = mt.setup(mesh, mt.Config(scan_layers=scan))
    return mesh, step, args
  return case


def types(args):
  """The arrays of ``args`` as ``jax.ShapeDtypeStruct``s with their shardings (an array
  on one device, a PRNG seed put nowhere in particular: none, as a user writes it)."""
  def of(a):
    named = isinstance(a.sharding, NamedSharding)
    return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding if named else None)
  return jax.tree.map(lambda a: of(a) if isinstance(a, jax.Array) else a, args)


PROGRAMS = {
    "notebook_dp": notebook("dp"), "notebook_dp_tp": notebook("dp_tp"),
    "notebook_fsdp": notebook("fsdp"), "mnist_auto": mnist(False), "mnist_explicit": mnist(True),
    "shard_map_dp": shard_map_tutorial("dp"), "shard_map_fsdp": shard_map_tutorial("fsdp"),
    "shard_map_tp": shard_map_tutorial("tp"),
    "shard_map_fsdp_tp": shard_map_tutorial("fsdp_tp"),
    "implicit_pcast": implicit_pcast("as_written"),
    "implicit_pcast_closed_over": implicit_pcast("closed_over"),
    "implicit_pcast_grad": implicit_pcast("grad"),
    "collective_matmul": collective_matmul("collective"),
    "collective_matmul_beside_naive": collective_matmul("both"),
    "flax_lm1b": lm1b, "maxtext_decoder_scanned": decoder(True),
    "maxtext_decoder_unscanned": decoder(False),
}
QUICK = {"notebook_dp_tp", "implicit_pcast_closed_over", "implicit_pcast_grad",
         "collective_matmul", "maxtext_decoder_scanned"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.quick) if n in QUICK
                                  else n for n in sorted(PROGRAMS)])
def test_public_program_runs_under_strict_use_as_jit_does(name):
  """The flops compared are the program's own: ``use`` with jit's collectives
  (``algorithm="native"``: the same placements, the same collectives as plain jit, which
  XLA's cost analysis counts as no flops), so that a value computed whole where jit splits
  it shows, and a schedule's own element work (encoding, padding: in step time, in
  ``benchmarks/``) does not. That program is lowered ahead of time, from the arguments'
  types (``jax.ShapeDtypeStruct``s with their shardings), as a user compiles for a machine
  they are not on."""
  mesh, step, args = PROGRAMS[name]()
  context = mesh if isinstance(mesh, _in_mesh_context) else jax.set_mesh(mesh)
  baseline = step if hasattr(step, "lower") else jax.jit(step)   # as the program jits it
  with context:
    want = baseline(*args)
    used = jaxcoll.use(step, algorithm="ring", strict=True)
    got = used(*args)
    report = jaxcoll.explain_step(used, *args)
    flops = jaxcoll.tools.flops_of(
        jaxcoll.use(step, algorithm="native", strict=True).lower(*types(args)).compile())
    compiled = baseline.lower(*args).compile()
  assert_like_jit_with_permutes_only(got, want, report, communicates=bool(report.collectives))
  jit_flops = jaxcoll.tools.flops_of(compiled)
  assert flops <= FLOPS_RATIOS.get(name, FLOPS_RATIO) * jit_flops, (flops, jit_flops, report)
  sent = sum(report_bytes(report, getattr(mesh, "mesh", mesh)).values())
  assert name in AS_WRITTEN or \
      sent <= BYTES_RATIO * sum(hlo_collective_bytes(compiled.as_text()).values()), report


@pytest.mark.quick
@pytest.mark.parametrize("algorithm", ["auto", "ring", "direct", "schedule"])
def test_maxtext_collective_matmul_under_any_algorithm(algorithm):
  """The example's own check (``jnp.allclose`` of the naive and the collective matmul),
  under ``use`` called plainly and under ``jax.jit``; the default and forced algorithms."""
  import maxtext_collective_matmul as cm
  mesh, run_collective, args = collective_matmul("collective")()
  with cm.global_mesh:
    naive = cm.jit_matmul(*args)
    for run in (jaxcoll.use(run_collective, algorithm=algorithm),
                jax.jit(jaxcoll.use(run_collective, algorithm=algorithm))):
      assert jnp.allclose(naive, run(*args)), algorithm


def test_axes_that_leave_out_a_shard_maps_axes_are_refused_by_name():
  import maxtext_collective_matmul as cm
  _, run_collective, args = collective_matmul("both")()
  with cm.global_mesh:
    with pytest.raises(ValueError, match=r"use\(axes=\('tp',\)\).*shard_map over \('dp', "
                                         r"'fsdp', 'tp'\).*\['dp', 'fsdp'\]"):
      jaxcoll.use(run_collective, axes=("tp",))(*args)
