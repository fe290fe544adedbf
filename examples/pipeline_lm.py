"""A small transformer language model trained over 4 pipeline stages x 2 data replicas
(``jaxcoll.pipeline``, 1F1B), to the same losses as the unpipelined model.

Eight CPU devices as a ("data", "stage") = 2 x 4 mesh: each stage one pre-norm transformer
block, 8 microbatches, the gradients of each stage synced over "data". The token embedding
and the output projection sit outside the pipeline and stay fixed here (``run`` returns
the stages' gradients). The same model is trained unpipelined (``jax.value_and_grad`` of
the blocks in sequence on the whole batch), and the two loss curves are printed side by
side.

  python examples/pipeline_lm.py
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxcoll  # noqa: E402

VOCAB, D, HIDDEN, SEQ, STAGES, MICRO, ROWS, STEPS, LR = 64, 32, 64, 16, 4, 8, 4, 20, 0.1


def block_init(key):
  k = jax.random.split(key, 6)
  w = lambda kk, a, b: jax.random.normal(kk, (a, b)) / np.sqrt(a)   # noqa: E731
  return {"ln": jnp.ones(D), "wq": w(k[0], D, D), "wk": w(k[1], D, D), "wv": w(k[2], D, D),
          "wo": w(k[3], D, D), "w1": w(k[4], D, HIDDEN), "w2": w(k[5], HIDDEN, D)}


def block(p, x):
  """A pre-norm causal transformer block (one head) on x [rows, SEQ, D]."""
  h = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * p["ln"]
  q, k, v = h @ p["wq"], h @ p["wk"], h @ p["wv"]
  scores = q @ jnp.swapaxes(k, -1, -2) / np.sqrt(D)
  scores = jnp.where(jnp.tril(jnp.ones((SEQ, SEQ), bool)), scores, -1e9)
  x = x + (jax.nn.softmax(scores, axis=-1) @ v) @ p["wo"]
  return x + jax.nn.gelu(x @ p["w1"]) @ p["w2"]


def main() -> None:
  keys = jax.random.split(jax.random.key(0), STAGES + 3)
  blocks = [block_init(k) for k in keys[:STAGES]]
  embed = jax.random.normal(keys[-3], (VOCAB, D))
  unembed = jax.random.normal(keys[-2], (D, VOCAB)) / np.sqrt(D)
  tokens = jax.random.randint(keys[-1], (MICRO, 2 * ROWS, SEQ + 1), 0, VOCAB)
  x, targets = embed[tokens[..., :-1]], tokens[..., 1:]   # [M, rows, SEQ, D], [M, rows, SEQ]

  def loss_fn(h, target):   # the output projection and next-token cross-entropy
    logits = h @ unembed
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), target[..., None], -1))

  def unpipelined(blocks, x, targets):
    def one(xm, tm):
      h = xm
      for p in blocks:
        h = block(p, h)
      return loss_fn(h, tm)
    return jnp.mean(jax.vmap(one)(x, targets))

  mesh = Mesh(np.array(jax.devices()).reshape(2, STAGES), ("data", "stage"))

  def pipelined(w, x, targets):
    loss, grads = jaxcoll.pipeline.run(block, w, x, targets, "stage", loss_fn=loss_fn,
                                       schedule="1f1b")
    return jaxcoll.all_reduce(loss, "data", op="mean"), jaxcoll.sync_gradients(grads, "data")

  pipe_step = jax.jit(jax.shard_map(pipelined, mesh=mesh,
                                    in_specs=(P("stage"), P(None, "data"), P(None, "data")),
                                    out_specs=(P(), P("stage"))))
  ref_step = jax.jit(jax.value_and_grad(unpipelined))
  sgd = jax.jit(lambda w, g: jax.tree.map(lambda a, b: a - LR * b, w, g))

  print(jaxcoll.pipeline.schedule("1f1b", STAGES, MICRO))
  w_pipe, w_ref = jaxcoll.pipeline.stack(blocks, STAGES), blocks
  print("step | pipelined loss | unpipelined loss")
  for step in range(STEPS):
    loss_p, g_p = pipe_step(w_pipe, x, targets)
    loss_r, g_r = ref_step(w_ref, x, targets)
    w_pipe, w_ref = sgd(w_pipe, g_p), sgd(w_ref, g_r)
    if step % 5 == 0 or step == STEPS - 1:
      print(f"{step:4d} | {float(loss_p):.6f} | {float(loss_r):.6f}")
  np.testing.assert_allclose(float(loss_p), float(loss_r), rtol=1e-4)
  print("final losses equal within 1e-4")


if __name__ == "__main__":
  main()
