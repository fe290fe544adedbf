"""``use(collective_matmul=...)``: a global program's gather of a matmul operand, and its
reduce-scatter of a matmul's sum, run as jaxcoll's collective matmuls (ring steps beside
partial matmuls) where asked, or by default where the target backend runs transfers beside
compute; values and gradients equal jit's on tensor + sequence parallel and FSDP steps; the
gathered operand kept for the backward pass (no gather twice); the decision in one place
(``Options.matmul_for``) and its refusals."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close_after_sums
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcoll
from jaxcoll._src.use.options import Options


def _tp_sp(layers=2):
  """Megatron blocks with sequence parallelism on a 2 x 4 (data, model) mesh: tokens split
  over both axes between blocks, w1 column- and w2 row-parallel over "model"."""
  mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
  rows = NamedSharding(mesh, P(("data", "model")))

  def loss(w1, w2, x):
    for a, b in zip(w1, w2):
      x = jax.lax.with_sharding_constraint(jnp.tanh(x @ a) @ b, rows)
    return jnp.mean(x ** 2)

  keys = jax.random.split(jax.random.key(0), 2 * layers + 1)
  w1 = [jax.device_put(jax.random.normal(keys[i], (16, 32)) / 4,
                       NamedSharding(mesh, P(None, "model"))) for i in range(layers)]
  w2 = [jax.device_put(jax.random.normal(keys[layers + i], (32, 16)) / 6,
                       NamedSharding(mesh, P("model", None))) for i in range(layers)]
  x = jax.device_put(jax.random.normal(keys[-1], (64, 16)), rows)
  return jax.value_and_grad(loss, argnums=(0, 1)), (w1, w2, x)


def _fsdp(layers=3):
  """An MLP whose weights are split by rows over "fsdp", the batch too; SGD."""
  mesh = Mesh(np.array(jax.devices()), ("fsdp",))

  def step(ws, x):
    def loss(ws):
      h = x
      for w in ws:
        h = jnp.tanh(h @ w)
      return jnp.mean(h ** 2)
    value, grads = jax.value_and_grad(loss)(ws)
    return value, [w - 0.1 * g for w, g in zip(ws, grads)]

  ws = [jax.device_put(jax.random.normal(jax.random.key(i), (16, 16)) / 4,
                       NamedSharding(mesh, P("fsdp", None))) for i in range(layers)]
  x = jax.device_put(jax.random.normal(jax.random.key(9), (64, 16)),
                     NamedSharding(mesh, P("fsdp")))
  return step, (ws, x)


def _dp(layers=3):
  """A data-parallel MLP: weights replicated, the batch split over "data"; SGD."""
  mesh = Mesh(np.array(jax.devices()), ("data",))
  step, (ws, x) = _fsdp(layers)
  ws = [jax.device_put(w, NamedSharding(mesh, P())) for w in ws]
  return step, (ws, jax.device_put(x, NamedSharding(mesh, P("data"))))


def _hlo(fn, args) -> str:
  return jax.jit(fn).lower(*args).as_text()


@pytest.mark.quick
@pytest.mark.parametrize("case", [_tp_sp, _fsdp, _dp])
@pytest.mark.parametrize("algorithm", ["auto", "ring"])
def test_values_and_gradients_equal_jits(case, algorithm):
  step, args = case()
  want = jax.jit(step)(*args)
  for asked in (True, False):
    got = jaxcoll.use(step, collective_matmul=asked, algorithm=algorithm)(*args)
    assert_close_after_sums(got, want, terms=64)


@pytest.mark.quick
def test_a_sum_headed_whole_is_a_ring_beside_the_matmul_only_where_a_schedule_was_asked():
  """A data-parallel weight gradient (a sum headed whole): under algorithm="ring" its
  reduce-scatter half runs beside the matmul's pieces, then an all_gather (2 loops a layer);
  under auto it stays XLA's all-reduce, which XLA's scheduler hides beside other GEMMs."""
  step, args = _dp(layers=3)
  ring = _hlo(jaxcoll.use(step, algorithm="ring", collective_matmul=True), args)
  assert "all_reduce" not in ring and ring.count("stablehlo.while") >= 2 * 3
  auto = _hlo(jaxcoll.use(step, collective_matmul=True), args)
  assert auto == _hlo(jaxcoll.use(step, collective_matmul=False), args)


@pytest.mark.quick
@pytest.mark.parametrize("case", [_tp_sp, _fsdp])
def test_gathers_and_reduce_scatters_become_loops_of_permutes(case):
  """Asked, no all-gather or reduce-scatter is left (each became a loop of permutes beside
  its matmul's pieces); by default on this CPU nothing changes (its collectives are
  synchronous: the partial products would only cost)."""
  step, args = case()
  fused = _hlo(jaxcoll.use(step, collective_matmul=True), args)
  assert "all_gather" not in fused and "reduce_scatter" not in fused
  assert "collective_permute" in fused and "while" in fused
  default = _hlo(jaxcoll.use(step), args)
  assert default == _hlo(jaxcoll.use(step, collective_matmul=False), args)
  assert "while" not in default


@pytest.mark.parametrize("layers", [2, 3])
def test_the_gathered_weight_is_kept_for_the_backward_pass(layers):
  """FSDP's forward gathers each weight once (all_gather_matmul, the gathered weight
  assembled as its chunks pass); the backward pass's dx = dy w^T reads it instead of
  gathering again: one loop a layer for its gather, one for its gradient's reduce-scatter
  (gathering again would add a loop for each layer but the first)."""
  step, args = _fsdp(layers)
  text = jax.jit(jaxcoll.use(step, collective_matmul=True)).lower(*args).as_text()
  assert text.count("stablehlo.while") == text.count("collective_permute") == 2 * layers


@pytest.mark.quick
def test_the_decision_is_made_in_one_place():
  opts = Options("auto", None, None)
  assert opts.matmul_for("all_gather", ("x",), jnp.float32, 4096) is None   # the CPU
  asked = Options("auto", None, None, collective_matmul=True)
  assert asked.matmul_for("all_gather", ("x",), jnp.float32, 4096) == {"algorithm": "native"}
  ring = Options("ring", None, None, collective_matmul=True)
  assert ring.matmul_for("reduce_scatter", ("x",), jnp.float32, 4096) is not None
  assert ring.matmul_for("all_reduce", ("x",), jnp.float32, 4096) is not None
  assert asked.matmul_for("all_reduce", ("x",), jnp.float32, 4096) is None   # auto: XLA's
  other = Options({"all_gather": "bruck"}, None, None, collective_matmul=True)
  assert other.matmul_for("all_gather", ("x",), jnp.float32, 4096) is None
  lossy = Options("auto", "int8", None, collective_matmul=True)
  assert lossy.matmul_for("reduce_scatter", ("x",), jnp.float32, 4096) is None
  assert lossy.matmul_for("reduce_scatter", ("x",), jnp.float32, 4096,
                          gradient=False) is not None   # a forward sum travels exact anyway
  off = Options("auto", None, None, collective_matmul=False)
  assert off.matmul_for("all_gather", ("x",), jnp.float32, 4096) is None


def test_collective_matmul_that_is_no_bool_is_refused_by_name():
  with pytest.raises(TypeError, match=r"use\(collective_matmul=...\)=1"):
    jaxcoll.use(lambda x: x, collective_matmul=1)
