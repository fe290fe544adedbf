"""Every difference between the supported jax versions, and every private jax name jaxcoll
uses where no public one exists, in one place.

Supported: jax/jaxlib 0.10.2 (what Python 3.11 resolves) through 0.12.x (Python 3.12+).
``tests/test_compat.py`` checks each private name below on the running jax, so a release
that moves one fails there first, loudly, instead of somewhere deep in a collective.

- ``trace_state_clean``: whether no transformation (jit, shard_map, vmap, grad) is tracing.
  No public API says so; ``jax._src.core.trace_state_clean`` on both versions.
- ``register_gloo_cpu_backend``: a CPU backend whose gloo transport binds to and advertises
  a given address. jax offers no flag for the address (its own factory passes no host
  name), so this rebuilds the factory from ``jax._src.xla_bridge`` and
  ``jax._src.lib._jax.make_gloo_tcp_collectives``, the same on both versions.
- ``distributed_client``: ``jax.distributed``'s client, whose key-value store
  (``key_value_set``, ``blocking_key_value_get``) carries the host table of
  :mod:`topology`; ``jax._src.distributed.global_state.client`` on both versions.
- ``custom_jvp_rule``: the jaxpr of a ``custom_jvp_call``'s rule (``jvp_jaxpr_fun``), for
  ``jaxcoll.use`` to run the user's rule through its own evaluator.
- ``in_backward``: whether autodiff's transpose made an equation (its name stack).
- ``source_line``, ``equation_config``: where an equation came from
  (``jax._src.source_info_util.summarize``) and the threefry mode it was traced under
  (``eqn.ctx``), for ``jaxcoll.use`` running a global program per device.
- ``jit_arguments``: which arguments a ``jax.jit``-wrapped function takes as static and
  which it donates (``static_argnums``/``static_argnames``/``donate_argnums``/
  ``donate_argnames`` of its ``_jit_info``, the same on both versions; no public accessor),
  so that ``jaxcoll.use(jitted)`` passes Python numbers as jit does.
- ``vmap_spmd_axes``: the mesh axes an enclosing ``jax.vmap(..., spmd_axis_name=...)`` maps
  its batch over (``jax._src.core.get_axis_env().spmd_axis_names``, both versions): a
  shard_map under such a vmap may not name them in its ``in_specs``.
- ``boot_ids``: each process's machine, from the topology jax's own backend published in
  that store (``<platform>:local_topology/<platform>/<process>``), for jobs started with
  plain ``jax.distributed.initialize``.

``replicated.py``'s primitive uses jax's extension API (``jax.extend.core.Primitive``,
``jax.interpreters.ad/batching/mlir``), the same on both versions and pinned by
``tests/test_replicated.py``.

- ``REMAT_COLLECTIVES_STAY_SEPARATE``: whether XLA keeps a collective that backward
  recomputes (behind a ``lax.optimization_barrier``) apart from its forward twin. jaxlib
  0.12's CPU compiler does; 0.10.2's merges the two, so every layer's gathered parameters
  stay live from forward to backward (``jaxcoll.fsdp.layer``'s memory;
  ``tests/test_fsdp.py`` measures both).
- ``BARRIERS_KEEP_UPDATES_IN_PLACE``: whether the executor's optimization barriers keep XLA
  from copying the whole buffer between unrolled steps (:mod:`executor`). jaxlib 0.12's CPU
  compiler keeps every update in place; 0.10.2's still copies the buffer where it did
  without them (up to one copy a step; ``tests/test_executor.py`` holds each version to
  its figure). The same holds for the barrier on the buffer as it comes in: 0.12 builds a
  packed buffer once, 0.10.2 still builds it for the first send and the first combine
  apart (two concatenates).
- ``BARRIERS_ORDER_COLLECTIVES``: whether a collective whose operand passed a
  ``lax.optimization_barrier`` beside another collective's result stays after it. jaxlib
  0.12's CPU compiler keeps the order; 0.10.2's drops the barrier's unused operand and
  combines the two all-reduces into one (``sync_gradients``' lax buckets then reduce
  together, as before; ``tests/test_training.py`` holds each version to its count).
- ``GLOO_REDUCES_OPERANDS_TOGETHER``: whether the CPU runtime runs a combined (many-operand)
  all-reduce across processes as one exchange. jaxlib 0.12's does (200 gradient leaves,
  2 processes over gloo: 29 ms, ``benchmarks/bench_grad_sync.py --processes 2``); 0.10.2's
  runs one gloo all-reduce per operand (1,141 ms), so there ``sync_gradients`` packs.

- ``shard_map_specs_after``: a ``jax.shard_map`` whose ``out_specs`` are known only once
  its body is traced. ``jax.shard_map`` reads ``out_specs`` after it traces the body (to
  broadcast them over the outputs, ``f_wrapped`` in ``jax/_src/shard_map.py``, both
  versions), so a list the body fills as it runs serves; ``tests/test_compat.py`` pins it.
  ``jaxcoll.use`` thus traces a global program once, not once to learn where its outputs
  fall and again to run it.

Where the versions behave differently rather than name things differently, the module that
depends on it says so and adapts in a form both accept: ``axes.ppermute_args`` (jax 0.12
refuses a tuple of axes out of mesh order in ``lax.ppermute``; 0.10.2 reads its
permutation in mesh order whatever the tuple's order).
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
import os
import re

import jax

OLDEST = (0, 10, 2)
NEWEST_MINOR = (0, 12)      # the newest minor release the tests ran on (pyproject caps below)


def _version(text: str) -> tuple[int, ...]:
  return tuple(int(p) for p in re.findall(r"\d+", text)[:3])


JAX_VERSION_TEXT = jax.__version__   # as jax prints it, for messages
JAX_VERSION = _version(JAX_VERSION_TEXT)
REMAT_COLLECTIVES_STAY_SEPARATE = JAX_VERSION >= (0, 12)
BARRIERS_KEEP_UPDATES_IN_PLACE = JAX_VERSION >= (0, 12)
BARRIERS_ORDER_COLLECTIVES = JAX_VERSION >= (0, 12)
GLOO_REDUCES_OPERANDS_TOGETHER = JAX_VERSION >= (0, 12)
# jax 0.12's pallas_call registers Triton's GPU lowering only (Mosaic GPU kernels go through
# plgpu.kernel there); jax 0.10's lowers a pallas_call with Mosaic GPU compiler params
PALLAS_CALL_LOWERS_MOSAIC_GPU = JAX_VERSION < (0, 12)


def trace_state_clean() -> bool:
  """True outside every jax transformation (jit, shard_map, vmap, grad)."""
  from jax._src import core
  return core.trace_state_clean()


def register_gloo_cpu_backend(hostname: str) -> None:
  """Makes the CPU backend's gloo collectives bind to and advertise ``hostname``.

  Call after ``jax.config.update("jax_cpu_collectives_implementation", "gloo")`` and before
  ``jax.distributed.initialize``; the factory runs when jax first creates the CPU backend,
  by which time the distributed client exists.
  """
  from jax._src import distributed, xla_bridge
  from jax._src.lib import _jax

  def make_cpu_client():
    collectives = _jax.make_gloo_tcp_collectives(
        distributed_client=distributed.global_state.client, hostname=hostname)
    return xla_bridge.make_cpu_client(collectives=collectives)

  xla_bridge.register_backend_factory("cpu", make_cpu_client, priority=0, fail_quietly=False)


def distributed_client():
  """``jax.distributed``'s client (None outside a multi-process job)."""
  from jax._src import distributed
  return distributed.global_state.client


def boot_ids(process_count: int, platform: str) -> tuple[str, ...] | None:
  """Every process's boot id as jax's own topology exchange recorded it, or None.

  When a multi-process backend starts, each process publishes a ``LocalTopologyProto``
  (field 1 its node id, field 2 the machine's boot id, ``/proc/sys/kernel/random/boot_id``)
  in ``jax.distributed``'s key-value store under
  ``"<platform>:local_topology/<platform>/<process>"``; XLA itself groups processes into
  hosts by it (``slice_index`` on GPUs). Read without waiting: the keys exist once the
  backend is up, which any trace has already needed. Same keys on jax 0.10.2 and 0.12."""
  client = distributed_client()
  if client is None or process_count <= 1:
    return None
  prefix = f"{platform}:local_topology/{platform}/"
  try:
    found = dict(client.key_value_dir_get_bytes(prefix))
  except (RuntimeError, AttributeError):   # no store, or no such keys on this platform
    return None
  ids = []
  for p in range(process_count):
    proto = found.get(f"{prefix}{p}")
    boot = None if proto is None else _proto_string(bytes(proto), field=2)
    if not boot:
      return None
    ids.append(boot)
  return tuple(ids)


def _proto_string(data: bytes, field: int) -> str | None:
  """The first length-delimited ``field`` of a serialized protobuf message, as text."""
  i = 0
  while i < len(data):
    key, i = _varint(data, i)
    number, kind = key >> 3, key & 7
    if kind == 0:
      _, i = _varint(data, i)
    elif kind == 2:
      length, i = _varint(data, i)
      if number == field:
        return data[i:i + length].decode("utf-8", "replace")
      i += length
    elif kind in (1, 5):
      i += 8 if kind == 1 else 4
    else:
      return None
  return None


def _varint(data: bytes, i: int) -> tuple[int, int]:
  value = shift = 0
  while True:
    byte = data[i]
    value |= (byte & 0x7F) << shift
    i += 1
    if not byte & 0x80:
      return value, i
    shift += 7


def open_jaxpr(sub) -> tuple[object, list]:
  """A higher-order primitive's sub-jaxpr as ``(jaxpr, consts)``: jax 0.10 stores a
  ``ClosedJaxpr`` (consts beside it), jax 0.12 an open ``Jaxpr`` whose consts were hoisted
  into its inputs."""
  if hasattr(sub, "consts"):
    return sub.jaxpr, list(sub.consts)
  if sub.constvars:
    raise NotImplementedError(f"a sub-jaxpr with {len(sub.constvars)} constvars and no values")
  return sub, []


def sub_jaxprs(params) -> list:
  """The jaxprs among an equation's params (closed on jax 0.10, open on 0.12), in params
  order: :func:`open_jaxpr` reads each."""
  out = []
  for v in params.values():
    for j in (v if isinstance(v, (tuple, list)) else (v,)):
      if hasattr(j, "eqns") or hasattr(getattr(j, "jaxpr", None), "eqns"):
        out.append(j)
  return out


def custom_jvp_rule(params) -> tuple[object, list, list[bool]]:
  """A ``custom_jvp_call`` equation's rule as a jaxpr: ``(jaxpr, consts, out_zeros)``, the
  jaxpr taking the primals (after the ``num_consts`` leading consts) then every tangent
  (none symbolically zero). ``params["jvp_jaxpr_fun"]`` (a ``lu.WrappedFun`` of the
  tangents' zero flags) on both versions, as ``jax._src.custom_derivatives.lift_jvp`` calls
  it."""
  fun = params["jvp_jaxpr_fun"]
  n = len(open_jaxpr(params["call_jaxpr"])[0].invars) - params["num_consts"]
  jaxpr, consts, out_zeros = fun.call_wrapped(*[False] * n)
  return jaxpr, list(consts), list(out_zeros)


LIBRARIES = ("optax", "flax", "chex", "jaxcoll")   # frames a report looks past


def in_backward(eqn) -> bool:
  """Whether JAX's autodiff made ``eqn`` by transposing (``jax.grad``, ``jax.vjp``): its name
  stack, relative to the jaxpr it is in, reads ``transpose(...)`` (``eqn.source_info.
  name_stack``, the names jax's profiler shows; the same on both versions)."""
  return "transpose" in str(eqn.source_info.name_stack)


def source_line(eqn) -> str:
  """Where the user's code made ``eqn``, for reports and errors: the innermost frame outside
  jax (``file:line:col (function)``); where that frame is a library's (optax, flax, chex,
  jaxcoll: an optimizer's moment update, a flax layer), the first frame outside them too,
  with the library's beside it: ``"train.py:12:9 (step) via optax/tree_utils/
  _tree_math.py:398:10 (tree_update_moment.<locals>.<lambda>)"``. jax's own
  ``source_info_util.user_frames`` (the frames jax counts as its users') on both versions."""
  from jax._src import source_info_util
  frames = list(itertools.islice(source_info_util.user_frames(eqn.source_info.traceback),
                                 64))
  if not frames:
    return source_info_util.summarize(eqn.source_info)
  inner = frames[0]
  if _library(inner.file_name) is None:
    return _frame(inner)
  user = next((f for f in frames if _library(f.file_name) is None), None)
  library = _frame(inner, _library(inner.file_name))
  return library if user is None else f"{_frame(user)} via {library}"


def _library(path: str) -> str | None:
  """The folder of the installed library of :data:`LIBRARIES` that holds ``path`` (None:
  the user's). Known by where the package is installed, never by a folder's name: a script
  in ``~/optax/`` or a clone of jaxcoll into ``jaxcoll/`` is the user's."""
  path = os.path.realpath(path)
  return next((root for root in _library_roots()
               if os.path.commonpath((path, root)) == root), None)


@functools.cache
def _library_roots() -> tuple[str, ...]:
  """The package folders of the installed libraries of :data:`LIBRARIES`
  (``importlib.util.find_spec``; none is imported here)."""
  roots = []
  for name in LIBRARIES:
    try:
      spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
      continue
    roots += [os.path.realpath(f) for f in (spec and spec.submodule_search_locations) or ()]
  return tuple(roots)


def _frame(frame, library: str | None = None) -> str:
  """``file:line:col (function)``; a library's file (``library``: its package's folder)
  from that folder's name (``optax/tree_utils/_tree_math.py``)."""
  path = frame.file_name
  if library is not None:
    path = os.path.relpath(os.path.realpath(path), os.path.dirname(library))
  return f"{path}:{frame.start_line}:{frame.start_column} ({frame.function_name})"


def _eqn_setting(eqn, name: str):
  """The value of config ``jax_<name>`` ``eqn`` was traced with: an attribute of
  ``eqn.ctx`` up to jax 0.12.0, a tuple ``eqn.ctx.configs`` beside
  ``config.jaxpr_eqn_ctx_names()`` from 0.12.1."""
  if hasattr(eqn.ctx, name):
    return getattr(eqn.ctx, name)
  from jax._src import config as jax_config
  return dict(zip(jax_config.jaxpr_eqn_ctx_names(), eqn.ctx.configs))[f"jax_{name}"]


def threefry_partitionable(eqn) -> bool:
  """Whether ``eqn`` was traced with ``jax_threefry_partitionable`` (its random bits are a
  hash of each element's position, drawn piece by piece alike)."""
  return bool(_eqn_setting(eqn, "threefry_partitionable"))


def equation_config(eqn):
  """A context that traces as ``eqn`` was traced, except for the mesh: the threefry mode
  (random bits differ by it), which ``eqn.ctx.manager`` also sets along with the equation's
  own abstract mesh, wrong inside a shard_map that runs it per device."""
  return jax.threefry_partitionable(threefry_partitionable(eqn))


def shard_map_specs_after(body, *, mesh, in_specs, axis_names=None):
  """``jax.shard_map`` of ``body``, which returns ``(outputs, out_specs)``: a list of
  outputs and their PartitionSpecs, known only as it is traced (module docstring)."""
  specs: list = []

  def run(*args):
    outs, learned = body(*args)
    specs[:] = list(learned)
    return list(outs)

  kw = {} if axis_names is None else {"axis_names": set(axis_names)}
  return jax.shard_map(run, mesh=mesh, in_specs=in_specs, out_specs=specs, check_vma=False,
                       **kw)


def scan_counts(params) -> tuple[int, int]:
  """``(num_consts, num_carry)`` of a scan equation: jax 0.10 names them; jax 0.12 keeps
  ``ft_in``, a ``jax._src.flattree.FlatTree`` of ``(consts, carry, xs)``: an ``FTTuple``
  of three FlatTrees (``len``: flat inputs) or an ``FTPyTree`` whose treedef has three
  children."""
  if "num_consts" in params:
    return params["num_consts"], params["num_carry"]
  ft = params["ft_in"]
  if hasattr(ft, "elts"):
    consts, carry, _ = ft.elts
    return len(consts), len(carry)
  consts, carry, _ = ft.tree.children()
  return consts.num_leaves, carry.num_leaves


def jit_arguments(fun) -> tuple[frozenset, frozenset, frozenset, frozenset] | None:
  """``(static positions, static names, donated positions, donated names)`` of a function
  ``jax.jit`` wrapped; None for any other callable."""
  info = getattr(fun, "_jit_info", None)
  if info is None:
    return None
  return (frozenset(info.static_argnums), frozenset(info.static_argnames),
          frozenset(info.donate_argnums), frozenset(info.donate_argnames))


def vmap_spmd_axes() -> frozenset:
  """The mesh axes enclosing ``jax.vmap`` calls map their batch over (``spmd_axis_name``)."""
  from jax._src import core
  return frozenset(core.get_axis_env().spmd_axis_names)


_BACKEND_OF_PLATFORM = {"cuda": "gpu", "rocm": "gpu"}   # jax.default_backend()'s names


def target_backend() -> str:
  """The backend the program being traced is for: the platform of the abstract mesh in use
  when it names one (``jax.sharding.use_abstract_mesh(AbstractMesh(...,
  abstract_device=AbstractDevice(platform="cuda", ...)))``, to lower for a GPU this machine
  lacks), as ``jax.default_backend()`` names it ("gpu" for cuda and rocm); else
  ``jax.default_backend()``. Every choice jaxcoll makes by backend (the Pallas kernel or its
  interpreter, the ragged_dot path, auto's preset and whether a profile is trusted) reads
  it, so a program lowered for a GPU is the program a GPU would run."""
  device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
  platform = getattr(device, "platform", None)
  if platform is None:
    return jax.default_backend()
  return _BACKEND_OF_PLATFORM.get(platform, platform)
