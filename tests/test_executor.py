"""The executor's compiled code: no whole-buffer copy in any schedule (XLA's copies of the
buffer between steps are what kept schedules far from their bytes' time), and a packed
buffer built once."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxcoll
from jaxcoll._src import compat, layout
from jaxcoll._src.collectives import flat_call

pytestmark = pytest.mark.quick

ELEMENTS = 1 << 14   # per device: M = 64 KiB of float32
MESHES = {"x": ((8,), ("x",)), "node,local": ((2, 4), ("node", "local"))}
CASES = [(p, a, key) for key, (shape, _) in MESHES.items() for p in jaxcoll.PRIMITIVES
         for a in jaxcoll.algorithms(p, num_axes=len(shape)) if a != "native"]


def buffer_copies(primitive: str, algorithm: str, mesh_key: str) -> tuple[int, str]:
  """Copies of the executor's whole buffer ([chunks, row length]) in the
  compiled HLO of ``primitive`` on 8 devices, and that shape."""
  shape, names = MESHES[mesh_key]
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(shape), names)
  axes = names if len(names) > 1 else names[0]
  options = {"axis_sizes": shape} if algorithm == "hierarchical" else {}
  sched = jaxcoll.schedule(primitive, algorithm, 8, **options)
  size = ELEMENTS // (8 if primitive == "all_gather" else 1)
  rows = sched.num_chunks
  buffer = f"f32[{rows},{layout.row_length(sched, size)}]"
  f = jax.jit(jax.shard_map(lambda v: flat_call(primitive, v[0], axes, algorithm)[None],
                            mesh=mesh, in_specs=P(names), out_specs=P(names)))
  hlo = f.lower(jnp.ones((8, size), jnp.float32)).compile().as_text()
  return len(re.findall(rf"= {re.escape(buffer)}\{{[^}}]*\}} copy\(", hlo)), buffer


@pytest.mark.parametrize("primitive,algorithm,mesh_key", CASES)
def test_no_schedule_copies_its_whole_buffer(primitive, algorithm, mesh_key):
  """None on jax 0.12; on 0.10.2, whose XLA copies through the barriers, at most one a
  ppermute (compat.BARRIERS_KEEP_UPDATES_IN_PLACE; the double binary tree: 14 in its 28)."""
  copies, shape = buffer_copies(primitive, algorithm, mesh_key)
  options = {"axis_sizes": MESHES[mesh_key][0]} if algorithm == "hierarchical" else {}
  sched = jaxcoll.schedule(primitive, algorithm, 8, **options)
  transfers = sum(len(step.transfers) for step in sched.steps)
  bound = 0 if compat.BARRIERS_KEEP_UPDATES_IN_PLACE else transfers
  assert copies <= bound, f"{copies} copies of the {shape} buffer in {transfers} ppermutes"


PACKED = [(a, n) for n in (2, 8) for a in jaxcoll.algorithms("all_reduce", num_axes=1)
          if a != "native"]


@pytest.mark.parametrize("algorithm,num_devices", PACKED)
def test_a_packed_buffer_is_built_once(algorithm, num_devices):
  """A buffer concatenated from several leaves (a gradient bucket) is built by one
  concatenate, however many steps and combines read it (without the executor's barrier on
  its input, XLA fused the concatenate into the first send and the first combine: two; so
  does jax 0.10.2's XLA, barrier or not: compat.BARRIERS_KEEP_UPDATES_IN_PLACE)."""
  mesh = Mesh(np.array(jax.devices()[:num_devices]), ("x",))
  pieces = [jnp.ones((num_devices, ELEMENTS // 4), jnp.float32) for _ in range(3)]
  f = jax.jit(jax.shard_map(
      lambda *p: jaxcoll.all_reduce(jnp.concatenate([q[0] for q in p]), "x",
                                    algorithm=algorithm)[None],
      mesh=mesh, in_specs=P("x"), out_specs=P("x")))
  hlo = f.lower(*pieces).compile().as_text()
  entry = hlo[hlo.index("\nENTRY"):]
  built = re.findall(r"\n\s*%?([\w.-]*concatenate[\w.-]*) = ", entry)
  assert len(built) <= (1 if compat.BARRIERS_KEEP_UPDATES_IN_PLACE else 2), built
