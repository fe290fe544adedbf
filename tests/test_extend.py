"""``jaxcoll.register``: an algorithm from a file outside ``jaxcoll/`` (tests/outside/) runs
through the collectives, auto, explain and the simulator, and is held to the checks every
built-in schedule passes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxcoll
from tests.helpers import per_device
from tests.outside import chain_all_reduce as outside

NAME = outside.NAME
pytestmark = pytest.mark.quick


@pytest.fixture
def installed():
  outside.install()
  yield
  jaxcoll.tools.unregister("all_reduce", NAME)
  assert NAME not in jaxcoll.algorithms("all_reduce")


def test_it_runs_like_the_lax_collective_and_differentiates(installed):
  assert NAME in jaxcoll.algorithms("all_reduce")
  x = jnp.asarray(np.random.default_rng(0).standard_normal((8, 37)), jnp.float32)
  got = per_device(lambda v: jaxcoll.all_reduce(v, "x", algorithm=NAME), 8)(x)
  want = per_device(lambda v: jax.lax.psum(v, "x"), 8)(x)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  loss = lambda f: lambda v: jnp.sum(per_device(f, 8)(v) ** 2)   # noqa: E731
  np.testing.assert_allclose(
      jax.grad(loss(lambda v: jaxcoll.all_reduce(v, "x", algorithm=NAME)))(x),
      jax.grad(loss(lambda v: jax.lax.psum(v, "x")))(x), rtol=1e-5, atol=1e-4)


def test_explain_prices_it_and_auto_or_an_override_runs_it(installed):
  x = jax.ShapeDtypeStruct((1024,), np.float32)
  why = jaxcoll.explain("all_reduce", x, {"x": 8}, "x")
  row, = [r for r in why.rows if r.algorithm == NAME]
  assert (row.steps, row.bytes["x"]) == (14, 2 * 4096)   # its formula: 2(N-1) steps, 2 M
  with jaxcoll.config(algorithm={"all_reduce": NAME}):
    assert jaxcoll.explain("all_reduce", x, {"x": 8}, "x").chosen == NAME
  # auto's own pick, priced as every schedule: a profile where one step is nearly free and
  # the lax collective slow makes the chain the fastest of all
  cheap = jaxcoll.Profile(links={"*": jaxcoll.Link(1e-9, 1e-15)}, basis="given",
                          native=(jaxcoll.NativeTimes("all_reduce", (8,), (1.0,), (1e3,)),))
  priced = jaxcoll.explain("all_reduce", x, {"x": 8}, "x", cheap)
  assert {r.algorithm for r in priced.rows} >= {NAME, "ring", "native"}


def test_the_simulator_and_hierarchical_stages_take_it(installed):
  for n in range(1, 9):
    jaxcoll.schedule("all_reduce", NAME, n).check()
  hier = jaxcoll.Hierarchical((NAME, "ring"))
  x = jnp.arange(8 * 16, dtype=jnp.float32).reshape(8, 16)
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("a", "b"))
  f = jax.jit(jax.shard_map(lambda v: jaxcoll.all_reduce(v, ("a", "b"), algorithm=hier),
                            mesh=mesh, in_specs=jax.P(("a", "b")), out_specs=jax.P(("a", "b"))))
  np.testing.assert_array_equal(f(x), np.tile(np.asarray(x).sum(0), (8, 1)))


def test_a_wrong_schedule_is_refused_and_nothing_stays_registered():
  def wrong(n):   # forgets the broadcast: only rank 0 ends with the sum
    return jaxcoll.Schedule("all_reduce", "half_chain", n, 1, outside.chain_then_broadcast(n)
                            .steps[:n - 1])
  with pytest.raises(AssertionError, match=r"half_chain.* on 2 ranks .*rank 1"):
    jaxcoll.register("all_reduce", "half_chain")(wrong)
  assert "half_chain" not in jaxcoll.algorithms("all_reduce")


def test_a_formula_that_disagrees_is_refused():
  with pytest.raises(ValueError, match=r"takes 2 steps .*formula says 1"):
    jaxcoll.register("all_reduce", "chain2", formula=lambda n: (n - 1, 1.0))(
        outside.chain_then_broadcast)
  assert "chain2" not in jaxcoll.algorithms("all_reduce")


@pytest.mark.parametrize("kwargs,match", [
    (dict(primitive="psum", name="x"), "primitive='psum' is not a collective"),
    (dict(primitive="all_reduce", name="auto"), "name='auto': expected an identifier"),
    (dict(primitive="all_reduce", name="ring"), "already has an algorithm"),
    (dict(primitive="all_reduce", name="a b"), "expected an identifier"),
    (dict(primitive="all_reduce", name="x", num_axes=0), "num_axes=0"),
    (dict(primitive="all_reduce", name="x", tune={"pipeline": 4}), "tune="),
    (dict(primitive="all_reduce", name="x", check_sizes=()), "check_sizes="),
])
def test_bad_arguments_are_named(kwargs, match):
  with pytest.raises(ValueError, match=match):
    jaxcoll.register(**kwargs)


def test_a_builder_returning_something_else_is_named():
  with pytest.raises(ValueError, match=r"builder returned None for axis_size=1"):
    jaxcoll.register("all_reduce", "nothing")(lambda n: None)
  assert "nothing" not in jaxcoll.algorithms("all_reduce")
  with pytest.raises(ValueError, match="no algorithm of that name"):
    jaxcoll.tools.unregister("all_reduce", "nothing")


def test_a_failed_replacement_keeps_the_algorithm_it_would_replace(installed):
  def wrong(n):
    return jaxcoll.Schedule("all_reduce", NAME, n, 1, outside.chain_then_broadcast(n)
                            .steps[:n - 1])
  with pytest.raises(AssertionError, match="rank 1"):
    jaxcoll.register("all_reduce", NAME, replace=True)(wrong)
  assert NAME in jaxcoll.algorithms("all_reduce")
  jaxcoll.schedule("all_reduce", NAME, 5).check()          # the original builder again
  rows = jaxcoll.explain("all_reduce", jax.ShapeDtypeStruct((8,), np.float32), {"x": 8},
                         "x").rows
  assert NAME in {r.algorithm for r in rows}                # and auto weighs it again
