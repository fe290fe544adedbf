"""Where devices are: the class of link between every two ranks of a collective.

NCCL does not ask its users to name their links; it detects them. jaxcoll prices every
message by the class of the link between its two devices, read from the devices:

- ``"process"``: both devices belong to one process (on the CPU: a memory copy; on a GPU
  host: NVLink between the GPUs one process drives; on a TPU slice: ICI).
- ``"host"``: two processes on one host (on the CPU: gloo over loopback TCP).
- ``"network"``: two hosts, or two TPU slices (``device.slice_index``: DCN).

On the CPU a multi-process job moves every message through gloo, even between two devices
of one process (measured: docs/measurements.md#multi-process-cpu-jobs), so there every
device counts as a process of its own: two devices of one host are linked "host".

A process's host is, in this order: what :func:`jaxcoll.distributed.initialize` publishes
for it when the job starts (its host name and, under ``jaxcoll.launch`` with per-rank
addresses, that address: a rank in its own network namespace is a host of its own),
exchanged once through ``jax.distributed``'s key-value store; else, in a job started with
plain ``jax.distributed.initialize``, the machine's boot id that jax's own backend published
in the same store when it started (:func:`jaxcoll._src.compat.boot_ids`: what XLA groups GPU
processes into hosts by). Both are the same table on every process (auto must pick the same
algorithm everywhere). Where neither exists the hosts are unknown: the topology then holds
both placements consistent with what is known (every process a host of its own, all on
one host; :attr:`Topology.alternatives`) and auto leaves native only for a schedule that
wins under each (:mod:`jaxcoll._src.auto.dispatch`).

Inside ``shard_map`` a trace sees only the abstract mesh (axis names and sizes), not its
devices. Unless ``jaxcoll.config(mesh=...)`` names the concrete mesh, the devices are
derived from the standard device order, the one ``jax.devices()`` and ``jax.make_mesh``
give: process-major, ``jax.device_count() // jax.process_count()`` devices per process
(:attr:`Topology.source` says which). A collective over some axes of a larger mesh runs
in many groups (one per coordinate of the other axes); a pair of ranks takes the slowest
class it has in any group, so every group prices the same and all processes agree.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import socket
from collections.abc import Sequence

import numpy as np

from jaxcoll._src import compat

PROCESS, HOST, NETWORK = "process", "host", "network"
CLASSES = (PROCESS, HOST, NETWORK)     # fastest first
MESH, PROCESS_MAJOR = "mesh", "process-major"
_KEY = "jaxcoll/host/"


@dataclasses.dataclass(frozen=True, eq=False)
class Topology:
  """Per rank of a collective (``[N, G]``: N ranks, G groups) the process and host ids of its
  device; :meth:`classes` gives the class of every message.

  ``source``: "mesh" (read from a concrete mesh's devices) or "process-major" (derived from
  the standard device order)."""

  process: np.ndarray
  host: np.ndarray
  source: str = MESH
  alternatives: tuple[Topology, ...] = ()   # other host placements, where hosts are unknown

  @functools.cached_property
  def key(self) -> tuple:
    return (self.process.shape, self.process.tobytes(), self.host.tobytes(),
            tuple(a.key for a in self.alternatives))

  def __hash__(self):
    return hash(self.key)

  def __eq__(self, other):
    return isinstance(other, Topology) and self.key == other.key

  @property
  def size(self) -> int:
    return self.process.shape[0]

  def classes(self, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    """Index into :data:`CLASSES` of the link from rank ``src[i]`` to ``dst[i]``: the
    slowest over all groups."""
    other_host = (self.host[src] != self.host[dst]).any(axis=-1)
    other_process = (self.process[src] != self.process[dst]).any(axis=-1)
    return np.where(other_host, CLASSES.index(NETWORK),
                    np.where(other_process, CLASSES.index(HOST), CLASSES.index(PROCESS)))

  @functools.cached_property
  def used(self) -> tuple[str, ...]:
    """The classes of link between some two ranks of some group, fastest first."""
    out = set()
    for g in range(self.process.shape[1]):
      hosts, pairs = self.host[:, g], set(zip(self.host[:, g], self.process[:, g]))
      out |= {NETWORK} if len(set(hosts)) > 1 else set()
      out |= {HOST} if len(pairs) > len(set(hosts)) else set()
      out |= {PROCESS} if len(pairs) < self.size else set()
    return tuple(c for c in CLASSES if c in out) or (PROCESS,)

  @property
  def label(self) -> str:
    """The classes used, and how they were found unless read from the mesh's devices:
    ``"host, process-major"``."""
    unknown = "".join(f", hosts unknown: also priced as {'+'.join(a.used)}"
                      for a in self.alternatives)
    return "+".join(self.used) + ("" if self.source == MESH else f", {self.source}") + unknown

  @property
  def span(self) -> str:
    """The slowest class any two ranks are linked by (what measured lax times are keyed by)."""
    return self.used[-1]


def single_process(n: int) -> Topology:
  """N ranks in one process (every link "process")."""
  zeros = np.zeros((n, 1), np.int64)
  return Topology(zeros, zeros, MESH)


def of_devices(devices: np.ndarray, mesh_names: Sequence[str], axes: Sequence[str]) -> Topology:
  """The topology of a collective over ``axes`` of a mesh whose devices are ``devices``
  (an array shaped as the mesh, axes ``mesh_names``). A device's host is its TPU slice and
  its process's host (:func:`hosts`); where hosts are unknown, each process is a host of its
  own, and all of a slice's processes on one host is the alternative."""
  import jax
  devices = np.asarray(devices, object)
  platform = devices.flat[0].platform
  ids = lambda attribute: np.vectorize(attribute, otypes=[np.int64])(devices)  # noqa: E731
  process = ids(lambda d: d.process_index)
  slices = ids(lambda d: int(getattr(d, "slice_index", 0) or 0) << 20)
  table = hosts(jax.process_count(), platform)
  host = slices + (process if table is None else np.asarray(table, np.int64)[process])
  if gloo_everywhere(platform, jax.process_count()):
    process = ids(lambda d: d.id)
  alternatives = () if table is not None else (
      _group(process, slices, mesh_names, axes, MESH),)
  return _group(process, host, mesh_names, axes, MESH, alternatives)


def gloo_everywhere(platform: str, process_count: int) -> bool:
  """Whether every message goes through the inter-process transport (module docstring)."""
  return platform == "cpu" and process_count > 1


def process_major(mesh_names: Sequence[str], mesh_sizes: Sequence[int], axes: Sequence[str],
                  process_count: int, device_count: int,
                  hosts: Sequence[int] | None = None, platform: str = "") -> Topology:
  """The topology of a collective over ``axes`` on a mesh laid out in the standard device
  order: flat mesh index i on process ``i // (device_count // process_count)``; process p on
  host ``hosts[p]`` (None: every process on a host of its own); on ``platform`` "cpu" with
  several processes every device a process of its own."""
  per = max(device_count // max(process_count, 1), 1)
  flat = np.arange(math.prod(mesh_sizes)).reshape(tuple(mesh_sizes))
  process = np.minimum(flat // per, process_count - 1)
  host = process if hosts is None else np.asarray(hosts, np.int64)[process]
  if gloo_everywhere(platform, process_count):
    process = flat
  alternatives = ()
  if hosts is None and process_count > 1:   # unknown: all on one host is as consistent
    alternatives = (_group(process, np.zeros_like(host), mesh_names, axes, PROCESS_MAJOR),)
  return _group(process, host, mesh_names, axes, PROCESS_MAJOR, alternatives)


def _group(process: np.ndarray, host: np.ndarray, mesh_names, axes, source,
           alternatives: tuple[Topology, ...] = ()) -> Topology:
  """Mesh-shaped ids -> ``[N, G]`` with the collective's axes (in ``axes``' order, rank
  numbering as ``lax.axis_index(axes)``) first."""
  order = [list(mesh_names).index(a) for a in axes]
  rest = [i for i in range(len(mesh_names)) if i not in order]
  n = math.prod(process.shape[i] for i in order)
  flat = lambda ids: _first_seen(np.transpose(ids, order + rest).reshape(n, -1))
  return Topology(flat(process), flat(host), source, alternatives)


def _first_seen(ids: np.ndarray) -> np.ndarray:
  """``ids`` renumbered 0, 1, ... in order of first appearance (equal placements compare
  equal whatever the devices' own ids)."""
  _, first, inverse = np.unique(ids.ravel(), return_index=True, return_inverse=True)
  rank = np.empty(len(first), np.int64)
  rank[np.argsort(first)] = np.arange(len(first))
  return rank[inverse].reshape(ids.shape)


# ------------------------------------------------------------------------- the host table

_hosts: tuple[str, ...] | None = None


def host_name() -> str:
  """What this process publishes as its host: the host name, and the address gloo binds to
  when the launcher gave one (a network namespace is a host of its own)."""
  from jaxcoll._src.launch_env import ENV_LOCAL_ADDRESS
  return f"{socket.gethostname()}/{os.environ.get(ENV_LOCAL_ADDRESS, '')}"


def exchange_hosts(client, process_id: int, num_processes: int,
                   timeout_ms: int = 60_000) -> tuple[str, ...]:
  """Publishes this process's host and waits for every other's (``jax.distributed``'s
  key-value store); sets the table :func:`hosts` returns."""
  global _hosts
  client.key_value_set(f"{_KEY}{process_id}", host_name())
  _hosts = tuple(client.blocking_key_value_get(f"{_KEY}{p}", timeout_ms)
                 for p in range(num_processes))
  return _hosts


def hosts(process_count: int, platform: str | None = None) -> tuple[int, ...] | None:
  """Host id of every process (equal ids: one host): from jaxcoll's table, else from jax's
  own boot ids (module docstring); None when neither is known."""
  if process_count <= 1:
    return (0,)
  table = _hosts if _hosts is not None and len(_hosts) == process_count else \
      _boot_ids(process_count, platform or _platform())
  if table is None:
    return None
  names = sorted(set(table))
  return tuple(names.index(h) for h in table)


@functools.cache
def _boot_ids(process_count: int, platform: str) -> tuple[str, ...] | None:
  return compat.boot_ids(process_count, platform)


def _platform() -> str:
  import jax
  return jax.devices()[0].platform


def current(axes: Sequence[str], axis_sizes: Sequence[int], mesh=None) -> Topology:
  """The topology of a collective over ``axes`` (of sizes ``axis_sizes``) traced now, on the
  enclosing shard_map's mesh (outside one: a mesh of just these axes)."""
  import jax
  abstract = jax.sharding.get_abstract_mesh()
  names, sizes = tuple(abstract.axis_names), tuple(abstract.axis_sizes)
  if not set(axes) <= set(names):
    names, sizes = tuple(axes), tuple(axis_sizes)
  return of_mesh_shape(names, sizes, axes, mesh)


def of_mesh_shape(names: Sequence[str], sizes: Sequence[int], axes: Sequence[str],
                  mesh=None) -> Topology:
  """The topology of a collective over ``axes`` of a mesh with these axis names and sizes:
  ``mesh``'s devices when it is that mesh (``jaxcoll.config(mesh=...)``), else the
  standard process-major order of this job's devices."""
  import jax
  names, sizes = tuple(names), tuple(int(s) for s in sizes)
  if mesh is not None and tuple(mesh.axis_names) == names and \
      tuple(mesh.devices.shape) == sizes:
    return of_devices(mesh.devices, names, axes)
  processes = jax.process_count()
  if processes == 1:
    return single_process(math.prod(dict(zip(names, sizes))[a] for a in axes))
  platform = jax.devices()[0].platform
  return process_major(names, sizes, axes, processes, jax.device_count(),
                       hosts(processes, platform), platform)
