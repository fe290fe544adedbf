"""jaxcoll._src.layout: a flat message as a schedule's rows of chunks and back, in NumPy.

Every rank's starting buffer is built with ``to_rows``; a collective that moves whole rows
(written here in plain NumPy, no schedule) turns them into every rank's final buffer, and
``from_rows`` must read the NumPy reference result off it. Schedules of every algorithm
over 1..8 ranks, whole and cut into pieces (more than one chunk per block), give the
layout every chunk count and block size it meets.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import jaxcoll
from jaxcoll._src import layout

SIZES = range(1, 9)
SCHEDULED = [(p, a) for p in jaxcoll.PRIMITIVES for a in jaxcoll.algorithms(p) if a != "native"]
BLOCKED = ("reduce_scatter", "all_gather")   # one block per rank (module docstring)
UNBLOCKED = ("all_reduce", "broadcast", "reduce")
PER_RANK_BLOCKS = ("reduce_scatter", "all_to_all")   # the input splits into N blocks
ROOTED = ("broadcast", "reduce")


def axis_shape(n: int) -> tuple[int, int]:
  """Two mesh axes of n ranks for algorithms that need a tuple (n = 1 or prime: (1, n))."""
  outer = next((d for d in range(2, n) if n % d == 0), 1)
  return outer, n // outer


def build(primitive: str, algorithm: str, n: int, pieces: int = 1, root: int = 0):
  """The schedule, with every chunk cut into ``pieces`` (blocks of ``pieces`` chunks)."""
  options = {}
  if algorithm not in jaxcoll.algorithms(primitive, num_axes=1):   # needs a tuple of axes
    options["axis_sizes"] = axis_shape(n)
  if primitive in ROOTED:
    options["root"] = root
  sched = jaxcoll.schedule(primitive, algorithm, n, **options)
  return sched if primitive == "shift" else sched.in_pieces(pieces)


def message_size(primitive: str, n: int, k: int) -> int:
  """The flat input size with k elements per block (per rank's piece for all_gather)."""
  return n * k if primitive in PER_RANK_BLOCKS else k


def unit(sched) -> int:
  """Elements per block that fill every row exactly once L = 1 (what sizes not divisible
  by the chunk count are measured against)."""
  if sched.primitive == "shift":
    return 1
  return sched.blocks_per_rank if sched.primitive in BLOCKED + ("all_to_all",) \
      else sched.num_chunks


def sizes_for(sched) -> list[int]:
  """Per-block element counts below, at and above multiples of the chunk count."""
  u = unit(sched)
  return sorted({k for k in (1, u - 1, u, u + 1, 2 * u + 1, 3 * u - 1) if k >= 1})


def inputs(primitive: str, n: int, k: int, seed: int) -> list[np.ndarray]:
  """Per-rank flat inputs, no element zero (a zero in the output is padding or nothing)."""
  rng = np.random.default_rng(seed)
  size = message_size(primitive, n, k)
  return [rng.integers(1, 100, size).astype(np.int64) * rng.choice([-1, 1], size)
          for _ in range(n)]


def exchange(sched, start: list[np.ndarray]) -> list[np.ndarray]:
  """Every rank's final [C, L] buffer from the starting ones, moving whole rows in NumPy
  as the collective does: reduce the rows, copy blocks into place, or take the root's."""
  n, prim = sched.axis_size, sched.primitive
  if prim in ("all_reduce", "reduce", "reduce_scatter"):
    return [np.sum(start, axis=0)] * n
  if prim == "broadcast":
    return [start[sched.root]] * n
  final = [s.copy() for s in start]
  if prim == "all_gather":
    b = sched.blocks_per_rank
    for r in range(n):
      for j in range(n):
        final[r][j * b:(j + 1) * b] = start[j][j * b:(j + 1) * b]
  elif prim == "all_to_all":
    b, out = sched.blocks_per_rank, sched.num_chunks - n * sched.blocks_per_rank
    for r in range(n):
      for j in range(n):   # output block j of rank r: input block r of rank j
        final[r][out + j * b:out + (j + 1) * b] = start[j][r * b:(r + 1) * b]
  elif prim == "shift":
    for r in range(n):
      final[r][1] = start[(r - 1) % n][0]
  return final


def check_round_trip(sched, k: int, seed: int, multiple: int = 1):
  n, prim = sched.axis_size, sched.primitive
  xs = inputs(prim, n, k, seed)
  size = xs[0].size
  start = [layout.to_rows(np, x, sched, rank=r, multiple=multiple) for r, x in enumerate(xs)]
  length = layout.row_length(sched, size, multiple)
  for rows in start:
    assert rows.shape == (sched.num_chunks, length)
    assert rows.dtype == xs[0].dtype
  final = exchange(sched, start)
  want = jaxcoll.spec(prim).expected(xs, sched.root)
  ranks = [sched.root] if prim == "reduce" else range(n)
  for r in ranks:
    got = layout.from_rows(np, final[r], sched, size, rank=r)
    np.testing.assert_array_equal(got, want[r], err_msg=f"{sched.algorithm} n={n} k={k} r={r}")


@pytest.mark.parametrize("primitive,algorithm,pieces", [
    (p, a, pieces) for p, a in SCHEDULED
    for pieces in ((1,) if p == "shift" else (1, 3))])   # shift: two rows, input and output
def test_round_trip_every_schedule_and_axis_size(primitive, algorithm, pieces):
  for n in SIZES:
    root = n - 1 if primitive in ROOTED else 0
    sched = build(primitive, algorithm, n, pieces, root)
    for k in sizes_for(sched):
      check_round_trip(sched, k, seed=n * 100 + k)


@pytest.mark.parametrize("primitive,algorithm", SCHEDULED)
@given(n=st.integers(1, 8), k=st.integers(1, 70), pieces=st.integers(1, 4),
       multiple=st.sampled_from([1, 2, 3, 8]))
def test_round_trip_any_size_and_row_multiple(primitive, algorithm, n, k, pieces, multiple):
  if primitive == "shift":   # shift takes no wire format, so no row multiple, and one piece
    pieces, multiple = 1, 1
  check_round_trip(build(primitive, algorithm, n, pieces), k, seed=k, multiple=multiple)


def capacity(sched, length: int) -> int:
  """Elements of the message (per block, for per-rank blocks) rows of ``length`` hold."""
  prim, c = sched.primitive, sched.num_chunks
  if prim in PER_RANK_BLOCKS or prim == "all_gather":
    return sched.blocks_per_rank * length
  return length if prim == "shift" else c * length


@pytest.mark.parametrize("primitive", jaxcoll.PRIMITIVES)
@given(n=st.integers(1, 8), k=st.integers(0, 90), pieces=st.integers(1, 5),
       multiple=st.sampled_from([1, 2, 4, 7, 16]))
def test_row_length_is_the_shortest_multiple_that_holds_the_message(primitive, n, k, pieces,
                                                                    multiple):
  algorithm = jaxcoll.algorithms(primitive, num_axes=1)[0]
  sched = build(primitive, algorithm, n, pieces)
  length = layout.row_length(sched, message_size(primitive, n, k), multiple)
  need = k
  shortest = next(v for v in range(0, need + multiple + 1, multiple) if capacity(sched, v) >= need)
  assert length == shortest
  assert length % multiple == 0


@pytest.mark.parametrize("primitive,algorithm", [c for c in SCHEDULED if c[0] in UNBLOCKED])
@pytest.mark.parametrize("n", SIZES)
def test_unblocked_rows_are_the_message_then_zeros(primitive, algorithm, n):
  sched = build(primitive, algorithm, n, pieces=2)
  c = sched.num_chunks
  for size in (1, c - 1, c + 1, 5 * c + 3):
    if size < 1:
      continue
    x = np.arange(1, size + 1, dtype=np.float32)
    rows = layout.to_rows(np, x, sched, rank=0)
    length = math.ceil(size / c)
    want = np.concatenate([x, np.zeros(c * length - size, np.float32)]).reshape(c, length)
    np.testing.assert_array_equal(rows, want)
    np.testing.assert_array_equal(layout.from_rows(np, rows, sched, size), x)


def padded_block(block: np.ndarray, rows: int, length: int) -> np.ndarray:
  """``block`` then zeros, as ``rows`` rows of ``length``: where one block must sit."""
  return np.concatenate([block, np.zeros(rows * length - block.size, block.dtype)]).reshape(
      rows, length)


@pytest.mark.parametrize("primitive,algorithm",
                         [c for c in SCHEDULED if c[0] in PER_RANK_BLOCKS + ("all_gather",)])
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("pieces", [1, 2, 3])
def test_padding_never_crosses_a_block_boundary(primitive, algorithm, n, pieces):
  """Each block is padded on its own: block j's data starts at its first row, and the rest
  of its rows are zeros, whatever the block's length against its rows."""
  sched = build(primitive, algorithm, n, pieces)
  b, c = sched.blocks_per_rank, sched.num_chunks
  assert b == pieces
  for k in sizes_for(sched):
    for rank in range(n):
      x = np.arange(1, message_size(primitive, n, k) + 1, dtype=np.int32)
      rows = layout.to_rows(np, x, sched, rank=rank)
      length = rows.shape[1]
      assert length == math.ceil(k / b)
      if primitive == "all_gather":   # its piece in block `rank`, every other row zero
        want = np.zeros((c, length), np.int32)
        want[rank * b:(rank + 1) * b] = padded_block(x, b, length)
        np.testing.assert_array_equal(rows, want)
        continue
      blocks = x.reshape(n, k)
      for j in range(n):
        np.testing.assert_array_equal(rows[j * b:(j + 1) * b], padded_block(blocks[j], b, length))
      rest = rows[n * b:]
      if primitive == "reduce_scatter":
        assert rest.size == 0 and c == n * b
        continue
      # all_to_all: [inputs | workspace | outputs], the own block already in its output block
      out = n * b + sched.workspace_chunks
      assert layout.output_start(sched) == out == c - n * b
      want = np.zeros((c - n * b, length), np.int32)
      want[out - n * b + rank * b:out - n * b + (rank + 1) * b] = padded_block(blocks[rank], b,
                                                                             length)
      np.testing.assert_array_equal(rest, want)


@pytest.mark.parametrize("primitive,algorithm", SCHEDULED)
@pytest.mark.parametrize("n", [1, 3, 4, 8])
def test_each_rank_alone_keeps_its_own_part(primitive, algorithm, n):
  """from_rows of a rank's untouched starting buffer: what it holds before any message."""
  sched = build(primitive, algorithm, n, pieces=1 if primitive == "shift" else 2)
  k = unit(sched) + 1
  xs = inputs(primitive, n, k, seed=n)
  for r, x in enumerate(xs):
    got = layout.from_rows(np, layout.to_rows(np, x, sched, rank=r), sched, x.size, rank=r)
    if primitive in UNBLOCKED:
      want = x
    elif primitive == "reduce_scatter":
      want = x.reshape(n, k)[r]
    elif primitive in ("all_gather", "all_to_all"):   # only the block from itself
      want = np.zeros((n, k), x.dtype)
      want[r] = x if primitive == "all_gather" else x.reshape(n, k)[r]
      want = want.reshape(-1)
    else:   # shift: nothing received yet
      want = np.zeros_like(x)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("primitive,algorithm", SCHEDULED)
@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_executor_form_in_jax_numpy(primitive, algorithm, n):
  """rank=None (the executor, rank traced): jax.numpy gives NumPy's rows, the caller places
  the own block (all_gather, all_to_all) and passes reduce_scatter its own rows."""
  sched = build(primitive, algorithm, n, pieces=1 if primitive == "shift" else 2)
  k = 2 * unit(sched) + 1
  xs = inputs(primitive, n, k, seed=n + 7)
  b = sched.blocks_per_rank
  for r in sorted({0, n - 1}):
    x = xs[r]
    placed = layout.to_rows(np, x, sched, rank=r)
    rows = np.array(layout.to_rows(jnp, jnp.asarray(x), sched))
    np.testing.assert_array_equal(rows, layout.to_rows(np, x, sched))
    assert rows.shape == placed.shape
    if primitive == "all_gather":   # every row the piece's first row: all are overwritten
      np.testing.assert_array_equal(rows, np.broadcast_to(placed[r * b], rows.shape))
      own = np.asarray(layout.block(jnp, jnp.asarray(x), sched, rows.shape[1]))
      np.testing.assert_array_equal(own, placed[r * b:(r + 1) * b])
      continue
    if primitive == "all_to_all":   # own output block not yet copied
      out = layout.output_start(sched)
      np.testing.assert_array_equal(rows[out + r * b:out + (r + 1) * b], 0)
      rows[out + r * b:out + (r + 1) * b] = rows[r * b:(r + 1) * b]
    np.testing.assert_array_equal(rows, placed)
    final = exchange(sched, [layout.to_rows(np, v, sched, rank=j) for j, v in enumerate(xs)])[r]
    mine = final[r * b:(r + 1) * b] if primitive == "reduce_scatter" else final
    got = np.asarray(layout.from_rows(jnp, jnp.asarray(mine), sched, x.size))
    want = layout.from_rows(np, final, sched, x.size, rank=r)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("primitive", PER_RANK_BLOCKS)
@pytest.mark.parametrize("n", [2, 3, 8])
def test_per_rank_blocks_need_a_size_divisible_by_the_axis_size(primitive, n):
  sched = build(primitive, jaxcoll.algorithms(primitive, num_axes=1)[0], n)
  for size in (n + 1, 2 * n - 1):
    with pytest.raises(ValueError, match=f"{primitive} needs a size divisible by {n}, got {size}"):
      layout.to_rows(np, np.ones(size, np.float32), sched, rank=0)


@pytest.mark.parametrize("primitive,algorithm", SCHEDULED)
@pytest.mark.parametrize("n", [1, 3, 8])
def test_place_own_with_a_traced_rank_equals_the_numpy_placement(primitive, algorithm, n):
  """The executor's start (to_rows with rank=None, then place_own under jit, the rank a
  tracer) holds the rank's own block where NumPy's rank=r start holds it."""
  sched = build(primitive, algorithm, n, pieces=1 if primitive == "shift" else 2)
  k = unit(sched) + 2
  b = sched.blocks_per_rank
  place = jax.jit(lambda x, r: layout.place_own(jnp, layout.to_rows(jnp, x, sched), x, sched, r))
  for r in sorted({0, n // 2, n - 1}):
    x = inputs(primitive, n, k, seed=r)[r]
    got = np.asarray(place(jnp.asarray(x), jnp.int32(r)))
    want = layout.to_rows(np, x, sched, rank=r)
    if primitive == "all_gather":   # the other blocks are received later, whatever they hold
      np.testing.assert_array_equal(got[r * b:(r + 1) * b], want[r * b:(r + 1) * b])
    else:
      np.testing.assert_array_equal(got, want)
