"""Grouped matmul: consecutive row groups of ``x``, group g times ``w[g]``.

The expert compute of the sorted MoE layout (:func:`jaxcoll.moe.dispatch` with
``layout="sorted"``): the rows arrive expert-major, ``group_sizes[g]`` rows for local
expert g, and each group is multiplied by its expert's weight.

On GPU and TPU this is ``jax.lax.ragged_dot``, which lowers to a grouped kernel there.
XLA:CPU lowers ragged_dot with a temporary of G times the rows (measured: 16.5 MiB of
temp for a 1 MiB input at G = 16), which would undo the sorted layout's memory saving,
so on CPU it runs tiled, the way MaxText's megablox tiles its grid: the rows are cut into
tiles of ``tile`` rows; a (tile, group) *visit* multiplies the tile's rows of one group by
that group's weight. A group spans consecutive tiles and two neighbouring groups share at
most one tile, so at most m / tile + G - 1 visits cover every row (the rows in the groups,
sum(group_sizes), set the real count): one loop over the real visits. Work: at most
(sum(group_sizes) + (G - 1) * tile) * d * f multiply-adds, at most G - 1 tiles more than
one matmul of the grouped rows, and none for the rows past them; temporary memory: one
tile. Its VJP is two more such loops (rows times w transposed, and each visit's x^T dy
added into its group's weight gradient), saving only x, w and the group sizes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxcoll._src import compat
from jaxcoll.extend import check_int, check_one_of, make_varying

IMPLEMENTATIONS = ("auto", "ragged_dot", "tiled")


def _zeros(shape, *operands):
  """float32 zeros typed varying over the mesh axes any of ``operands`` varies over (inside
  ``shard_map(check_vma=True)``), so a scan carry keeps the type of what is added to it."""
  axes = frozenset().union(*(jax.typeof(o).mat.varying for o in operands))
  return make_varying(jnp.zeros(shape, jnp.float32), tuple(sorted(axes)))


def _visits(group_sizes, m: int, tile: int):
  """Per visit v < m / tile + G - 1: its group, tile, and the rows ``[lo, hi)`` of the group
  (lo = hi = 0 past the real visits, so they are masked out); and the real visits."""
  num = group_sizes.shape[0]
  ends = jnp.cumsum(group_sizes)
  starts = ends - group_sizes
  first = starts // tile
  spans = jnp.where(group_sizes > 0, (ends - 1) // tile - first + 1, 0)
  visit_end = jnp.cumsum(spans)
  v = jnp.arange(m // tile + num - 1, dtype=group_sizes.dtype)
  group = jnp.searchsorted(visit_end, v, side="right")
  real = group < num
  group = jnp.minimum(group, num - 1)
  tile_of = jnp.clip(first[group] + v - (visit_end - spans)[group], 0, m // tile - 1)
  lo = jnp.where(real, starts[group], 0)
  hi = jnp.where(real, ends[group], 0)
  return group, tile_of, lo, hi, visit_end[-1]


def _over_visits(x, group_sizes, tile: int, visit, init):
  """``carry = visit(carry, g, t, rows)`` for each real visit (a loop of their dynamic count,
  so the rows past the groups cost nothing): group g, tile t, and ``rows`` the tile's rows of
  ``x`` with the other groups' rows zeroed."""
  group, tile_of, lo, hi, count = _visits(group_sizes, x.shape[0], tile)

  def body(i, carry):
    t = tile_of[i]
    r = t * tile + jnp.arange(tile)
    block = lax.dynamic_slice_in_dim(x, t * tile, tile)
    rows = jnp.where(((r >= lo[i]) & (r < hi[i]))[:, None], block, jnp.zeros_like(block))
    return visit(carry, group[i], t, rows)
  return lax.fori_loop(0, count, body, init)


def _tiled(x, w, group_sizes, tile: int, transposed: bool = False):
  """``x`` by ``w`` (by ``w[g].T`` where ``transposed``, without a transposed copy of w)."""
  contract = 2 if transposed else 1

  def visit(y, g, t, rows):
    part = lax.dot_general(rows, w[g], (((1,), (contract - 1,)), ((), ())),
                           preferred_element_type=jnp.float32)
    cur = lax.dynamic_slice_in_dim(y, t * tile, tile)
    return lax.dynamic_update_slice_in_dim(y, cur + part, t * tile, 0)

  y0 = _zeros((x.shape[0], w.shape[3 - contract]), x, w, group_sizes)
  return _over_visits(x, group_sizes, tile, visit, y0).astype(jnp.result_type(x, w))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _tiled_gmm(x, w, group_sizes, tile):
  return _tiled(x, w, group_sizes, tile)


def _tiled_gmm_fwd(x, w, group_sizes, tile):
  return _tiled(x, w, group_sizes, tile), (x, w, group_sizes)


def _tiled_gmm_bwd(tile, saved, dy):
  x, w, group_sizes = saved
  dx = _tiled(dy, w, group_sizes, tile, transposed=True).astype(x.dtype)

  def visit(dw, g, t, rows):
    dyt = lax.dynamic_slice_in_dim(dy, t * tile, tile)
    return dw.at[g].add(jnp.matmul(rows.T, dyt, preferred_element_type=jnp.float32))

  dw = _over_visits(x, group_sizes, tile, visit, _zeros(w.shape, x, w, group_sizes, dy))
  return dx, dw.astype(w.dtype), None


_tiled_gmm.defvjp(_tiled_gmm_fwd, _tiled_gmm_bwd)


def grouped_matmul(x, w, group_sizes, *, implementation: str = "auto", tile: int = 64):
  """Rows of ``x`` in consecutive groups, each times its group's weight:
  ``y[r] = x[r] @ w[g]`` for the rows r of group g; rows past ``sum(group_sizes)`` give zero.

  The expert compute of the sorted layout: ``x`` the rows :func:`dispatch` returned,
  ``group_sizes`` its ``state.group_sizes``, ``w`` the local experts' weights. Equal to
  ``jax.lax.ragged_dot`` (module docstring: on CPU a tiled loop of at most m / tile + G - 1
  tile matmuls, since XLA:CPU's ragged_dot takes G times the rows in temporaries).

  Args:
    x: ``[m, d]`` rows, grouped consecutively.
    w: ``[G, d, f]`` one weight per group.
    group_sizes: ``[G]`` int, rows per group, summing to at most m.
    implementation: "ragged_dot", "tiled", or "auto": ragged_dot on GPU and TPU, tiled on
      CPU.
    tile: rows per tile of the tiled form (rounded down to m when m is smaller; m is padded
      to a multiple of it).

  Returns:
    ``[m, f]`` in the result dtype of ``x`` and ``w``, accumulated in float32.

  Raises:
    ValueError: shapes that do not match (``x`` not 2-D, ``w`` not ``[G, d, f]``,
      ``group_sizes`` not ``[G]`` integers), a bad ``implementation`` or ``tile``.

  Example:
    >>> import jax.numpy as jnp, jaxcoll
    >>> x = jnp.ones((5, 2))
    >>> w = jnp.stack([jnp.eye(2), 2 * jnp.eye(2), 3 * jnp.eye(2)])
    >>> y = jaxcoll.moe.grouped_matmul(x, w, jnp.array([2, 0, 2]), tile=2)
    >>> y[:, 0].tolist()               # rows 0-1 by w[0], 2-3 by w[2], row 4 in no group
    [1.0, 1.0, 3.0, 3.0, 0.0]
  """
  x, w, group_sizes = jnp.asarray(x), jnp.asarray(w), jnp.asarray(group_sizes)
  if x.ndim != 2:
    raise ValueError(f"grouped_matmul: x must be [m, d], got shape {x.shape}")
  if w.ndim != 3 or w.shape[1] != x.shape[1]:
    raise ValueError(f"grouped_matmul: w must be [G, d, f] with d = {x.shape[1]}, got shape "
                     f"{w.shape}")
  if group_sizes.shape != w.shape[:1] or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
    raise ValueError(f"grouped_matmul: group_sizes must be [G] = [{w.shape[0]}] integers, got "
                     f"{group_sizes.dtype}{list(group_sizes.shape)}")
  check_one_of(implementation, IMPLEMENTATIONS, "implementation")
  check_int(tile, "tile", least=1)
  if implementation == "auto":
    implementation = "tiled" if compat.target_backend() == "cpu" else "ragged_dot"
  group_sizes = group_sizes.astype(jnp.int32)
  if implementation == "ragged_dot":
    return lax.ragged_dot(x, w, group_sizes)
  m = x.shape[0]
  if m == 0:
    return jnp.zeros((0, w.shape[2]), jnp.result_type(x, w))
  tile = min(tile, m)
  pad = -m % tile
  if pad:
    x = jnp.concatenate([x, jnp.zeros((pad, x.shape[1]), x.dtype)])
  return _tiled_gmm(x, w, group_sizes, tile)[:m]
