"""A top-2 mixture-of-experts feed-forward layer, expert-parallel over 8 CPU devices.

Run with:  pip install -e '.[examples]' && python examples/moe_layer.py

16 experts (2 per device), 64 tokens of width 32 per device. Each device routes its tokens
(``jaxcoll.moe.route``), dispatches them to the experts' owners
(``jaxcoll.moe.dispatch``, an all-to-all), applies its two experts, and combines
(``jaxcoll.moe.combine``). The script prints the largest difference to a dense
single-device reference that loops over experts, the (token, choice) pairs dropped at
capacity factors 1.0 and 1.25 and none dropless (``capacity=None``), and the loss over a
few optax SGD steps (the router and
the experts trained together, with the load-balancing loss). Exits non-zero if the
layer differs from the reference.
"""

from __future__ import annotations

import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jaxcoll import moe  # noqa: E402

try:
  import optax  # noqa: E402
except ImportError:
  raise SystemExit(f"{__file__} needs optax: pip install -e '.[examples]'") from None

N, T, D, H, E, K, AXIS = 8, 64, 32, 64, 16, 2, "expert"


def ffn(w1, w2, h):
  return jax.nn.gelu(h @ w1) @ w2


def init(key):
  kr, k1, k2 = jax.random.split(key, 3)
  return {"router": jax.random.normal(kr, (D, E)) / np.sqrt(D),
          "w1": jax.random.normal(k1, (E, D, H)) / np.sqrt(D),
          "w2": jax.random.normal(k2, (E, H, D)) / np.sqrt(H)}


def layer(params, x, cap):
  """One device's tokens x [T, D] through the expert-parallel layer."""
  logits = x @ params["router"]
  ids, gates = moe.route(logits, K)
  h, state = moe.dispatch(x, ids, num_experts=E, capacity=cap, axis_name=AXIS)
  y = jax.vmap(ffn)(params["w1"], params["w2"], h)
  return moe.combine(y, state, gates), state, moe.load_balancing_loss(logits, ids)


def dense(params, x):
  """Every token through its top-2 experts on one device (nothing dropped)."""
  ids, gates = moe.route(x @ params["router"], K)
  out = jnp.zeros_like(x)
  for e in range(E):
    weight = jnp.sum(jnp.where(ids == e, gates, 0.0), axis=-1, keepdims=True)
    out = out + weight * ffn(params["w1"][e], params["w2"][e], x)
  return out


def main() -> int:
  mesh = Mesh(np.array(jax.devices()), (AXIS,))
  specs = {"router": P(), "w1": P(AXIS), "w2": P(AXIS)}
  params = init(jax.random.key(0))
  x = jax.random.normal(jax.random.key(1), (N * T, D))
  target = jnp.sin(x)

  def forward(cap):
    def body(p, xb):
      out, state, _ = layer(p, xb, cap)
      return out, state.dropped[None], state.exchanged[None]
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(specs, P(AXIS)),
                                 out_specs=(P(AXIS), P(AXIS), P(AXIS))))

  print(moe.explain(x[:T], K, num_experts=E, capacity=moe.capacity(T, E, K, 1.25), mesh=mesh,
                    axis_name=AXIS))   # what algorithm="auto" (the default) runs, and why
  out, dropped, _ = forward(T * K)(params, x)
  diff = float(jnp.abs(out - dense(params, x)).max())
  print(f"{N} devices, {E} experts (top-{K}), {T} tokens of width {D} per device")
  print(f"max |expert-parallel - dense reference| = {diff:.2e} (capacity {T * K}: "
        f"{int(dropped.sum())} dropped)")
  for factor in (1.0, 1.25):
    cap = moe.capacity(T, E, K, factor)
    _, dropped, _ = forward(cap)(params, x)
    print(f"capacity factor {factor}: {cap} slots per expert per device, "
          f"{int(dropped.sum())} of {N * T * K} (token, choice) pairs dropped")
  out, dropped, exchanged = forward(None)(params, x)
  dropless_diff = float(jnp.abs(out - dense(params, x)).max())
  print(f"dropless: {int(dropped.sum())} dropped, max |diff| to the reference "
        f"{dropless_diff:.2e}; the exchange sent {int(exchanged[0])} of {T * K} slots per "
        "expert buffer (the busiest expert's load, in chunks of the balanced capacity)")

  tx = optax.sgd(0.2)
  cap = moe.capacity(T, E, K, 1.25)

  def step(p, xb, yb):
    def loss(q):
      out, _, aux = layer(q, xb, cap)
      return (jnp.mean((out - yb) ** 2) + 0.01 * aux) / N   # global mean over devices
    value, grads = jax.value_and_grad(loss)(p)                # router grads summed by jax
    updates, _ = tx.update(grads, tx.init(p), p)
    return optax.apply_updates(p, updates), jax.lax.psum(value, AXIS)

  train = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(specs, P(AXIS), P(AXIS)),
                                out_specs=(specs, P())))
  losses = []
  for _ in range(20):
    params, value = train(params, x, target)
    losses.append(float(value))
  print("loss over 20 SGD steps: " + " ".join(f"{v:.4f}" for v in losses[::4]) +
        f" ... {losses[-1]:.4f}")
  ok = diff < 1e-5 and dropless_diff < 1e-5 and losses[-1] < losses[0]
  print("OK" if ok else "FAILED")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
