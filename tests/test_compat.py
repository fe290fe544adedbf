"""The private jax names in ``jaxcoll._src.compat`` still exist and do what it relies on."""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import pytest

from jaxcoll._src import compat

pytestmark = pytest.mark.quick   # also on the oldest supported jax (.ci/run)


def test_running_jax_is_a_supported_version():
  assert compat.OLDEST <= compat.JAX_VERSION
  assert compat.JAX_VERSION[:2] <= compat.NEWEST_MINOR, (
      f"jax {jax.__version__} is newer than the newest tested minor release "
      f"{compat.NEWEST_MINOR}: run the suite on it, then raise NEWEST_MINOR and pyproject's cap")


@pytest.mark.parametrize("text,want", [
    ("0.10.2", (0, 10, 2)), ("0.12.0.1", (0, 12, 0)), ("0.13.0rc1", (0, 13, 0)),
    ("0.12.1.dev20261201", (0, 12, 1))])
def test_version_parsing(text, want):
  assert compat._version(text) == want


def test_trace_state_clean_sees_every_transformation():
  assert compat.trace_state_clean()
  seen = []

  def f(x):
    seen.append(compat.trace_state_clean())
    return x

  jax.jit(f)(1.0)
  jax.vmap(f)(jnp.ones(2))
  jax.grad(f)(1.0)
  assert seen == [False, False, False]


def test_gloo_backend_factory_internals_still_exist():
  from jax._src import distributed, xla_bridge
  from jax._src.lib import _jax
  assert hasattr(distributed.global_state, "client")
  assert "collectives" in inspect.signature(xla_bridge.make_cpu_client).parameters
  params = inspect.signature(xla_bridge.register_backend_factory).parameters
  assert {"priority", "fail_quietly"} <= set(params)
  assert "hostname" in (_jax.make_gloo_tcp_collectives.__doc__ or "")
  assert callable(jax.distributed.is_initialized) and not jax.distributed.is_initialized()


def test_distributed_key_value_store_internals_still_exist():
  """topology's host table goes through the distributed client's key-value store."""
  from jax._src.lib import _jax
  for name in ("key_value_set", "blocking_key_value_get"):
    assert hasattr(_jax.DistributedRuntimeClient, name)
  assert compat.distributed_client() is None    # not in a job here


def test_a_custom_jvp_rule_is_read_as_its_jaxpr():
  """jaxcoll.use runs a custom_jvp rule from its jaxpr (params["jvp_jaxpr_fun"]): primals,
  then tangents, in; primals out, then the tangents not symbolically zero."""
  @jax.custom_jvp
  def f(x, y):
    return jnp.sin(x) * y

  f.defjvp(lambda p, t: (f(*p), 3.0 * t[0] + 5.0 * t[1]))
  (eqn,) = [e for e in jax.make_jaxpr(f)(1.0, 2.0).jaxpr.eqns
            if e.primitive.name == "custom_jvp_call"]
  jaxpr, consts, out_zeros = compat.custom_jvp_rule(eqn.params)
  assert out_zeros == [False]
  primal, tangent = jax.core.eval_jaxpr(jaxpr, consts, 1.0, 2.0, 10.0, 100.0)
  assert primal == pytest.approx(jnp.sin(1.0) * 2.0) and tangent == pytest.approx(530.0)


def test_sub_jaxprs_and_their_consts_are_read_on_both_versions():
  closed = jax.make_jaxpr(lambda x: jax.lax.cond(x > 0, jnp.sin, jnp.cos, x))(1.0)
  (cond,) = [e for e in closed.jaxpr.eqns if e.primitive.name == "cond"]
  subs = compat.sub_jaxprs(cond.params)
  assert len(subs) == 2
  for sub in subs:
    jaxpr, consts = compat.open_jaxpr(sub)
    assert len(jaxpr.invars) == 1 and consts == []


def test_shard_map_reads_out_specs_after_tracing_its_body():
  """``compat.shard_map_specs_after``: the specs the body returns as it is traced are the
  out_specs (a split output comes back split, a replicated one whole), traced once."""
  import numpy as np
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P
  mesh = jax.make_mesh((4,), ("x",), devices=jax.devices()[:4],
                       axis_types=(jax.sharding.AxisType.Auto,))
  traces = []

  def body(a):
    traces.append(1)
    return [a * 2, jax.lax.psum(a, "x")], [P("x"), P()]

  a = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("x")))
  split, total = jax.jit(compat.shard_map_specs_after(body, mesh=mesh, in_specs=(P("x"),)))(a)
  np.testing.assert_array_equal(split, np.arange(8.0) * 2)
  np.testing.assert_array_equal(total, np.arange(8.0).reshape(4, 2).sum(0))
  assert split.sharding.spec == P("x") and total.sharding.is_fully_replicated
  assert len(traces) == 1


@pytest.mark.parametrize("partitionable", [True, False])
def test_an_equations_threefry_mode_is_read_on_both_versions(partitionable):
  """jax 0.12.1 moved ``eqn.ctx``'s settings into a tuple; both layouts read alike, and
  ``equation_config`` traces random bits as the equation was traced."""
  with jax.threefry_partitionable(partitionable):
    jaxpr = jax.make_jaxpr(lambda k: jax.random.bits(k, (4, 8)))(jax.random.key(0))
    want = jax.random.bits(jax.random.key(0), (4, 8))
  eqn = jaxpr.jaxpr.eqns[-1]
  assert compat.threefry_partitionable(eqn) is partitionable
  with jax.threefry_partitionable(not partitionable), compat.equation_config(eqn):
    got = jax.random.bits(jax.random.key(0), (4, 8))
  assert (got == want).all()


def test_a_jitted_functions_static_and_donated_arguments_are_read():
  def f(x, n, *, k):
    return x * n * k
  jitted = jax.jit(f, static_argnames=("n",), donate_argnums=0)
  static, static_names, donated, _ = compat.jit_arguments(jitted)
  assert 1 in static and "n" in static_names and donated == {0}
  assert compat.jit_arguments(f) is None
  assert compat.jit_arguments(jax.jit(f)) == (frozenset(), frozenset(), frozenset(),
                                              frozenset())


def test_vmaps_spmd_axes_are_read_on_both_versions():
  seen = []

  def f(x):
    seen.append(compat.vmap_spmd_axes())
    return x

  jax.vmap(f, spmd_axis_name="x")(jnp.ones((2, 3)))
  f(jnp.ones(3))
  assert seen == [frozenset({"x"}), frozenset()]
