"""``jaxcoll.traffic``: the bytes a whole program sends over each mesh axis, read off its jaxpr.

Every jaxcoll schedule runs as ``lax.ppermute`` steps, so a traced program (a training
step, forward and backward) shows every message it will send: the ppermutes, inside
loops (scan trip counts multiply), remat, custom VJPs and shard_map. Each message crosses
the outermost mesh axis in which its two devices differ (as :meth:`Schedule.traffic`
counts); the report gives, per axis, the most bytes any one device sends across it and the
number of messages. jax.lax collectives other than ppermute (``native`` picks, XLA's own)
cannot be priced this way: they are counted by name in ``collectives`` so a reader knows
the figure is incomplete. Loops whose trip count is not static count once and are counted
in ``unbounded_loops``; both branches of a ``cond`` count.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np

from jaxcoll._src import checks
from jaxcoll._src.interpreter import While, form_of, walk
from jaxcoll._src.table import Table

_COLLECTIVES = ("psum", "psum_invariant", "pmax", "pmin", "all_gather", "all_gather_invariant",
                "reduce_scatter", "psum_scatter", "all_to_all", "ragged_all_to_all")


@dataclasses.dataclass(frozen=True)
class Traffic:
  """Per mesh axis (outermost first): the most bytes one device sends across it, and the
  messages that cross it (all devices'); plus what the count could not see."""

  axis_names: tuple[str, ...]
  bytes: dict
  messages: dict
  collectives: dict
  unbounded_loops: int

  def table(self, title: str = "traffic") -> Table:
    rows = [(a, f"{self.bytes[a] / 2**20:.3f}", self.messages[a]) for a in self.axis_names]
    note = "".join(f"; not counted: {n} x {c}" for c, n in self.collectives.items())
    return Table.of(title + note, ("axis", "MiB sent per device", "messages"), rows)

  def __str__(self) -> str:
    return str(self.table())


def traffic(fn, mesh, *args, **kwargs) -> Traffic:
  """Traces ``fn(*args, **kwargs)`` (a jitted or shard_mapped step over ``mesh``: anything
  ``jax.make_jaxpr`` takes) and counts the bytes its ppermutes send across each axis of
  ``mesh`` (module docstring).

  Args:
    fn: the step.
    mesh: the mesh whose axes the bytes are counted over.
    *args: ``fn``'s arguments (arrays or ``jax.ShapeDtypeStruct``).
    **kwargs: ``fn``'s keyword arguments.

  Returns:
    A :class:`Traffic`: per axis the most bytes a device sends across it and the messages
    crossing it; collectives it cannot count (lax's own) listed by name.

  Raises:
    TypeError: ``mesh`` is not a mesh.

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np, jaxcoll
    >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("x",))
    >>> f = jax.shard_map(lambda v: jaxcoll.all_reduce(v, "x", algorithm="ring"),
    ...                   mesh=mesh, in_specs=jax.P("x"), out_specs=jax.P())
    >>> jaxcoll.traffic(f, mesh, jnp.ones(4096, jnp.float32)).bytes["x"]
    6144.0
  """
  shape_of = checks.mesh_shape(mesh)
  names, shape = tuple(shape_of), tuple(shape_of.values())
  coords = np.stack(np.unravel_index(np.arange(math.prod(shape)), shape), axis=1)
  sent = np.zeros((len(coords), len(names)))
  messages = np.zeros(len(names), np.int64)
  other: dict[str, int] = {}
  unbounded = [0]

  def visit(eqn, mult):
    name = eqn.primitive.name
    if isinstance(form_of(eqn), While):   # its trip count is not known: counted once
      unbounded[0] += 1
    if name in _COLLECTIVES:
      other[name] = other.get(name, 0) + mult
    if name != "ppermute":
      return
    axes = checks.as_axes(eqn.params["axis_name"])
    idx = [names.index(a) for a in axes]
    group = [shape[i] for i in idx]
    nbytes = sum(math.prod(v.aval.shape) * v.aval.dtype.itemsize for v in eqn.invars)
    rank = np.ravel_multi_index(coords[:, idx].T, group)       # each device's rank in its group
    for src, dst in eqn.params["perm"]:
      senders = np.flatnonzero(rank == src)
      target = np.array(np.unravel_index(dst, group))
      differ = coords[senders][:, idx] != target
      if not differ.any():
        continue
      axis = min(i for i, d in zip(idx, differ[0]) if d)       # outermost differing axis
      sent[senders, axis] += mult * nbytes
      messages[axis] += mult * len(senders)

  for eqn, times in walk(jax.make_jaxpr(fn)(*args, **kwargs).jaxpr):
    visit(eqn, times)
  return Traffic(names, {a: float(sent[:, i].max(initial=0)) for i, a in enumerate(names)},
                 {a: int(messages[i]) for i, a in enumerate(names)}, other, unbounded[0])
