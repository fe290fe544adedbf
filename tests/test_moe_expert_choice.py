"""Expert-choice routing (``route_experts``, ``dispatch_chosen``) against flaxformer's
ExpertsChooseMaskedRouter and its masked-matmul dispatch and combine, copied unchanged."""

from __future__ import annotations

from typing import Optional, Tuple  # noqa: UP035 (the copied code's own annotations)

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxcoll import moe

Array = jax.Array
D = 8


# google/flaxformer flaxformer/architectures/moe/routing.py (commit 5400cce), unchanged:
# _favor_one_hot_slices, _take_along_axis, _top_k, and the body of
# ExpertsChooseMaskedRouter._compute_routing_instructions (self.dtype made an argument,
# RouterMask returned as a tuple).
def _favor_one_hot_slices() -> bool:
  """Returns true iff running on TPUs."""
  return jax.default_backend() == 'tpu' or jax.devices()[0].platform == 'tpu'


def _take_along_axis(array: Array, indices: Array, axis: int) -> Array:
  if array.ndim != indices.ndim:
    raise ValueError(
        'indices and array must have the same number of dimensions; '
        f'{indices.ndim} vs. {array.ndim}.')

  if (axis != -1 and axis != array.ndim - 1 and  # Not last dimension
      axis != 1 and axis != -array.ndim + 1):  # Not second dimension
    raise ValueError(
        'Only slices along the second or last dimension are supported; '
        f'array.ndim = {array.ndim}, while axis = {axis}.')

  if _favor_one_hot_slices():
    one_hot_length = array.shape[axis]
    one_hot_indices = jax.nn.one_hot(indices, one_hot_length, axis=axis)

    if axis == -1 or array.ndim == 1:
      result = jnp.einsum(
          '...s,...is->...i',
          array,
          one_hot_indices,
          precision=jax.lax.Precision.HIGHEST)
    else:
      result = jnp.einsum(
          'ns...,nis...->ni...',
          array,
          one_hot_indices,
          precision=jax.lax.Precision.HIGHEST)
    return jax.lax.convert_element_type(result, array.dtype)
  else:
    return jnp.take_along_axis(array, indices, axis=axis)


def _top_k(array: Array, k: int) -> Tuple[Array, Array]:  # noqa: UP006
  if _favor_one_hot_slices():
    top_k_indices = jax.lax.top_k(array, k)[-1]
    top_k_values = _take_along_axis(array, top_k_indices, axis=-1)
    return top_k_values, top_k_indices
  else:
    return jax.lax.top_k(array, k)


def experts_choose_instructions(router_probs: Array, padding_mask: Optional[Array],  # noqa: UP045
                                expert_capacity: int, dtype=jnp.float32):
  tokens_per_group = router_probs.shape[1]

  if padding_mask is not None:
    router_probs *= jnp.expand_dims(padding_mask, axis=-1)

  # vmap over group dimension.
  router_probs_t = jax.vmap(lambda m: m.transpose())(router_probs)

  # Top expert_capacity router probability and corresponding token indices for
  # each expert. Shapes: [num_groups, num_experts, expert_capacity].
  expert_gate, expert_index = _top_k(router_probs_t, k=expert_capacity)

  # Convert to one-hot mask of expert indices for each token in each group.
  # Shape: [num_groups, num_experts, expert_capacity, tokens_per_group].
  dispatch_mask = jax.nn.one_hot(
      expert_index, tokens_per_group, dtype=jnp.int32)

  # Move axes to conform with shape expected by MoeLayer API.
  # Shape: [num_groups, tokens_per_group, num_experts, expert_capacity]
  dispatch_mask = jnp.moveaxis(dispatch_mask, 3, 1)

  # The combine array will be used for combining expert outputs, scaled by the
  # router probabilities. Shape: [num_groups, num_experts, tokens_per_group,
  # expert_capacity].
  combine_array = jnp.einsum(
      '...ec,...tec->...tec',
      expert_gate,
      dispatch_mask,
      precision=jax.lax.Precision.DEFAULT)

  # Return to default dtype now that router computation is complete.
  combine_array = jax.lax.convert_element_type(combine_array, dtype)
  return dispatch_mask, combine_array


def flaxformer_moe(x, logits, w, capacity):
  """Router._compute_router_probabilities' softmax, the instructions above, and
  MoeLayer._mask_and_dispatch_to_experts' two einsums (google/flaxformer
  flaxformer/architectures/moe/moe_layers.py), with tanh(h @ w[e]) as the experts; one
  group per device: x [N, T, d]."""
  router_probs = jax.nn.softmax(logits, axis=-1)
  dispatch_mask, combine_array = experts_choose_instructions(router_probs, None, capacity)
  expert_inputs = jnp.einsum('gtd,gtec->gecd', x, dispatch_mask)
  expert_outputs = jnp.tanh(jnp.einsum('gecd,edf->gecf', expert_inputs, w))
  return jnp.einsum('gecd,gtec->gtd', expert_outputs, combine_array)


@pytest.mark.quick
@pytest.mark.parametrize("tokens,experts,capacity", [(8, 4, 2), (16, 8, 16), (12, 3, 1)])
def test_route_experts_equals_flaxformer_experts_choose_router(tokens, experts, capacity):
  logits = jnp.asarray(np.random.default_rng(tokens).standard_normal((tokens, experts)),
                       jnp.float32)
  ids, gates = moe.route_experts(logits, capacity)
  dispatch_mask, combine_array = experts_choose_instructions(
      jax.nn.softmax(logits, axis=-1)[None], None, capacity)
  ours = jnp.zeros((tokens, experts, capacity)).at[
      ids, jnp.arange(experts)[:, None], jnp.arange(capacity)[None]].set(gates)
  np.testing.assert_array_equal(ours != 0, dispatch_mask[0] == 1)
  np.testing.assert_allclose(ours, combine_array[0], rtol=1e-6)


@pytest.mark.quick
@pytest.mark.parametrize("shape,names", [((4,), ("x",)), ((2, 4), ("node", "local"))],
                         ids=["4", "2x4"])
@pytest.mark.parametrize("algorithm", ["auto", "direct", "bruck"])
def test_expert_choice_layer_equals_flaxformer(shape, names, algorithm):
  """route_experts -> dispatch_chosen -> experts -> combine over the mesh equals flaxformer's
  masked-matmul layer run per device group: outputs, and the gradients of tokens, expert
  weights and router logits."""
  n = int(np.prod(shape))
  e, t, c = 2 * n, 12, 5
  rng = np.random.default_rng(n)
  x = rng.standard_normal((n, t, D)).astype(np.float32)
  logits = rng.standard_normal((n, t, e)).astype(np.float32)
  w = (rng.standard_normal((e, D, D)) / np.sqrt(D)).astype(np.float32)
  mesh = Mesh(np.array(jax.devices()[:n]).reshape(shape), names)
  axes = names if len(names) > 1 else names[0]

  def body(x, logits, w):
    tokens, gates = moe.route_experts(logits[0], c)
    h, state = moe.dispatch_chosen(x[0], tokens, axis_name=axes, algorithm=algorithm)
    assert h.shape == (e // n, n * c, D)
    out = moe.combine(jnp.tanh(jnp.einsum("lcd,ldf->lcf", h, w)), state, gates)
    return out[None], moe.total_dropped(state)[None]

  spec = P(names)
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 3, out_specs=(spec, spec)))
  got, dropped = f(x, logits, w)
  np.testing.assert_allclose(got, flaxformer_moe(x, logits, w, c), rtol=1e-5, atol=1e-5)
  assert not np.any(dropped)
  grads = jax.grad(lambda *a: jnp.sum(jnp.sin(f(*a)[0])), (0, 1, 2))(x, logits, w)
  want = jax.grad(lambda *a: jnp.sum(jnp.sin(flaxformer_moe(*a, c))), (0, 1, 2))(x, logits, w)
  for a, b in zip(grads, want):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.quick
def test_expert_choice_errors_name_the_argument():
  with pytest.raises(ValueError, match="capacity=9"):
    moe.route_experts(jnp.zeros((8, 4)), 9)
  with pytest.raises(ValueError, match=r"route_experts: logits must be \[tokens, experts\]"):
    moe.route_experts(jnp.zeros(8), 2)
  mesh = Mesh(np.array(jax.devices()[:4]), ("x",))

  def call(token_ids, **options):
    body = lambda x: moe.dispatch_chosen(x[0], token_ids, axis_name="x", **options)[0][None]
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))(
        np.zeros((4, 6, D), np.float32))

  with pytest.raises(ValueError, match="num_experts=6 must be a positive multiple"):
    call(jnp.zeros((6, 2), jnp.int32))
  with pytest.raises(ValueError, match=r"token_ids must be \[E, C\] integers"):
    call(jnp.zeros((8, 2)))
  with pytest.raises(ValueError, match="allgather"):
    call(jnp.zeros((8, 2), jnp.int32), algorithm="allgather")
