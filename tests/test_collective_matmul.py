"""jaxcoll.all_gather_matmul / matmul_reduce_scatter / matmul_all_reduce: equal to lax's
all_gather, psum_scatter or psum around the same einsum (values and gradients), on axis sizes
1-8, one direction and both, typed and untyped shard_maps; MaxText's collective matmul
example run unchanged beside it; the loop form XLA overlaps (one permute beside one einsum a
body); bad input named."""

import math

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import AXIS, assert_close_after_sums, mesh
from jax.sharding import PartitionSpec as P

import jaxcoll

# (subscripts, dim, gathered operand and its axis, per-device shapes given n, in_specs,
#  out_specs)
GATHERS = {
    # tensor parallel: activations' rows gathered (dim in the output), columns of w local
    "rows": ("sk,kn->sn", "s", (0, 0), lambda n: ((4, 6), (6, 3)), (P(AXIS), P(None, AXIS)),
             P(None, AXIS)),
    # FSDP: the weight's contracted rows gathered, summed into the output
    "contracted": ("bk,kn->bn", "k", (1, 0), lambda n: ((2, 4 * n), (4, 5)),
                   (P(AXIS), P(AXIS)), P(AXIS)),
    # a batch letter both operands hold: the other operand sliced along it too
    "batch": ("bsk,bkn->bsn", "b", (0, 0), lambda n: ((2, 3, 4), (2 * n, 4, 5)),
              (P(AXIS), P()), P(AXIS)),
    # "..." in the subscripts; the second operand gathered
    "ellipsis": ("...k,nk->...n", "n", (1, 0), lambda n: ((2, 3, 4), (2, 4)),
                 (P(), P(AXIS)), P(AXIS)),
}
SCATTERS = {
    # Megatron's row-parallel matmul, sequence-parallel output (dim from x)
    "rows": ("sf,fn->sn", "s", lambda n: ((4 * n, 3), (3, 5)), (P(None, AXIS), P(AXIS))),
    # the scattered letter from the second operand
    "columns": ("sf,fn->sn", "n", lambda n: ((3, 2), (2, 4 * n)), (P(None, AXIS), P(AXIS))),
    # FSDP's weight gradient: x^T dy over the batch, scattered over the weight's rows
    "weight_grad": ("bk,bn->kn", "k", lambda n: ((5, 2 * n), (5, 3)), (P(AXIS), P(AXIS))),
}



# (n, check_vma, bidirectional): every axis size typed and one way, four of them on the
# oldest-jax leg; both ways and untyped on two sizes
CASES = [pytest.param(n, True, False, marks=pytest.mark.quick) if n in (1, 3, 4, 8)
         else (n, True, False) for n in range(1, 9)] + \
    [(n, v, b) for n in (3, 4) for v, b in ((True, True), (False, False))]


def _global(shape, spec, n, key):
  """A random global array whose per-device piece under ``spec`` has ``shape``."""
  whole = tuple(d * (n if s is not None else 1) for d, s in
                zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))))
  return jax.random.normal(jax.random.key(key), whole)


def _stacked(out_spec):
  """Results varying over the axis leave shard_map stacked along a new leading axis."""
  return P(AXIS, *out_spec)


@pytest.mark.parametrize("name", sorted(GATHERS))
@pytest.mark.parametrize("n, check_vma, bidirectional", CASES)
def test_all_gather_matmul_equals_lax_all_gather_then_einsum(name, n, bidirectional,
                                                            check_vma):
  subscripts, dim, (operand, axis), shapes, in_specs, _ = GATHERS[name]
  args = [_global(s, p, n, k) for k, (s, p) in enumerate(zip(shapes(n), in_specs))]

  def ours(x, y):
    return jaxcoll.all_gather_matmul(subscripts, x, y, AXIS, dim=dim, operand=operand,
                                     bidirectional=bidirectional)[None]

  def lax(x, y):
    ops = [x, y]
    ops[operand] = jax.lax.all_gather(ops[operand], AXIS, axis=axis, tiled=True)
    return jnp.einsum(subscripts, *ops)[None]
  got, want = (jax.jit(jax.shard_map(f, mesh=mesh(n), in_specs=in_specs, out_specs=P(AXIS),
                                     check_vma=check_vma))(*args) for f in (ours, lax))
  assert_close_after_sums(got, want, _terms(subscripts, args))


def _terms(subscripts, args):
  """How many products each output value sums (the contracted extent, global)."""
  lhs, out = subscripts.replace("...", "").split("->")
  x, y = lhs.split(",")
  shape = dict(zip(x, args[0].shape[args[0].ndim - len(x):])) | \
      dict(zip(y, args[1].shape[args[1].ndim - len(y):]))
  return math.prod(shape[c] for c in set(x + y) - set(out))


@pytest.mark.parametrize("name", sorted(SCATTERS))
@pytest.mark.parametrize("n, check_vma, bidirectional", CASES)
def test_matmul_reduce_scatter_equals_the_dense_product_scattered(name, n, bidirectional,
                                                                 check_vma):
  subscripts, dim, shapes, in_specs = SCATTERS[name]
  args = [_global(s, p, n, k) for k, (s, p) in enumerate(zip(shapes(n), in_specs))]
  out_spec = P(*(AXIS if c == dim else None for c in subscripts.split("->")[1]))
  got = jax.jit(jax.shard_map(
      lambda x, y: jaxcoll.matmul_reduce_scatter(subscripts, x, y, AXIS, dim=dim,
                                                 bidirectional=bidirectional),
      mesh=mesh(n), in_specs=in_specs, out_specs=out_spec, check_vma=check_vma))(*args)
  assert_close_after_sums(got, jnp.einsum(subscripts, *args), _terms(subscripts, args))


# every axis size on one layout; every layout and piece count on 4 devices; untyped once
ALL_REDUCE_CASES = [pytest.param("rows", n, 2, True, marks=pytest.mark.quick) if n in (1, 3, 8)
                    else ("rows", n, 2, True) for n in range(1, 9)] + \
    [pytest.param(name, 4, pieces, True, marks=pytest.mark.quick) if pieces == 1 else
     (name, 4, pieces, True) for name in sorted(SCATTERS) for pieces in (1, 3)] + \
    [("weight_grad", 4, 2, False)]


@pytest.mark.parametrize("name, n, pieces, check_vma", ALL_REDUCE_CASES)
def test_matmul_all_reduce_equals_psum_of_the_einsum(name, n, pieces, check_vma):
  """Values equal lax.psum of the einsum (whole on every device, as its invariant result may
  leave a typed shard_map with P()), and bit-identical across devices."""
  subscripts, dim, shapes, in_specs = SCATTERS[name]
  shapes = [tuple(d * pieces if c == dim else d for c, d in zip(t, s))
            for t, s in zip(subscripts.split("->")[0].split(","), shapes(n))]
  args = [_global(s, p, n, k) for k, (s, p) in enumerate(zip(shapes, in_specs))]

  def run(f, out_specs):
    return jax.jit(jax.shard_map(f, mesh=mesh(n), in_specs=in_specs, out_specs=out_specs,
                                 check_vma=check_vma))(*args)
  ours = lambda x, y: jaxcoll.matmul_all_reduce(subscripts, x, y, AXIS, dim=dim,   # noqa: E731
                                                pieces=pieces)
  got = run(ours, P())
  want = run(lambda x, y: jax.lax.psum(jnp.einsum(subscripts, x, y), AXIS), P())
  assert_close_after_sums(got, want, _terms(subscripts, args))
  copies = run(lambda x, y: ours(x, y)[None], P(AXIS))
  assert all(np.array_equal(c, copies[0]) for c in copies)


@pytest.mark.parametrize("n", [2, 3, 4, 8])
@pytest.mark.parametrize("pieces", [1, 2])
def test_matmul_all_reduce_gradients_equal_psums(n, pieces):
  """A row-parallel product summed whole (Megatron without sequence parallelism) feeding a
  loss: value and gradients equal lax.psum's (typed shard_map: the sum is invariant)."""
  x = jax.random.normal(jax.random.key(4), (2 * n * pieces, 3 * n))
  w = jax.random.normal(jax.random.key(5), (3 * n, 5)) / 3

  def loss(summed):
    def f(x, w):
      return jnp.sum(jnp.tanh(summed("sf,fn->sn", x, w)) ** 2)
    return jax.jit(jax.value_and_grad(jax.shard_map(
        f, mesh=mesh(n), in_specs=(P(None, AXIS), P(AXIS)), out_specs=P()), argnums=(0, 1)))

  got = loss(lambda s, x, w: jaxcoll.matmul_all_reduce(s, x, w, AXIS, dim="s",
                                                       pieces=pieces))(x, w)
  want = loss(lambda s, x, w: jax.lax.psum(jnp.einsum(s, x, w), AXIS))(x, w)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * float(np.max(np.abs(b))))


@pytest.mark.parametrize("n", [2, 3, 4, 8])
@pytest.mark.parametrize("bidirectional", [False, True])
def test_gradients_equal_the_dense_models(n, bidirectional):
  """A sequence-parallel Megatron MLP block (gather rows, column-parallel, row-parallel,
  scatter rows) and an FSDP layer: loss and every gradient equal the dense model's."""
  m = mesh(n)
  x = jax.random.normal(jax.random.key(0), (4 * n, 6))
  w1 = jax.random.normal(jax.random.key(1), (6, 2 * n)) / 3
  w2 = jax.random.normal(jax.random.key(2), (2 * n, 2 * n)) / 3
  w3 = jax.random.normal(jax.random.key(3), (2 * n, 4)) / 3   # FSDP: rows split

  def block(x, w1, w2, w3):
    h = jnp.tanh(jaxcoll.all_gather_matmul("sk,kn->sn", x, w1, AXIS, dim="s",
                                           bidirectional=bidirectional))
    y = jaxcoll.matmul_reduce_scatter("sf,fn->sn", h, w2, AXIS, dim="s",
                                      bidirectional=bidirectional)
    z = jnp.tanh(jaxcoll.all_gather_matmul("bk,kn->bn", y, w3, AXIS, dim="k", operand=1,
                                           bidirectional=bidirectional))
    return jax.lax.psum(jnp.sum(z ** 2), AXIS)

  def dense(x, w1, w2, w3):
    return jnp.sum(jnp.tanh(jnp.tanh(x @ w1) @ w2 @ w3) ** 2)

  f = jax.jit(jax.value_and_grad(jax.shard_map(
      block, mesh=m, in_specs=(P(AXIS), P(None, AXIS), P(AXIS, None), P(AXIS)),
      out_specs=P()), argnums=(0, 1, 2, 3)))
  value, grads = f(x, w1, w2, w3)
  want_value, want_grads = jax.value_and_grad(dense, argnums=(0, 1, 2, 3))(x, w1, w2, w3)
  np.testing.assert_allclose(value, want_value, rtol=1e-5)
  for g, w in zip(grads, want_grads):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * float(np.max(np.abs(w))))


@pytest.mark.quick
def test_maxtext_collective_matmul_example_equals_all_gather_matmul():
  """MaxText's ``shmap_collective_matmul.py`` (tests/maxtext_collective_matmul.py, unchanged)
  and ``all_gather_matmul`` on its mesh and data: equal (bfloat16, each output value one
  einsum over E either way), and both equal the example's naive ``jit_matmul``."""
  import maxtext_collective_matmul as cm
  with cm.global_mesh:
    activations, weights = cm.data_fn()
    theirs = jax.jit(cm.collective_matmul)(activations, weights)
    naive = cm.jit_matmul(activations, weights)
  ours = jax.jit(jax.shard_map(
      lambda a, w: jaxcoll.all_gather_matmul("bsE,Ehd->bshd", a, w, cm.MESH_TENSOR_AXIS,
                                             dim="s"),
      mesh=cm.global_mesh,
      in_specs=(P(cm.MESH_FSDP_AXIS, cm.MESH_TENSOR_AXIS, None),
                P(cm.MESH_FSDP_AXIS, cm.MESH_TENSOR_AXIS, None)),
      out_specs=P(cm.MESH_FSDP_AXIS, None, cm.MESH_TENSOR_AXIS, None)))(activations, weights)
  assert ours.dtype == theirs.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(ours, np.float32), np.asarray(theirs, np.float32))
  assert jnp.allclose(naive, ours)   # the example's own check


def test_one_permute_beside_one_einsum_in_each_loop_body():
  """The form XLA's GPU scheduler hides (docs/guide/overlap.md): each loop body holds a
  ppermute and an einsum that does not read it; bidirectional, two of each."""
  m = mesh(4)
  for bidirectional, count in ((False, 1), (True, 2)):
    f = jax.shard_map(
        lambda x, w, b=bidirectional: jaxcoll.all_gather_matmul("sk,kn->sn", x, w, AXIS,
                                                                dim="s", bidirectional=b),
        mesh=m, in_specs=(P(AXIS), P(None, AXIS)), out_specs=P(None, AXIS))
    jaxpr = jax.make_jaxpr(f)(jnp.ones((16, 4)), jnp.ones((4, 8)))
    loops = [e for e in _walk(jaxpr.jaxpr) if e.primitive.name in ("scan", "while")]
    assert len(loops) == 1
    body = loops[0].params["jaxpr"].jaxpr
    names = [e.primitive.name for e in _walk(body)]
    assert names.count("ppermute") == count and names.count("dot_general") == count
    permuted = {v for e in body.eqns if e.primitive.name == "ppermute" for v in e.outvars}
    for e in body.eqns:
      if e.primitive.name == "dot_general":
        assert not permuted & set(e.invars)


def _walk(jaxpr):
  for e in jaxpr.eqns:
    yield e
    if e.primitive.name == "shard_map":
      yield from _walk(e.params["jaxpr"])
    if e.primitive.name == "pjit":
      yield from _walk(e.params["jaxpr"].jaxpr)


@hypothesis.given(n=st.integers(1, 8), rows=st.integers(1, 3), k=st.integers(1, 4),
                  cols=st.integers(1, 3), dtype=st.sampled_from(["float32", "bfloat16"]))
def test_any_shape_and_dtype(n, rows, k, cols, dtype):
  """Random sizes and dtypes: gather then scatter back equals the dense product chain, in
  the operands' dtype, within the summation's rounding."""
  m = mesh(n)
  x = jax.random.normal(jax.random.key(rows), (rows * n, k)).astype(dtype)
  w = jax.random.normal(jax.random.key(k), (k, cols * n)).astype(dtype)
  v = jax.random.normal(jax.random.key(cols), (cols * n, k)).astype(dtype)

  def f(x, w, v):
    h = jaxcoll.all_gather_matmul("sk,kn->sn", x, w, AXIS, dim="s")
    return jaxcoll.matmul_reduce_scatter("sf,fn->sn", h, v, AXIS, dim="s")
  got = jax.jit(jax.shard_map(f, mesh=m, in_specs=(P(AXIS), P(None, AXIS), P(AXIS)),
                              out_specs=P(AXIS)))(x, w, v)
  assert got.dtype == jnp.dtype(dtype) and got.shape == (rows * n, k)
  h = (x @ w).astype(jnp.float32)
  want = h @ v.astype(jnp.float32)
  eps = float(jnp.finfo(dtype).eps)
  bound = (np.abs(x.astype(jnp.float32)) @ np.abs(w.astype(jnp.float32))) @ \
      np.abs(v.astype(jnp.float32))
  np.testing.assert_array_less(np.abs(np.asarray(got, np.float32) - want),
                               4 * (k + cols * n + 2) * eps * bound + 1e-30)


@pytest.mark.parametrize("call, match", [
    (lambda x, w: jaxcoll.all_gather_matmul("sk,kn", x, w, AXIS, dim="s"), r"subscripts="),
    (lambda x, w: jaxcoll.all_gather_matmul("sk,kn,n->sn", x, w, AXIS, dim="s"),
     r"subscripts=.*3 operand"),
    (lambda x, w: jaxcoll.all_gather_matmul("skq,kn->sn", x, w, AXIS, dim="s"),
     r"subscripts=.*term 'skq'"),
    (lambda x, w: jaxcoll.all_gather_matmul("sk,kn->sn", x, w, AXIS, dim="q"), r"dim='q'"),
    (lambda x, w: jaxcoll.all_gather_matmul("sk,kn->sn", x, w, AXIS, dim="n"),
     r"dim='n' is not a dimension of operand 0"),
    (lambda x, w: jaxcoll.all_gather_matmul("sk,kn->sn", x, w, AXIS, dim="k"),
     r"dim='k': operand 1 has extent 4 there; .* 4 x 4 = 16"),
    (lambda x, w: jaxcoll.all_gather_matmul("sk,kn->sn", x, w, AXIS, dim="s", operand=2),
     r"operand=2"),
    (lambda x, w: jaxcoll.all_gather_matmul("sk,kn->sn", x[:3], w, AXIS, dim="s",
                                            bidirectional=True), r"bidirectional=True.*odd"),
    (lambda x, w: jaxcoll.all_gather_matmul("sk,kn->sn", x, w, AXIS, dim="s",
                                            bidirectional=1), r"bidirectional=1"),
    (lambda x, w: jaxcoll.all_gather_matmul("sk,kn->sn", x, w, "y", dim="s"),
     r"axis_name='y'"),
    (lambda x, w: jaxcoll.matmul_reduce_scatter("sk,kn->sn", x, w, AXIS, dim="k"),
     r"dim='k' is not a dimension of the output"),
    (lambda x, w: jaxcoll.matmul_reduce_scatter("sk,kn->sn", x[:2], w, AXIS, dim="s"),
     r"dim='s': the output's extent 2 there is not divisible by the axis size 4"),
    (lambda x, w: jaxcoll.matmul_all_reduce("sk,kn->sn", x, w, AXIS, dim="k"),
     r"dim='k' is not a dimension of the output"),
    (lambda x, w: jaxcoll.matmul_all_reduce("sk,kn->sn", x, w, AXIS, dim="s", pieces=3),
     r"pieces=3: the output's extent 4 along dim='s' is not divisible by pieces x the axis "
     r"size \(3 x 4\)"),
    (lambda x, w: jaxcoll.matmul_all_reduce("sk,kn->sn", x, w, AXIS, dim="s", pieces=0),
     r"pieces=0"),
])
def test_bad_input_is_named_at_trace_time(call, match):
  f = jax.shard_map(call, mesh=mesh(4), in_specs=(P(AXIS), P(None, AXIS)),
                    out_specs=P(AXIS), check_vma=False)
  with pytest.raises((ValueError, TypeError), match=match):
    jax.eval_shape(f, jnp.ones((16, 4)), jnp.ones((4, 8)))
