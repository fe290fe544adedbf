"""``data_parallel``: a training step written for one device, run over a mesh axis."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxcoll._src.collectives import all_reduce
from jaxcoll._src.training.per_device import PerDevice, is_per_device
from jaxcoll.extend import axes_in_mesh, check_int, varying


def data_parallel(step: Callable, mesh: jax.sharding.Mesh, axis_name="data", *,
                  batch_argnums: Sequence[int] = (2,), donate_argnums: Sequence[int] = ()):
  """``step(params, opt_state, batch) -> (params, opt_state, metrics)``, written for one
  device, as one jitted function over the global batch.

  The returned function takes the step's arguments with the batch arguments
  (``batch_argnums``) global: every leaf is split along its leading dimension over
  ``axis_name`` (a mesh axis or a tuple of them), which must divide it, and every leaf of
  one batch argument must have the same leading dimension. Every other argument is
  replicated, except leaves under a :class:`jaxcoll.PerDevice` node (error-feedback
  residuals), which each device keeps for itself: they come back stacked, one row per
  device. The step runs inside ``jax.shard_map(check_vma=False)``, as under ``pmap``: every
  value is the device's own, collectives are explicit, so the step syncs its gradients
  itself (``jaxcoll.sync_gradients``, ``jaxcoll.sync_in_backward``,
  ``jaxcoll.optax.sync`` or ``lax.pmean``). The last output (the metrics) is averaged over
  the axis; every other output is returned once, so it must be the same on every device.

  That is checked when the step is traced, not trusted: the step's jaxpr is read
  (:func:`jaxcoll.extend.varying`) for what each output depends on, and an
  output (outside a ``PerDevice``) that depends on this device's batch without passing
  through a reduction over the axis is a ValueError naming it: a step that applies a
  plain optimizer to unsynced gradients would otherwise return one device's parameters,
  trained on 1/N of the batch.

  Args:
    step: the one-device step; its last output is the metrics (a pytree of arrays).
    mesh: the ``jax.sharding.Mesh``.
    axis_name: the data-parallel axis of ``mesh`` (or a tuple of its axes).
    batch_argnums: the positions of the batch arguments (split over the axis).
    donate_argnums: positions of arguments whose buffers the step may reuse.

  Returns:
    The jitted step over global arguments.

  Raises:
    ValueError, TypeError: at once for a bad mesh, axis or argnum; when traced, for batch
      leaves the axis does not divide or of different lengths, and for an output that
      differs between devices.

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np, jaxcoll
    >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("data",))
    >>> def step(w, state, batch):
    ...   g = jaxcoll.sync_gradients(jax.grad(lambda w: jnp.mean((batch @ w) ** 2))(w), "data")
    ...   return w - 0.1 * g, state, {"norm": jnp.linalg.norm(g)}
    >>> w, state, metrics = jaxcoll.data_parallel(step, mesh)(jnp.ones(3), (), jnp.ones((8, 3)))
    >>> w.round(3)   # 1 - 0.1 * 2 * 3: every device's gradient of the mean loss is 6
    Array([0.4, 0.4, 0.4], dtype=float32)
  """
  if not callable(step):
    raise TypeError(f"step={step!r}: expected a function step(params, opt_state, batch)")
  axes, sizes = axes_in_mesh(axis_name, mesh)
  n = math.prod(sizes)
  batch_spec = P(axes if len(axes) > 1 else axes[0])
  batch_argnums = tuple(check_int(i, "batch_argnums", least=0) for i in batch_argnums)
  donate_argnums = tuple(check_int(i, "donate_argnums", least=0) for i in donate_argnums)

  def check_batch(i, arg):
    rows = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(arg)[0]:
      shape = jnp.shape(leaf)
      where = f"argument {i}{jax.tree_util.keystr(path)}"
      if not shape or shape[0] % n:
        raise ValueError(f"{where} has shape {shape}: a batch argument needs a leading "
                         f"dimension divisible by the {n} devices of axis {axis_name!r}")
      rows.setdefault(shape[0], where)
    if len(rows) > 1:
      (a, first), (b, second) = list(rows.items())[:2]
      raise ValueError(f"{first} has {a} rows but {second} has {b}: every leaf of a batch "
                       f"argument is split along its leading dimension over {axis_name!r} "
                       "(a device would get rows of different examples); pass what is not "
                       "per-example as an argument outside batch_argnums")

  def stack(x):          # a PerDevice from init: one copy per device
    if not is_per_device(x) or x.stacked:
      return x
    return PerDevice(jax.tree.map(lambda v: jnp.broadcast_to(v, (n,) + jnp.shape(v)), x.value),
                     stacked=True)

  def local(x):          # inside: this device's row
    return PerDevice(jax.tree.map(lambda v: v[0], x.value)) if is_per_device(x) else x

  def split(tree):
    """(replicated parts, per-device subtrees, their paths, a function putting them back)."""
    parts = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_per_device)[0]
    mask = [is_per_device(p) for _, p in parts]
    treedef = jax.tree.structure(tree, is_leaf=is_per_device)
    rep = [p for (_, p), m in zip(parts, mask) if not m]
    dev = [p for (_, p), m in zip(parts, mask) if m]
    paths = [jax.tree_util.keystr(k) for (k, _), m in zip(parts, mask) if not m]

    def join(rep, dev):
      it_r, it_d = iter(rep), iter(dev)
      return jax.tree.unflatten(treedef, [next(it_d) if m else next(it_r) for m in mask])
    return rep, dev, paths, join

  def run(*args):
    for i in batch_argnums:
      if i >= len(args):
        raise ValueError(f"batch_argnums={batch_argnums}: the step got {len(args)} arguments")
      check_batch(i, args[i])
    args = jax.tree.map(stack, args, is_leaf=is_per_device)
    batch = {i: args[i] for i in batch_argnums}
    rep, dev, _, join = split([None if i in batch else a for i, a in enumerate(args)])
    traced = {}

    def body(rep_local, dev_local, batch_local):
      args_local = list(jax.tree.map(local, join(rep_local, dev_local), is_leaf=is_per_device))
      for i, b in batch_local.items():
        args_local[i] = b
      out = step(*args_local)
      if not isinstance(out, tuple) or not out:
        raise ValueError("data_parallel: the step must return a tuple whose last element is "
                         f"the metrics, got {type(out).__name__}")
      metrics = jax.tree.map(lambda m: all_reduce(m, axis_name, op="mean"), out[-1])
      o_rep, o_dev, paths, o_join = split((*out[:-1], metrics))
      traced.update(join=o_join, paths=paths, metrics=len(jax.tree.leaves(metrics)))
      return o_rep, [PerDevice(jax.tree.map(lambda v: v[None], d.value)) for d in o_dev]

    f = jax.shard_map(body, mesh=mesh, in_specs=(P(), batch_spec, batch_spec),
                      out_specs=(P(), batch_spec), check_vma=False)
    closed, shapes = jax.make_jaxpr(f, return_shape=True)(rep, dev, batch)
    _check_replicated(closed, (rep, dev, batch), traced, set(axes), axis_name)
    flat = jax.extend.core.jaxpr_as_fun(closed)(*jax.tree.leaves((rep, dev, batch)))
    o_rep, o_dev = jax.tree.unflatten(jax.tree.structure(shapes), flat)
    return traced["join"](o_rep, [PerDevice(d.value, stacked=True) for d in o_dev])

  return jax.jit(run, donate_argnums=donate_argnums)


def _check_replicated(closed, args, traced: dict, axes: set, axis_name) -> None:
  """Raises for an output the step returns once (not under PerDevice) that differs between
  devices (:func:`varying`), reading the jitted program's jaxpr with the per-device inputs
  (``args[1:]``: PerDevice state and the batch) varying over ``axes``."""
  replicated_inputs = len(jax.tree.leaves(args[0]))
  in_vary = [frozenset(axes) if i >= replicated_inputs else frozenset()
             for i in range(len(closed.jaxpr.invars))]
  out_vary = varying(closed.jaxpr, [frozenset()] * len(closed.consts), in_vary)
  checked = len(traced["paths"]) - traced["metrics"]   # the metrics are averaged
  for path, vary in zip(traced["paths"][:checked], out_vary):
    if vary & axes:
      raise ValueError(
          f"data_parallel: the step's output {path} differs between the devices of "
          f"{axis_name!r}: it depends on this device's batch without a reduction over "
          f"{axis_name!r}, so returning one device's copy would be wrong. Sync the gradients "
          f"before the update (jaxcoll.sync_gradients(grads, {axis_name!r}), "
          f"jaxcoll.sync_in_backward, or optax.chain(jaxcoll.optax.sync({axis_name!r}), "
          "optimizer)); state each device keeps for itself goes under jaxcoll.PerDevice")
