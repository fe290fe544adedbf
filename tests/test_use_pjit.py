"""``jaxcoll.use`` on steps written for global arrays (``jax.jit`` over sharded arrays).

A pjit-style step has no collective in its jaxpr: XLA's partitioner inserts them when it
compiles. ``use`` runs such a step per device in one shard_map, with jaxcoll collectives
where values change layout. Each step here is public code (``pjit_models``) or written as
flax and MaxText write theirs; under ``use(step, algorithm="ring")`` its outputs (loss,
gradients, updated parameters) equal plain ``jax.jit``'s within 1e-5, keep its layouts,
and the compiled step holds no collective but the schedules' collective-permutes
(:func:`jaxcoll.explain_step`).
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pjit_models as models
import pytest
from helpers import LAX_COLLECTIVES, assert_like_jit_with_permutes_only, primitives
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcoll


def make_mesh(shape, names, explicit: bool = False):
  types = (AxisType.Explicit if explicit else AxisType.Auto,) * len(shape)
  return jax.make_mesh(shape, names, axis_types=types)


def put(tree, mesh, specs):
  """``tree`` laid out on ``mesh`` as ``specs`` (one spec for all, or a matching tree)."""
  if isinstance(specs, P):
    return jax.device_put(tree, NamedSharding(mesh, specs))
  return jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), tree, specs,
                      is_leaf=lambda s: isinstance(s, P))


def assert_like_jit(step, *args, mesh, tol=1e-5, **use_kwargs):
  """``use(step, algorithm="ring")`` equals ``jax.jit(step)`` (values and layouts), and its
  compiled step communicates by collective-permutes only. Returns the report."""
  with jax.set_mesh(mesh):
    want = jax.jit(step)(*args)
    used = jaxcoll.use(step, algorithm="ring", **use_kwargs)
    got = used(*args)
    report = jaxcoll.explain_step(used, *args)
  assert_like_jit_with_permutes_only(got, want, report, tol)
  return report


# ---- JAX's distributed-arrays notebook ----

def notebook(layout: str):
  params, batch = models.init_model(jax.random.key(0), [784, 64, 64, 64, 10], 64)
  if layout in ("dp", "dp_explicit"):
    mesh = make_mesh((8,), ("batch",), explicit=layout == "dp_explicit")
    return mesh, put(params, mesh, P()), put(batch, mesh, P("batch"))
  if layout == "dp_tp":   # the notebook's 4-way batch, 2-way model parallel layout
    mesh = make_mesh((4, 2), ("batch", "model"))
    specs = [(P(), P()), (P(None, "model"), P("model")), (P("model", None), P()), (P(), P())]
    return mesh, put(params, mesh, specs), put(batch, mesh, P("batch", None))
  mesh = make_mesh((8,), ("batch",))   # fsdp: every weight split over the batch axis
  return mesh, put(params, mesh, [(P("batch"), P()) for _ in params]), put(batch, mesh,
                                                                           P("batch"))


@pytest.mark.quick
@pytest.mark.parametrize("layout", ["dp", "dp_explicit", "dp_tp", "fsdp"])
def test_notebook_training_step(layout):
  mesh, params, batch = notebook(layout)
  report = assert_like_jit(models.notebook_step, params, batch, mesh=mesh)
  if layout != "fsdp":   # the gradients' sums go together (buckets), not one per leaf
    summed = [x for x in report.collectives if x.what in ("all_reduce", "reduce_scatter")
              and x.equation != "dot_general"]
    assert 1 <= len(summed) <= 3, report


@pytest.mark.quick
def test_notebook_loss_and_gradient():
  mesh, params, batch = notebook("dp_tp")
  assert_like_jit(jax.value_and_grad(models.loss), params, batch, mesh=mesh)


# ---- JAX's examples/spmd_mnist_classifier_fromscratch.py ----

@pytest.mark.quick
@pytest.mark.parametrize("explicit", [True, False])
def test_spmd_mnist_train_step(explicit):
  mesh = make_mesh((8,), ("batch",), explicit=explicit)
  params = put(models.init_random_params(0.1, [784, 128, 128, 10]), mesh, P())
  rng = np.random.RandomState(0)
  images = rng.rand(64, 784).astype(np.float32)
  labels = np.eye(10, dtype=np.float32)[rng.randint(0, 10, 64)]
  batch = put((images, labels), mesh, P("batch"))
  assert_like_jit(models.mnist_step, params, batch, mesh=mesh)


# ---- a transformer language model: embedding, layer norm, attention, dropout, scan, Adam ----

def lm(layout: str, explicit: bool = False):
  if layout == "tp":
    mesh = make_mesh((4, 2), ("data", "model"), explicit=explicit)
  else:
    mesh = make_mesh((8,), ("data",), explicit=explicit)
  params = models.lm_init(jax.random.key(0), **models.LM)
  params = put(params, mesh, models.lm_specs(params, layout))
  opt_state = models.lm_optimizer.init(params)   # laid out as the parameters
  tokens = jax.random.randint(jax.random.key(1), (8, models.LM["length"] + 1), 0,
                              models.LM["vocab"])
  return mesh, params, opt_state, put(tokens, mesh, P("data")), jax.random.key(2)


# every test reads jaxprs: quick (on the oldest jax too), the LM in one layout of three
@pytest.mark.parametrize("layout", ["dp", "tp", pytest.param("fsdp", marks=pytest.mark.quick)])
def test_transformer_lm_step(layout):
  mesh, *args = lm(layout)
  report = assert_like_jit(models.lm_step, *args, mesh=mesh)
  if layout == "fsdp":   # weights gathered for use, gradients reduce-scattered to their shards
    kinds = {x.what for x in report.collectives}
    assert {"all_gather", "reduce_scatter"} <= kinds, report


@pytest.mark.quick
def test_dropout_draws_as_jit_and_differ_between_devices():
  """The same random bits as plain jit: every device draws its own rows' mask."""
  mesh = make_mesh((8,), ("data",))
  x = put(jnp.ones((8, 64)), mesh, P("data"))
  key = jax.random.key(3)
  step = lambda key, x: models.dropout(key, x, 0.5)  # noqa: E731
  with jax.set_mesh(mesh):
    got = jaxcoll.use(step, algorithm="ring")(key, x)
    want = jax.jit(step)(key, x)
  np.testing.assert_array_equal(got, want)
  masks = np.asarray(got) > 0
  assert len({m.tobytes() for m in masks}) == len(masks)


# ---- jax.grad of a pjit-style function under use ----

@pytest.mark.quick
def test_grad_of_use_holds_no_lax_collective():
  mesh, params, batch = notebook("dp")
  rerouted = jaxcoll.use(models.loss, algorithm="ring", in_shardings=(
      jax.tree.map(lambda x: x.sharding, params), jax.tree.map(lambda x: x.sharding, batch)))
  with jax.set_mesh(mesh):
    grad = jax.grad(rerouted)
    jaxpr = jax.make_jaxpr(grad)(params, batch)
    got = jax.jit(grad)(params, batch)
    want = jax.jit(jax.grad(models.loss))(params, batch)
  assert not LAX_COLLECTIVES & primitives(jaxpr)
  chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-5)



# ---- layouts given to use, taken from a jitted function, axes left to XLA ----

@pytest.mark.quick
def test_layouts_from_a_jitted_functions_shardings():
  """``use(jax.jit(step, in_shardings=..., out_shardings=...))`` on arrays not yet laid
  out: the jitted function's shardings say how the step runs (flax's lm1b example jits its
  step this way)."""
  mesh, params, batch = notebook("dp")
  shardings = (NamedSharding(mesh, P()), NamedSharding(mesh, P("batch")))
  jitted = jax.jit(models.notebook_step, in_shardings=shardings, out_shardings=shardings[0])
  host_params, host_batch = jax.device_get((params, batch))
  used = jaxcoll.use(jitted, algorithm="ring")
  got = used(host_params, host_batch)
  chex.assert_trees_all_close(got, jitted(params, batch), rtol=1e-5, atol=1e-5)
  report = jaxcoll.explain_step(used, host_params, host_batch)
  assert report.xla_collectives == 0 and report.collectives, report


@pytest.mark.quick
def test_out_shardings_lay_out_the_outputs():
  mesh, params, batch = notebook("dp")
  with jax.set_mesh(mesh):
    got = jaxcoll.use(models.predict, algorithm="ring", out_shardings=P())(params, batch[0])
    want = jax.jit(models.predict)(params, batch[0])
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  assert got.sharding.is_fully_replicated


@pytest.mark.quick
def test_axes_leaves_the_others_to_xla():
  mesh, params, batch = notebook("dp_tp")
  with jax.set_mesh(mesh):
    want = jax.jit(models.notebook_step)(params, batch)
    used = jaxcoll.use(models.notebook_step, algorithm="ring", axes=("batch",))
    got = used(params, batch)
    report = jaxcoll.explain_step(used, params, batch)
  chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-5)
  assert {x.axes for x in report.collectives} == {("batch",)}, report
  left = [x for x in report.left_to_xla if x.what == "partitioner"]
  assert left and left[0].axes == ("model",), report


# ---- equations without a per-device rule: whole inputs, reported; refused with strict ----

def _fft(x):
  return jnp.abs(jnp.fft.fft(x, axis=0)).sum(axis=1)


def _reduce_window(x):   # max pooling over rows, split across devices
  return jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (2, 1), (2, 1), "VALID")


def _custom_reduce(x):   # a variadic reduction (value and index of each column's maximum)
  def best(a, b):
    take = a[0] >= b[0]
    return jnp.where(take, a[0], b[0]), jnp.where(take, a[1], b[1])
  index = jax.lax.broadcasted_iota(jnp.int32, x.shape, 0)
  return jax.lax.reduce((x, index), (np.float32(-np.inf), np.int32(0)), best, (0,))


def _cholesky(x):   # one small Gram matrix per row, rows split across devices
  gram = x[:, :, None] * x[:, None, :] + 4 * jnp.eye(x.shape[1])
  return jnp.linalg.cholesky(gram)


FALLBACKS = {"fft": _fft, "reduce_window_max": _reduce_window, "reduce": _custom_reduce,
             "cholesky": _cholesky}


@pytest.mark.quick
@pytest.mark.parametrize("name", sorted(FALLBACKS))
def test_a_primitive_without_rule_runs_whole_and_is_reported(name):
  fn = FALLBACKS[name]
  mesh = make_mesh((8,), ("data",))
  x = put(jax.random.normal(jax.random.key(0), (16, 8)) / 4, mesh, P("data"))
  with jax.set_mesh(mesh):
    used = jaxcoll.use(fn, algorithm="ring")
    got, want = used(x), jax.jit(fn)(x)
    report = jaxcoll.explain_step(used, x)
    with pytest.raises(ValueError, match=rf"strict=True.*{name}.* at .*test_use_pjit.py"):
      jaxcoll.use(fn, algorithm="ring", strict=True)(x)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  assert [x.what for x in report.whole] == [name], report
  assert "test_use_pjit.py" in report.whole[0].where


# ---- bad arguments ----

@pytest.mark.quick
def test_bad_arguments_name_what_was_expected():
  mesh, params, batch = notebook("dp")
  with jax.set_mesh(mesh):
    with pytest.raises(ValueError, match=r"use\(axes=.*'nope' is not an axis of the mesh"):
      jaxcoll.use(models.loss, axes=("nope",))(params, batch)
    with pytest.raises(ValueError, match=r"use\(in_shardings=...\): expected a pytree prefix"):
      jaxcoll.use(models.loss, in_shardings=(P(), P(), P(), P()))(params, batch)
  with pytest.raises(TypeError, match=r"explain_step\(step=.*made by jaxcoll.use"):
    jaxcoll.explain_step(models.loss, params, batch)
  with pytest.raises(TypeError, match=r"use\(strict=...\)"):
    jaxcoll.use(models.loss, strict="yes")
  with pytest.raises(TypeError, match=r"use\(fun=42\): expected a callable"):
    jaxcoll.use(42)
  with pytest.raises(TypeError, match=r"use\(fun='step'\): expected a callable"):
    jaxcoll.use(algorithm="ring")("step")


@pytest.mark.quick
def test_inputs_on_different_meshes_are_refused_by_name():
  """As ``jax.jit`` refuses them: each input named, each mesh's devices."""
  from jax.sharding import Mesh
  first = Mesh(np.array(jax.devices()[:4]), ("data",))
  second = Mesh(np.array(jax.devices()[4:]), ("data",))
  a = put(jnp.ones(8), first, P("data"))
  b = put(jnp.ones(8), second, P("data"))
  with pytest.raises(ValueError, match=r"different meshes: args\[0\] on \{'data': 4\} "
                                       r"\(devices \[0, 1, 2, 3\]\), args\[1\]\['b'\] on "
                                       r"\{'data': 4\} \(devices \[4, 5, 6, 7\]\)"):
    jaxcoll.use(lambda x, y: x + y["b"])(a, {"b": b})


@pytest.mark.quick
def test_the_report_names_the_users_frame_beside_the_librarys():
  """An optimizer's gradient sum is made in optax's code; the report's line names the
  user's call (this file) and optax's frame beside it."""
  import optax
  tx = optax.adam(1e-2)

  def step(w, state, x):
    grad = jax.grad(lambda w: jnp.mean((x @ w) ** 2))(w)
    updates, state = tx.update(grad, state, w)
    return optax.apply_updates(w, updates), state

  mesh = make_mesh((8,), ("data",))
  w = put(jnp.ones((8, 4)), mesh, P())
  x = put(jnp.ones((64, 8)), mesh, P("data"))
  with jax.set_mesh(mesh):
    report = jaxcoll.explain_step(jaxcoll.use(step, algorithm="ring"), w, tx.init(w), x)
  (line,) = [x for x in report.collectives if x.what == "all_reduce"]
  assert "test_use_pjit.py" in line.where and ".step) via optax/" in line.where, line


# A user's script, written into a folder of the test's choosing: an Adam step's report.
_SCRIPT = """
import jax, jax.numpy as jnp, optax, jaxcoll

def report(w, x):
  tx = optax.adam(1e-2)

  def step(w, state, x):
    grad = jax.grad(lambda w: jnp.mean((x @ w) ** 2))(w)
    updates, state = tx.update(grad, state, w)
    return optax.apply_updates(w, updates), state

  return jaxcoll.explain_step(jaxcoll.use(step, algorithm="ring"), w, tx.init(w), x)
"""


@pytest.mark.parametrize("folder", ["optax", "jaxcoll", "flax"])
def test_a_library_is_known_by_where_it_is_installed_not_by_a_folders_name(tmp_path, folder):
  """A script in a folder named like a library (``~/optax/train.py``; a clone of jaxcoll
  into ``jaxcoll/``) is the user's: the report names its line, with optax's beside it."""
  import runpy
  script = tmp_path / folder / "tests" / "train.py"
  script.parent.mkdir(parents=True)
  script.write_text(_SCRIPT)
  mesh = make_mesh((8,), ("data",))
  w = put(jnp.ones((8, 4)), mesh, P())
  x = put(jnp.ones((64, 8)), mesh, P("data"))
  with jax.set_mesh(mesh):
    report = runpy.run_path(str(script))["report"](w, x)
  (line,) = [x for x in report.collectives if x.what == "all_reduce"]
  assert line.where.startswith(f"{script}:") and ".step) via optax/" in line.where, line


@pytest.mark.quick
def test_a_sum_made_whole_for_an_output_names_the_line_that_made_it():
  mesh = make_mesh((8,), ("data",))
  x = put(jnp.ones((64, 8)), mesh, P("data"))

  def step(x):
    return 2 * x.sum(0)   # a partial sum until the output needs it whole

  with jax.set_mesh(mesh):
    report = jaxcoll.explain_step(jaxcoll.use(step, algorithm="ring"), x)
  (line,) = report.collectives
  assert line.equation == "output" and "test_use_pjit.py" in line.where, line


# ---- a gather and scatter-add whose rows pair with the indices' (take_along_axis) ----

@pytest.mark.quick
def test_integer_label_cross_entropy_stays_per_device():
  """optax's integer-label cross-entropy reads each row's label with take_along_axis (a
  gather with batching dimensions; its gradient a scatter-add): with logits and labels
  split alike, every device reads and writes its own rows, nothing gathered."""
  import optax
  mesh = make_mesh((4, 2), ("batch", "model"))
  rng = np.random.default_rng(0)
  logits = put(rng.normal(size=(16, 12)).astype(np.float32), mesh, P("batch"))
  labels = put(rng.integers(0, 12, 16).astype(np.int32), mesh, P("batch"))
  fn = jax.value_and_grad(
      lambda z, y: optax.softmax_cross_entropy_with_integer_labels(z, y).mean())
  report = assert_like_jit(fn, logits, labels, mesh=mesh)
  assert not [x for x in report.collectives if x.what == "all_gather"], report


# ---- Explicit sharding mode: reshard and out_sharding as jaxcoll collectives ----

@pytest.mark.quick
@pytest.mark.parametrize("case", ["gather", "move", "sum_whole", "sum_split"])
def test_explicit_mode_reshard_runs_as_the_jaxcoll_collective(case):
  """Split -> whole: all_gather; one split dimension -> another: all_to_all; a contraction
  over a split dimension (a partial sum) -> whole: all_reduce, -> split: reduce_scatter."""
  mesh = make_mesh((8,), ("data",), explicit=True)
  rng = np.random.default_rng(0)
  x = put(rng.normal(size=(16, 16)).astype(np.float32), mesh, P(None, "data"))
  w = put(rng.normal(size=(16, 8)).astype(np.float32), mesh, P("data", None))
  steps = {
      "gather": (lambda x, w: jax.sharding.reshard(x, P()), "all_gather"),
      "move": (lambda x, w: jax.sharding.reshard(x, P("data", None)), "all_to_all"),
      "sum_whole": (lambda x, w: jnp.matmul(x, w, out_sharding=P()), "all_reduce"),
      "sum_split": (lambda x, w: jnp.matmul(x, w, out_sharding=P("data")), "reduce_scatter"),
  }
  step, collective = steps[case]
  report = assert_like_jit(step, x, w, mesh=mesh)
  assert [c.what for c in report.collectives] == [collective], report


@pytest.mark.quick
def test_debug_log_lists_the_report_lines(monkeypatch, caplog):
  """``JAXCOLL_DEBUG=INFO``: each line of the step's report is logged as it is traced."""
  import logging

  from jaxcoll._src.auto import debug_log
  monkeypatch.setenv("JAXCOLL_DEBUG", "INFO")
  debug_log._seen.clear()   # each distinct line is logged once per process
  mesh, params, batch = notebook("dp")
  with caplog.at_level(logging.INFO, logger="jaxcoll"), jax.set_mesh(mesh):
    used = jaxcoll.use(models.notebook_step, algorithm="ring")
    report = jaxcoll.explain_step(used, params, batch)
  logged = "\n".join(r.getMessage() for r in caplog.records)
  for line in report.collectives:
    assert f"use: {line}" in logged, (line, logged)


@pytest.mark.quick
def test_sums_run_over_the_mesh_axes_outer_first():
  """A sum over two mesh axes names them in the mesh's order (outer first), so a
  hierarchical all-reduce crosses the outer (slow) axis with the smallest pieces."""
  mesh = make_mesh((2, 4), ("node", "local"))
  params, batch = models.init_model(jax.random.key(0), [32, 16, 8], 16)
  params, batch = put(params, mesh, P()), put(batch, mesh, P(("node", "local")))
  with jax.set_mesh(mesh):
    want = jax.jit(models.notebook_step)(params, batch)
    used = jaxcoll.use(models.notebook_step, algorithm="hierarchical")
    got = used(params, batch)
    report = jaxcoll.explain_step(used, params, batch)
  chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-5)
  sums = [x for x in report.collectives if x.what == "all_reduce"]
  assert sums and {x.axes for x in sums} == {("node", "local")}, report
  assert {x.algorithm for x in sums} == {"hierarchical"}, report


@pytest.mark.quick
@pytest.mark.parametrize("name", ["argmax", "argmin", "cumsum", "cummax", "one_hot",
                                  "log_softmax", "top_k"])
def test_reductions_and_scans_over_the_split_dimension(name):
  """Over the dimension the devices split: argmax/argmin combine each device's best with
  its global index; cumulative ops and top_k see the whole dimension; one_hot and
  log_softmax of split rows stay per device. Equal to jit, nothing run whole."""
  fns = {"argmax": lambda x: jnp.argmax(x, axis=0), "argmin": lambda x: jnp.argmin(x, axis=1),
         "cumsum": lambda x: jnp.cumsum(x, axis=0), "cummax": lambda x: jax.lax.cummax(x, 1),
         "one_hot": lambda x: jax.nn.one_hot(jnp.argmax(x, axis=1), 8) * x,
         "log_softmax": lambda x: jax.nn.log_softmax(x, axis=0),
         "top_k": lambda x: jax.lax.top_k(x.T, 3)[0]}
  mesh = make_mesh((4, 2), ("data", "model"))
  x = put(jax.random.normal(jax.random.key(0), (16, 8)), mesh, P("data", "model"))
  report = assert_like_jit(fns[name], x, mesh=mesh)
  assert not report.whole, report
