"""``jaxcoll.use`` on flax's own sharded train step, run as flax's lm1b example runs it.

``flax_lm1b`` is google/flax examples/lm1b copied unchanged: the linen TransformerLM with
logically partitioned parameters (embedding, layer norm, attention with softmax, dropout,
MLP), its weighted cross-entropy, and ``train_step`` with optax AdamW, jitted as
``train.py`` jits it (``in_shardings``/``out_shardings`` from ``setup_initial_state``,
config, schedule and label smoothing static), on a data x fsdp x tensor mesh with
``configs/default.py``'s logical axis rules. ``use`` of that jitted step equals it (new
state and metrics within 1e-5) with collective-permutes only in its compiled step.
"""

from __future__ import annotations

import types

import flax_lm1b as lm1b
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from helpers import assert_like_jit_with_permutes_only
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcoll


def lm1b_setup(mesh_shape):
  """train.py's train_and_evaluate up to its jitted train step, at a small size."""
  mesh = Mesh(np.array(jax.devices()).reshape(mesh_shape), lm1b.MESH_AXES)   # as train.py
  config = types.SimpleNamespace(per_device_batch_size=4, max_target_length=16,
                                 logical_axis_rules=lm1b.LOGICAL_AXIS_RULES)
  train_config = lm1b.TransformerConfig(
      vocab_size=64, output_vocab_size=64, logits_via_embedding=False, dtype=jnp.float32,
      emb_dim=64, num_heads=8, num_layers=1, qkv_dim=64, mlp_dim=128, max_len=16,
      dropout_rate=0.1, attention_dropout_rate=0.1, deterministic=False, decode=False,
      kernel_init=nn.initializers.xavier_uniform(),
      bias_init=nn.initializers.normal(stddev=1e-6),
      posemb_init=lm1b.sinusoidal_init(max_len=16))
  eval_config = train_config.replace(deterministic=True)
  m = lm1b.TransformerLM(eval_config)
  learning_rate_fn = lm1b.create_learning_rate_schedule(learning_rate=0.0016, warmup_steps=10)
  optimizer = optax.adamw(learning_rate_fn, b1=0.9, b2=0.98, eps=1e-9, weight_decay=0.1)
  state, state_mesh_annotations = lm1b.setup_initial_state(
      m, optimizer, config, jax.random.PRNGKey(0), mesh)
  data_sharding = NamedSharding(mesh, P(lm1b.DATA_SHARDING))
  jit_train_step = jax.jit(
      lm1b.train_step,
      in_shardings=(state_mesh_annotations, data_sharding, None),
      out_shardings=(state_mesh_annotations, None),
      static_argnums=(2, 3, 4))
  tokens = jax.random.randint(jax.random.PRNGKey(1), (16, 16), 1, 64)
  batch = {"inputs": jax.device_put(tokens, data_sharding)}
  static = (train_config, learning_rate_fn, 0.0)
  return mesh, jit_train_step, (state, batch, *static, jax.random.PRNGKey(2))


# reads jaxprs, so on every supported jax (quick): the three-axis mesh; all four on the
# newest (the four took 123 s of the oldest's CI leg)
@pytest.mark.parametrize("mesh_shape", [
    pytest.param((2, 2, 2), id="data2_fsdp2_tensor2", marks=pytest.mark.quick),
    pytest.param((8, 1, 1), id="data8"),
    pytest.param((1, 8, 1), id="fsdp8"),
    pytest.param((2, 1, 4), id="data2_tensor4")])
def test_flax_lm1b_train_step(mesh_shape):
  mesh, jit_train_step, args = lm1b_setup(mesh_shape)
  with jax.set_mesh(mesh):
    want = jit_train_step(*args)
    used = jaxcoll.use(jit_train_step, algorithm="ring")
    got = used(*args)
    report = jaxcoll.explain_step(used, *args)
  assert_like_jit_with_permutes_only(got, want, report)
