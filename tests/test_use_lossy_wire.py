"""A lossy wire under ``jaxcoll.use`` rounds gradients, each on blocks of its own, and nothing
else.

The step of the issue that found it: an MLP with a LayerNorm whose loss is returned beside
its new parameters (``value_and_grad``), on a data-parallel mesh and a data x model one.
Before, the loss's per-device term was packed into the gradients' bucket and shared a
256-value block (one scale) with the bias and LayerNorm gradients, whose int8 errors then
grew 4-5x; with ``optax.lamb`` on 2x4 the LayerNorm scale ended as far from jit's as jit
had moved it. Here:

- the loss a user logs equals jit's within float32 summation order (a loss, a metric and
  tensor parallelism's forward sums are not gradients: they travel exact);
- the int8 errors of the small gradients (128 values, compressed on their own blocks) are
  the same, within 2x, whether the loss is returned or not;
- ten Lamb steps on 2x4 move every parameter to within 3x of jit's own movement of it;
- ``sync_gradients`` packs each leaf on blocks of its own: a small gradient beside a large
  one errs by its own block's step, not the large one's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_close_after_sums, per_device
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcoll

pytestmark = pytest.mark.quick   # reads jaxprs (the backward pass's equations): every jax

H, B, DIN, DOUT = 128, 256, 32, 8
SHAPES = {"w1": (DIN, H), "b1": (H,), "scale": (H,), "bias": (H,), "w2": (H, DOUT),
          "b2": (DOUT,)}
SMALL = ("b1", "scale", "bias")


def loss_fn(p, x, y):
  h = x @ p["w1"] + p["b1"]
  mu = jnp.mean(h, -1, keepdims=True)
  var = jnp.mean((h - mu) ** 2, -1, keepdims=True)
  h = (h - mu) * jax.lax.rsqrt(var + 1e-5) * p["scale"] + p["bias"]
  return jnp.mean((jax.nn.relu(h) @ p["w2"] + p["b2"] - y) ** 2)


def setup(layout: str):
  if layout == "dp":
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    specs = {k: P() for k in SHAPES}
  else:
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    specs = {"w1": P(None, "model"), "b1": P("model"), "scale": P("model"),
             "bias": P("model"), "w2": P("model", None), "b2": P()}
  k = jax.random.split(jax.random.key(0), 4)
  params = {"w1": jax.random.normal(k[0], SHAPES["w1"]) / 6, "b1": jnp.zeros(H),
            "scale": jnp.ones(H), "bias": jnp.zeros(H),
            "w2": jax.random.normal(k[1], SHAPES["w2"]) / 8, "b2": jnp.zeros(DOUT)}
  params = {n: jax.device_put(v, NamedSharding(mesh, specs[n])) for n, v in params.items()}
  data = NamedSharding(mesh, P("data"))
  x = jax.device_put(jax.random.normal(k[2], (B, DIN)), data)
  y = jax.device_put(jax.random.normal(k[3], (B, DOUT)), data)
  return mesh, params, x, y


@pytest.mark.parametrize("layout", ["dp", "dp_tp"])
def test_the_loss_a_user_logs_is_jits(layout):
  mesh, params, x, y = setup(layout)
  step = jax.jit(jax.value_and_grad(loss_fn))
  with jax.set_mesh(mesh):
    want, _ = step(params, x, y)
    got, _ = jaxcoll.use(step, algorithm="ring", wire_dtype="int8")(params, x, y)
  assert_close_after_sums(got, want, terms=B * DOUT * H)


def test_small_gradients_err_alike_with_and_without_the_loss():
  mesh, params, x, y = setup("dp")
  with_loss = jax.jit(jax.value_and_grad(loss_fn))
  without = jax.jit(jax.grad(loss_fn))
  with jax.set_mesh(mesh):
    want = without(params, x, y)
    _, got_with = jaxcoll.use(with_loss, algorithm="ring", wire_dtype="int8")(params, x, y)
    got_without = jaxcoll.use(without, algorithm="ring", wire_dtype="int8")(params, x, y)
  for k in SMALL:
    a = float(jnp.max(jnp.abs(got_with[k] - want[k])))
    b = float(jnp.max(jnp.abs(got_without[k] - want[k])))
    assert 0 < a <= 2 * b and 0 < b <= 2 * a, (k, a, b)   # rounded (compressed), alike


def test_lamb_on_an_int8_wire_moves_every_parameter_as_jit_does():
  mesh, params, x, y = setup("dp_tp")
  tx = optax.lamb(1e-2)

  @jax.jit
  def step(p, s, x, y):
    loss, g = jax.value_and_grad(loss_fn)(p, x, y)
    updates, s = tx.update(g, s, p)
    return optax.apply_updates(p, updates), s, loss

  used = jaxcoll.use(step, algorithm="ring", wire_dtype="int8")
  want = got = (params, tx.init(params))
  with jax.set_mesh(mesh):
    for _ in range(10):
      *want, _ = step(*want, x, y)
      *got, _ = used(*got, x, y)
  for k in SHAPES:
    moved = float(jnp.max(jnp.abs(want[0][k] - params[k])))
    apart = float(jnp.max(jnp.abs(got[0][k] - want[0][k])))
    assert apart <= 3 * moved, (k, apart, moved)


def test_sync_gradients_puts_each_leaf_on_blocks_of_its_own():
  """A gradient of 128 values near 0.01 packed after one of 4096 values near 100: each
  all-reduce step rounds a block to at most eps of its own largest value, so the small
  leaf's error after the sum of 8 devices is bounded by its own magnitude, 1e4 times below
  what sharing the large leaf's blocks would allow."""
  n = 8
  rng = np.random.default_rng(0)
  big = jnp.asarray(rng.standard_normal((n, 4096)) * 100, jnp.float32)
  small = jnp.asarray(rng.standard_normal((n, 128)) * 0.01, jnp.float32)
  sync = per_device(lambda g: jaxcoll.sync_gradients(g, "x", op="sum", algorithm="ring",
                                                     wire_dtype="int8"), n, check_vma=False)
  got = sync({"big": big, "small": small})
  want = small.sum(0)
  eps = jaxcoll.WireFormat("int8").relative_error
  bound = 2 * n * eps * float(jnp.max(jnp.abs(jnp.cumsum(small, 0))))   # per step, own scale
  err = float(jnp.max(jnp.abs(got["small"][0] - want)))
  assert 0 < err <= bound, (err, bound)
