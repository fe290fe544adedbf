"""Shared test helpers: meshes over the first n CPU devices, and jaxpr byte counting."""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

AXIS = "x"


def mesh(n: int) -> Mesh:
  return Mesh(np.array(jax.devices()[:n]), (AXIS,))


def per_device(fn, n: int, *, replicated_out: bool = False, check_vma: bool = True, jit=True):
  """``fn`` maps one device's pytree to one device's pytree; the wrapper takes and returns
  arrays with a leading axis of n (device r's value at index r).

  With ``replicated_out`` the outputs leave shard_map with ``out_specs=P()`` (they must be
  typed invariant) and come back without the leading axis.
  """
  m = mesh(n)
  out_spec = P() if replicated_out else P(AXIS)

  def body(tree):
    out = fn(jax.tree.map(lambda v: v[0], tree))
    return out if replicated_out else jax.tree.map(lambda v: v[None], out)

  f = jax.shard_map(body, mesh=m, in_specs=P(AXIS), out_specs=out_spec, check_vma=check_vma)
  f = jax.jit(f) if jit else f

  def call(tree):
    tree = jax.tree.map(lambda v: jax.device_put(v, NamedSharding(m, P(AXIS))), tree)
    return f(tree)
  return call


def iter_eqns(jaxpr, mult: int = 1):
  """Every equation of a (closed) jaxpr and its sub-jaxprs, with its scan trip-count multiplier."""
  jx = jaxpr.jaxpr if hasattr(jaxpr, "jaxpr") else jaxpr
  for eqn in jx.eqns:
    yield eqn, mult
    if eqn.primitive.name == "while":
      raise AssertionError("unbounded while loop: trip count unknown")
    inner = mult * eqn.params["length"] if eqn.primitive.name == "scan" else mult
    for v in eqn.params.values():
      for j in (v if isinstance(v, (tuple, list)) else (v,)):
        if hasattr(j, "eqns") or hasattr(getattr(j, "jaxpr", None), "eqns"):
          yield from iter_eqns(j, inner)


def ppermute_bytes_per_rank(jaxpr, n: int) -> np.ndarray:
  """Bytes each rank sends through ppermute in a (closed) jaxpr, loops counted by trip count."""
  sent = np.zeros(n, np.int64)
  for eqn, mult in iter_eqns(jaxpr):
    if eqn.primitive.name == "ppermute":
      aval = eqn.invars[0].aval
      for src, _ in eqn.params["perm"]:
        sent[src] += mult * math.prod(aval.shape) * aval.dtype.itemsize
  return sent


def count_primitive(jaxpr, name: str) -> int:
  return sum(eqn.primitive.name == name for eqn, _ in iter_eqns(jaxpr))
