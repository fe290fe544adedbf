"""One rank of the multi-process tests (tests/test_multiprocess.py starts it with jaxcoll.launch).

  mp_worker.py collectives   every algorithm of every primitive over ("process", "local"),
                             and each axis alone, equals lax on this rank's devices
  mp_worker.py fail          rank 1 raises after joining; rank 0 waits in a collective
  mp_worker.py topology      link classes read from the devices of the two processes
  mp_worker.py plain_topology  the same in a job joined by jax.distributed.initialize alone:
                             hosts from the boot ids jax's own backend published
  mp_worker.py plain_moe_sorted  the sorted MoE layout's training step across the two
                             processes of such a job equals the dense reference
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

if sys.argv[1].startswith("plain"):   # as most jobs start: jax.distributed alone
  import jax
  jax.distributed.initialize(coordinator_address=os.environ["JAXCOLL_COORDINATOR"],
                             num_processes=int(os.environ["JAXCOLL_NUM_PROCESSES"]),
                             process_id=int(os.environ["JAXCOLL_PROCESS_ID"]))
else:
  from jaxcoll import distributed
  distributed.initialize()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxcoll  # noqa: E402
from tests.helpers import call, call_lax, input_length  # noqa: E402

PRIMITIVES = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "reduce",
              "shift")


def run(mesh, body, x):
  """``body`` on every device; returns this process's rows (one per local device, in order)."""
  spec = P(mesh.axis_names)
  f = jax.jit(jax.shard_map(
      lambda v: jax.tree.map(lambda o: o[None], body(jax.tree.map(lambda i: i[0], v))),
      mesh=mesh, in_specs=spec, out_specs=spec))
  rows = _local_rows(mesh)
  out = f(jax.tree.map(lambda a: jax.make_array_from_process_local_data(
      NamedSharding(mesh, spec), a[rows]), x))
  return jax.tree.map(lambda a: np.concatenate(
      [np.asarray(s.data) for s in sorted(a.addressable_shards, key=lambda s: s.index[0].start)]),
      out)


def _local_rows(mesh):
  """Rows of the global [devices, ...] input that live on this process, in mesh order."""
  flat = list(mesh.devices.flat)
  return [i for i, d in enumerate(flat) if d.process_index == jax.process_index()]


def collectives() -> None:
  assert jax.process_count() == 2 and jax.device_count() == 8, (jax.process_count(),
                                                                jax.device_count())
  mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("process", "local"))
  checked = 0
  for axes in (("process", "local"), ("process",), ("local",)):
    n = int(np.prod([dict(mesh.shape)[a] for a in axes]))
    over = axes if len(axes) > 1 else axes[0]
    cases = [(p, a) for p in PRIMITIVES for a in jaxcoll.algorithms(p, num_axes=len(axes))]
    rng = np.random.default_rng(n)
    xs = {p: rng.integers(-8, 8, (mesh.size, input_length(p, n, 6))).astype(np.float32)
          for p in PRIMITIVES}
    root = n - 1   # on the second process when the group spans both
    got = run(mesh, lambda v, over=over, root=root, cases=cases: {
        f"{p}/{a}": call(p, v[p], over, a, root) for p, a in cases}, xs)
    want = run(mesh, lambda v, over=over, root=root: {
        p: call_lax(p, v[p], over, root) for p in PRIMITIVES}, xs)
    for p, a in cases:
      np.testing.assert_array_equal(got[f"{p}/{a}"], want[p], err_msg=f"{p} {a} over {axes}")
      checked += 1
  print(f"rank {jax.process_index()}: {checked} (primitive, algorithm, axes) cases equal lax",
        flush=True)


def fail() -> None:
  if jax.process_index() == 1:
    raise ValueError("rank 1 fails on purpose")
  mesh = Mesh(np.array(jax.devices()), ("x",))
  x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("x")),
                                             np.ones((4, 1), np.float32))
  jax.jit(jax.shard_map(lambda v: jaxcoll.all_reduce(v, "x", algorithm="ring"), mesh=mesh,
                        in_specs=P("x"), out_specs=P("x")))(x).block_until_ready()
  raise AssertionError("rank 0 finished a collective its peer never joined")


def topology() -> None:
  """The link classes read from the devices across two processes on one host."""
  from jaxcoll._src.auto import topology as topo
  assert topo.hosts(2) == (0, 0), topo._hosts               # both ranks on this host
  devices = np.array(jax.devices())
  flat = Mesh(devices, ("x",))
  mine = topo.of_devices(flat.devices, ("x",), ("x",))
  assert mine == topo.process_major(("x",), (8,), ("x",), 2, 8, (0, 0), "cpu")
  assert mine.used == ("host",)     # on the CPU every message of the job goes through gloo
  # one device of each process in turn: not the standard order
  mixed = Mesh(devices.reshape(2, 4).T.reshape(8), ("x",))
  seen = {}

  def body(v):
    seen["default"] = topo.current(("x",), (8,))
    with jaxcoll.config(mesh=mixed):
      seen["given"] = topo.current(("x",), (8,), jaxcoll._src.config.current().mesh)
      return jaxcoll.all_reduce(v, "x")
  x = jax.make_array_from_process_local_data(NamedSharding(mixed, P("x")),
                                             np.ones((4, 3), np.float32))
  y = jax.jit(jax.shard_map(body, mesh=mixed, in_specs=P("x"), out_specs=P()))(x)
  np.testing.assert_array_equal(np.asarray(y.addressable_data(0)), np.full((1, 3), 8.0))
  assert seen["default"].source == "process-major" and seen["default"] == mine
  given = topo.of_devices(mixed.devices, ("x",), ("x",))
  assert seen["given"] == given and seen["given"].source == "mesh"
  assert given == mine       # on the CPU every device is a gloo endpoint: the order is moot
  why = jaxcoll.explain("all_reduce", jax.ShapeDtypeStruct((4096,), np.float32), flat, "x")
  assert why.links == "host, process-major", why.links
  # one decision: a traced call, explain, the debug log and jaxcoll-bench name the same pick
  # under a profile that holds cross-process lax times ("cpu": its "host" span)
  from tests.helpers import auto_disagreements
  two = Mesh(devices.reshape(2, 4), ("process", "local"))
  disagree = auto_disagreements(two, "cpu")
  assert not disagree, "\n".join(disagree)
  print(f"rank {jax.process_index()}: topology ok", flush=True)


def plain_topology() -> None:
  """No jaxcoll table: the hosts come from jax's own topology exchange (one boot id)."""
  from jaxcoll._src import compat
  from jaxcoll._src.auto import topology as topo
  assert topo._hosts is None
  jax.devices()   # the backend up: its topology exchange done
  ids = compat.boot_ids(2, "cpu")
  with open("/proc/sys/kernel/random/boot_id") as f:
    assert ids == (f.read().strip(),) * 2, ids
  topology()


def plain_moe_sorted() -> None:
  """The sorted MoE layout across the process boundary in a job joined by
  jax.distributed.initialize alone: a training step's outputs, drops and gradients equal
  the dense reference (tests/test_moe_sorted.py's)."""
  import jax.numpy as jnp

  from jaxcoll import moe
  from tests.test_moe_sorted import D, dense, kept_pairs, routed

  axes = ("process", "local")
  mesh = Mesh(np.array(jax.devices()).reshape(2, 4), axes)
  n, e, k, t, factor = 8, 16, 2, 12, 1.25
  x, ids, gates, w = routed(n, t, e, k, 3.0, seed=11)
  kept = kept_pairs(ids, e, int(np.ceil(factor * t * k)))
  assert (~kept).sum() > 0   # the bound bites

  def step(v):
    def loss(xb, wb):
      h, state = moe.dispatch(xb, v["ids"], num_experts=e, capacity=None, axis_name=axes,
                              layout="sorted", buffer_factor=factor)
      out = moe.combine(jnp.tanh(moe.grouped_matmul(h, wb, state.group_sizes)), state,
                        v["gates"])
      return jnp.sum(jnp.sin(out)), (out, moe.total_dropped(state))
    (_, (out, dropped)), grads = jax.value_and_grad(loss, (0, 1), has_aux=True)(v["x"], v["w"])
    return {"out": out, "dropped": dropped, "gx": grads[0], "gw": grads[1]}

  got = run(mesh, step, {"x": x, "ids": ids, "gates": gates,
                         "w": w.reshape(n, e // n, D, D)})
  rows = _local_rows(mesh)
  want = dense(x, w, ids, gates, kept)
  gx, gw = jax.grad(lambda x, w: jnp.sum(jnp.sin(dense(x, w, ids, gates, kept))), (0, 1))(x, w)
  np.testing.assert_allclose(got["out"], np.asarray(want)[rows], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(got["gx"], np.asarray(gx)[rows], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(got["gw"], np.asarray(gw).reshape(n, e // n, D, D)[rows],
                             rtol=1e-5, atol=1e-5)
  assert set(got["dropped"].tolist()) == {int((~kept).sum())}, got["dropped"]
  print(f"rank {jax.process_index()}: sorted moe ok, {int((~kept).sum())} dropped", flush=True)


if __name__ == "__main__":
  {"collectives": collectives, "fail": fail, "topology": topology,
   "plain_topology": plain_topology, "plain_moe_sorted": plain_moe_sorted}[sys.argv[1]]()
