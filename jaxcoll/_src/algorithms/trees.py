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

import collections

from jaxcoll._src.algorithms import register, ring
from jaxcoll._src.algorithms.common import Rounds, build, log2_ceil
from jaxcoll._src.schedule import Message


def binomial_reduce_rounds(n: int, chunks=(0,)) -> Rounds:
  rounds, d = [], 1
  while d < n:
    rounds.append([Message(r, r - d, chunks, chunks, "reduce") for r in range(d, n, 2 * d)])
    d <<= 1
  return rounds


def binomial_broadcast_rounds(n: int, chunks=(0,)) -> Rounds:
  d = 1 << log2_ceil(n) >> 1
  rounds = []
  while d:
    rounds.append([Message(r, r + d, chunks, chunks, "copy") for r in range(0, n - d, 2 * d)])
    d >>= 1
  return rounds


def binomial_scatter_rounds(n: int) -> Rounds:
  """The root's N blocks go down the tree; rank v ends holding block v."""
  d = 1 << log2_ceil(n) >> 1
  rounds = []
  while d:
    rounds.append([Message(v, v + d, blocks, blocks, "copy") for v in range(0, n - d, 2 * d)
                   for blocks in [tuple(range(v + d, min(v + 2 * d, n)))]])
    d >>= 1
  return rounds


def binomial_gather_rounds(n: int) -> Rounds:
  """Block v (held by rank v) goes up the tree to rank 0."""
  rounds, d = [], 1
  while d < n:
    rounds.append([Message(v, v - d, blocks, blocks, "copy") for v in range(d, n, 2 * d)
                   for blocks in [tuple(range(v, min(v + d, n)))]])
    d <<= 1
  return rounds


@register("all_reduce", "binomial_tree")
def all_reduce_binomial(n: int):
  return build("all_reduce", "binomial_tree", n, 1, binomial_reduce_rounds(n),
               binomial_broadcast_rounds(n))


@register("broadcast", "binomial_tree")
def broadcast_binomial(n: int):
  return build("broadcast", "binomial_tree", n, 1, binomial_broadcast_rounds(n))


@register("broadcast", "scatter_allgather")
def broadcast_scatter_allgather(n: int):
  return build("broadcast", "scatter_allgather", n, n, binomial_scatter_rounds(n),
               ring.all_gather_rounds(n))


@register("reduce", "binomial_tree")
def reduce_binomial(n: int):
  return build("reduce", "binomial_tree", n, 1, binomial_reduce_rounds(n))


@register("reduce", "reduce_scatter_gather")
def reduce_scatter_gather(n: int):
  return build("reduce", "reduce_scatter_gather", n, n, ring.reduce_scatter_rounds(n),
               binomial_gather_rounds(n))


def nccl_btree_parents(n: int) -> list[int]:
  """Parent of each rank in NCCL's in-order binary tree (``ncclGetBtree``); root 0 has -1."""
  parents = [-1] * n
  for rank in range(1, n):
    bit = 1
    while bit < n and not bit & rank:
      bit <<= 1
    up = (rank ^ bit) | (bit << 1)
    parents[rank] = up if up < n else rank ^ bit
  return parents


def double_binary_trees(n: int) -> tuple[list[int], list[int]]:
  """The two complementary trees (``ncclGetDtree``): the second is the first mirrored
  (N even) or shifted by one (N odd)."""
  first = nccl_btree_parents(n)
  relabel = (lambda r: n - 1 - r) if n % 2 == 0 else (lambda r: (r + 1) % n)
  second = [-1] * n
  for r, p in enumerate(first):
    second[relabel(r)] = -1 if p < 0 else relabel(p)
  return first, second


def _pipelined_tree_messages(parents: list[int], chunks: list[int]) -> dict[int, list[Message]]:
  n = len(parents)
  children = collections.defaultdict(list)
  for r, p in enumerate(parents):
    if p >= 0:
      children[p].append(r)
  height, depth = [0] * n, [0] * n

  def set_height(r):
    height[r] = 1 + max((set_height(c) for c in children[r]), default=-1)
    return height[r]

  root = parents.index(-1)
  set_height(root)
  order = [root]
  for r in order:
    for c in children[r]:
      depth[c] = depth[r] + 1
      order.append(c)
  if len(order) != n:
    raise AssertionError(f"not a tree: {parents}")
  steps = collections.defaultdict(list)
  top = height[root]
  for i, chunk in enumerate(chunks):
    for r in range(n):
      if parents[r] >= 0:
        steps[i + height[r]].append(Message(r, parents[r], (chunk,), (chunk,), "reduce"))
      for c in children[r]:
        steps[i + top + depth[r]].append(Message(r, c, (chunk,), (chunk,), "copy"))
  return steps


@register("all_reduce", "double_binary_tree")
def all_reduce_double_binary_tree(n: int, *, pipeline: int = 4):
  if pipeline < 1:
    raise ValueError(f"pipeline must be >= 1, got {pipeline}")
  first, second = double_binary_trees(n)
  steps = collections.defaultdict(list)
  for parents, chunks in ((first, range(pipeline)), (second, range(pipeline, 2 * pipeline))):
    if n > 1:
      for t, msgs in _pipelined_tree_messages(parents, list(chunks)).items():
        steps[t].extend(msgs)
  rounds = [steps[t] for t in range(max(steps, default=-1) + 1)]
  return build("all_reduce", "double_binary_tree", n, 2 * pipeline, rounds)
