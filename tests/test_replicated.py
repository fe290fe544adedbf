"""The private vma primitive: fails loudly when the JAX internals it uses change."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from jaxcoll._src import invariant as replicated
from tests.helpers import AXIS, mesh

pytestmark = pytest.mark.quick   # also on the oldest supported jax (.ci/run)


def test_jax_internals_still_exist():
  from jax.interpreters import ad, batching, mlir
  assert hasattr(jax.extend.core, "Primitive")
  assert hasattr(ad, "deflinear2") and hasattr(batching, "primitive_batchers")
  assert hasattr(mlir, "register_lowering")
  assert hasattr(ad, "primitive_transposes")


def test_mark_invariant_drops_only_the_named_axes():
  m = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))

  def body(v):
    typ = jax.typeof(v).mat.varying
    out = replicated.mark_invariant(v, ("b",))
    assert typ == {"a", "b"}
    assert jax.typeof(out).mat.varying == {"a"}
    # identity on values, and the lowering is the identity
    return out

  f = jax.jit(jax.shard_map(body, mesh=m, in_specs=jax.P("a", "b"), out_specs=jax.P("a")))
  x = jnp.broadcast_to(jnp.arange(2.0)[:, None], (2, 4))
  np.testing.assert_array_equal(f(x), np.arange(2.0)[:, None])
  assert "jaxcoll_mark_invariant" in str(jax.make_jaxpr(f)(x))


def test_transpose_sends_the_cotangent_to_rank_zero_and_batching_keeps_the_dim():
  m = mesh(4)

  def body(v):
    return replicated.mark_invariant(v, (AXIS,))

  f = jax.shard_map(body, mesh=m, in_specs=jax.P(AXIS), out_specs=jax.P())
  x = jnp.ones(4)
  _, vjp = jax.vjp(f, x)
  (ct,) = vjp(jnp.full((1,), 5.0))
  np.testing.assert_array_equal(ct, [5.0, 0.0, 0.0, 0.0])
  batched = jax.shard_map(jax.vmap(body), mesh=m, in_specs=jax.P(None, AXIS),
                          out_specs=jax.P())
  assert batched(jnp.ones((3, 4))).shape == (3, 1)


def test_check_vma_detection():
  m = mesh(2)
  seen = []

  def body(v):
    seen.append(replicated.check_vma_enabled((AXIS,)))
    return lax.psum(v, AXIS)

  for check in (True, False):
    jax.jit(jax.shard_map(body, mesh=m, in_specs=jax.P(AXIS), out_specs=jax.P(),
                          check_vma=check))(jnp.ones(2))
  assert seen == [True, False]
