"""A decoder-only language model and training step written as MaxText writes them.

MaxText (AI-Hypercomputer/maxtext) is too large to import here, so this file keeps its
structure and its arithmetic, each piece from the file named beside it:

- ``RMSNorm``: ``src/maxtext/layers/normalizations.py`` ``RMSNorm.__call__`` (float32 mean
  of squares, ``lax.rsqrt``, the scale applied by ``einsum("...k,k->...k")``), as a linen
  module with its ``("norm",)`` logical axes;
- ``apply_rotary``: ``src/maxtext/layers/embeddings.py`` ``RotaryEmbedding`` (timescales,
  ``_rotate_half``, ``apply_rotary``);
- ``DecoderLayer``: ``src/maxtext/layers/decoders.py`` ``DecoderLayer``: the input
  constrained to ``("activation_batch", "activation_length", "activation_embed")`` and named
  ``"decoder_layer_input"``, one pre-norm, attention and MLP on it in parallel, the sum
  added to the input; q/k/v/out projections and the SwiGLU MLP's ``mlpwi_0``, ``mlpwi_1``,
  ``mlpwo`` each named with ``checkpoint_name``, as ``attentions.py`` and ``linears.py`` do;
- ``Decoder``: ``nn.remat`` of the layer with ``minimal_policy``
  (``jax.checkpoint_policies.save_only_these_names`` of those names,
  ``DecoderLayer.minimal_policy``) and ``prevent_cse`` off under scan, scanned with
  ``nn.scan`` (``scan_decoder_layers``: params on ``param_scan_axis`` 1, params rngs split,
  the layer's other inputs broadcast, the ``"layers"`` partition name), or the layers one
  after another (``scan_layers=False``);
- the logical axis rules: ``src/maxtext/configs/base.yml``'s ``logical_axis_rules`` for the
  names used here, on a ``("data", "fsdp", "tensor")`` mesh;
- ``train_step``: ``src/maxtext/utils/gradient_accumulation.py``'s
  ``gradient_accumulation_loss_and_grad`` (microbatches by reshape and ``swapaxes``, a
  ``lax.scan`` adding each microbatch's gradient to a zero-initialized carry, the sum of
  losses and weights) followed by optax's ``clip_by_global_norm`` and ``adamw``, as
  ``optimizers.py`` chains them.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

MESH_AXES = ("data", "fsdp", "tensor")
LOGICAL_AXIS_RULES = (   # base.yml's rules for the names used here, on this mesh's axes
    ("activation_batch", ("data", "fsdp")), ("activation_length", None),
    ("activation_embed", "tensor"), ("activation_mlp", "tensor"),
    ("activation_heads", "tensor"), ("activation_kv", None), ("activation_vocab", "tensor"),
    ("mlp", "tensor"), ("vocab", "tensor"), ("embed", "fsdp"), ("heads", "tensor"),
    ("q_heads", "tensor"), ("kv_heads", "tensor"), ("kv", None), ("norm", "tensor"),
    ("layers", None),
)
MINIMAL = ("query_proj", "value_proj", "key_proj", "out_proj", "mlpwi_0", "mlpwi_1", "mlpwo")


@dataclasses.dataclass(frozen=True)
class Config:
  vocab: int = 64
  emb: int = 32
  heads: int = 4
  head_dim: int = 8
  mlp: int = 64
  layers: int = 2
  length: int = 16
  scan_layers: bool = True
  remat: bool = True
  microbatches: int = 2
  learning_rate: float = 1e-3


def _init(axes):
  return nn.with_logical_partitioning(nn.initializers.lecun_normal(), axes)


class RMSNorm(nn.Module):
  epsilon: float = 1e-5
  kernel_axes: tuple = ("norm",)

  @nn.compact
  def __call__(self, x):
    x = jnp.asarray(x, jnp.float32)
    mean2 = jnp.mean(lax.square(x), axis=-1, keepdims=True)
    y = jnp.asarray(x * lax.rsqrt(mean2 + self.epsilon), jnp.float32)
    scale = self.param("scale", nn.with_logical_partitioning(nn.initializers.ones,
                                                             self.kernel_axes),
                       (x.shape[-1],), jnp.float32)
    return jnp.einsum("...k,k->...k", y, jnp.asarray(scale, jnp.float32))


class DenseGeneral(nn.Module):
  """``linears.py``'s DenseGeneral: a kernel of shape ``in (axis) + features`` with its
  logical axes, contracted by ``lax.dot_general``."""
  features: tuple
  kernel_axes: tuple
  axis: tuple = (-1,)

  @nn.compact
  def __call__(self, inputs):
    axis = tuple(a % inputs.ndim for a in self.axis)
    shape = tuple(inputs.shape[a] for a in axis) + tuple(self.features)
    kernel = self.param("kernel", _init(self.kernel_axes), shape, jnp.float32)
    contract = tuple(range(len(axis)))
    return lax.dot_general(inputs, kernel, ((axis, contract), ((), ())))


def _rotate_half(x):
  x1, x2 = jnp.split(x, 2, axis=-1)
  return jnp.concatenate((-x2, x1), axis=-1)


def apply_rotary(inputs, position, min_timescale=1, max_timescale=10_000):
  dims = inputs.shape[-1]
  fraction = 2 * jnp.arange(0, dims // 2) / dims
  timescale = min_timescale * (max_timescale / min_timescale) ** fraction
  position = position[:, :, jnp.newaxis, jnp.newaxis]
  sinusoid_inp = position / timescale
  sin_half = jnp.sin(sinusoid_inp).astype(inputs.dtype)
  cos_half = jnp.cos(sinusoid_inp).astype(inputs.dtype)
  sin = jnp.concatenate([sin_half, sin_half], axis=-1)
  cos = jnp.concatenate([cos_half, cos_half], axis=-1)
  return (inputs * cos) + (_rotate_half(inputs) * sin)


class Attention(nn.Module):
  config: Config

  @nn.compact
  def __call__(self, x, positions):
    c = self.config
    proj = functools.partial(DenseGeneral, (c.heads, c.head_dim), ("embed", "q_heads", "kv"))
    q = checkpoint_name(proj(name="query")(x), "query_proj")
    k = checkpoint_name(proj(name="key")(x), "key_proj")
    v = checkpoint_name(proj(name="value")(x), "value_proj")
    q, k = apply_rotary(q, positions), apply_rotary(k, positions)
    q = nn.with_logical_constraint(q, ("activation_batch", "activation_length",
                                       "activation_heads", "activation_kv"))
    logits = jnp.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(c.head_dim)
    causal = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
    weights = jax.nn.softmax(jnp.where(causal, logits, -1e9), axis=-1)
    context = jnp.einsum("bnts,bsnh->btnh", weights, v)
    out = DenseGeneral((c.emb,), ("heads", "kv", "embed"), axis=(-2, -1), name="out")(context)
    return checkpoint_name(out, "out_proj")


class MlpBlock(nn.Module):   # SwiGLU, as linears.py's MlpBlock with ("silu", "linear")
  config: Config

  @nn.compact
  def __call__(self, x):
    c = self.config
    wi_0 = DenseGeneral((c.mlp,), ("embed", "mlp"), name="wi_0")
    wi_1 = DenseGeneral((c.mlp,), ("embed", "mlp"), name="wi_1")
    h = nn.silu(checkpoint_name(wi_0(x), "mlpwi_0")) * checkpoint_name(wi_1(x), "mlpwi_1")
    h = nn.with_logical_constraint(h, ("activation_batch", "activation_length",
                                       "activation_mlp"))
    out = DenseGeneral((c.emb,), ("mlp", "embed"), name="wo")(h)
    return checkpoint_name(out, "mlpwo")


class DecoderLayer(nn.Module):
  config: Config

  @nn.compact
  def __call__(self, inputs, positions):
    names = ("activation_batch", "activation_length", "activation_embed")
    inputs = nn.with_logical_constraint(inputs, names)
    inputs = checkpoint_name(inputs, "decoder_layer_input")
    lnx = nn.with_logical_constraint(RMSNorm(name="pre_self_attention_norm")(inputs), names)
    attention = nn.with_logical_constraint(Attention(self.config, name="self_attention")(
        lnx, positions), names)
    mlp = nn.with_logical_constraint(MlpBlock(self.config, name="mlp")(lnx), names)
    out = nn.with_logical_constraint(mlp + attention + inputs, names)
    return (out, None) if self.config.scan_layers else out


class Decoder(nn.Module):
  config: Config

  @nn.compact
  def __call__(self, tokens, positions):
    c = self.config
    embed = nn.Embed(c.vocab, c.emb, name="token_embedder",
                     embedding_init=nn.with_logical_partitioning(
                         nn.initializers.normal(1.0), ("vocab", "embed")))
    x = embed(tokens)
    layer = DecoderLayer
    if c.remat:
      layer = nn.remat(layer, prevent_cse=not c.scan_layers,
                       policy=jax.checkpoint_policies.save_only_these_names(*MINIMAL))
    if c.scan_layers:
      x, _ = nn.scan(layer, variable_axes={"params": 1}, split_rngs={"params": True},
                     in_axes=(nn.broadcast,), length=c.layers,
                     metadata_params={nn.PARTITION_NAME: "layers"})(c, name="layers")(
                         x, positions)
    else:
      for i in range(c.layers):
        x = layer(c, name=f"layers_{i}")(x, positions)
    x = RMSNorm(name="decoder_norm")(x)
    logits = DenseGeneral((c.vocab,), ("embed", "vocab"), name="logits_dense")(x)
    return nn.with_logical_constraint(logits, ("activation_batch", "activation_length",
                                               "activation_vocab"))


def loss_fn(model, params, batch):
  tokens = batch["inputs"]
  positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
  logits = model.apply({"params": params}, tokens, positions)
  xent = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
  return jnp.sum(xent), {"xent_sum": jnp.sum(xent), "total_weights": jnp.float32(xent.size)}


def optimizer(config: Config):
  return optax.chain(optax.clip_by_global_norm(1.0),
                     optax.adamw(config.learning_rate, b1=0.9, b2=0.95, weight_decay=0.1))


def train_step(model, config: Config, params, opt_state, batch, params_shardings=None):
  """One step: the gradient accumulated over microbatches (gradient_accumulation.py, its
  zero-initialized accumulator constrained to ``params_shardings`` as it does), divided by
  the total weight, then clipped and applied by AdamW."""
  grad_func = jax.value_and_grad(functools.partial(loss_fn, model), has_aux=True)

  def accumulate_gradient(acc, data):
    (_, aux), grad = grad_func(params, data)
    acc["loss"] += aux["xent_sum"]
    acc["grad"] = jax.tree_util.tree_map(lambda x, y: x + y, grad, acc["grad"])
    acc["total_weights"] += aux["total_weights"]
    return acc, aux

  def reshape_to_microbatch_accumulations(batch_arr):
    num_microbatches = config.microbatches
    microbatch_shape = (batch_arr.shape[0] // num_microbatches, num_microbatches) + \
        batch_arr.shape[1:]
    reshaped_batch_arr = jnp.reshape(batch_arr, microbatch_shape)
    return jnp.swapaxes(reshaped_batch_arr, 0, 1)

  data = jax.tree_util.tree_map(reshape_to_microbatch_accumulations, batch)
  init_grad = jax.tree_util.tree_map(jnp.zeros_like, params)
  if params_shardings is not None:   # _maybe_shard_with_name in Auto mode
    init_grad = jax.tree.map(jax.lax.with_sharding_constraint, init_grad, params_shardings)
  init = {"loss": 0.0, "grad": init_grad, "total_weights": 0.0}
  acc, _ = jax.lax.scan(accumulate_gradient, init, data, length=config.microbatches)
  loss = acc["loss"] / acc["total_weights"]
  grads = jax.tree_util.tree_map(lambda g: g / acc["total_weights"], acc["grad"])
  updates, opt_state = optimizer(config).update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, {"loss": loss}


def setup(mesh, config: Config = Config(), batch: int = 16, constrain: bool = True,
          abstract: bool = False):
  """The model, its parameters and optimizer state laid out by the logical axis rules
  (initialized jitted with those ``out_shardings``, as MaxText's ``setup_initial_state``),
  a batch split over ("data", "fsdp"), and the jitted step with its shardings
  (``constrain=False`` leaves out the accumulator's sharding constraint). ``abstract``:
  the arguments as ``jax.ShapeDtypeStruct``s with those shardings, nothing computed (as
  MaxText's ``train_compile.py`` compiles for devices it is not on)."""
  model = Decoder(config)
  tokens = jnp.ones((batch, config.length), jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(config.length), tokens.shape)

  def init(key):
    params = model.init(key, tokens, positions)["params"]
    return params, optimizer(config).init(params)

  shapes = jax.eval_shape(init, jax.random.key(0))
  with jax.set_mesh(mesh), nn.logical_axis_rules(LOGICAL_AXIS_RULES):
    shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(shapes), mesh,
                                            LOGICAL_AXIS_RULES)
    if not abstract:
      params, opt_state = jax.jit(init, out_shardings=shardings)(jax.random.key(0))
  shardings = nn.meta.unbox(shardings)
  data = NamedSharding(mesh, P(("data", "fsdp")))
  if abstract:
    params, opt_state = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        nn.meta.unbox(shapes), shardings)
    batch_ = {k: jax.ShapeDtypeStruct((batch, config.length), jnp.int32, sharding=data)
              for k in ("inputs", "targets")}
  else:
    params, opt_state = nn.meta.unbox((params, opt_state))
    rng = np.random.default_rng(0)
    text = rng.integers(0, config.vocab, (batch, config.length + 1)).astype(np.int32)
    batch_ = {"inputs": jax.device_put(text[:, :-1], data),
              "targets": jax.device_put(text[:, 1:], data)}

  def step(params, opt_state, batch):
    with nn.logical_axis_rules(LOGICAL_AXIS_RULES):
      return train_step(model, config, params, opt_state, batch,
                        shardings[0] if constrain else None)

  jitted = jax.jit(step, in_shardings=(*shardings, data),
                   out_shardings=(*shardings, None))
  return jitted, (params, opt_state, batch_)
