"""``jaxcoll.use`` reduces every partial sum's terms once per step.

A gradient is a partial sum until something needs it whole, and optimizers read it more than
once: Adam's first moment reads ``(1 - b1) * g``, its second ``g ** 2``. Reducing each
reader's value apart sends the bytes twice and, on a lossy wire, rounds one gradient two
ways: an entry whose first moment is non-zero while its second is exactly zero takes a step
of ``mu / eps`` (the silent divergence this file guards against). Here:

- Adam + int8 on a data-parallel mesh and a data x model mesh: after one step every entry
  holds ``nu == (1 - b2) * (mu / (1 - b1)) ** 2`` (one rounding of one gradient); after ten,
  no entry has ``mu != 0`` with ``nu == 0``, every parameter is within Adam's own bound of
  jit's, and the loss is finite;
- the bytes a step's jaxcoll collectives carry equal the gradients' and the loss's (data
  parallel), and a hand-written shard_map step's psums (data x model);
- a hypothesis test over small programs: a partial value with k linear and m nonlinear
  consumers, at top level or inside ``lax.scan``, is reduced once, and every consumer reads
  the one reduced value.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_close_after_sums
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from small_mlp import SHAPES, mlp_loss
from small_mlp import setup as mlp_setup

import jaxcoll

pytestmark = pytest.mark.quick   # reads jaxprs: on every supported jax

LR, B1, B2 = 1e-2, 0.9, 0.999
tx = optax.adam(LR)


@jax.jit
def adam_step(p, s, x, y):
  loss, g = jax.value_and_grad(mlp_loss)(p, x, y)
  updates, s = tx.update(g, s, p)
  return optax.apply_updates(p, updates), s, loss


def setup(layout: str):
  """The issue's step (:mod:`small_mlp`) with Adam's state."""
  return mlp_setup(layout, tx)


def adam_step_bound(t: int) -> float:
  """The most one Adam step (optax's, bias-corrected, eps aside) moves an entry, whatever
  the gradients: by Cauchy-Schwarz, |mu_hat / sqrt(nu_hat)| <= (1 - b1) / (1 - b1^t) *
  sqrt((1 - b2^t) / (1 - b2)) * sqrt(sum_{k<t} (b1^2 / b2)^k)."""
  series = sum((B1 * B1 / B2) ** k for k in range(t))
  return LR * (1 - B1) / (1 - B1 ** t) * np.sqrt((1 - B2 ** t) / (1 - B2) * series)


@pytest.mark.parametrize("layout", ["dp", "dp_tp"])
def test_adam_on_an_int8_wire_rounds_each_gradient_once(layout):
  mesh, params, state, x, y = setup(layout)
  used = jaxcoll.use(adam_step, wire_dtype="int8")
  with jax.set_mesh(mesh):
    p, s, _ = used(params, state, x, y)
    for k in SHAPES:   # step 1: mu = (1 - b1) g, nu = (1 - b2) g^2, of one rounded g
      mu, nu = np.asarray(s[0].mu[k]), np.asarray(s[0].nu[k])
      np.testing.assert_allclose(nu, (1 - B2) * (mu / (1 - B1)) ** 2, rtol=1e-5, atol=0,
                                 err_msg=k)
    want, got, drift = (params, state), (p, s), 2 * adam_step_bound(1)
    want = adam_step(*want, x, y)[:2]
    for t in range(2, 11):
      want_p, want_s, want_loss = adam_step(*want, x, y)
      got_p, got_s, got_loss = used(*got, x, y)
      want, got, drift = (want_p, want_s), (got_p, got_s), drift + 2 * adam_step_bound(t)
  assert np.isfinite(got_loss) and abs(got_loss - want_loss) < 0.1 * want_loss
  for k in SHAPES:
    mu, nu = np.asarray(got[1][0].mu[k]), np.asarray(got[1][0].nu[k])
    assert not np.any((mu != 0) & (nu == 0)), k
    assert np.max(np.abs(np.asarray(got[0][k]) - np.asarray(want[0][k]))) <= drift, k


# ---- bytes: each gradient and the loss once ----

def _sums_by_axes(report) -> dict:
  """Bytes each set of axes reduces in one call (all_reduce and reduce_scatter lines)."""
  out: dict = {}
  for line in report.collectives:
    if line.what in ("all_reduce", "reduce_scatter"):
      out[line.axes] = out.get(line.axes, 0) + line.nbytes * line.count
  return out


def _psum_bytes(jaxpr) -> dict:
  """Bytes each set of axes sums in a jaxpr's psums (a hand-written step's)."""
  from helpers import eqns
  out: dict = {}
  for eqn in eqns(jaxpr):
    if eqn.primitive.name in ("psum", "psum_invariant"):
      axes = tuple(eqn.params["axes"])
      for v in eqn.invars:
        out[axes] = out.get(axes, 0) + int(np.prod(v.aval.shape)) * v.aval.dtype.itemsize
  return out


def hand_written_dp_tp_step(mesh):
  """The Megatron-style loss and gradient for the same MLP, written by hand as JAX's
  shard_map tutorial writes them (``check_vma=True``): the row-split layer's product summed
  over "model", the loss's mean over "data", and JAX's own transposes summing each
  gradient of a parameter replicated over "data" (no communication for "model" in
  backward)."""
  def local(p, x, y):
    def loss(p):
      h = jax.nn.relu(x @ p["w1"] + p["b1"])
      out = jax.lax.psum(h @ p["w2"], "model") + p["b2"]
      return jax.lax.pmean(jnp.mean((out - y) ** 2), "data")
    return jax.value_and_grad(loss)(p)
  specs = {"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None), "b2": P()}
  return jax.shard_map(local, mesh=mesh, in_specs=(specs, P("data"), P("data")),
                       out_specs=(P(), specs))


@pytest.mark.parametrize("layout", ["dp", "dp_tp"])
def test_the_steps_collectives_carry_each_gradient_and_the_loss_once(layout):
  mesh, params, state, x, y = setup(layout)
  used = jaxcoll.use(adam_step, algorithm="ring")
  with jax.set_mesh(mesh):
    report = jaxcoll.explain_step(used, params, state, x, y)
    if layout == "dp":
      want = {("data",): 4 * (sum(int(np.prod(s)) for s in SHAPES.values()) + 1)}
    else:
      want = _psum_bytes(jax.make_jaxpr(hand_written_dp_tp_step(mesh))(params, x, y))
  assert _sums_by_axes(report) == want, report


# ---- any program: a partial value, k linear and m nonlinear consumers ----

LINEAR = {"scale": lambda s: 0.5 * s, "neg": lambda s: -s, "reshape": lambda s: s.reshape(4, -1),
          "transpose": lambda s: s.reshape(4, -1).T, "slice": lambda s: s[2:10],
          "widen": lambda s: s.astype(jnp.float32) * 3}
NONLINEAR = {"square": lambda s: s * s, "exp": jnp.exp, "tanh": jnp.tanh,
             "relu": jax.nn.relu, "abs": jnp.abs}
D = 16


def _consumers(s, linear, nonlinear):
  return tuple(LINEAR[n](s) for n in linear) + tuple(NONLINEAR[n](s) for n in nonlinear)


def program(linear, nonlinear, where):
  """``s = x.sum(0)`` of a batch split over "data": a partial sum of D values. At top
  level, in each step of a ``lax.scan`` over stacked batches, accumulated in a scan's or a
  ``while_loop``'s carry (reduced once, after the loop), added to a carry the body reads
  nonlinearly (reduced in each step), read inside ``jax.checkpoint``, or in both branches
  of a ``lax.cond``."""
  def top(x):
    return _consumers(x.sum(0), linear, nonlinear)

  def remat(x):
    return jax.checkpoint(lambda s: _consumers(s, linear, nonlinear))(x.sum(0))

  def branches(x):
    s = x.sum(0)
    return jax.lax.cond(x.shape[0] > 1, lambda s: _consumers(s, linear, nonlinear),
                        lambda s: _consumers(2 * s, linear, nonlinear), s)

  def looped(xs):
    _, total = jax.lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] + xs[c[0]].sum(0)),
                                  (0, jnp.zeros(D)))
    return _consumers(total, linear, nonlinear)

  def scanned(xs):
    return jax.lax.scan(lambda c, x: (c, _consumers(x.sum(0), linear, nonlinear)), 0.0, xs)[1]

  def carried(xs):
    total = jax.lax.scan(lambda c, x: (c + x.sum(0), None), jnp.zeros(D), xs)[0]
    return _consumers(total, linear, nonlinear)

  def residual(xs):   # a carry the body reads nonlinearly: each step's sum reduced in it
    total = jax.lax.scan(lambda c, x: (jnp.tanh(c) + x.sum(0), None), jnp.zeros(D), xs)[0]
    return _consumers(total, linear, nonlinear)
  return {"top": top, "scan": scanned, "carry": carried, "remat": remat, "cond": branches,
          "while": looped, "residual": residual}[where]


def _magnitudes(name: str, value) -> np.ndarray:
  """|s| recovered from one consumer's value (NaN where it tells nothing)."""
  v = np.asarray(value, np.float64)
  out = np.full(D, np.nan)
  recover = {"scale": lambda: np.abs(v / 0.5), "neg": lambda: np.abs(v),
             "reshape": lambda: np.abs(v.reshape(-1)), "transpose": lambda: np.abs(v.T.reshape(-1)),
             "widen": lambda: np.abs(v / 3), "square": lambda: np.sqrt(v),
             "exp": lambda: np.abs(np.log(v)), "tanh": lambda: np.abs(np.arctanh(v)),
             "abs": lambda: v, "relu": lambda: np.where(v > 0, v, np.nan)}
  if name == "slice":
    out[2:10] = np.abs(v)
  else:
    out[:] = recover[name]()
  return out


@given(linear=st.lists(st.sampled_from(sorted(LINEAR)), max_size=3),
       nonlinear=st.lists(st.sampled_from(sorted(NONLINEAR)), max_size=3),
       where=st.sampled_from(["top", "scan", "carry", "remat", "cond", "while", "residual"]),
       wire=st.sampled_from([None, "int8"]))
def test_a_partial_value_is_reduced_once_whatever_reads_it(linear, nonlinear, where, wire):
  """Elements reduced in one call: s's D once per source. A scan's 3 steps and a residual
  carry's 3 steps each reduce their own; an accumulator's 3 terms are reduced once, after
  the loop; a lone linear reader's own value is reduced where it is the only one needed
  (stacked after a scan), except in a cond, whose operands enter it whole, and after a
  residual loop, whose carry leaves it whole.
  On an int8 wire every consumer reads the same rounded s: |s| recovered from each agrees
  to float32 rounding (two roundings of s differ by int8's step, ~1/126 of the block)."""
  if not linear and not nonlinear:
    nonlinear = ["square"]
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
  shape = (64, D) if where in ("top", "remat", "cond") else (3, 64, D)
  x = jax.random.normal(jax.random.key(len(linear) * 7 + len(nonlinear)), shape) / 32
  x = jax.device_put(x, NamedSharding(mesh, P(*([None] * (len(shape) - 2)), "data")))
  fn = program(linear, nonlinear, where)
  used = jaxcoll.use(fn, algorithm="ring", wire_dtype=wire)
  with jax.set_mesh(mesh):
    got, want = used(x), jax.jit(fn)(x)
    report = jaxcoll.explain_step(used, x)
  names = linear + nonlinear
  steps = 3 if where in ("scan", "residual") else 1   # a source in each of 3 steps
  size = D * steps
  if len(names) == 1 and linear and where not in ("cond", "residual"):   # whole before
    size = int(np.prod(jax.eval_shape(LINEAR[linear[0]], jax.ShapeDtypeStruct((D,), jnp.float32))
                       .shape)) * steps
  assert _sums_by_axes(report) == {("data",): 4 * size}, report
  if wire is None:
    assert_close_after_sums(got, want, terms=64 * (1 if len(shape) == 2 else 3))
    return
  steps = [got] if where != "scan" else [[g[i] for g in got] for i in range(3)]
  for values in steps:
    seen = [_magnitudes(n, v) for n, v in zip(names, values)]
    for m in seen[1:]:
      both = ~np.isnan(m) & ~np.isnan(seen[0])
      np.testing.assert_allclose(m[both], seen[0][both], rtol=1e-5, atol=1e-6)


# ---- what a lossy wire touches: sums and gathers, never a max or a min ----

@pytest.mark.parametrize("wire", ["int8", "float8_e4m3fn", "bfloat16"])
def test_a_lossy_wire_never_rounds_a_max(wire):
  """argmax, max and min over a split dimension, and a shard_map's ``lax.pmax``, are exact
  under a compressed wire: each selects a device's own value (a rounded maximum matched
  none, and argmax returned 2**31 - 1)."""
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
  x = jax.device_put(jax.random.normal(jax.random.key(0), (64, 16)),
                     NamedSharding(mesh, P("data")))
  split = lambda x: (jnp.argmax(x, axis=0), jnp.max(x, axis=0), jnp.min(x, axis=0))  # noqa: E731
  island = jax.shard_map(lambda x: jax.lax.pmax(x, "data"), mesh=mesh, in_specs=P("data"),
                         out_specs=P())
  with jax.set_mesh(mesh):
    for fn in (split, island):
      for got, want in zip(jax.tree.leaves(jaxcoll.use(fn, algorithm="ring",
                                                       wire_dtype=wire)(x)),
                           jax.tree.leaves(jax.jit(fn)(x))):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("where", ["global", "shard_map"])
def test_a_lossy_wire_refuses_a_float64_value_by_name(where):
  """A float64 value has no float32 home beyond float32's range (1e300 would arrive inf):
  under a compressed wire its sum (a gradient's, of 128 values: one the wire would round)
  is an error naming the equation's source line, raised when the step is traced; without
  one it sums as jit does."""
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
  with jax.enable_x64(True):
    x = jax.device_put(jnp.full((64, 128), 1e300, jnp.float64), NamedSharding(mesh, P("data")))
    fn = (lambda x: jax.grad(lambda w: jnp.sum(x * w))(jnp.ones(128))) \
        if where == "global" else jax.shard_map(
        lambda x: jax.lax.psum(x.sum(0), "data"), mesh=mesh, in_specs=P("data"), out_specs=P())
    with jax.set_mesh(mesh):
      with pytest.raises(ValueError, match=r"float64 value .* at .*test_use_reduce_once\.py"):
        jaxcoll.use(fn, algorithm="ring", wire_dtype="int8")(x)
      np.testing.assert_array_equal(jaxcoll.use(fn, algorithm="ring")(x), jax.jit(fn)(x))
