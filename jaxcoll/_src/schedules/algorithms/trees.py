"""Tree algorithms: binomial trees, binomial scatter/gather, and NCCL's double binary tree.

L = ceil(log2 N), M = message bytes.
  reduce "binomial_tree": L steps; every non-root rank sends M once: M per rank.
  broadcast "binomial_tree": L steps; the root sends in every step: L * M.
  all_reduce "binomial_tree": reduce to rank 0 then broadcast: 2L steps, L * M.
  broadcast "scatter_allgather" (van de Geijn): binomial scatter of N blocks,
    then a ring all-gather: L + N - 1 steps, 2(N-1)/N * M (the root's sends).
  reduce "reduce_scatter_gather": ring reduce-scatter, then a binomial gather
    of the blocks to the root: N - 1 + L steps and
    max_v (N - 1 + min(lowbit(v), N - v)) / N * M.
  all_reduce "double_binary_tree" (Sanders, Speck, Traff 2009; NCCL 2.4): half
    of the buffer reduces up and broadcasts down each of two binary trees in
    which every interior node of one is a leaf of the other, pipelined in S
    chunks per half (``pipeline=S``, default 4). A node of height h sends chunk
    i up at step i + h; the root (height H) sends it down at step i + H and a
    node of depth d at i + H + d. Steps: max over the trees of S + H + D - 1
    (D: depth of the deepest node with children + 1). Bytes: per half, M/2 up
    (non-roots) plus M/2 per child.
"""

from __future__ import annotations

import numpy as np

from jaxcoll._src.schedules.algorithms import ring
from jaxcoll._src.schedules.algorithms.common import Rounds, build, log2_ceil
from jaxcoll._src.schedules.algorithms.registry import register
from jaxcoll._src.schedules.schedule import Messages

WHOLE = np.zeros((1, 1), np.int32)   # the one chunk of an unblocked tree


def binomial_reduce_rounds(n: int) -> Rounds:
  rounds, d = [], 1
  while d < n:
    src = np.arange(d, n, 2 * d)
    rounds.append([Messages.of(src, src - d, WHOLE, combine="reduce")])
    d <<= 1
  return rounds


def binomial_broadcast_rounds(n: int) -> Rounds:
  d = 1 << log2_ceil(n) >> 1
  rounds = []
  while d:
    src = np.arange(0, n - d, 2 * d)
    rounds.append([Messages.of(src, src + d, WHOLE, combine="copy")])
    d >>= 1
  return rounds


def _subtree_blocks(v: np.ndarray, d: int, n: int):
  """Blocks [v, min(v + d, n)) for each v, as ragged rows."""
  return [np.arange(x, min(x + d, n)) for x in v.tolist()]


def binomial_scatter_rounds(n: int) -> Rounds:
  """The root's N blocks go down the tree; rank v ends holding block v."""
  d = 1 << log2_ceil(n) >> 1
  rounds = []
  while d:
    v = np.arange(0, n - d, 2 * d)
    rounds.append(Messages.ragged(v, v + d, _subtree_blocks(v + d, d, n), combine="copy"))
    d >>= 1
  return rounds


def binomial_gather_rounds(n: int) -> Rounds:
  """Block v (held by rank v) goes up the tree to rank 0."""
  rounds, d = [], 1
  while d < n:
    v = np.arange(d, n, 2 * d)
    rounds.append(Messages.ragged(v, v - d, _subtree_blocks(v, d, n), combine="copy"))
    d <<= 1
  return rounds


@register("all_reduce", "binomial_tree", stage=True, fit=True)
def all_reduce_binomial(n: int):
  return build("all_reduce", "binomial_tree", n, 1, binomial_reduce_rounds(n),
               binomial_broadcast_rounds(n))


@register("broadcast", "binomial_tree", native_like=True)
def broadcast_binomial(n: int):
  return build("broadcast", "binomial_tree", n, 1, binomial_broadcast_rounds(n))


@register("broadcast", "scatter_allgather")
def broadcast_scatter_allgather(n: int):
  return build("broadcast", "scatter_allgather", n, n, binomial_scatter_rounds(n),
               ring.all_gather_rounds(n))


@register("reduce", "binomial_tree", native_like=True)
def reduce_binomial(n: int):
  return build("reduce", "binomial_tree", n, 1, binomial_reduce_rounds(n))


@register("reduce", "reduce_scatter_gather")
def reduce_scatter_gather(n: int):
  return build("reduce", "reduce_scatter_gather", n, n, ring.reduce_scatter_rounds(n),
               binomial_gather_rounds(n))


def nccl_btree_parents(n: int) -> np.ndarray:
  """Parent of each rank in NCCL's in-order binary tree (``ncclGetBtree``); root 0 has -1.

  Rank r's lowest set bit b: its parent is (r ^ b) | 2b if that is a rank, else r ^ b."""
  rank = np.arange(n)
  bit = rank & -rank
  up = (rank ^ bit) | (bit << 1)
  parents = np.where(up < n, up, rank ^ bit)
  parents[0] = -1
  return parents


def double_binary_trees(n: int) -> tuple[np.ndarray, np.ndarray]:
  """The two complementary trees (``ncclGetDtree``): the second is the first mirrored
  (N even) or shifted by one (N odd)."""
  first = nccl_btree_parents(n)
  relabel = (lambda r: n - 1 - r) if n % 2 == 0 else (lambda r: (r + 1) % n)
  second = np.full(n, -1)
  second[relabel(np.arange(n))] = np.where(first < 0, -1, relabel(first))
  return first, second


def _heights_depths(parents: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Height (edges down to the deepest leaf) and depth of every node of a tree."""
  n = len(parents)
  depth = np.zeros(n, np.int64)
  node = np.arange(n)
  for _ in range(n):                        # walk every node to the root at once
    up = parents[node] >= 0
    if not up.any():
      break
    node = np.where(up, parents[node], node)
    depth += up
  if (parents < 0).sum() != 1 or (parents[node] >= 0).any():
    raise AssertionError(f"not a tree: {parents}")
  height = np.zeros(n, np.int64)
  for d in range(int(depth.max(initial=0)), 0, -1):   # a level's children before its parents
    child = np.flatnonzero(depth == d)
    np.maximum.at(height, parents[child], height[child] + 1)
  return height, depth


def _pipelined_tree_rounds(parents: np.ndarray, chunks: np.ndarray) -> dict[int, list[Messages]]:
  """Step -> messages of one pipelined tree: chunk i goes up from a node of height h at step
  i + h and down from a node of depth d at step i + H + d (H: the root's height)."""
  height, depth = _heights_depths(parents)   # O(depth) array passes: cheap at 16,384 ranks
  top = height.max()
  child = np.flatnonzero(parents >= 0)          # one edge per child, in rank order
  parent = parents[child]
  by_parent = np.argsort(parent, kind="stable")
  child, parent = child[by_parent], parent[by_parent]   # down edges in (parent, child) order
  up_child = np.sort(child)
  steps: dict[int, list[Messages]] = {}
  for i, chunk in enumerate(chunks.tolist()):
    for t in np.unique(np.concatenate([i + height[child], i + top + depth[parent]])).tolist():
      up = up_child[i + height[up_child] == t]
      down = i + top + depth[parent] == t
      steps.setdefault(t, []).extend([
          Messages.of(up, parents[up], [[chunk]], combine="reduce"),
          Messages.of(parent[down], child[down], [[chunk]], combine="copy")])
  return steps


@register("all_reduce", "double_binary_tree", native_like=True, stage=True,
          tune={"pipeline": (4, 1, 2, 8)})
def all_reduce_double_binary_tree(n: int, *, pipeline: int = 4):
  if pipeline < 1:
    raise ValueError(f"pipeline must be >= 1, got {pipeline}")
  first, second = double_binary_trees(n)
  steps: dict[int, list[Messages]] = {}
  for parents, chunks in ((first, np.arange(pipeline)),
                          (second, np.arange(pipeline, 2 * pipeline))):
    if n > 1:
      for t, msgs in _pipelined_tree_rounds(parents, chunks).items():
        steps.setdefault(t, []).extend(msgs)
  rounds = [steps.get(t, []) for t in range(max(steps, default=-1) + 1)]
  return build("all_reduce", "double_binary_tree", n, 2 * pipeline, rounds)
