"""``jaxcoll.pipeline.run``: a pipeline-parallel training step as one SPMD program.

Every device of the pipeline axis runs the same program: a ``fori_loop`` over the ticks of
the schedule's table (:mod:`jaxcoll._src.pipeline.schedules`). At each tick a device reads
its row of the table and runs one branch of a ``lax.switch`` (a GPU runs only the branch
taken; XLA's CPU runtime too: a ``switch`` lowers to a conditional, not a select): the
forward of one microbatch chunk, its backward (the input gradient and, unless the schedule
splits it, the weight gradient), its weight gradient alone (zero-bubble), or nothing. Then
every device sends what it made: the activation one device on (``jaxcoll.shift`` by +1)
and the input's cotangent one device back (by -1), and keeps what arrives where the table
says it belongs. The backward of each chunk is its VJP, recomputed from the chunk's saved
input (each stage is rematerialised), so the schedule, not autodiff of the loop, decides
when it runs.

Memory: the saved inputs and pending cotangents live in ring buffers of as many slots as
the table ever holds at once for a chunk (``_Plan.slots``, from the table): M for GPipe,
at most PP for 1F1B.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcoll._src.collectives import all_reduce, shift
from jaxcoll._src.pipeline import schedules
from jaxcoll._src.pipeline.schedules import BACKWARD, FORWARD, IDLE, WEIGHT
from jaxcoll.extend import (
  axis_index,
  axis_size,
  check_int,
  make_varying,
  normalize_axes,
  varying_axes,
)


@dataclasses.dataclass(frozen=True)
class _Plan:
  """What each device receives and where it keeps it, per tick: ``act[t, s]`` and
  ``ct[t, s]`` the (chunk, slot) an arriving activation / cotangent is stored in (chunk -1:
  nothing arrives); ``slots``: ring buffer slots a chunk needs (activations, cotangents)."""

  act: np.ndarray
  ct: np.ndarray
  slots: tuple[int, int]


@functools.lru_cache(maxsize=256)
def _plan(schedule: str, stages: int, microbatches: int, virtual: int) -> _Plan:
  tab = schedules.table(schedule, stages, microbatches, virtual)
  p, v = tab.stages, tab.virtual
  last = p * v - 1
  act = np.full(tab.kind.shape + (2,), -1, np.int32)
  ct = np.full(tab.kind.shape + (2,), -1, np.int32)
  # when each (virtual stage, microbatch) input arrives and is last read
  held_act: dict = {}
  held_ct: dict = {}
  for t in range(tab.ticks):
    for s in range(p):
      kind, m, r = tab.kind[t, s], tab.micro[t, s], tab.chunk[t, s]
      k = r * p + s
      if kind == FORWARD and k < last:
        nk = k + 1
        act[t, nk % p] = (nk // p, m)
        held_act.setdefault((nk, m), [t, t])
      if kind == BACKWARD and k > 0:
        pk = k - 1
        ct[t, pk % p] = (pk // p, m)
        held_ct.setdefault((pk, m), [t, t])
      if kind in (BACKWARD, WEIGHT):   # reads its saved input and (not last) its cotangent
        if (k, m) in held_act:
          held_act[k, m][1] = max(held_act[k, m][1], t)
        if (k, m) in held_ct:
          held_ct[k, m][1] = max(held_ct[k, m][1], t)

  def slots(held) -> int:   # slot = m % S must never hit a live microbatch of the chunk
    need = 1
    for (k, m), (_, b) in held.items():
      for (k2, m2), (a2, _) in held.items():
        if k2 == k and m2 > m and a2 <= b:   # m2 arrives while m is still held
          need = max(need, m2 - m + 1)
    return need

  s_act, s_ct = slots(held_act), slots(held_ct)
  act[..., 1] = np.where(act[..., 0] >= 0, act[..., 1] % s_act, -1)
  ct[..., 1] = np.where(ct[..., 0] >= 0, ct[..., 1] % s_ct, -1)
  return _Plan(act, ct, (s_act, s_ct))


def run(stage_fn: Callable, params, inputs, targets, axis_name, *, loss_fn: Callable,
        schedule: str = "1f1b", virtual_stages: int = 1, algorithm: str = "auto"):
  """One pipeline-parallel step inside ``shard_map``: the mean loss over microbatches and
  the gradients of this device's stages.

  The model is ``V = PP * virtual_stages`` stages in sequence, ``y = stage_fn(p_k, x)`` for
  k = 0 .. V-1, then ``loss_fn(y, target)``; stage k runs on device ``k % PP`` of
  ``axis_name`` as its chunk ``k // PP`` (MaxText's circular layout; one chunk a device
  unless interleaved). Equal to ``jax.value_and_grad`` of the mean over microbatches of that
  model (within reduction-order tolerance).

  Args:
    stage_fn: ``stage_fn(stage_params, x) -> y``, ``y`` of ``x``'s shape and dtype.
    params: this device's stage parameters: every leaf with a leading dimension of
      ``virtual_stages`` (chunk r: stage ``r * PP + device``). :func:`stack` lays out a
      list of every stage's parameters for ``shard_map``'s ``P(axis_name)``.
    inputs: ``[M, ...]``, the microbatches (stage 0 reads them).
    targets: ``[M, ...]`` (the last stage reads them), a pytree.
    axis_name: the pipeline mesh axis (PP devices).
    loss_fn: ``loss_fn(y, target) -> scalar``.
    schedule: "gpipe", "1f1b", "interleaved" or "zero_bubble" (:func:`schedule`).
    virtual_stages: chunks a device (v, "interleaved" only).
    algorithm: every stage transfer's (:func:`jaxcoll.shift`).

  Returns:
    ``(loss, grads)``: the loss (the same on every device) and ``grads`` shaped as
    ``params`` (this device's chunks).

  Raises:
    ValueError: at trace time, naming the argument: a schedule, M or v the schedule does
      not take (interleaved: M a multiple of PP), params whose leading dimension is not
      ``virtual_stages``, inputs and targets of different M, a stage that changes its
      input's shape or dtype.

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np, jaxcoll
    >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("stage",))
    >>> w = jaxcoll.pipeline.stack([jnp.eye(3) * 2, jnp.eye(3) * 3], 2)
    >>> step = jax.shard_map(
    ...     lambda w, x, y: jaxcoll.pipeline.run(
    ...         lambda p, h: h @ p, w, x, y, "stage",
    ...         loss_fn=lambda out, t: jnp.sum(out * t)),
    ...     mesh=mesh, in_specs=(jax.P("stage"), jax.P(), jax.P()),
    ...     out_specs=(jax.P(), jax.P("stage")))
    >>> loss, grads = step(w, jnp.ones((4, 1, 3)), jnp.ones((4, 1, 3)))
    >>> float(loss)
    18.0
  """
  axes = normalize_axes(axis_name)
  p = axis_size(axes)
  leaves = jax.tree.leaves(inputs)
  if len(leaves) != 1:
    raise ValueError("inputs: expected one array [M, ...] of microbatches")
  x_all = leaves[0]
  m = x_all.shape[0] if x_all.ndim else 0
  if m < 1:
    raise ValueError(f"inputs of shape {x_all.shape}: expected [M, ...] with M >= 1 "
                     "microbatches")
  for t in jax.tree.leaves(targets):
    if t.ndim == 0 or t.shape[0] != m:
      raise ValueError(f"targets: a leaf of shape {t.shape}; expected a leading dimension "
                       f"of M = {m} (inputs' microbatches)")
  v = check_int(virtual_stages, "virtual_stages", least=1)
  tab = schedules.table(schedule, p, m, v)
  for leaf in jax.tree.leaves(params):
    if leaf.ndim == 0 or leaf.shape[0] != v:
      raise ValueError(f"params: a leaf of shape {leaf.shape} on each device; expected a "
                       f"leading dimension of virtual_stages = {v} (this device's chunks; "
                       "jaxcoll.pipeline.stack lays out every stage's parameters)")
  x_shape = jax.ShapeDtypeStruct(x_all.shape[1:], x_all.dtype)
  chunk0 = jax.tree.map(lambda a: a[0], params)
  out = jax.eval_shape(stage_fn, chunk0, x_shape)
  if (out.shape, out.dtype) != (x_shape.shape, x_shape.dtype):
    raise ValueError(f"stage_fn maps an input of shape {x_shape.shape} {x_shape.dtype} to "
                     f"{out.shape} {out.dtype}; a pipeline stage must keep its input's shape "
                     "and dtype (embed before the pipeline, unembed in loss_fn)")

  plan = _plan(schedule, p, m, v)
  table = {name: jnp.asarray(a) for name, a in (
      ("kind", tab.kind), ("micro", tab.micro), ("chunk", tab.chunk),
      ("act", plan.act), ("ct", plan.ct))}
  me = axis_index(axes)
  last = p * v - 1
  # every carried value varies over the pipeline axis and over whatever the data does
  vary = functools.partial(make_varying,
                           axes=tuple(sorted({*axes, *varying_axes(inputs, targets, params)})))
  zeros_x = vary(jnp.zeros(x_shape.shape, x_shape.dtype))
  state = dict(
      acts=vary(jnp.zeros((v, plan.slots[0]) + x_shape.shape, x_shape.dtype)),
      cts=vary(jnp.zeros((v, plan.slots[1]) + x_shape.shape, x_shape.dtype)),
      grads=jax.tree.map(lambda a: vary(jnp.zeros_like(a)), params),
      loss=vary(jnp.zeros((), jnp.float32)))
  params = jax.tree.map(vary, params)

  def tick(t, state):
    kind, mb, r = (table[name][t, me] for name in ("kind", "micro", "chunk"))
    k = r * p + me
    pr = jax.tree.map(lambda a: a[r], params)
    x = jnp.where(k == 0, x_all[mb], state["acts"][r, mb % plan.slots[0]])
    target = jax.tree.map(lambda a: a[mb], targets)

    def cotangent(y):   # of the stage's output: the loss's (last stage) or the arrived one
      seed = jax.grad(lambda y: loss_fn(y, target).astype(jnp.float32) / m)(y)
      return jnp.where(k == last, seed.astype(y.dtype), state["cts"][r, mb % plan.slots[1]])

    def add(grads, d):
      return jax.tree.map(lambda g, dd: g.at[r].add(dd.astype(g.dtype)), grads, d)

    def idle(state):
      return state, zeros_x, zeros_x

    def forward(state):
      y = stage_fn(pr, x)
      loss = jnp.where(k == last, loss_fn(y, target).astype(jnp.float32), 0.0)
      return dict(state, loss=state["loss"] + loss), y, zeros_x

    def backward(state):   # the input's gradient; the weights' too unless split
      y, pull = jax.vjp(stage_fn, pr, x)
      d_params, d_x = pull(cotangent(y))
      grads = state["grads"] if tab.split else add(state["grads"], d_params)
      return dict(state, grads=grads), zeros_x, d_x

    def weight(state):   # zero-bubble's W: the weights' gradient alone
      y, pull = jax.vjp(lambda q: stage_fn(q, x), pr)
      (d_params,) = pull(cotangent(y))
      return dict(state, grads=add(state["grads"], d_params)), zeros_x, zeros_x

    branches = [None] * 4
    branches[IDLE], branches[FORWARD], branches[BACKWARD], branches[WEIGHT] = (
        idle, forward, backward, weight)
    state, send_act, send_ct = lax.switch(kind, branches, state)
    got_act = shift(send_act, axes, 1, algorithm=algorithm)
    got_ct = shift(send_ct, axes, -1, algorithm=algorithm)

    def keep(buffer, where, value):   # in place: a select of one slot, no conditional copy
      chunk, slot = jnp.maximum(where[0], 0), jnp.maximum(where[1], 0)
      return buffer.at[chunk, slot].set(jnp.where(where[0] >= 0, value, buffer[chunk, slot]))
    return dict(state, acts=keep(state["acts"], table["act"][t, me], got_act),
                cts=keep(state["cts"], table["ct"][t, me], got_ct))

  state = lax.fori_loop(0, tab.ticks, tick, state)
  return all_reduce(state["loss"], axes) / m, state["grads"]


def stack(stage_params, num_devices: int):
  """Every stage's parameters, stacked for :func:`run` under ``shard_map(in_specs=
  P(axis_name))``: leaf ``[V, ...]`` ordered so that device s's block holds stages
  s, s + PP, s + 2 PP, ... (its chunks, in order).

  Args:
    stage_params: a list of V pytrees of the same structure (stage k's parameters).
    num_devices: PP, the pipeline axis size (V must be a multiple of it).

  Returns:
    The stacked pytree.

  Raises:
    ValueError: V not a multiple of ``num_devices``, or an empty list.

  Example:
    >>> import jax.numpy as jnp, jaxcoll
    >>> jaxcoll.pipeline.stack([jnp.full((), k) for k in range(4)], 2).tolist()
    [0, 2, 1, 3]
  """
  p = check_int(num_devices, "num_devices", least=1)
  if not stage_params or len(stage_params) % p:
    raise ValueError(f"stage_params holds {len(stage_params)} stages; expected a positive "
                     f"multiple of num_devices = {p}")
  v = len(stage_params) // p
  order = [r * p + s for s in range(p) for r in range(v)]
  return jax.tree.map(lambda *leaves: jnp.stack([leaves[k] for k in order]), *stage_params)


def schedule(name: str, stages: int, microbatches: int, virtual_stages: int = 1):
  """The tick table :func:`run` follows: ``print(schedule("1f1b", 4, 8))`` shows it
  (stage x tick: ``F3`` forward of microbatch 3, ``B1`` backward, ``W2`` weight gradient,
  ``.`` idle), with its bubble fraction and its peak of live microbatches.

  Args:
    name: "gpipe", "1f1b", "interleaved" or "zero_bubble".
    stages, microbatches, virtual_stages: PP, M, v.

  Returns:
    A ``Table``: ``.bubble``, ``.peak_live``, ``.ticks``, ``kind``/``micro``/``chunk``.

  Raises:
    ValueError: as :func:`run` (naming the argument).

  Example:
    >>> import jaxcoll
    >>> t = jaxcoll.pipeline.schedule("gpipe", 4, 8)
    >>> round(t.bubble, 4), t.peak_live
    (0.2727, 8)
  """
  return schedules.table(name, stages, microbatches, virtual_stages)
