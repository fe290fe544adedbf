"""jaxcoll.use on a training step written for global arrays (pjit style, no shard_map).

The step below is what JAX's distributed-arrays notebook and flax's examples write: a loss,
``jax.grad``, an optax update, on arrays laid out over a 4 x 2 mesh (batch split 4 ways,
the hidden layer's weights split 2 ways). Plain ``jax.jit`` leaves every collective to
XLA's partitioner; ``jaxcoll.use(step)`` runs the same step per device in one shard_map
with jaxcoll's collectives where values change layout, the gradient sums together in
buckets. ``jaxcoll.explain_step`` prints each collective, the equation it serves and its
source line, and counts the compiled step's collectives.

  python examples/pjit_training.py
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxcoll  # noqa: E402

optimizer = optax.adam(1e-2)


def loss_fn(params, batch):
  x, y = batch
  h = jax.nn.relu(x @ params["w1"] + params["b1"])
  logits = h @ params["w2"] + params["b2"]
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def step(params, opt_state, batch):
  loss, grads = jax.value_and_grad(loss_fn)(params, batch)
  updates, opt_state = optimizer.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, loss


def main():
  mesh = jax.make_mesh((4, 2), ("batch", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  rng = np.random.default_rng(0)
  params = {"w1": rng.normal(size=(32, 64)) / 6, "b1": np.zeros(64),
            "w2": rng.normal(size=(64, 10)) / 8, "b2": np.zeros(10)}
  specs = {"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None), "b2": P()}
  params = {k: jax.device_put(jnp.asarray(v, jnp.float32), NamedSharding(mesh, specs[k]))
            for k, v in params.items()}
  x = rng.normal(size=(64, 32)).astype(np.float32)
  y = (x[:, :10].argmax(axis=1)).astype(np.int32)
  batch = jax.device_put((x, y), NamedSharding(mesh, P("batch")))
  opt_state = optimizer.init(params)

  with jax.set_mesh(mesh):
    plain = jax.jit(step)
    ours = jaxcoll.use(step, algorithm="ring")
    a = b = (params, opt_state)
    for i in range(20):
      *a, loss_jit = plain(*a, batch)
      *b, loss_use = ours(*b, batch)
      if i % 5 == 0 or i == 19:
        print(f"step {i:2d}  loss jit {float(loss_jit):.6f}  jaxcoll.use {float(loss_use):.6f}")
    np.testing.assert_allclose(loss_use, loss_jit, rtol=1e-5)
    print(jaxcoll.explain_step(ours, *b, batch).table())


if __name__ == "__main__":
  main()
