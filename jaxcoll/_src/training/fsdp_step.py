"""``jaxcoll.fsdp.train_step``: a sharded training step without a hand-written shard_map."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcoll._src.collectives import all_reduce
from jaxcoll._src.training import fsdp
from jaxcoll.extend import axes_in_mesh, axis_size, check_flag, normalize_axes


class State(NamedTuple):
  """Sharded parameters (:class:`jaxcoll.fsdp.Sharded` leaves) and the optimizer state
  (sharded the same way wherever it mirrors the parameters)."""

  params: Any
  opt_state: Any


@dataclasses.dataclass(frozen=True)
class TrainStep:
  """``init(params) -> State`` and ``step(state, batch) -> (state, loss)``; see
  :func:`train_step`."""

  loss_fn: Callable
  optimizer: Any
  mesh: Any
  axis_name: Any
  gather_params: bool = True
  gather_options: tuple = ()
  donate: bool = True

  @property
  def num_shards(self) -> int:
    return math.prod(axes_in_mesh(self.axis_name, self.mesh)[1])

  def init(self, params, *, axis=0) -> State:
    """Shards ``params`` (:func:`jaxcoll.fsdp.shard`) over the axis, places them on the mesh
    and initialises the optimizer state there, each device holding 1/N of both."""
    sharded = fsdp.place(fsdp.shard(params, self.num_shards, axis=axis), self.mesh,
                         self.axis_name)
    abstract = jax.eval_shape(self.optimizer.init, sharded)
    shardings = jax.tree.map(lambda p: NamedSharding(self.mesh, p),
                             fsdp.specs(abstract, self.axis_name),
                             is_leaf=lambda x: isinstance(x, P))
    return State(sharded, jax.jit(self.optimizer.init, out_shardings=shardings)(sharded))

  def params(self, state: State):
    """The whole parameters, in their original shapes."""
    return fsdp.unshard(state.params)

  def __call__(self, state: State, batch):
    """One step: ``(state, loss)``, the loss averaged over devices. ``state`` is donated
    (its buffers reused) unless the step was built with ``donate=False``."""
    return (_donating if self.donate else _step)(self, state, batch)


def _run(ts: TrainStep, state: State, batch):
  specs = State(fsdp.specs(state.params, ts.axis_name), fsdp.specs(state.opt_state, ts.axis_name))
  options = dict(ts.gather_options)

  def body(state: State, batch):
    n = axis_size(normalize_axes(ts.axis_name))

    def loss(shards):
      params = fsdp.gather(shards, ts.axis_name, **options) if ts.gather_params else shards
      return ts.loss_fn(params, batch) / n     # the reduce-scatter sums: a mean over devices
    value, grads = jax.value_and_grad(loss)(state.params)
    updates, opt_state = ts.optimizer.update(grads, state.opt_state, state.params)
    params = jax.tree.map(lambda p, u: (p + u).astype(p.dtype), state.params, updates)
    return State(params, opt_state), all_reduce(value, ts.axis_name)

  return jax.shard_map(body, mesh=ts.mesh, in_specs=(specs, P(ts.axis_name)),
                       out_specs=(specs, P()), check_vma=False)(state, batch)


_step = jax.jit(_run, static_argnums=0)
_donating = jax.jit(_run, static_argnums=0, donate_argnums=1)


def train_step(loss_fn: Callable, optimizer, mesh, axis_name, *, gather_params: bool = True,
               donate: bool = True, **gather_options) -> TrainStep:
  """A fully sharded training step: parameters, gradients and optimizer state 1/N per device.

  Args:
    loss_fn: ``loss_fn(params, batch) -> scalar``, the mean loss over the batch it is given
      (this device's share of the global batch, split on its leading dimension).
    optimizer: an optax ``GradientTransformation`` (or anything with ``init``/``update``).
      It sees each device's blocks, so an elementwise optimizer (sgd, adam, adamw, ...)
      updates them exactly as it would the whole parameters; one that reduces over all
      parameters (``clip_by_global_norm``) would see only this device's blocks.
    mesh, axis_name: the mesh and the axis (or tuple) to shard over; the batch is split
      over the same axis.
    gather_params: True: ``loss_fn`` receives the whole parameters, gathered at once before
      it runs. False: it receives the :class:`Sharded` blocks and gathers them itself, a
      layer at a time (:func:`jaxcoll.fsdp.layer`), for a peak of one layer's parameters.
    donate: reuse the state's buffers for the new state (the old one is invalidated).
    **gather_options: :func:`jaxcoll.fsdp.gather`'s options (``algorithm``, ``wire_dtype``,
      ``grad_wire_dtype``, ``secondary_axis``, ``dtype``) for the gather of the whole tree.

  Returns:
    A :class:`TrainStep`: ``state = step.init(params)``; ``state, loss = step(state,
    batch)`` (loss averaged over devices); ``step.params(state)`` the whole parameters.
    Gradients are the mean over devices, as data-parallel training's.

  Raises:
    ValueError: a bad mesh, axis or option, named; ``optimizer`` without ``init`` and
      ``update``.

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np, optax, jaxcoll
    >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("fsdp",))
    >>> loss = lambda p, batch: jnp.mean((batch @ p["w"]) ** 2)
    >>> step = jaxcoll.fsdp.train_step(loss, optax.sgd(0.1), mesh, "fsdp")
    >>> state = step.init({"w": jnp.ones((3, 2))})
    >>> state, value = step(state, jnp.ones((8, 3)))
    >>> float(value), step.params(state)["w"].shape
    (9.0, (3, 2))
  """
  for name in gather_options:
    if name not in ("algorithm", "wire_dtype", "grad_wire_dtype", "secondary_axis", "dtype"):
      raise TypeError(f"train_step: unexpected keyword argument {name!r} (gather options: "
                      "algorithm, wire_dtype, grad_wire_dtype, secondary_axis, dtype)")
  if not callable(loss_fn):
    raise TypeError(f"loss_fn={loss_fn!r}: expected a function loss_fn(params, batch)")
  if not (callable(getattr(optimizer, "init", None)) and
          callable(getattr(optimizer, "update", None))):
    raise TypeError(f"optimizer={optimizer!r}: expected an optax GradientTransformation (init "
                    "and update)")
  axes_in_mesh(axis_name, mesh)
  fsdp.check_options(**{k: gather_options.get(k) for k in ("wire_dtype", "grad_wire_dtype",
                                                           "dtype")},
                     algorithm=gather_options.get("algorithm", "auto"))
  check_flag(gather_params, "gather_params")
  check_flag(donate, "donate")
  return TrainStep(loss_fn, optimizer, mesh, axis_name, gather_params,
                   tuple(sorted(gather_options.items())), donate)
