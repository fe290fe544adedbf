"""``jaxcoll.extend.varying``: which values of a per-device program differ between devices,
read off its jaxpr; and ``data_parallel`` refusing a step whose outputs are not synced.

Reads jaxprs, so it runs on every supported jax (the quick subset)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import AXIS, mesh
from jax import lax
from jax.sharding import PartitionSpec as P

import jaxcoll

pytestmark = pytest.mark.quick

X = frozenset({AXIS})
NONE = frozenset()


def outputs_vary(fn, *, check_vma=False, n=8):
  """``fn(w, b) -> tuple`` inside shard_map: w replicated, b per-device. The set of axes
  each output varies over, by :func:`jaxcoll.extend.varying` on the whole program."""
  w, b = jnp.ones((4,), jnp.float32), jnp.arange(8 * 4, dtype=jnp.float32).reshape(8, 4)
  f = jax.shard_map(lambda w, b: fn(w, b[0]), mesh=mesh(n), in_specs=(P(), P(AXIS)),
                    out_specs=P(), check_vma=check_vma)
  closed = jax.make_jaxpr(f)(w, b)
  return jaxcoll.extend.varying(closed.jaxpr, [NONE] * len(closed.consts), [NONE, X])


def differs_on_devices(fn, n=8) -> list[bool]:
  """The same question answered by running: does each output differ between devices?"""
  w, b = jnp.ones((4,), jnp.float32), jnp.arange(8 * 4, dtype=jnp.float32).reshape(8, 4)
  f = jax.jit(jax.shard_map(lambda w, b: jax.tree.map(lambda v: v[None], fn(w, b[0])),
                            mesh=mesh(n), in_specs=(P(), P(AXIS)), out_specs=P(AXIS),
                            check_vma=False))
  return [bool(np.any(np.asarray(o) != np.asarray(o)[:1])) for o in f(w, b)]


CASES = {
    "replicated only": lambda w, b: (w * 2,),
    "batch": lambda w, b: (w * b,),
    "psum": lambda w, b: (lax.psum(w * b, AXIS),),
    "pmean then more": lambda w, b: (lax.pmean(b, AXIS) * w + 1,),
    "pmax": lambda w, b: (lax.pmax(b, AXIS),),
    "all_gather": lambda w, b: (lax.all_gather(b, AXIS).sum(0),),
    "axis_index": lambda w, b: (w * lax.axis_index(AXIS),),
    "jaxcoll all_reduce ring": lambda w, b: (jaxcoll.all_reduce(b, AXIS, algorithm="ring"),),
    "jaxcoll broadcast": lambda w, b: (jaxcoll.broadcast(b, AXIS, algorithm="binomial_tree"),),
    "jaxcoll all_gather": lambda w, b: (jaxcoll.all_gather(b, AXIS, algorithm="ring").sum(0),),
    "jaxcoll reduce_scatter": lambda w, b: (
        jaxcoll.reduce_scatter(jnp.tile(b, 2), AXIS, tiled=True, algorithm="ring"),),
    "grad then sync": lambda w, b: (
        jaxcoll.sync_gradients(jax.grad(lambda v: jnp.sum(jnp.tanh(v * b)))(w), AXIS),),
    "grad unsynced": lambda w, b: (jax.grad(lambda v: jnp.sum(jnp.tanh(v * b)))(w),),
    "cond on a batch value": lambda w, b: (lax.cond(b[0] > 3, lambda v: v + 1, lambda v: v, w),),
    "cond on a synced value": lambda w, b: (
        lax.cond(lax.psum(b, AXIS)[0] > 3, lambda v: v + 1, lambda v: v, w),),
    "scan carrying the batch in": lambda w, b: (
        lax.scan(lambda c, x: (c * x + b, None), w, jnp.ones((3, 4)))[0],),
    "scan synced each step": lambda w, b: (
        lax.scan(lambda c, x: (lax.pmean(c * x + b, AXIS), None), w, jnp.ones((3, 4)))[0],),
    "while on a batch bound": lambda w, b: (
        lax.while_loop(lambda c: c[0] < b[0], lambda c: c + 1, w),),
    "while on a replicated bound": lambda w, b: (
        lax.while_loop(lambda c: c[0] < 5, lambda c: c + 1, w), lax.psum(b, AXIS)),
    "jit inside": lambda w, b: (jax.jit(lambda u, v: u * v)(w, b), jax.jit(jnp.sin)(w)),
    "remat": lambda w, b: (jax.checkpoint(lambda u: jnp.sin(u) * b)(w),),
    "custom_vjp sync": lambda w, b: (jaxcoll.sync_in_backward(w, AXIS) * 1.0,),
    "one of two outputs": lambda w, b: (w + 1, b + 1),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_varying_agrees_with_what_devices_hold(name):
  """Whatever the walk calls replicated is equal on every device when run; what it calls
  varying differs (these inputs make every per-device value differ)."""
  said = [bool(v & X) for v in outputs_vary(CASES[name])]
  assert said == differs_on_devices(CASES[name])


def test_varying_is_per_axis_on_a_tuple():
  """A psum over the inner axis only leaves a value varying over the outer one."""
  m = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("node", "local"))
  f = jax.shard_map(lambda b: (lax.psum(b, "local"), lax.psum(b, ("node", "local"))), mesh=m,
                    in_specs=P(("node", "local")), out_specs=P(), check_vma=False)
  closed = jax.make_jaxpr(f)(jnp.ones(8))
  both = frozenset({"node", "local"})
  assert jaxcoll.extend.varying(closed.jaxpr, [NONE] * len(closed.consts), [both]) == [
      frozenset({"node"}), NONE]


def test_the_walk_is_sound_not_exact():
  """A ppermute of a replicated value leaves every device the same value (each gets its
  neighbour's copy), but a ppermute is a per-device result: the walk says varying. It may
  call a replicated value varying, never the reverse."""
  fn = lambda w, b: (lax.ppermute(w, AXIS, [(i, (i + 1) % 8) for i in range(8)]),)  # noqa: E731
  assert differs_on_devices(fn) == [False]
  assert outputs_vary(fn) == [X]


def test_a_while_predicate_that_varies_makes_the_carry_vary():
  """The cond reads a batch value only through the predicate: each device runs the loop a
  different number of times, so the carry (w + count) differs."""
  got = outputs_vary(lambda w, b: (lax.while_loop(lambda c: c[1] < b[0],
                                                  lambda c: (c[0] + 1, c[1] + 1),
                                                  (w, 0.0))[0],))
  assert got == [X]


# ------------------------------------------------------------------ data_parallel

def loss(p, b):
  return jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)


def step_with(tx, sync=None):
  def step(params, state, batch):
    value, grads = jax.value_and_grad(loss)(params, batch)
    grads = sync(grads) if sync else grads
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, {"loss": value}
  return step


PARAMS = {"w": np.ones((4, 2), np.float32)}
BATCH = {"x": np.arange(64 * 4, dtype=np.float32).reshape(64, 4) / 100,
         "y": np.zeros((64, 2), np.float32)}


def test_data_parallel_refuses_a_step_that_never_syncs():
  """The plain optax step returned device 0's parameters, trained on 1/8 of the batch."""
  tx = optax.adam(0.1)
  with pytest.raises(ValueError, match=r"output \[0\]\['w'\] differs between the devices of "
                                       r"'x'.*jaxcoll\.sync_gradients"):
    jaxcoll.data_parallel(step_with(tx), mesh(8), AXIS)(PARAMS, tx.init(PARAMS), BATCH)


@pytest.mark.parametrize("how", ["sync_gradients", "pmean", "optax.sync", "optax.sync int8"])
def test_data_parallel_accepts_every_way_to_sync(how):
  sgd = optax.sgd(0.1)
  tx, sync = {
      "sync_gradients": (sgd, lambda g: jaxcoll.sync_gradients(g, AXIS)),
      "pmean": (sgd, lambda g: lax.pmean(g, AXIS)),
      "optax.sync": (optax.chain(jaxcoll.optax.sync(AXIS), sgd), None),
      "optax.sync int8": (optax.chain(jaxcoll.optax.sync(AXIS, wire_dtype="int8"), sgd), None),
  }[how]
  params, _, metrics = jaxcoll.data_parallel(step_with(tx, sync), mesh(8), AXIS)(
      PARAMS, tx.init(PARAMS), BATCH)
  value, grads = jax.value_and_grad(loss)(PARAMS, BATCH)   # one device, the whole batch
  np.testing.assert_allclose(metrics["loss"], value, rtol=1e-5)
  want = PARAMS["w"] - 0.1 * grads["w"]
  # int8: each of the ring's 2(N-1) hops errs by at most relative_error of a block's max
  bound = 0.1 * np.abs(grads["w"]).max() * 14 * jaxcoll.WireFormat("int8").relative_error
  np.testing.assert_allclose(params["w"], want, rtol=1e-5, atol=bound if "int8" in how else 0)


def test_data_parallel_batch_leaves_of_different_lengths_are_named():
  """64 and 32 rows would give each device 8 and 4: a broadcasting error from deep inside."""
  tx = optax.sgd(0.1)
  step = jaxcoll.data_parallel(step_with(tx, lambda g: jaxcoll.sync_gradients(g, AXIS)),
                               mesh(8), AXIS)
  batch = {"x": BATCH["x"], "y": BATCH["y"][:32]}
  with pytest.raises(ValueError, match=r"argument 2\['x'\] has 64 rows but argument "
                                       r"2\['y'\] has 32"):
    step(PARAMS, tx.init(PARAMS), batch)
