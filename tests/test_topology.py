"""Link classes from where devices are (jaxcoll._src.auto.topology), and what the model does
with them: every message priced by its class, lax times used only on the span measured."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

import jaxcoll
from jaxcoll import Link, NativeTimes, Profile
from jaxcoll._src import calibrate
from jaxcoll._src.auto import cost, dispatch, topology

pytestmark = pytest.mark.quick

SLOW, FAST = Link(alpha=1.0, beta=0.0), Link(alpha=0.001, beta=0.0)


def classes(topo, pairs):
  src, dst = np.array(pairs).T
  return [topology.CLASSES[c] for c in topo.classes(src, dst)]


def test_process_major_order_gives_each_pair_its_class():
  two = topology.process_major(("x",), (8,), ("x",), 2, 8, hosts=(0, 0))
  assert classes(two, [(0, 3), (0, 4), (7, 3), (5, 5)]) == ["process", "host", "host", "process"]
  assert two.used == ("process", "host") and two.span == "host"
  apart = topology.process_major(("x",), (8,), ("x",), 2, 8, hosts=None)   # no host table
  assert classes(apart, [(0, 3), (0, 4)]) == ["process", "network"]
  four = topology.process_major(("x",), (8,), ("x",), 4, 8, hosts=(0, 0, 1, 1))
  assert classes(four, [(0, 1), (0, 2), (0, 4)]) == ["process", "host", "network"]
  assert four.used == topology.CLASSES
  assert topology.single_process(8).used == ("process",)


def test_on_the_cpu_a_multi_process_job_sends_everything_through_gloo():
  """Two devices of one process of a multi-process CPU job are linked as two processes."""
  cpu = topology.process_major(("x",), (8,), ("x",), 2, 8, (0, 0), platform="cpu")
  gpu = topology.process_major(("x",), (8,), ("x",), 2, 8, (0, 0), platform="gpu")
  assert cpu.used == ("host",) and gpu.used == ("process", "host")
  assert topology.gloo_everywhere("cpu", 2) and not topology.gloo_everywhere("cpu", 1)


def test_a_collective_over_some_axes_takes_the_slowest_class_of_every_group():
  """("node", "local") 2 x 4 on 2 processes of 4 devices: over "local" every group is inside a
  process; over "node" every pair crosses; over ("local", "node") ranks are local-major."""
  mesh = (("node", "local"), (2, 4))
  local = topology.process_major(*mesh, ("local",), 2, 8, (0, 0))
  node = topology.process_major(*mesh, ("node",), 2, 8, (0, 0))
  swapped = topology.process_major(*mesh, ("local", "node"), 2, 8, (0, 0))
  assert local.used == ("process",) and local.process.shape == (4, 2)
  assert node.used == ("host",)
  assert classes(swapped, [(0, 1), (0, 2)]) == ["host", "process"]
  # a 4 x 2 mesh split the other way: every "b" pair of a group sits in one process
  b = topology.process_major(("a", "b"), (4, 2), ("b",), 2, 8, (0, 0))
  assert b.used == ("process",)


def test_devices_of_a_concrete_mesh_are_read_directly():
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("node", "local"))
  topo = topology.of_devices(mesh.devices, mesh.axis_names, ("node", "local"))
  assert topo == topology.single_process(8) and topo.source == "mesh"


def test_every_message_is_priced_by_its_class():
  """On 2 processes a ring crosses the process boundary in every step; recursive doubling
  only in its distance-4 step: with a slow host link the model sees exactly that."""
  prof = Profile(links={"process": FAST, "host": SLOW})
  two = topology.process_major(("x",), (8,), ("x",), 2, 8, (0, 0))
  ring, rd = (jaxcoll.schedule("all_reduce", a, 8) for a in ("ring", "recursive_doubling"))
  assert cost.predict(ring, prof, ("x",), (8,), 1e3, topology=two) == pytest.approx(14 * 1.0)
  assert cost.predict(rd, prof, ("x",), (8,), 1e3, topology=two) == pytest.approx(1.0 + 0.002)
  one = topology.single_process(8)
  assert cost.predict(ring, prof, ("x",), (8,), 1e3, topology=one) == pytest.approx(0.014)
  # an axis-name link overrides the class; "*" covers a class the profile lacks
  named = Profile(links={"x": FAST, "process": SLOW})
  assert cost.predict(ring, named, ("x",), (8,), 1e3, topology=two) == pytest.approx(0.014)
  star = Profile(links={"process": FAST, "*": SLOW})
  assert cost.predict(rd, star, ("x",), (8,), 1e3, topology=two) == pytest.approx(1.002)
  # an axis named like a class is priced by its class
  assert Profile(links={"process": FAST, "host": SLOW}).link("host", "process") == FAST


def test_measured_schedules_are_priced_by_their_times_and_the_rest_no_better_than_proven():
  """A schedule the profile timed is priced by its times; every other by the model times the
  worst underestimate seen on a timed one of the primitive at that size (never below 1)."""
  prof = Profile(links={"*": Link(1e-3, 0.0)})
  ring = jaxcoll.schedule("all_reduce", "ring", 8)
  model = {label: cost.predict(s, prof, ("x",), (8,), 4096.0)
           for label, _, _, s in cost.candidate_schedules("all_reduce", (8,))}
  slow = NativeTimes("all_reduce", (8,), (1024.0, 8192.0), (5 * model["ring"],) * 2,
                     algorithm="ring")
  timed = dataclasses.replace(prof, native=(slow,))
  got = {label: t for label, *_, t in cost.schedule_times("all_reduce", timed, ("x",), (8,),
                                                            4096.0)}
  assert got["ring"] == pytest.approx(5 * model["ring"])
  for label, t in got.items():
    if label != "ring":
      assert t == pytest.approx(5 * model[label]), label
  fast = NativeTimes("all_reduce", (8,), (1024.0,), (model["ring"] / 3,), algorithm="ring")
  got = {label: t for label, *_, t in cost.schedule_times(
      "all_reduce", dataclasses.replace(prof, native=(fast,)), ("x",), (8,), 4096.0)}
  assert got["ring"] == pytest.approx(model["ring"] / 3)
  assert got["recursive_doubling"] == pytest.approx(model["recursive_doubling"])
  # times of a schedule on another number of devices are not its times here
  other = NativeTimes("all_reduce", (4,), (1024.0,), (1.0,), algorithm="ring")
  assert dataclasses.replace(prof, native=(other,)).native_times(
      "all_reduce", (8,), algorithm="ring") is None
  assert cost.predict(ring, prof, ("x",), (8,), 4096.0) == model["ring"]


def test_lax_times_price_only_the_span_they_were_measured_on():
  inside = NativeTimes("all_reduce", (8,), (1e3,), (5.0,), span="process")
  across = NativeTimes("all_reduce", (8,), (1e3,), (7.0,), span="host")
  prof = Profile(links={"*": FAST}, native=(inside, across))
  two = topology.process_major(("x",), (8,), ("x",), 2, 8, (0, 0))
  assert cost.predict_native("all_reduce", prof, ("x",), (8,), 1e3) == 5.0
  assert cost.predict_native("all_reduce", prof, ("x",), (8,), 1e3, topology=two) == 7.0
  only_inside = Profile(links={"*": FAST}, native=(inside,))   # modeled as NCCL's instead
  modeled = cost.predict_native("all_reduce", only_inside, ("x",), (8,), 1e3, topology=two)
  assert modeled == pytest.approx(min(
      cost.predict(jaxcoll.schedule("all_reduce", a, 8), only_inside, ("x",), (8,), 1e3,
                   topology=two) for a in cost.native_equivalents("all_reduce")))


def test_the_cpu_preset_holds_figures_measured_in_one_process_and_across_two():
  prof = Profile.preset("cpu")
  across = prof.for_span("host")
  assert set(dict(prof.links)) == {"process", "*"} and set(dict(across.links)) == {"host", "*"}
  network = prof.for_span("network")
  assert prof.for_span("process") is prof and network is not across
  assert {t.span for t in prof.native} == {"process"}
  assert {t.span for t in across.native} == {"host"}
  # no second host measured: the host figures, a 1 Gbit/s Ethernet prior for the link
  # between hosts, and no lax times (priced as NCCL would run them)
  assert network.native == () and network.link("x", "network") == Link(50e-6, 8e-9)
  assert network.link("x", "host") == across.link("x", "host")
  assert (network.mu, network.nu, network.fresh) == (across.mu, across.nu, across.fresh)
  ring = jaxcoll.schedule("all_reduce", "ring", 8)
  cpu = topology.process_major(("x",), (8,), ("x",), 2, 8, (0, 0), platform="cpu")
  for nbytes in (1 << 10, 1 << 20):     # gloo costs more than a copy in one process
    assert cost.predict(ring, prof, ("x",), (8,), nbytes, topology=cpu) > \
        cost.predict(ring, prof, ("x",), (8,), nbytes)
  timed = {(t.algorithm, t.span) for t in prof.native + across.native}
  assert {("ring", "process"), ("binomial_tree", "host"), ("native", "host")} <= timed
  assert prof.basis == "cpu" and Profile.from_json(prof.to_json()) == prof
  # 2 devices across processes: one set of times (a 2-process job's, calibrate_cpu.py's
  # "pairs"), the lax collective and every fitted schedule, none shadowed by another
  pairs = [(t.primitive, t.algorithm) for t in across.native if t.axis_sizes == (2,)]
  assert len(pairs) == len(set(pairs))
  assert {("all_reduce", a.name) for a in calibrate.fit_algorithms(1)
          if a.primitive == "all_reduce"} | {("all_reduce", "native")} <= set(pairs)
  # every figure is one calibrate fitted: a codec for compressed wires in every span
  assert all(p.codec > 0 for p in (prof, across, network))


def test_a_profile_picks_the_figures_of_the_span_a_call_uses():
  inside = Profile(links={"*": FAST}, name="inside")
  across = Profile(links={"*": SLOW}, name="across")
  prof = dataclasses.replace(inside, spans={"host": across})
  assert [prof.for_span(c).name for c in topology.CLASSES] == ["inside", "across", "across"]
  rd = jaxcoll.schedule("all_reduce", "recursive_doubling", 8)
  gpu = topology.process_major(("x",), (8,), ("x",), 2, 8, (0, 0), platform="gpu")
  assert cost.predict(rd, prof, ("x",), (8,), 1e3, topology=gpu) == pytest.approx(3.0)
  assert cost.predict(rd, prof, ("x",), (8,), 1e3) == pytest.approx(0.003)
  with pytest.raises(ValueError, match="Profile spans: 'process'"):
    Profile(spans={"process": across})


def test_auto_on_two_processes_prices_the_process_boundary():
  """The cpu preset on a flat 8-device axis over 2 processes: a schedule at 16 KiB (the
  measured lax time across processes is far above a tree's), native at 16 MiB."""
  prof = Profile.preset("cpu")
  two = topology.process_major(("x",), (8,), ("x",), 2, 8, (0, 0), platform="cpu")
  small = dispatch.choose("all_reduce", ("x",), (8,), 16 << 10, prof, topology=two)
  large = dispatch.choose("all_reduce", ("x",), (8,), 16 << 20, prof, topology=two)
  assert small.algorithm != "native" and large.algorithm == "native"
  # the same names and sizes in one process keep native at 16 KiB
  assert dispatch.choose("all_reduce", ("x",), (8,), 16 << 10, prof).algorithm == "native"


def network_share(algorithm: str) -> float:
  """What an all_reduce of 8 ranks sends from ranks 0-3 to ranks 4-7 (one direction of the
  link between two hosts of 4), as a fraction of the buffer."""
  sched = jaxcoll.schedule("all_reduce", algorithm, 8)
  rows = sum(count * t.send.width * int(np.sum((t.src < 4) & (t.dst >= 4)))
             for step, count in sched.steps.runs() for t in step.transfers)
  return rows / sched.num_chunks


@pytest.mark.parametrize("nbytes", [1 << 20, 4 << 20, 12 << 20])
def test_across_two_cpu_hosts_auto_ships_fewer_bytes_over_the_network(nbytes):
  """The cpu preset on a flat 8-device axis over two hosts (4 devices each, gloo): auto
  picks a schedule that puts less across the network than the ring's 1.75 M a direction
  (measured on the emulated 250 Mbit link: halving-doubling 160 ms for 4 MiB where the ring
  and the lax collective took 238, benchmarks/bench_vs_ddp.py --netns). Two ranks, one per
  host: every algorithm ships M each way, and the lax collective is kept."""
  prof = Profile.preset("cpu")
  apart = topology.process_major(("x",), (8,), ("x",), 2, 8, (0, 1), platform="cpu")
  pick = dispatch.choose("all_reduce", ("x",), (8,), nbytes, prof, topology=apart).algorithm
  assert pick != "native"
  assert network_share(pick) < 0.7 * network_share("ring") == pytest.approx(0.7 * 1.75)
  pair = topology.process_major(("x",), (2,), ("x",), 2, 2, (0, 1), platform="cpu")
  assert dispatch.choose("all_reduce", ("x",), (2,), nbytes, prof,
                         topology=pair).algorithm == "native"


def test_where_hosts_are_unknown_both_placements_are_kept():
  """No host table and no boot ids: each process its own host (network) is what the links
  say, and all processes on one host is kept beside it."""
  apart = topology.process_major(("x",), (8,), ("x",), 2, 8, hosts=None, platform="cpu")
  (together,) = apart.alternatives
  assert apart.used == ("host", "network") and together.used == ("host",)
  assert "hosts unknown: also priced as host" in apart.label
  known = topology.process_major(("x",), (8,), ("x",), 2, 8, hosts=(0, 0), platform="cpu")
  assert known.alternatives == () and known == together
  assert topology.single_process(8).alternatives == ()
  assert apart != together and hash(apart) != hash(known)   # alternatives are in the key


def pair_profile(network: float, host: float, native_network: float, native_host: float):
  """A flat axis of 8 on 2 processes; links per class, and lax times measured per span."""
  times = lambda span, s: NativeTimes("all_reduce", (8,), (1.0, 1e9), (s, s), span=span)  # noqa
  return Profile(links={"process": FAST, "host": Link(host, 0.0), "network": Link(network, 0.0)},
                 native=(times("host", native_host), times("network", native_network)))


def test_auto_leaves_native_only_for_a_schedule_that_wins_under_every_placement():
  """Recursive doubling's 3 steps against a measured lax time: across hosts it wins (0.03 s
  against 0.1 s), on one host it loses (0.3 s against 0.1 s). Unknown hosts: native; known
  to be apart: the schedule; a schedule that wins in both placements is taken unknown too."""
  prof = pair_profile(network=0.01, host=0.1, native_network=0.1, native_host=0.1)
  unknown = topology.process_major(("x",), (8,), ("x",), 2, 8, None, platform="gpu")
  (one_host,) = unknown.alternatives
  apart = topology.process_major(("x",), (8,), ("x",), 2, 8, (0, 1), platform="gpu")
  choose = lambda topo, p=prof: dispatch.choose("all_reduce", ("x",), (8,), 1e3, p,  # noqa
                                                topology=topo).algorithm
  assert choose(apart) != "native" and choose(one_host) == "native"
  assert choose(unknown) == "native"
  both = pair_profile(network=0.01, host=0.01, native_network=0.1, native_host=0.1)
  assert choose(unknown, both) == choose(apart, both) != "native"
  weighed = dispatch.candidates("all_reduce", ("x",), (8,), 1e3, prof, topology=unknown)
  native, *scheduled = weighed
  assert len(native.placed_s) == 2 and all(len(c.placed_s) == 2 for c in scheduled)
  rd = next(c for c in scheduled if c.label == "recursive_doubling")
  assert rd.placed_s[0] < native.placed_s[0] / 1.25 and rd.placed_s[1] > native.placed_s[1]
  assert not dispatch.replaces(rd.placed_s, native.placed_s)


def test_boot_ids_are_read_from_the_topology_protobuf():
  """jax's LocalTopologyProto: field 1 the node id (varint), field 2 the boot id (string),
  field 3 the devices (messages, which may hold strings of their own)."""
  from jaxcoll._src import compat
  device = b"\x08\x01\x20\x01\x42\x03cpu\x4a\x0fCpuDevice(id=1)"
  proto = b"\x08\x07\x12\x24" + b"0123456789abcdef0123456789abcdef0123" + \
      b"\x1a" + bytes([len(device)]) + device
  assert compat._proto_string(proto, field=2) == "0123456789abcdef0123456789abcdef0123"
  assert compat._proto_string(b"\x12\x00", field=2) == ""
  assert compat._proto_string(b"\x08\x96\x01", field=2) is None   # only a long varint
  assert compat.boot_ids(2, "cpu") is None     # no jax.distributed job in this process
