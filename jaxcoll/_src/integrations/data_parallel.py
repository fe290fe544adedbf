"""``data_parallel``: a training step written for one device, run over a mesh axis."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxcoll._src.collectives import all_reduce
from jaxcoll._src.integrations.per_device import PerDevice, is_per_device


def data_parallel(step: Callable, mesh: jax.sharding.Mesh, axis_name: str = "data", *,
                  batch_argnums: Sequence[int] = (2,), donate_argnums: Sequence[int] = ()):
  """``step(params, opt_state, batch) -> (params, opt_state, metrics)``, written for one
  device, as one jitted function over the global batch.

  The returned function takes the step's arguments with the batch arguments
  (``batch_argnums``) global: every leaf is split along its leading dimension over
  ``axis_name``, which must divide it. Every other argument is replicated, except leaves
  under a :class:`jaxcoll.PerDevice` node (error-feedback residuals), which each device
  keeps for itself: they come back stacked, one row per device. The step runs inside
  ``jax.shard_map(check_vma=False)``, as under ``pmap``: every value is the device's own,
  collectives are explicit, so the step syncs its gradients itself
  (``jaxcoll.sync_gradients``, ``jaxcoll.sync_in_backward`` or ``jaxcoll.optax.sync``).
  The last output (the metrics) is averaged over the axis; the others are returned as
  device 0 holds them (equal on every device when the step synced its gradients).
  """
  if axis_name not in mesh.axis_names:
    raise ValueError(f"axis_name={axis_name!r} is not an axis of the mesh {mesh.axis_names}")
  n = mesh.shape[axis_name]
  batch_argnums = tuple(batch_argnums)

  def check_batch(i, arg):
    for path, leaf in jax.tree_util.tree_flatten_with_path(arg)[0]:
      shape = jnp.shape(leaf)
      if not shape or shape[0] % n:
        raise ValueError(f"argument {i}{jax.tree_util.keystr(path)} has shape {shape}: a batch "
                         f"argument needs a leading dimension divisible by the {n} devices "
                         f"of axis {axis_name!r}")

  def stack(x):          # a PerDevice from init: one copy per device
    if not is_per_device(x) or x.stacked:
      return x
    return PerDevice(jax.tree.map(lambda v: jnp.broadcast_to(v, (n,) + jnp.shape(v)), x.value),
                     stacked=True)

  def local(x):          # inside: this device's row
    return PerDevice(jax.tree.map(lambda v: v[0], x.value)) if is_per_device(x) else x

  def split(tree):
    """(replicated leaves, per-device subtrees, a function putting them back)."""
    parts = jax.tree.leaves(tree, is_leaf=is_per_device)
    mask = [is_per_device(p) for p in parts]
    treedef = jax.tree.structure(tree, is_leaf=is_per_device)
    rep = [p for p, m in zip(parts, mask) if not m]
    dev = [p for p, m in zip(parts, mask) if m]

    def join(rep, dev):
      it_r, it_d = iter(rep), iter(dev)
      return jax.tree.unflatten(treedef, [next(it_d) if m else next(it_r) for m in mask])
    return rep, dev, join

  def run(*args):
    for i in batch_argnums:
      if not 0 <= i < len(args):
        raise ValueError(f"batch_argnums={batch_argnums}: the step got {len(args)} arguments")
      check_batch(i, args[i])
    args = jax.tree.map(stack, args, is_leaf=is_per_device)
    batch = {i: args[i] for i in batch_argnums}
    rep, dev, join = split([None if i in batch else a for i, a in enumerate(args)])
    out_join = []

    def body(rep_local, dev_local, batch_local):
      args_local = list(jax.tree.map(local, join(rep_local, dev_local), is_leaf=is_per_device))
      for i, b in batch_local.items():
        args_local[i] = b
      out = step(*args_local)
      if not isinstance(out, tuple) or not out:
        raise ValueError("data_parallel: the step must return a tuple whose last element is "
                         f"the metrics, got {type(out).__name__}")
      metrics = jax.tree.map(lambda m: all_reduce(m, axis_name, op="mean"), out[-1])
      o_rep, o_dev, o_join = split((*out[:-1], metrics))
      out_join.append(o_join)
      return o_rep, [PerDevice(jax.tree.map(lambda v: v[None], d.value)) for d in o_dev]

    f = jax.shard_map(body, mesh=mesh, in_specs=(P(), P(axis_name), P(axis_name)),
                      out_specs=(P(), P(axis_name)), check_vma=False)
    o_rep, o_dev = f(rep, dev, batch)
    return out_join[-1](o_rep, [PerDevice(d.value, stacked=True) for d in o_dev])

  return jax.jit(run, donate_argnums=tuple(donate_argnums))
