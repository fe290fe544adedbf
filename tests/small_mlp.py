"""The small MLP step the `use` traffic tests share (issues 45 and 54): w1 (32, 64), b1, w2
(64, 8), b2; parameters replicated ("dp", 8 devices) or w1/b1 column-split and w2
row-split over "model" ("dp_tp", 2 x 4); a (256, 32) batch split over "data"."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

SHAPES = {"w1": (32, 64), "b1": (64,), "w2": (64, 8), "b2": (8,)}


def mlp_loss(p, x, y):
  h = jax.nn.relu(x @ p["w1"] + p["b1"])
  return jnp.mean((h @ p["w2"] + p["b2"] - y) ** 2)


def mesh_and_specs(layout: str):
  if layout == "dp":
    return (jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,)),
            {k: P() for k in SHAPES})
  return (jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2),
          {"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None), "b2": P()})


def setup(layout: str, tx):
  """``(mesh, params, tx.init(params), x, y)``, laid out as ``layout`` says."""
  mesh, specs = mesh_and_specs(layout)
  keys = jax.random.split(jax.random.key(0), 4)
  params = {"w1": jax.random.normal(keys[0], SHAPES["w1"]) / 6, "b1": jnp.zeros(64),
            "w2": jax.random.normal(keys[1], SHAPES["w2"]) / 8, "b2": jnp.zeros(8)}
  params = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in params.items()}
  data = NamedSharding(mesh, P("data"))
  x = jax.device_put(jax.random.normal(keys[2], (256, 32)), data)
  y = jax.device_put(jax.random.normal(keys[3], (256, 8)), data)
  return mesh, params, tx.init(params), x, y
