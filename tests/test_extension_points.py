"""Extensions written outside ``jaxcoll/`` (tests/outside/), each added in one declaration, as
an algorithm already is (tests/test_extend.py): a wire format, a router for
``jaxcoll.moe.layer``, a per-device rule for ``jaxcoll.use``, and a config setting. Each runs
through everything that reads its table and is checked against a reference jaxcoll did not
compute."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcoll
from jaxcoll import moe
from jaxcoll.extend import (
  config_field,
  register_spmd_rule,
  register_wire_format,
  remove_config_field,
  setting,
  unregister_spmd_rule,
  unregister_wire_format,
)
from tests.helpers import per_device
from tests.outside import doubling_primitive, float16_wire, mixtral_router

pytestmark = pytest.mark.quick
B = 256


# ---- a wire format ----

@pytest.fixture
def float16():
  register_wire_format(float16_wire.FLOAT16)
  yield "float16"
  unregister_wire_format("float16")
  assert "float16" not in jaxcoll.wire_dtypes()


def test_an_undeclared_wire_format_is_refused_by_name():
  with pytest.raises(ValueError, match=r"wire_dtype='float16': expected one of \("):
    jaxcoll.WireFormat("float16")


@pytest.mark.parametrize("algorithm", ["ring", "halving_doubling"])
def test_a_declared_wire_format_runs_through_the_collectives(float16, algorithm):
  """Replicas bit-identical, the sum within one encode per step of the declared bound,
  infinities where lax puts them; auto never picks native for it; explain prices its
  bytes."""
  assert float16 in jaxcoll.wire_dtypes()
  n = 6
  rng = np.random.default_rng(0)
  x = (rng.standard_normal((n, 4 * B)) * 10.0 ** rng.uniform(-20, 20, (n, 4, 1)).repeat(B, 1)
       .reshape(n, 4 * B)).astype(np.float32)
  x[2, 5] = np.inf
  f = per_device(lambda v: jaxcoll.all_reduce(v, "x", algorithm=algorithm, wire_dtype=float16), n)
  y = np.asarray(f(x))
  for r in range(1, n):
    np.testing.assert_array_equal(y[r].view(np.uint32), y[0].view(np.uint32))
  exact = x.astype(np.float64).sum(0)
  finite = np.isfinite(exact)
  assert np.isposinf(y[0][~finite]).all()
  steps = jaxcoll.schedule("all_reduce", algorithm, n).num_steps + 1
  blocks = np.where(np.isfinite(x), np.abs(x), 0).reshape(n, 4, B).max(-1).sum(0).repeat(B)
  bound = steps * (float16_wire.FLOAT16.relative_error + 2.0 ** -23) * blocks
  with np.errstate(invalid="ignore"):   # inf - inf where the sum is inf
    err = np.abs(y[0] - exact)
  assert np.all(err[finite] <= bound[finite])
  why = jaxcoll.explain("all_reduce", jax.ShapeDtypeStruct((4 * B,), jnp.float32), {"x": n}, "x",
                        wire_dtype=float16)
  assert why.chosen != "native" and why.wire_dtype == float16
  assert jaxcoll.WireFormat(float16).ratio(np.float32) == pytest.approx((2 + 1 / B) / 4)


def test_a_declared_wire_format_compresses_use_and_the_gradient_sync(float16):
  """``use(wire_dtype=...)`` and ``sync_gradients(wire_dtype=...)`` read the same table."""
  n = 4
  x = np.random.default_rng(1).standard_normal((n, B)).astype(np.float32)
  body = lambda v: jax.lax.psum(v, "x")   # noqa: E731
  got = per_device(jaxcoll.use(body, algorithm="ring", wire_dtype=float16), n)(x)
  synced = per_device(lambda v: jaxcoll.sync_gradients({"g": v}, "x", op="sum", algorithm="ring",
                                                       wire_dtype=float16)["g"], n)(x)
  want = x.sum(0)
  bound = 8 * (2.0 ** -11) * np.abs(x).max(-1).sum()
  np.testing.assert_allclose(np.asarray(got)[0], want, atol=bound)
  np.testing.assert_allclose(np.asarray(synced)[0], want, atol=bound)
  assert not np.array_equal(np.asarray(got)[0], want)   # it did travel as float16


def test_a_wire_format_declaration_is_checked():
  with pytest.raises(ValueError, match="already declared"):
    register_wire_format(jaxcoll.extend.WireElement("int8", 0.01, 126.0, integer=True))
  with pytest.raises(ValueError, match="finite_max=1e\\+30 must be in"):
    register_wire_format(jaxcoll.extend.WireElement("float16", 0.001, finite_max=1e30))
  with pytest.raises(ValueError, match="built in"):
    unregister_wire_format("int8")


# ---- a router ----

@pytest.fixture
def mixtral():
  moe.register_router(mixtral_router.MIXTRAL)
  yield "mixtral"
  moe.unregister_router("mixtral")


def _swiglu(w, h):
  return (jax.nn.silu(h @ w["w_gate"]) * (h @ w["w_up"])) @ w["w_out"]


def test_a_declared_router_runs_in_the_layer_as_mixtral_routes(mixtral):
  """``layer(router="mixtral")`` over 4 devices equals Mixtral's routing done densely: each
  token's top-k experts by logit, gated by the softmax of those k logits."""
  n, t, d, f, e, k = 4, 16, 8, 16, 8, 2
  params = moe.init_layer(jax.random.key(0), d, f, e)
  x = jax.random.normal(jax.random.key(1), (n, t, d))
  mesh = Mesh(np.array(jax.devices()[:n]), ("x",))
  specs = {w: P("x") if w != "router" else P() for w in params}

  def step(params, x):
    return moe.layer(params, x[0], axis_name="x", k=k, router=mixtral,
                     capacity_factor=None)[0][None]
  got = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(specs, P("x")), out_specs=P("x")))(
      params, x)
  tokens = x.reshape(n * t, d)
  logits = np.asarray(tokens @ params["router"], np.float64)
  want = np.zeros((n * t, d))
  experts = [_swiglu({w: params[w][j] for w in ("w_gate", "w_up", "w_out")}, tokens)
             for j in range(e)]
  for i in range(n * t):
    top = np.argsort(-logits[i])[:k]
    gates = np.exp(logits[i, top] - logits[i, top].max())
    gates /= gates.sum()
    want[i] = sum(g * np.asarray(experts[j][i], np.float64) for g, j in zip(gates, top))
  np.testing.assert_allclose(np.asarray(got).reshape(n * t, d), want, rtol=1e-4, atol=1e-5)


def test_a_router_s_options_are_checked_from_its_declaration(mixtral):
  params = moe.init_layer(jax.random.key(0), 8, 16, 4)
  with pytest.raises(ValueError, match="key applies to router='softmax'; this layer's router "
                                       "is 'mixtral'"):
    moe.layer(params, jnp.ones((4, 8)), axis_name="x", router=mixtral, key=jax.random.key(0))
  with pytest.raises(ValueError, match="already declared"):
    moe.register_router(mixtral_router.MIXTRAL)
  with pytest.raises(ValueError, match=r"options \['temperature'\] the layer does not have"):
    moe.register_router(moe.Router("hot", mixtral_router.top_k_softmax, {"temperature": 1.0}))


# ---- a per-device rule for use ----

@pytest.fixture
def doubling():
  register_spmd_rule(*doubling_primitive.RULE)
  yield
  unregister_spmd_rule(doubling_primitive.RULE[0])


def _doubling_program():
  mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
  x = jax.device_put(jnp.arange(64.0).reshape(8, 8), NamedSharding(mesh, P("x")))
  step = jax.jit(lambda v: doubling_primitive.double(jnp.sin(v)).sum(0))
  return step, x


def test_an_outside_primitive_is_refused_under_strict_without_its_rule():
  step, x = _doubling_program()
  with pytest.raises(ValueError, match="double"):
    jaxcoll.use(step, strict=True)(x)


def test_a_declared_rule_runs_the_outside_primitive_per_device(doubling):
  """With its rule the primitive runs on each device's rows (no gather), the sum over the
  split rows is one jaxcoll all_reduce, and the result equals jit's."""
  step, x = _doubling_program()
  got = jaxcoll.use(step, strict=True, algorithm="ring")(x)
  np.testing.assert_allclose(got, step(x), rtol=1e-6)
  report = jaxcoll.explain_step(jaxcoll.use(step, strict=True, algorithm="ring"), x)
  assert [(c.what, c.algorithm) for c in report.collectives] == [("all_reduce", "ring")]
  assert not [line for line in report.lines if line.kind != "jaxcoll"], report
  with pytest.raises(ValueError, match="primitive 'sin' is already declared"):
    register_spmd_rule("sin", "cos")


# ---- a config setting ----

def test_a_declared_setting_is_set_scoped_read_from_its_variable_and_checked(monkeypatch):
  def check(value, name):
    if not isinstance(value, int) or value < 1:
      raise ValueError(f"config({name}={value!r}): expected a positive int")
    return value
  config_field("chunks", default=4, check=check, env="JAXCOLL_CHUNKS", parse=int)
  try:
    assert setting("chunks") == 4
    monkeypatch.setenv("JAXCOLL_CHUNKS", "6")
    assert setting("chunks") == 6
    with jaxcoll.config(chunks=8):
      assert setting("chunks") == 8
    assert setting("chunks") == 6
    with pytest.raises(ValueError, match=r"config\(chunks=0\): expected a positive int"):
      jaxcoll.config(chunks=0)
    monkeypatch.setenv("JAXCOLL_CHUNKS", "-1")
    with pytest.raises(ValueError, match="JAXCOLL_CHUNKS=-1"):
      setting("chunks")
  finally:
    remove_config_field("chunks")
  with pytest.raises(TypeError, match="unexpected keyword arguments \\['chunks'\\]"):
    jaxcoll.config(chunks=8)
