"""Which exchange MoE's ``algorithm="auto"`` runs: two all_to_alls, or all_gather + reduce_scatter.

Per device: T tokens of d values (itemsize s), top-k routing, E experts over N devices,
C slots per (source, expert). The two formulations of dispatch + combine:

- ``all_to_all``: dispatch sends the ``[E, C, d]`` buffers in one all_to_all
  (M = E * C * d * s, of which (N-1)/N leaves the device), combine sends them back.
- ``allgather`` (MaxText's ring of experts): dispatch all-gathers the tokens
  (M = N * T * d * s) and the expert ids (N * T * k int32); combine all-gathers the gates
  and reduce-scatters the ``[N, T, d]`` per-source partial sums (M = N * T * d * s).

By bytes alone, all_to_all sends 2 (N-1)/N * E * C * d * s ~ 2 (N-1)/N * k * f * T * d * s
(f the capacity factor) and allgather 2 (N-1) * T * d * s: the ring of experts sends less
once k * f > N. Here every collective is priced by :func:`jaxcoll.explain` (the
collectives' own cost model and profile, each call at the algorithm its own auto picks) and
all_to_all runs unless allgather is predicted ``NATIVE_MARGIN`` (1.25x) faster under a
profile measured on this backend (auto's margin rule, :func:`jaxcoll.extend.replaces`, the
one place it is applied): all_to_all is the conventional exchange (the lax
implementation's), and the model does not price
local work, which the ring of experts has more of (N * T gathered tokens, an
``[N * T, d]`` partial sum; README, Mixture of experts, has a case where it mattered).
Dropless dispatch loops over chunks as the load requires, which trace time cannot know:
it is priced at one trip of ``chunk`` slots, the balanced load. The choice is a pure
function of static shapes, axis sizes and the profile, so every device makes the same one.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np

from jaxcoll._src.auto.explain import Explanation, explain
from jaxcoll._src.auto.profile import Profile
from jaxcoll._src.table import Table
from jaxcoll.extend import (
  NATIVE_MARGIN,
  axes_in_mesh,
  check_int,
  check_number,
  check_one_of,
  format_seconds,
  format_size,
  replaces,
)

ALL_TO_ALL, ALLGATHER = "all_to_all", "allgather"


@dataclasses.dataclass(frozen=True)
class MoECall:
  """One collective of a formulation: where it runs and its :class:`jaxcoll.Explanation`."""

  formulation: str
  phase: str
  explanation: Explanation


@dataclasses.dataclass(frozen=True)
class MoEExplanation:
  """Both formulations of one MoE layer's exchange priced, auto's choice marked. Prints as a
  table: a row per collective (auto's algorithm for it, bytes, predicted time), a total per
  formulation."""

  tokens: int
  d: int
  k: int
  num_experts: int
  capacity: int
  axis_names: tuple[str, ...]
  axis_sizes: tuple[int, ...]
  chosen: str
  calls: tuple[MoECall, ...]

  def predicted_s(self, formulation: str) -> float:
    """Predicted seconds of dispatch + combine in ``formulation``."""
    return sum(c.explanation.predicted_s for c in self.calls if c.formulation == formulation)

  def table(self) -> Table:
    shape = "x".join(map(str, self.axis_sizes))
    title = (f"MoE dispatch + combine: T={self.tokens}, d={self.d}, k={self.k}, "
             f"E={self.num_experts}, C={self.capacity} over {self.axis_names} ({shape}): "
             f"auto -> {self.chosen} (all_to_all unless allgather is {NATIVE_MARGIN:g}x faster)")
    rows = []
    for formulation in (ALL_TO_ALL, ALLGATHER):
      for c in (c for c in self.calls if c.formulation == formulation):
        e = c.explanation
        rows.append((formulation, c.phase, e.primitive, format_size(e.nbytes), e.wire_dtype or "-",
                     e.chosen, format_seconds(e.predicted_s), ""))
      total = format_seconds(self.predicted_s(formulation))
      rows.append((formulation, "total", "", "", "", "", total,
                   "<- auto" if formulation == self.chosen else ""))
    return Table.of(title, ("formulation", "phase", "collective", "M", "wire", "algorithm",
                            "predicted", ""), rows)

  def __str__(self) -> str:
    return str(self.table())

  def __rich__(self):
    return self.table().__rich__()


# slots per expert per source by each framework's formula (capacity's docstring): T, E, k, f
_SLOTS = {
    "gshard": lambda t, e, k, f: math.ceil(k * t * f / e),
    "flaxformer": lambda t, e, k, f: int(round(f * t / e)),
    "maxtext": lambda t, e, k, f: int(max(math.ceil(t * k / e) * f, f)),
}
CONVENTIONS = tuple(_SLOTS)


def capacity(tokens: int, num_experts: int, k: int, factor: float = 1.0, *,
             multiple: int = 1, convention: str = "gshard", min_capacity: int = 0) -> int:
  """Slots per expert per source device, by one framework's formula (``convention``):

  - ``"gshard"`` (the default): ceil(k * T * f / E), GShard's (Switch's with k = 1);
  - ``"flaxformer"``: int(round(f * T / E)), flaxformer's ``MoeLayer`` (k is not in it; its
    ``min_expert_capacity`` is ``min_capacity``);
  - ``"maxtext"``: int(max(ceil(T * k / E) * f, f)), MaxText's ``generate_masks``;

  then at least ``min_capacity``, rounded up to a multiple of ``multiple``. T is the tokens
  of one routing group: a device's tokens here (flaxformer's ``tokens_per_group``,
  MaxText's tokens of one batch row). An evaluation factor (flaxformer's configs set
  ``eval_capacity_factor`` apart) is this function called with it. docs/guide/moe.md has
  the conventions side by side.

  Args:
    tokens: T, tokens per device.
    num_experts: E.
    k: choices per token.
    factor: the capacity factor f.
    multiple: round up to a multiple of this.
    convention: whose formula: "gshard", "flaxformer" or "maxtext" (above).
    min_capacity: the fewest slots.

  Returns:
    Slots per expert per source device.

  Raises:
    ValueError: a negative ``tokens`` or ``min_capacity``; ``num_experts``, ``k`` or
      ``multiple`` below 1; a ``factor`` that is not a finite number above 0; another
      ``convention``.

  Example:
    >>> import jaxcoll
    >>> jaxcoll.moe.capacity(1024, 16, 2, 1.25)
    160
    >>> jaxcoll.moe.capacity(1024, 16, 2, 1.25, convention="flaxformer", min_capacity=4)
    80
    >>> jaxcoll.moe.capacity(1024, 16, 2, 1.25, convention="maxtext")
    160
  """
  check_int(tokens, "tokens", least=0)
  for name, v in (("num_experts", num_experts), ("k", k), ("multiple", multiple)):
    check_int(v, name, least=1)
  check_int(min_capacity, "min_capacity", least=0)
  check_number(factor, "factor", above=0)
  check_one_of(convention, CONVENTIONS, "convention")
  slots = _SLOTS[convention](tokens, num_experts, k, factor)
  return -(-max(slots, min_capacity) // multiple) * multiple


balanced_capacity = capacity   # dispatch's and explain's ``capacity`` shadows the function


def check_sizes(num_experts, capacity, n: int, k=None) -> None:
  """MoE's sizes where they are given (dispatch, explain): E a positive multiple of the axis
  size N, C a positive int or None (dropless), k a positive int."""
  if isinstance(num_experts, bool) or not isinstance(num_experts, (int, np.integer)) or \
      num_experts < 1 or num_experts % n:
    raise ValueError(f"num_experts={num_experts!r} must be a positive multiple of the axis "
                     f"size {n}")
  if capacity is not None:
    check_int(capacity, "capacity", least=1)
  if k is not None:
    check_int(k, "k", least=1)


def explain_moe(x, k: int, *, num_experts: int, capacity: int, mesh, axis_name,
                wire_dtype=None, combine_wire_dtype=None,
                profile: Profile | str | None = None) -> MoEExplanation:
  """Prices both formulations of dispatch + combine (module docstring); ``.chosen`` is what
  ``dispatch(..., algorithm="auto")`` runs.

  Args:
    x: this device's tokens ``[T, d]`` (an array or ``jax.ShapeDtypeStruct``).
    k: choices per token.
    num_experts: E.
    capacity: slots per (source device, expert); for a dropless dispatch, its chunk, or None:
      the default chunk, ceil(k * T / E) (dropless dispatch's balanced load).
    mesh: a ``Mesh`` or ``{axis name: size}``; axis_name: the expert-parallel axis or tuple.
    wire_dtype, combine_wire_dtype: the exchanges' wire formats (dispatch's and combine's).
    profile: the profile to price with (default: the one auto uses).

  Returns:
    A :class:`MoEExplanation`: both formulations' collectives, each priced at its own
    auto; ``.chosen`` is the formulation auto runs.

  Raises:
    ValueError: a bad shape, axis or option, named as :func:`dispatch` names them.

  Example:
    >>> import jax, jaxcoll
    >>> why = jaxcoll.moe.explain(jax.ShapeDtypeStruct((1024, 512), "bfloat16"), 2,
    ...                           num_experts=16, capacity=160, mesh={"expert": 8},
    ...                           axis_name="expert", profile="cpu")
    >>> why.chosen in ("all_to_all", "allgather")
    True
  """
  if len(getattr(x, "shape", ())) != 2 or not hasattr(x, "dtype"):
    raise ValueError(f"x={x!r}: expected this device's tokens [T, d] (an array or a "
                     "jax.ShapeDtypeStruct)")
  t, d = map(int, x.shape)
  dtype = np.dtype(x.dtype)
  axes, sizes = axes_in_mesh(axis_name, mesh, mapping=True)
  n = math.prod(sizes)
  check_sizes(num_experts, capacity, n, k)
  if capacity is None:   # dropless: priced at one trip of the default chunk (module docstring)
    capacity = balanced_capacity(t, num_experts, k)
  sds = lambda *shape, dt=dtype: jax.ShapeDtypeStruct(shape, dt)   # noqa: E731
  price = lambda prim, v, wire=None: explain(prim, v, mesh, axes, profile,   # noqa: E731
                                             wire_dtype=wire)
  buffer = sds(num_experts * capacity, d)
  calls = [MoECall(ALL_TO_ALL, "dispatch", price("all_to_all", buffer, wire_dtype)),
           MoECall(ALL_TO_ALL, "combine", price("all_to_all", buffer, combine_wire_dtype)),
           MoECall(ALLGATHER, "dispatch", price("all_gather", sds(t, d), wire_dtype)),
           MoECall(ALLGATHER, "dispatch", price("all_gather", sds(t, k, dt=np.int32))),
           MoECall(ALLGATHER, "combine", price("all_gather", sds(t, k))),
           MoECall(ALLGATHER, "combine", price("reduce_scatter", sds(n * t, d),
                                               combine_wire_dtype))]
  moe = MoEExplanation(t, d, k, num_experts, capacity, axes, sizes, ALL_TO_ALL, tuple(calls))
  if replaces([moe.predicted_s(ALLGATHER)], [moe.predicted_s(ALL_TO_ALL)],
              trusted=all(c.explanation.trusted for c in calls)):   # auto's margin rule
    moe = dataclasses.replace(moe, chosen=ALLGATHER)
  return moe

