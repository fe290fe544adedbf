"""Training steps written "pjit style" (``jax.jit`` over sharded arrays), for ``use`` to run.

Public code, copied unchanged where it is cited:

- JAX's distributed-arrays notebook, "Examples: neural networks" (jax-ml/jax,
  ``docs/notebooks/Distributed_arrays_and_automatic_parallelization.md`` before commit
  a900877d84; the page's text at tag jax-v0.10.2): ``predict``, ``loss``, ``init_layer``,
  ``init_model`` and the body of its training loop (``notebook_step``);
- JAX's ``examples/spmd_mnist_classifier_fromscratch.py`` (jax-ml/jax): its
  ``init_random_params``, ``predict``, ``loss`` and ``train_step`` (``mnist_step``; the file
  decorates it with ``@jax.jit(donate_argnums=0)``, a form jax 0.10 lacks: the tests jit it).

The transformer language model (``lm_*``) is this package's: embedding lookup, layer norm,
causal attention with softmax, dropout, a ``lax.scan`` over stacked layers, a cross entropy
with ``one_hot``, and optax's Adam, as flax's and MaxText's models have them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import numpy.random as npr
import optax
from jax.scipy.special import logsumexp

# ---- jax-ml/jax docs/notebooks/Distributed_arrays_and_automatic_parallelization.md ----


def predict(params, inputs):
  for W, b in params:
    outputs = jnp.dot(inputs, W) + b
    inputs = jnp.maximum(outputs, 0)
  return outputs


def loss(params, batch):
  inputs, targets = batch
  predictions = predict(params, inputs)
  return jnp.mean(jnp.sum((predictions - targets)**2, axis=-1))


def init_layer(key, n_in, n_out):
  k1, k2 = jax.random.split(key)
  W = jax.random.normal(k1, (n_in, n_out)) / jnp.sqrt(n_in)
  b = jax.random.normal(k2, (n_out,))
  return W, b


def init_model(key, layer_sizes, batch_size):
  key, *keys = jax.random.split(key, len(layer_sizes))
  params = list(map(init_layer, keys, layer_sizes[:-1], layer_sizes[1:]))

  key, *keys = jax.random.split(key, 3)
  inputs = jax.random.normal(keys[0], (batch_size, layer_sizes[0]))
  targets = jax.random.normal(keys[1], (batch_size, layer_sizes[-1]))

  return params, (inputs, targets)


gradfun = jax.grad(loss)
step_size = 1e-5


def notebook_step(params, batch):
  """One pass of the notebook's training loop (``for _ in range(30): ...``)."""
  grads = gradfun(params, batch)
  params = [(W - step_size * dW, b - step_size * db)
            for (W, b), (dW, db) in zip(params, grads)]
  return params


# ---- jax-ml/jax examples/spmd_mnist_classifier_fromscratch.py ----

def init_random_params(scale, layer_sizes, rng=npr.RandomState(0)):  # noqa: B008 (copied unchanged)
  return [
    (scale * rng.randn(m, n), scale * rng.randn(n))
    for m, n in zip(layer_sizes[:-1], layer_sizes[1:])
  ]


def mnist_predict(params, inputs):
  activations = inputs
  for w, b in params[:-1]:
    outputs = jnp.dot(activations, w) + b
    activations = jnp.tanh(outputs)

  final_w, final_b = params[-1]
  logits = jnp.dot(activations, final_w) + final_b
  return logits - logsumexp(logits, axis=1, keepdims=True)


def mnist_loss(params, batch):
  inputs, targets = batch
  preds = mnist_predict(params, inputs)
  return -jnp.mean(jnp.sum(preds * targets, axis=1))


mnist_step_size = 0.001


def mnist_step(params, batch):
  grads = jax.grad(mnist_loss)(params, batch)
  return [
    (w - mnist_step_size * dw, b - mnist_step_size * db)
    for (w, b), (dw, db) in zip(params, grads)
  ]


# ---- a transformer language model, pjit style ----

LM = dict(vocab=64, dim=32, heads=4, hidden=64, layers=2, length=16)


def lm_init(key, vocab, dim, heads, hidden, layers, length):
  del heads, length
  ks = jax.random.split(key, 8)
  normal = lambda k, shape, scale=0.02: scale * jax.random.normal(k, shape)  # noqa: E731
  return {
      "embed": normal(ks[0], (vocab, dim), 1.0),
      "layers": {
          "ln1": jnp.ones((layers, dim)), "ln2": jnp.ones((layers, dim)),
          "wq": normal(ks[1], (layers, dim, dim)), "wk": normal(ks[2], (layers, dim, dim)),
          "wv": normal(ks[3], (layers, dim, dim)), "wo": normal(ks[4], (layers, dim, dim)),
          "w1": normal(ks[5], (layers, dim, hidden)), "w2": normal(ks[6], (layers, hidden, dim)),
      },
      "ln_f": jnp.ones((dim,)),
      "unembed": normal(ks[7], (dim, vocab)),
  }


def layer_norm(x, scale):
  mean = x.mean(-1, keepdims=True)
  var = ((x - mean) ** 2).mean(-1, keepdims=True)
  return (x - mean) * jax.lax.rsqrt(var + 1e-6) * scale


def dropout(key, x, rate):
  keep = jax.random.bernoulli(key, 1 - rate, x.shape)
  return jnp.where(keep, x / (1 - rate), 0)


def lm_block(x, p, key, heads, rate):
  b, t, d = x.shape
  h = layer_norm(x, p["ln1"])
  q = (h @ p["wq"]).reshape(b, t, heads, d // heads)
  k = (h @ p["wk"]).reshape(b, t, heads, d // heads)
  v = (h @ p["wv"]).reshape(b, t, heads, d // heads)
  s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d // heads)
  s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -1e9)
  a = jax.nn.softmax(s, axis=-1)
  o = jnp.einsum("bhqk,bkhd->bqhd", a, v).reshape(b, t, d)
  x = x + dropout(key, o @ p["wo"], rate)
  h = layer_norm(x, p["ln2"])
  return x + jax.nn.gelu(h @ p["w1"]) @ p["w2"]


def lm_loss(params, tokens, key, heads=LM["heads"], rate=0.1):
  x = params["embed"][tokens[:, :-1]]
  keys = jax.random.split(key, params["layers"]["ln1"].shape[0])

  def body(x, layer):
    p, k = layer
    return lm_block(x, p, k, heads, rate), None

  x, _ = jax.lax.scan(body, x, (params["layers"], keys))
  logits = layer_norm(x, params["ln_f"]) @ params["unembed"]
  labels = jax.nn.one_hot(tokens[:, 1:], params["embed"].shape[0])
  return -(jax.nn.log_softmax(logits) * labels).sum(-1).mean()


lm_optimizer = optax.adam(1e-3)


def lm_step(params, opt_state, tokens, key):
  loss_value, grads = jax.value_and_grad(lm_loss)(params, tokens, key)
  updates, opt_state = lm_optimizer.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, loss_value


def lm_specs(params, layout: str, data: str = "data", model: str = "model"):
  """PartitionSpecs for the LM's parameters: "dp" (replicated), "tp" (Megatron: attention
  and MLP input projections split on their outputs, output projections on their inputs),
  "fsdp" (every matrix split over ``data`` on its largest dimension)."""
  P = jax.sharding.PartitionSpec
  tp = {"wq": P(None, None, model), "wk": P(None, None, model), "wv": P(None, None, model),
        "wo": P(None, model, None), "w1": P(None, None, model), "w2": P(None, model, None)}

  def spec(path, x):
    name = path[-1].key
    if layout == "tp":
      return tp.get(name, P())
    if layout == "fsdp":   # the largest dimension, where 8 devices divide it
      d = max(range(x.ndim), key=lambda d: x.shape[d], default=None)
      if x.ndim < 2 or x.shape[d] % 8:
        return P()
      return P(*[data if i == d else None for i in range(x.ndim)])
    return P()
  return jax.tree_util.tree_map_with_path(spec, params)
