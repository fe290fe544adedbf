"""Schedules without JAX: the NumPy simulator against NumPy references, and cost formulas."""

from __future__ import annotations

import dataclasses
import math

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import jaxcoll
from jaxcoll._src.schedules.algorithms import entry
from jaxcoll._src.schedules.algorithms.trees import double_binary_trees
from jaxcoll._src.schedules.schedule import Messages, Step, Transfer

SIZES = range(1, 9)
SCHEDULED = [(p, a) for p in jaxcoll.PRIMITIVES for a in jaxcoll.algorithms(p)
             if a not in ("native", "hierarchical")]
HIERARCHICAL = [p for p in jaxcoll.PRIMITIVES if "hierarchical" in jaxcoll.algorithms(p)]
SHAPES = [(2, 4), (4, 2), (2, 3), (3, 2), (2, 2, 2), (1, 4), (3, 1, 2), (2, 5), (4, 4), (2, 2, 3)]


@pytest.mark.parametrize("primitive,algorithm", SCHEDULED)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("op", ["sum", "prod", "min", "max"])
def test_simulate_matches_reference(primitive, algorithm, n, op):
  rng = np.random.default_rng(n)
  roots = range(n) if primitive in ("broadcast", "reduce") else [0]
  size = 3 * n if primitive != "all_gather" else 5
  for root in roots:
    sched = jaxcoll.schedule(primitive, algorithm, n, root=root)
    xs = [rng.integers(-3, 4, size).astype(np.int64) for _ in range(n)]
    sched.check(xs, op=op)
    sched.check(op=op)   # its own inputs


@pytest.mark.parametrize("primitive,algorithm", SCHEDULED)
@given(n=st.integers(1, 24), length=st.integers(1, 40))
def test_simulate_any_size(primitive, algorithm, n, length):
  rng = np.random.default_rng(length)
  size = n * length if primitive in ("reduce_scatter", "all_to_all") else length
  xs = [rng.integers(-100, 100, size).astype(np.int32) for _ in range(n)]
  root = n - 1 if primitive in ("broadcast", "reduce") else 0
  sched = jaxcoll.schedule(primitive, algorithm, n, root=root)
  sched.check(xs)


def test_check_names_the_rank_that_differs():
  sched = jaxcoll.schedule("all_reduce", "ring", 4)
  wrong = dataclasses.replace(sched, steps=list(sched.steps)[:-1])   # the last step dropped
  with pytest.raises(AssertionError, match=r"all_reduce schedule 'ring' on 4 ranks .*rank \d"):
    wrong.check()


@pytest.mark.parametrize("primitive", jaxcoll.PRIMITIVES)
def test_each_collective_s_numpy_reference_equals_lax(primitive):
  """``CollectiveSpec.expected``, which Schedule.check holds every schedule to, is what the
  jax.lax collective computes (4 devices; root 1)."""
  import jax

  from tests.helpers import call_lax, per_device
  n, length = 4, 3 if primitive == "all_gather" else 12
  xs = np.arange(n * length, dtype=np.float32).reshape(n, length) ** 1.5 % 17
  lax_out = per_device(lambda v: call_lax(primitive, v, "x", root=1), n)(jax.numpy.asarray(xs))
  for got, want in zip(jaxcoll.spec(primitive).expected(list(xs), root=1), np.asarray(lax_out)):
    np.testing.assert_allclose(got, want.reshape(-1), rtol=1e-6)


def lg(n):
  return math.ceil(math.log2(n)) if n > 1 else 0


def pow2_floor(n):
  return 1 << (n.bit_length() - 1)


def lowbit(v):
  return v & -v


def formula(primitive, algorithm, n):
  """Closed-form (steps, bytes per rank / M) of every algorithm, written independently."""
  p2 = pow2_floor(n)
  p = p2.bit_length() - 1
  odd = n != p2
  ring = (n - 1) / n
  table = {
      ("all_reduce", "ring"): (2 * (n - 1), 2 * ring),
      ("all_reduce", "bidirectional_ring"): (2 * (n - 1), 2 * ring),
      ("all_reduce", "halving_doubling"):
          (2 * p + 2, 2 * (p2 - 1) / p2 + 1) if odd else (2 * p, 2 * (p2 - 1) / p2),
      ("all_reduce", "recursive_doubling"): (p + 2, p + 1) if odd else (p, p),
      ("all_reduce", "binomial_tree"): (2 * lg(n), lg(n)),
      ("reduce_scatter", "ring"): (n - 1, ring),
      ("reduce_scatter", "direct"): (n - 1, ring),
      ("all_gather", "ring"): (n - 1, ring),
      ("all_gather", "bruck"): (lg(n), ring),
      ("all_gather", "direct"): (n - 1, ring),
      ("broadcast", "binomial_tree"): (lg(n), lg(n)),
      ("broadcast", "scatter_allgather"): (lg(n) + n - 1, 2 * ring),
      ("reduce", "binomial_tree"): (lg(n), 1.0 if n > 1 else 0.0),
      ("all_to_all", "direct"): (n - 1, ring),
      ("shift", "direct"): (1, 1.0),   # N = 1 too: one message to itself
      ("all_to_all", "bruck"): (lg(n), sum(bin(i).count("1") for i in range(n)) / n),
      ("reduce", "reduce_scatter_gather"):
          (n - 1 + lg(n), max((n - 1 + min(lowbit(v), n - v)) / n for v in range(1, n))
           if n > 1 else 0.0),
  }
  if (primitive, algorithm) == ("reduce_scatter", "halving_doubling"):
    if not odd:
      return p, (p2 - 1) / p2
    return p + 2, 1.0  # the folded ranks hand over the whole buffer; halving sends less
  if (primitive, algorithm) == ("all_gather", "recursive_doubling"):
    return p, (p2 - 1) / p2
  return table[primitive, algorithm]


def all_gather_rd_bytes(n):
  """Recursive-doubling all-gather with the fold: a partner carries 2 blocks and returns M."""
  p2 = pow2_floor(n)
  extra = n - p2
  owned = [2 if v < extra else 1 for v in range(p2)]  # virtual v < e stands for two ranks
  best = 0
  for v in range(p2):
    sent, mask = 0, 1
    while mask < p2:
      group = [u for u in range(p2) if u // mask == v // mask]
      sent += sum(owned[u] for u in group)
      mask <<= 1
    best = max(best, sent + (n if v < extra else 0))
  return p2.bit_length() - 1 + 2, best / n


def double_binary_tree_formula(n, pipeline):
  if n == 1:
    return 0, 0.0
  steps, sent = 0, np.zeros(n)
  for parents in map(list, double_binary_trees(n)):
    children = {r: [c for c, q in enumerate(parents) if q == r] for r in range(n)}
    root = parents.index(-1)

    def height(r, children=children):
      return 1 + max((height(c) for c in children[r]), default=-1)

    def depth(r, root=root, parents=parents):
      return 0 if r == root else 1 + depth(parents[r])

    inner_depth = max(depth(r) for r in range(n) if children[r])
    steps = max(steps, pipeline + height(root) + inner_depth)
    for r in range(n):
      sent[r] += 0.5 * ((parents[r] >= 0) + len(children[r]))
  return steps, sent.max()


@pytest.mark.parametrize("primitive,algorithm", SCHEDULED)
@pytest.mark.parametrize("n", list(range(1, 17)) + [31, 32, 33, 100])
def test_steps_and_bytes_equal_formula(primitive, algorithm, n):
  sched = jaxcoll.schedule(primitive, algorithm, n)
  declared = entry(primitive, algorithm).formula
  if declared is not None:   # the algorithm states its own formula (new algorithms do)
    steps, frac = declared(n)
  elif algorithm == "double_binary_tree":
    steps, frac = double_binary_tree_formula(n, 4)
  elif (primitive, algorithm) == ("all_gather", "recursive_doubling") and n != pow2_floor(n):
    steps, frac = all_gather_rd_bytes(n)
  else:
    steps, frac = formula(primitive, algorithm, n)
  if n == 1 and primitive != "shift":
    steps, frac = 0, 0.0
  assert sched.num_steps == steps
  if (primitive, algorithm) == ("reduce_scatter", "halving_doubling") and n != pow2_floor(n):
    # the folded ranks send the whole buffer once; no rank sends more than that plus a block
    assert 1.0 <= sched.bytes_per_rank(1.0) <= 1.0 + 1.0 / n
  else:
    assert sched.bytes_per_rank(1.0) == pytest.approx(frac)


def test_double_binary_tree_pipeline_option():
  for s in (1, 2, 8):
    sched = jaxcoll.schedule("all_reduce", "double_binary_tree", 8, pipeline=s)
    assert (sched.num_steps, sched.bytes_per_rank(1.0)) == pytest.approx(
        double_binary_tree_formula(8, s))
    xs = [np.arange(40) * (r + 1) for r in range(8)]
    for got in sched.simulate(xs):
      np.testing.assert_array_equal(got, np.sum(xs, 0))


def test_double_binary_trees_are_complementary():
  for n in (4, 8, 16, 7, 9):
    first, second = double_binary_trees(n)
    interior = [{p for p in t if p >= 0} for t in (first, second)]
    # as in NCCL: no rank is interior in both trees (odd N: rank 0 alone is)
    assert interior[0] & interior[1] == (set() if n % 2 == 0 else {0}), n


def test_partial_sum_scale_counts_the_larger_reduce_phase():
  ring = jaxcoll.schedule("all_reduce", "ring", 8)
  assert ring.bytes_per_rank(1.0, partial_sum_scale=2.0) == pytest.approx(3 * 7 / 8)


@pytest.mark.parametrize("primitive,algorithm", [
    (p, a) for p in ("all_reduce", "reduce_scatter", "all_gather") for a in jaxcoll.algorithms(p)
    if a != "native"])
def test_builds_and_simulates_at_4096_ranks(primitive, algorithm):
  """Schedules are NumPy arrays, not Python objects per message: a 4,096-rank ring (8,190
  steps of 4,096 messages) builds and simulates in seconds (timings:
  ``benchmarks/bench_schedule_scale.py``)."""
  n = 4096
  options = {"axis_sizes": (64, 64)} if algorithm == "hierarchical" else {}
  sched = jaxcoll.schedule.__wrapped__(primitive, algorithm, n, **options)   # not kept cached
  rng = np.random.default_rng(0)
  xs = list(rng.integers(0, 4, (n, n if primitive != "all_gather" else 1)).astype(np.float32))
  out = sched.simulate(xs)
  want = jaxcoll.spec(primitive).expected(xs, 0)
  for r in (0, 1, 2049, n - 1):
    np.testing.assert_array_equal(out[r], want[r])


def test_simulate_low_precision_rounds_once_per_combine():
  sched = jaxcoll.schedule("all_reduce", "ring", 2)
  a = np.array([1.0, 256.0], ml_dtypes.bfloat16)
  b = np.array([2.0 ** -9, 1.0], ml_dtypes.bfloat16)
  out = sched.simulate([a, b])
  want = (a.astype(np.float32) + b.astype(np.float32)).astype(ml_dtypes.bfloat16)
  np.testing.assert_array_equal(out[0], want)


@given(groups=st.lists(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 5)), min_size=1,
                                max_size=6), min_size=1, max_size=4),
       combines=st.lists(st.sampled_from(["reduce", "copy"]), min_size=4, max_size=4))
def test_step_packs_messages_first_fit(groups, combines):
  """Step.of equals packing the messages one by one, each into the first ppermute of its
  shape and combine in which neither its source sends nor its destination receives."""
  messages = [(s, d, c) for g, c in zip(groups, combines) for s, d in g]
  layers = []   # (combine, sources, destinations, messages), in order of creation
  for s, d, c in messages:
    fits = [layer for layer in layers if layer[0] == c and s not in layer[1] and d not in layer[2]]
    if not fits:
      layers.append((c, set(), set(), []))
    layer = fits[0] if fits else layers[-1]
    layer[1].add(s)
    layer[2].add(d)
    layer[3].append((s, d))
  step = Step.of([Messages.of([s for s, _ in g], [d for _, d in g], np.arange(len(g)), combine=c)
                  for g, c in zip(groups, combines)])
  got = [(t.combine, list(zip(t.src.tolist(), t.dst.tolist()))) for t in step.transfers]
  assert got == [(c, msgs) for c, _, _, msgs in layers]


def test_invalid_schedules_raise():
  with pytest.raises(ValueError, match="distinct"):
    Transfer((0, 0), (1, 2), ((0,), (0,)), ((0,), (0,)), "reduce")
  with pytest.raises(ValueError, match="same number of chunks"):
    Transfer((0, 1), (1, 0), ((0,), (0, 1)), ((0,), (0, 1)), "copy")
  with pytest.raises(ValueError, match="combine"):
    Transfer((0,), (1,), ((0,),), ((0,),), "add")
  t = Step((Transfer((0,), (3,), ((0,),), ((0,),), "copy"),))
  with pytest.raises(ValueError, match="rank out of range"):
    jaxcoll.Schedule("all_reduce", "x", 2, 1, (t,))
  with pytest.raises(ValueError, match="algorithm='nope'"):
    jaxcoll.schedule("all_reduce", "nope", 4)
  with pytest.raises(ValueError, match="primitive='all_to_some'"):
    jaxcoll.algorithms("all_to_some")
  with pytest.raises(ValueError, match="no schedule"):
    jaxcoll.schedule("all_reduce", "native", 4)
  with pytest.raises(ValueError, match="root=4"):
    jaxcoll.schedule("broadcast", "binomial_tree", 4, root=4)
  with pytest.raises(ValueError, match="4 inputs"):
    jaxcoll.schedule("all_reduce", "ring", 4).simulate([np.zeros(3)] * 3)


def test_algorithms_lists():
  """The documented algorithms are always offered (a new one may join them), "native"
  last, "hierarchical" only over two axes or more."""
  documented = {
      "all_reduce": {"ring", "bidirectional_ring", "halving_doubling", "recursive_doubling",
                     "binomial_tree", "double_binary_tree", "hierarchical"},
      "reduce_scatter": {"ring", "halving_doubling", "direct", "hierarchical"},
      "all_gather": {"ring", "recursive_doubling", "bruck", "direct", "hierarchical"},
      "all_to_all": {"direct", "bruck", "hierarchical"},
      "shift": {"direct"},
      "broadcast": {"binomial_tree", "scatter_allgather"},
      "reduce": {"binomial_tree", "reduce_scatter_gather"},
  }
  assert set(documented) == set(jaxcoll.PRIMITIVES)
  for primitive, names in documented.items():
    offered = jaxcoll.algorithms(primitive)
    assert offered[-1] == "native" and names <= set(offered)
    assert len(set(offered)) == len(offered)
  for primitive in HIERARCHICAL:
    assert "hierarchical" not in jaxcoll.algorithms(primitive, num_axes=1)
    assert "hierarchical" in jaxcoll.algorithms(primitive, num_axes=2)


@pytest.mark.parametrize("offset", [0, 1, -1, 3, 9, -9])
@pytest.mark.parametrize("wrap", [True, False])
@pytest.mark.parametrize("n", SIZES)
def test_shift_moves_every_value_offset_ranks(offset, wrap, n):
  sched = jaxcoll.schedule("shift", "direct", n, offset=offset % n if wrap else offset, wrap=wrap)
  xs = [np.full(3, r + 1) for r in range(n)]
  for r, got in enumerate(sched.simulate(xs)):
    src = (r - offset) % n if wrap else r - offset
    np.testing.assert_array_equal(got, xs[src] if 0 <= src < n else np.zeros(3))


@pytest.mark.parametrize("primitive", HIERARCHICAL)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("op", ["sum", "max"])
def test_hierarchical_simulates_like_the_flat_collective(primitive, shape, op):
  n = math.prod(shape)
  rng = np.random.default_rng(n)
  sched = jaxcoll.schedule(primitive, "hierarchical", n, axis_sizes=shape)
  assert sched.axis_sizes == shape
  xs = [rng.integers(-9, 9, 2 * n).astype(np.int64) for _ in range(n)]
  for got, want in zip(sched.simulate(xs, op=op), jaxcoll.spec(primitive).expected(xs, 0, op)):
    np.testing.assert_array_equal(got, want)


def hierarchical_traffic(primitive, shape):
  """Per-axis (steps, bytes / M) of hierarchical with default (ring / direct) stages."""
  out = []
  for t, s in enumerate(shape):
    inner = math.prod(shape[t + 1:])      # the data shrinks by this before reaching axis t
    frac = (s - 1) / s
    if primitive == "all_reduce":
      out.append((2 * (s - 1), 2 * frac / inner))
    elif primitive in ("reduce_scatter", "all_gather"):
      out.append((s - 1, frac / inner))
    else:   # all_to_all: s - 1 messages of N/s blocks whatever the stage
      out.append((s - 1, frac))
  return [(st, b) if shape[t] > 1 else (0, 0.0) for t, (st, b) in enumerate(out)]


@pytest.mark.parametrize("primitive", HIERARCHICAL)
@pytest.mark.parametrize("shape", SHAPES)
def test_hierarchical_traffic_per_axis_equals_formula(primitive, shape):
  n = math.prod(shape)
  sched = jaxcoll.schedule(primitive, "hierarchical", n, axis_sizes=shape)
  traffic = sched.traffic(1.0)
  want = hierarchical_traffic(primitive, shape)
  assert [a.steps for a in traffic] == [s for s, _ in want]
  assert [a.bytes for a in traffic] == pytest.approx([b for _, b in want])
  assert sched.num_steps == sum(a.steps for a in traffic)


def test_hierarchical_all_to_all_aggregates_messages_across_the_outer_axis():
  o, i = 2, 4
  flat, hier = (jaxcoll.schedule("all_to_all", a, o * i, **kw) for a, kw in
                [("direct", {}), ("hierarchical", {"axis_sizes": (o, i)})])
  def outer_messages(sched):   # messages rank 0 sends across the outer axis
    return sum(1 for st in sched.steps for t in st.transfers for s, d in t.perm
               if s == 0 and d // i != 0)
  assert outer_messages(flat) == (o - 1) * i
  assert outer_messages(hier) == o - 1
  # same bytes over the node axis, in fewer, bigger messages
  assert hier.traffic(1.0)[0].bytes == pytest.approx(flat.traffic(1.0, (o, i))[0].bytes)


def test_flat_ring_over_two_axes_puts_more_on_the_outer_link():
  ring = jaxcoll.schedule("all_reduce", "ring", 8).traffic(1.0, (2, 4))
  hier = jaxcoll.schedule("all_reduce", "hierarchical", 8, axis_sizes=(2, 4)).traffic(1.0)
  assert ring[0].bytes == pytest.approx(2 * 7 / 8)   # rank 3 sends everything to rank 4
  assert hier[0].bytes == pytest.approx(2 * 1 / 2 / 4)


def test_hierarchical_per_axis_algorithms():
  sched = jaxcoll.schedule("all_reduce", "hierarchical", 8, axis_sizes=(2, 4),
                           per_axis=("recursive_doubling", "halving_doubling"))
  outer, inner = sched.traffic(1.0)
  assert (outer.steps, inner.steps) == (1, 4)   # one exchange; halving 2 + doubling 2
  xs = [np.arange(16) * (r + 1) for r in range(8)]
  for got in sched.simulate(xs):
    np.testing.assert_array_equal(got, np.sum(xs, 0))
  with pytest.raises(ValueError, match="per_axis"):
    jaxcoll.schedule("all_reduce", "hierarchical", 8, axis_sizes=(2, 4), per_axis=("ring",))
  with pytest.raises(ValueError, match="bruck"):
    jaxcoll.schedule("reduce_scatter", "hierarchical", 8, axis_sizes=(2, 4),
                     per_axis=("ring", "bruck"))
  with pytest.raises(ValueError, match="axis_sizes"):
    jaxcoll.schedule("all_reduce", "hierarchical", 8)
  with pytest.raises(ValueError, match="multiply"):
    jaxcoll.schedule("all_reduce", "hierarchical", 8, axis_sizes=(2, 3))


@pytest.mark.parametrize("primitive,algorithm", [c for c in SCHEDULED if c[0] != "shift"])
@pytest.mark.parametrize("n", [1, 3, 4, 7])
@pytest.mark.parametrize("pieces", [2, 3])
def test_in_pieces_gives_the_same_result_in_pieces_times_the_steps(primitive, algorithm, n,
                                                                   pieces):
  sched = jaxcoll.schedule(primitive, algorithm, n)
  cut = sched.in_pieces(pieces)
  assert cut.num_steps == pieces * sched.num_steps
  assert cut.bytes_per_rank(1.0) == pytest.approx(sched.bytes_per_rank(1.0))
  assert [t.bytes for t in cut.traffic(1.0)] == pytest.approx(
      [t.bytes for t in sched.traffic(1.0)])
  rng = np.random.default_rng(n)
  size = 6 * n if primitive != "all_gather" else 6
  xs = [rng.integers(-5, 5, size).astype(np.int64) for _ in range(n)]
  for got, want in zip(cut.simulate(xs), sched.simulate(xs)):
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("primitive", ["all_reduce", "reduce_scatter", "all_gather", "all_to_all"])
@pytest.mark.parametrize("pieces", [(8, 1), (3, 2)])
def test_hierarchical_stage_pieces_cut_only_that_axis(primitive, pieces):
  plain = jaxcoll.schedule(primitive, "hierarchical", 8, axis_sizes=(2, 4))
  cut = jaxcoll.schedule(primitive, "hierarchical", 8, axis_sizes=(2, 4), stage_pieces=pieces)
  (node0, local0), (node1, local1) = plain.traffic(1.0), cut.traffic(1.0)
  assert (node1.steps, local1.steps) == (pieces[0] * node0.steps, pieces[1] * local0.steps)
  assert (node1.bytes, local1.bytes) == pytest.approx((node0.bytes, local0.bytes))
  assert cut.bytes_per_rank(1.0) == pytest.approx(plain.bytes_per_rank(1.0))
  rng = np.random.default_rng(8)
  size = 6 if primitive == "all_gather" else 48
  xs = [rng.integers(-5, 5, size).astype(np.int64) for _ in range(8)]
  for got, want in zip(cut.simulate(xs), plain.simulate(xs)):
    np.testing.assert_array_equal(got, want)


def test_pieces_must_be_positive():
  with pytest.raises(ValueError, match="pieces"):
    jaxcoll.schedule("all_reduce", "hierarchical", 8, axis_sizes=(2, 4), stage_pieces=(0, 1))
  with pytest.raises(ValueError, match="pieces"):
    jaxcoll.schedule("all_to_all", "hierarchical", 8, axis_sizes=(2, 4), stage_pieces=(2,))
  with pytest.raises(ValueError, match="pieces"):
    jaxcoll.schedule("all_reduce", "ring", 8).in_pieces(0)
