"""The gradient sums JAX makes for replicated values, as jaxcoll all_reduces.

A value that is the same on every device of a shard_map (replicated, invariant) and is used
per device gets a gradient that is the sum of every device's contribution. JAX makes that
sum when ``jax.grad`` transposes the program, after ``jaxcoll.use`` has rewritten the forward,
in one of two places: the transpose of ``pvary``, the cast to varying that
``shard_map(check_vma=True)`` inserts wherever a replicated value meets a varying one
(``psum_invariant``); and, under ``check_vma=False``, shard_map's own transpose, which sums
the cotangent of every input its ``in_specs`` leave unmentioned over those axes (``psum``).
Two primitives of jaxcoll's take their place in ``use``'s rewrite (:mod:`rewrite`), so that
``jax.grad``, ``jax.vjp`` and ``jax.linear_transpose`` of the rewritten function sum with
jaxcoll (the algorithm and wire format ``use`` was given):

- :func:`vary`: ``pvary`` itself (no data moves), its transpose ``jaxcoll.all_reduce``.
- :func:`stack`: a replicated input made one copy per device of the axes its spec leaves
  out (``[n, *shape]``, sharded over them on the new leading dimension: each device keeps its
  own copy, no data moves), so the shard_map mentions every axis in every input and sums
  nothing itself; its transpose sums the ``n`` cotangents with ``jaxcoll.all_reduce`` in a
  shard_map of its own.

Both are linear, so ``jax.jvp`` passes through them. They rely on jax's extension API
(``jax.extend.core.Primitive``, ``ad.deflinear2``, ``batching.primitive_batchers``,
``mlir.register_lowering``) as ``replicated.py`` does; ``tests/test_use_grad.py`` checks them
on both supported jax versions.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcoll._src.collectives import all_reduce
from jaxcoll._src.use.placement import with_leading

vary_p = Primitive("jaxcoll_vary")
stack_p = Primitive("jaxcoll_stack")


def vary(x, axes: tuple[str, ...], algorithm="auto", wire_dtype=None):
  """``x`` typed varying over ``axes`` (the values unchanged); the transpose all-reduces the
  cotangent over ``axes`` with jaxcoll (``algorithm``, ``wire_dtype``)."""
  return vary_p.bind(x, axes=tuple(axes), algorithm=algorithm, wire_dtype=wire_dtype)


def stack(x, mesh, axes: tuple[str, ...], spec, algorithm="auto", wire_dtype=None):
  """``x`` (laid out as ``spec`` on ``mesh``, replicated over ``axes``) as ``[n, *x.shape]``,
  n the devices of ``axes``, sharded over ``axes`` on the new dimension: one copy a device.
  Its transpose sums the n cotangents with jaxcoll (``algorithm``, ``wire_dtype``)."""
  return stack_p.bind(x, mesh=mesh, axes=tuple(axes), spec=tuple(spec), algorithm=algorithm,
                      wire_dtype=wire_dtype)


def _sum(ct, axes, algorithm, wire_dtype):
  """The gradient sum, on the wire ``use`` decided for it (:meth:`Options.wire_for`).

  Raises:
    ValueError: a float64 cotangent on a compressed wire, which encodes in float32.
  """
  if wire_dtype is None:
    return all_reduce(ct, axes, algorithm=algorithm)
  if jnp.dtype(ct.dtype).itemsize > 4:
    name = getattr(wire_dtype, "name", wire_dtype)
    raise ValueError(
        f"use(wire_dtype={name!r}): the gradient of a {jnp.dtype(ct.dtype)} input of shape "
        f"{tuple(ct.shape)}, replicated over {tuple(axes)}, would be summed encoded in "
        "float32, where a float64 value has no home beyond float32's range; cast it to "
        "float32, or pass wire_dtype=None")
  return all_reduce(ct, axes, algorithm=algorithm, wire_dtype=wire_dtype)


# ---- vary ----

def _vary_abstract_eval(aval, *, axes, algorithm, wire_dtype):
  del algorithm, wire_dtype   # as lax's pvary: the sharding's mesh is the one of this trace
  return aval.update(sharding=aval.sharding.update(mesh=jax.sharding.get_abstract_mesh()),
                     manual_axis_type=aval.mat.update(varying=aval.mat.varying | set(axes)))


def _vary_transpose(ct, x, *, axes, algorithm, wire_dtype):
  del x
  return (_sum(ct, axes, algorithm, wire_dtype),)


def _vary_batch(vals, dims, **params):
  (x,), (d,) = vals, dims
  return vary_p.bind(x, **params), d


vary_p.def_abstract_eval(_vary_abstract_eval)
vary_p.def_impl(lambda x, **params: x)
mlir.register_lowering(vary_p, lambda ctx, x, **params: [x])
ad.deflinear2(vary_p, _vary_transpose)
batching.primitive_batchers[vary_p] = _vary_batch


# ---- stack ----

def _copies(mesh, axes) -> int:
  return math.prod(mesh.shape[a] for a in axes)


def _broadcast(x, *, mesh, axes, **params):
  return jnp.broadcast_to(x[None], (_copies(mesh, axes),) + x.shape)


def _stack_abstract_eval(aval, *, mesh, axes, spec, algorithm, wire_dtype):
  """On a mesh whose axes are Explicit the type says the layout (``P(axes, *spec)``), as
  shard_map's ``in_specs`` check there; elsewhere the layout is left to the partitioner."""
  del algorithm, wire_dtype
  shape = (_copies(mesh, axes),) + aval.shape
  abstract = mesh.abstract_mesh
  if all(t == jax.sharding.AxisType.Explicit for t in abstract.axis_types):
    return aval.update(shape=shape, sharding=NamedSharding(abstract, P(axes, *spec)))
  return aval.update(shape=shape,
                     sharding=aval.sharding.update(spec=with_leading(aval.sharding.spec, None)))


def _stack_transpose(ct, x, *, mesh, axes, spec, algorithm, wire_dtype):
  del x
  total = jax.shard_map(lambda c: _sum(c[0], axes, algorithm, wire_dtype), mesh=mesh,
                        in_specs=P(axes, *spec), out_specs=P(*spec), check_vma=True)
  return (total(ct),)


def _stack_batch(vals, dims, **params):
  (x,), (d,) = vals, dims
  out = stack_p.bind(jnp.moveaxis(x, d, -1), **params)   # the batch dimension last
  return out, out.ndim - 1


stack_p.def_abstract_eval(_stack_abstract_eval)
stack_p.def_impl(lambda x, *, mesh, axes, spec, **params: jax.device_put(   # eagerly: laid out
    _broadcast(x, mesh=mesh, axes=axes), NamedSharding(mesh, P(axes, *spec))))
mlir.register_lowering(stack_p, mlir.lower_fun(_broadcast, multiple_results=False))
ad.deflinear2(stack_p, _stack_transpose)
batching.primitive_batchers[stack_p] = _stack_batch
