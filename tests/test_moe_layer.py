"""jaxcoll.moe.layer against a dense single-device reference: every router, layout and
activation, with shared experts; outputs, losses and the gradients of every parameter."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxcoll import moe

D, F, T = 8, 12, 16
EXPERT_WEIGHTS = ("w_gate", "w_up", "w_in", "w_out")


def ffn(weights, h, activation):
  if activation == "swiglu":
    return (jax.nn.silu(h @ weights["w_gate"]) * (h @ weights["w_up"])) @ weights["w_out"]
  act = {"gelu": jax.nn.gelu, "relu": jax.nn.relu, "silu": jax.nn.silu}[activation]
  return act(h @ weights["w_in"]) @ weights["w_out"]


def kept_by_capacity(ids, e, cap):
  """GShard's drops on one device: slots in choice-major order, pairs past cap dropped."""
  t, k = ids.shape
  fill, kept = np.zeros(e, int), np.zeros((t, k), bool)
  for j in range(k):
    for i in range(t):
      kept[i, j] = fill[ids[i, j]] < cap
      fill[ids[i, j]] += 1
  return kept


def dense_layer(params, x, options):
  """Every device's tokens x [N, T, d] on one device: the same routers, every expert's FFN
  on every token, the chosen ones summed with their gates; (y, summed losses, dropped)."""
  n, t, _ = x.shape
  act = options.get("activation", "swiglu")
  experts = {w: params[w] for w in EXPERT_WEIGHTS if w in params}
  e = params["router"].shape[1]
  factor = options.get("capacity_factor", 1.25)
  router = options.get("router", "softmax")
  ys, losses, dropped = [], 0.0, 0
  for s in range(n):
    logits = x[s] @ params["router"]
    every = jax.vmap(lambda w, s=s: ffn(w, x[s], act))(experts)             # [E, T, d]
    if router == "experts":
      tokens, gates = moe.route_experts(logits, moe.capacity(t, e, 1, factor))
      contrib = gates[..., None] * every[jnp.arange(e)[:, None], tokens]    # [E, C, d]
      y = jnp.zeros((t, D)).at[tokens].add(contrib)
    else:
      k = options.get("k", 2)
      if router == "softmax":
        ids, gates = moe.route(logits, k)
        losses = losses + moe.load_balancing_loss(logits, ids) + moe.router_z_loss(logits)
      else:
        ids, gates = moe.route_biased(logits, k, params["bias"],
                                      groups=options.get("groups", 1),
                                      top_groups=options.get("top_groups", 1))
      kept = np.ones(ids.shape, bool) if factor is None else kept_by_capacity(
          np.asarray(ids), e, moe.capacity(t, e, k, factor))
      dropped += int((~kept).sum())
      picked = every[ids, jnp.arange(t)[:, None]]                            # [T, k, d]
      y = jnp.einsum("tk,tkd->td", gates * kept, picked)
    if "shared" in params:
      y = y + ffn(params["shared"], x[s], act)
    ys.append(y)
  return jnp.stack(ys), losses, dropped


def sharded_layer(shape, names, params, options):
  mesh = Mesh(np.array(jax.devices()[:int(np.prod(shape))]).reshape(shape), names)
  axes = names if len(names) > 1 else names[0]
  specs = {name: (P(names) if name in EXPERT_WEIGHTS else jax.tree.map(lambda _: P(), v))
           for name, v in params.items()}

  def body(params, x):
    y, aux = moe.layer(params, x[0], axis_name=axes, **options)
    loss = aux["load_balancing_loss"] + aux["router_z_loss"]
    return y[None], loss[None], aux["dropped"][None], aux["load"][None]

  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(specs, P(names)),
                               out_specs=(P(names),) * 4))


CASES = {
    "softmax, capacity 1.25 (drops)": {},
    "softmax, dropless, sorted": {"capacity_factor": None},
    "softmax, dropless, buffers": {"capacity_factor": None, "layout": "buffers"},
    "softmax, sorted, buffer factor 2": {"capacity_factor": None, "buffer_factor": 2.0,
                                         "k": 3},
    "sigmoid, groups, sorted": {"router": "sigmoid", "capacity_factor": None, "groups": 2,
                                "top_groups": 1},
    "experts choose": {"router": "experts", "capacity_factor": 1.0},
    "gelu MLP, capacity 2": {"activation": "gelu", "capacity_factor": 2.0},
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
@pytest.mark.parametrize("shared", [0, 16], ids=["routed only", "shared experts"])
def test_layer_equals_the_dense_reference(case, shared):
  options = CASES[case]
  shape, names = ((2, 4), ("node", "local")) if "sigmoid" in case else ((4,), ("x",))
  n = int(np.prod(shape))
  e = 2 * n
  params = moe.init_layer(jax.random.key(n), D, F, e, shared_ffn=shared,
                          activation=options.get("activation", "swiglu"),
                          bias="sigmoid" in case)
  if "bias" in params:
    params["bias"] = jnp.linspace(-0.5, 0.5, e)
  params["router"] = params["router"] * 50   # routers sure of their choice: some skew
  x = jax.random.normal(jax.random.key(1), (n, T, D))
  f = sharded_layer(shape, names, params, options)
  y, losses, dropped, load = f(params, x)
  want, want_losses, want_dropped = dense_layer(params, x, options)
  np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.sum(losses), want_losses, rtol=1e-5, atol=1e-6)
  assert set(np.asarray(dropped).tolist()) == {want_dropped}
  if case.startswith("softmax, capacity"):
    assert want_dropped > 0   # the case drops pairs
  assert int(load[0].sum()) == (n * moe.capacity(T, e, 1, 1.0) * e if "experts" in case
                                else n * T * options.get("k", 2))
  trained = {name: v for name, v in params.items() if name != "bias"}
  fixed = {name: v for name, v in params.items() if name == "bias"}
  loss = lambda p, x: jnp.sum(jnp.sin(f({**p, **fixed}, x)[0])) + jnp.sum(f({**p, **fixed}, x)[1])
  want_loss = lambda p, x: (jnp.sum(jnp.sin(dense_layer({**p, **fixed}, x, options)[0]))
                            + dense_layer({**p, **fixed}, x, options)[1])
  got_g, want_g = jax.grad(loss, (0, 1))(trained, x), jax.grad(want_loss, (0, 1))(trained, x)
  for a, b in zip(jax.tree.leaves(got_g), jax.tree.leaves(want_g)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.quick
def test_layer_quick():
  """The quick subset's case: sorted dropless SwiGLU with shared experts on 4 devices."""
  test_layer_equals_the_dense_reference("softmax, dropless, sorted", 16)


@pytest.mark.quick
def test_layer_errors_name_the_argument():
  mesh = Mesh(np.array(jax.devices()[:4]), ("x",))
  params = moe.init_layer(jax.random.key(0), D, F, 8)

  def call(params=params, **options):
    specs = {name: P("x") if name in EXPERT_WEIGHTS else P() for name in params}
    body = lambda p, x: moe.layer(p, x[0], axis_name="x", **options)[0][None]
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(specs, P("x")), out_specs=P("x")))(
        params, jnp.ones((4, T, D)))

  with pytest.raises(ValueError, match="router='topk'"):
    call(router="topk")
  with pytest.raises(ValueError, match="layout='dense'"):
    call(layout="dense")
  with pytest.raises(ValueError, match="activation='tanh'"):
    call(activation="tanh")
  with pytest.raises(ValueError, match=r"params lack \['w_in'\]"):
    call(activation="gelu")
  with pytest.raises(ValueError, match="key applies to router='softmax'"):
    call(router="experts", key=jax.random.key(0))
  with pytest.raises(ValueError, match="k=2 applies to the token-choice routers"):
    call(router="experts", k=2)
  with pytest.raises(ValueError, match="router='experts' fills every expert"):
    call(router="experts", capacity_factor=None)
  with pytest.raises(ValueError, match=r"router='sigmoid' chooses by params\['bias'\]"):
    call(router="sigmoid")
  with pytest.raises(ValueError, match="groups=2 applies to router='sigmoid'"):
    call(groups=2)
  with pytest.raises(ValueError, match="buffer_factor=2.0 applies to layout='sorted'"):
    call(buffer_factor=2.0)
  with pytest.raises(ValueError, match="capacity_factor=0"):
    call(capacity_factor=0)
  with pytest.raises(ValueError, match=r"params\['w_gate'\] must be this device's experts"):
    mesh_params = dict(params, w_gate=jnp.ones((4, D, F)))
    call(mesh_params)
  with pytest.raises(ValueError, match="activation='tanh'"):
    moe.init_layer(jax.random.key(0), D, F, 8, activation="tanh")
  with pytest.raises(ValueError, match="shared_ffn=-1"):
    moe.init_layer(jax.random.key(0), D, F, 8, shared_ffn=-1)
