"""``jax.grad(jaxcoll.use(f))``: the gradient reductions JAX makes by itself run as jaxcoll's.

Inside ``shard_map(check_vma=True)`` JAX casts a replicated value used with a varying one
through ``pvary``, whose transpose (``psum_invariant``) is made when ``jax.grad`` runs, after
``use`` rewrote the forward; a ``check_vma=False`` shard_map sums its replicated inputs'
gradients in its own transpose. Either way the data-parallel gradient sum escaped ``use``.
Here every program's gradient (and vjp, and linear transpose) under ``use(f, "ring")``
equals JAX's and holds no lax collective.

The programs are public code, copied unchanged but for the ``check_vma`` each shard_map is
built with (both values are tried):

- the neural-network examples of JAX's shard_map tutorial (jax-ml/jax,
  ``docs/notebooks/shard_map.md``, "Neural networks": 8-way data parallelism, 8-way FSDP,
  8-way tensor parallelism, FSDP + TP; the same text at tag jax-v0.10.2);
- the matmuls of JEP 14273 (jax-ml/jax, ``docs/jep/14273-shard-map.md``: ``matmul_basic``
  and ``matmul_reduce_scatter``, whose right operand is replicated over "i");
- the issue's minimal case, ``x * y`` with ``y`` replicated.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import LAX_COLLECTIVES, assert_close_after_sums, primitives
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcoll

pytestmark = pytest.mark.quick   # reads jaxprs: on every supported jax


# ---- jax-ml/jax docs/notebooks/shard_map.md, "Neural networks" (unchanged) ----

def predict(params, inputs):
  for W, b in params:
    outputs = jnp.dot(inputs, W) + b
    inputs = jax.nn.relu(outputs)
  return outputs


def loss(params, batch):
  inputs, targets = batch
  predictions = predict(params, inputs)
  return jnp.mean(jnp.sum((predictions - targets) ** 2, axis=-1))


def init_layer(key, n_in, n_out):
  k1, k2 = jax.random.split(key)
  W = jax.random.normal(k1, (n_in, n_out)) / jnp.sqrt(n_in)
  b = jax.random.normal(k2, (n_out,))
  return W, b


def init(key, layer_sizes, batch_size):
  key, *keys = jax.random.split(key, len(layer_sizes))
  params = list(map(init_layer, keys, layer_sizes[:-1], layer_sizes[1:]))

  key, *keys = jax.random.split(key, 3)
  inputs = jax.random.normal(keys[0], (batch_size, layer_sizes[0]))
  targets = jax.random.normal(keys[1], (batch_size, layer_sizes[-1]))

  return params, (inputs, targets)


layer_sizes = [784, 128, 128, 128, 128, 128, 8]
batch_size = 32


def loss_dp_body(params, local_batch):
  inputs, targets = local_batch
  predictions = predict(params, inputs)  # use reference 'predict`
  local_loss = jnp.mean(jnp.sum((predictions - targets)**2, axis=-1))
  return jax.lax.pmean(local_loss, 'batch')


@partial(jax.remat, policy=lambda op, *_, **__: str(op) != 'all_gather')
def predict_fsdp(params_frag, inputs):
  for W_frag, b_frag in params_frag:
    W = jax.lax.all_gather(W_frag, 'batch', tiled=True)
    b = jax.lax.all_gather(b_frag, 'batch', tiled=True)
    outputs = jnp.dot(inputs, W) + b
    inputs = jax.nn.relu(outputs)
  return outputs


def loss_fsdp_body(local_params, local_batch):
  inputs, targets = local_batch
  predictions = predict_fsdp(local_params, inputs)
  local_loss = jnp.mean(jnp.sum((predictions - targets) ** 2, axis=-1))
  return jax.lax.pmean(local_loss, 'batch')


def gemm_tp_body(inputs, W, b):
  block_result = jnp.dot(inputs, W)
  return jax.lax.psum_scatter(block_result, 'feats',
                              scatter_dimension=1, tiled=True) + b


@partial(jax.remat, policy=lambda op, *_, **__: str(op) != 'all_gather')
def predict_fsdp_tp(params_frag, inputs):
  for W_frag, b_frag in params_frag:
    W = jax.lax.all_gather(W_frag, 'batch', tiled=True)
    b = jax.lax.all_gather(b_frag, 'batch', tiled=True)
    block_result = jnp.dot(inputs, W)
    outputs = jax.lax.psum_scatter(block_result, 'feats',
                                   scatter_dimension=1, tiled=True) + b
    inputs = jax.nn.relu(outputs)
  return outputs


def loss_fsdp_tp_body(local_params, local_batch):
  inputs, targets = local_batch
  predictions = predict_fsdp_tp(local_params, inputs)
  sq_err = jax.lax.psum(jnp.sum((predictions - targets) ** 2, axis=-1), 'feats')
  return jax.lax.pmean(jnp.mean(sq_err), 'batch')


# ---- jax-ml/jax docs/jep/14273-shard-map.md (unchanged bodies) ----

def matmul_basic(a_block, b_block):
  # a_block: f32[2, 8]
  # b_block: f32[8, 32]
  z_partialsum = jnp.dot(a_block, b_block)
  z_block = jax.lax.psum(z_partialsum, 'j')
  return z_block


def matmul_reduce_scatter(a_block, b_block):
  # c_partialsum: f32[8/X, 32]
  c_partialsum = jnp.matmul(a_block, b_block)
  # c_block: f32[8/X, 32/Y]
  c_block = jax.lax.psum_scatter(c_partialsum, 'j', scatter_dimension=1, tiled=True)
  return c_block


# ---- the cases: (mesh shape, names, a function of check_vma giving (f, args)) ----

def dp(check_vma):
  mesh = jax.make_mesh((8,), ('batch',))
  params, batch = init(jax.random.key(0), layer_sizes, batch_size)
  batch = jax.device_put(batch, NamedSharding(mesh, P('batch')))
  params = jax.device_put(params, NamedSharding(mesh, P()))
  f = jax.shard_map(loss_dp_body, mesh=mesh, in_specs=(P(), P('batch')), out_specs=P(),
                    check_vma=check_vma)
  return mesh, f, (params, batch)


def fsdp(check_vma):
  mesh = jax.make_mesh((4,), ('batch',), devices=jax.devices()[:4])
  params, batch = init(jax.random.key(0), layer_sizes, batch_size)
  batch = jax.device_put(batch, NamedSharding(mesh, P('batch')))
  params = jax.device_put(params, NamedSharding(mesh, P('batch')))
  f = jax.shard_map(loss_fsdp_body, mesh=mesh, in_specs=(P('batch'), P('batch')),
                    out_specs=P(), check_vma=check_vma)
  return mesh, f, (params, batch)


def tp(check_vma):
  mesh = jax.make_mesh((8,), ('feats',))
  params, batch = init(jax.random.key(0), layer_sizes, batch_size)
  batch = jax.device_put(batch, NamedSharding(mesh, P(None, 'feats')))
  params = jax.device_put(params, NamedSharding(mesh, P('feats')))
  gemm_tp = jax.shard_map(gemm_tp_body, mesh=mesh,
                          in_specs=(P(None, 'feats'), P('feats', None), P('feats')),
                          out_specs=P(None, 'feats'), check_vma=check_vma)

  def predict_tp(params, inputs):
    for W, b in params:
      outputs = gemm_tp(inputs, W, b)
      inputs = jax.nn.relu(outputs)
    return outputs

  def loss_tp(params, batch):
    inputs, targets = batch
    predictions = predict_tp(params, inputs)
    return jnp.mean(jnp.sum((predictions - targets) ** 2, axis=-1))  # NOTE psum!
  return mesh, loss_tp, (params, batch)


def fsdp_tp(check_vma):
  mesh = jax.make_mesh((4, 2), ('batch', 'feats'))
  params, batch = init(jax.random.key(0), layer_sizes, batch_size)
  batch = jax.device_put(batch, NamedSharding(mesh, P('batch', 'feats')))
  params = jax.device_put(params, NamedSharding(mesh, P(('feats', 'batch'))))
  f = jax.shard_map(loss_fsdp_tp_body, mesh=mesh,
                    in_specs=(P(('feats', 'batch')), P('batch', 'feats')), out_specs=P(),
                    check_vma=check_vma)
  return mesh, f, (params, batch)


def jep_matmul(body, out_spec):
  def case(check_vma):
    mesh = jax.make_mesh((4, 2), ('i', 'j'))
    a = jax.device_put(jnp.arange(8 * 16.).reshape(8, 16) / 100,
                       NamedSharding(mesh, P('i', 'j')))
    b = jax.device_put(jnp.arange(16 * 32.).reshape(16, 32) / 100,
                       NamedSharding(mesh, P('j', None)))
    f = jax.shard_map(body, mesh=mesh, in_specs=(P('i', 'j'), P('j', None)),
                      out_specs=out_spec, check_vma=check_vma)
    return mesh, lambda a, b: jnp.sum(jnp.sin(f(a, b))), (a, b)
  return case


def minimal(check_vma):
  mesh = jax.make_mesh((2,), ("i",), devices=jax.devices()[:2])
  x = jax.device_put(jnp.arange(4.0), NamedSharding(mesh, P("i")))
  y = jax.device_put(jnp.array([1.5, -2.0]), NamedSharding(mesh, P()))
  f = jax.shard_map(lambda x, y: x * y, mesh=mesh, in_specs=(P("i"), P()), out_specs=P("i"),
                    check_vma=check_vma)
  return mesh, lambda x, y: f(x, y).sum(), (x, y)


CASES = {"minimal": minimal, "dp": dp, "fsdp": fsdp, "tp": tp, "fsdp_tp": fsdp_tp,
         "jep_matmul_basic": jep_matmul(matmul_basic, P('i', None)),
         "jep_matmul_reduce_scatter": jep_matmul(matmul_reduce_scatter, P('i', 'j'))}


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("name", sorted(CASES))
def test_grad_of_use_reduces_with_jaxcoll_and_equals_jax(name, check_vma):
  mesh, f, args = CASES[name](check_vma)
  rerouted = jaxcoll.use(f, algorithm="ring")
  with jax.set_mesh(mesh):
    want_value, want = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(*args)
    grad = jax.value_and_grad(rerouted, argnums=(0, 1))
    value, got = jax.jit(grad)(*args)
    assert not LAX_COLLECTIVES & primitives(jax.make_jaxpr(grad)(*args)), name
    # jitted: an eager jax.vjp runs the forward op by op (31 s for fsdp_tp)
    pull_one = lambda *args: jax.vjp(rerouted, *args)[1](jnp.float32(1.0))
    assert not LAX_COLLECTIVES & primitives(jax.make_jaxpr(pull_one)(*args)), name
    pulled = jax.jit(pull_one)(*args)
  # every gradient entry sums at most (devices x the longest dimension) products, in another
  # order than jax's: its rounding, not a machine's, sets the tolerance
  terms = mesh.size * max(max(x.shape, default=1) for x in jax.tree.leaves(args))
  assert_close_after_sums(value, want_value, terms)
  for tree in (got, pulled):
    assert_close_after_sums(tree, want, terms)


@pytest.mark.parametrize("check_vma", [True, False])
def test_linear_transpose_of_use_reduces_with_jaxcoll(check_vma):
  """``y -> x * y`` is linear in y; its transpose sums over the axis."""
  mesh, _, (x, y) = minimal(check_vma)
  f = jax.shard_map(lambda x, y: x * y, mesh=mesh, in_specs=(P("i"), P()), out_specs=P("i"),
                    check_vma=check_vma)
  ct = jax.device_put(jnp.array([1.0, 2.0, 3.0, 4.0]), NamedSharding(mesh, P("i")))
  with jax.set_mesh(mesh):
    want = jax.linear_transpose(lambda y: f(x, y), y)(ct)
    transpose = jax.linear_transpose(lambda y: jaxcoll.use(f, algorithm="ring")(x, y), y)
    assert not LAX_COLLECTIVES & primitives(jax.make_jaxpr(transpose)(ct))
    got = transpose(ct)
  np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
  np.testing.assert_allclose(got[0], [0 * 1 + 2 * 3, 1 * 2 + 3 * 4], rtol=1e-6)
