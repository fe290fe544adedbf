"""Bad input across the public API, property-based: every invalid value of every argument is a
ValueError or TypeError raised at trace time whose message names the argument, never a hang,
a wrong answer or an error from deep inside; and valid edge values (empty arrays, 0-d,
lengths the axis does not divide, one device, one-element axes) give lax's answer, with and
without a wire format.

Runs on every supported jax (the quick subset)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from helpers import AXIS, mesh
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcoll
from jaxcoll import fsdp, moe

pytestmark = pytest.mark.quick

N = 8
X = np.zeros((N, 16), np.float32)   # 16 values per device: every collective's layout fits


def trace(fn, n: int = N, x=X):
  """Traces ``fn(this device's row)`` inside shard_map over n devices; nothing runs."""
  f = jax.shard_map(lambda v: fn(v[0]), mesh=mesh(n), in_specs=P(AXIS), out_specs=P(),
                    check_vma=False)
  return jax.make_jaxpr(f)(x[:n])


def refused(call, argument: str):
  """``call()`` raises ValueError or TypeError, and its message names ``argument``."""
  with pytest.raises((ValueError, TypeError)) as info:
    call()
  message = str(info.value)
  assert re.search(rf"(?<![\w]){re.escape(argument)}(?![\w])", message), message
  return message


# ------------------------------------------------------------------ invalid values

def _is_dtype(text: str) -> bool:
  try:
    np.dtype(getattr(ml_dtypes, text, text))
    return True
  except (TypeError, ValueError, SyntaxError, AssertionError):
    return False


NOT_A_STRING = st.one_of(st.integers(-5, 5), st.floats(allow_nan=False, width=32), st.none(),
                         st.tuples(st.integers()), st.just(b"ring"), st.just(object()))
TEXT = st.text(alphabet=st.characters(codec="ascii", categories=("L", "N", "P", "Zs")),
               max_size=14)


def not_in(valid) -> st.SearchStrategy:
  """Names that are none of ``valid``: random text, near misses, other primitives' names."""
  near = ["Ring", " ring", "ring ", "RING", "rnig", "fp8", "INT8", "float12", "auto ", "",
          "bruck", "native_", "hierarchical(ring)", "direct", "binomial_tree", "ring,ring"]
  return st.one_of(TEXT, st.sampled_from(near)).filter(lambda s: s not in valid)


BAD_DTYPE = st.one_of(TEXT.filter(lambda s: s and not _is_dtype(s)),
                      st.sampled_from(["fp8", "INT8", "float12", "bf16x"]),
                      NOT_A_STRING.filter(lambda v: v is not None))
NOT_AN_INT = st.one_of(st.floats(allow_nan=True), st.text(max_size=3), st.none(), st.just(True),
                       st.just(False), st.just([1]))
NOT_A_FLAG = st.one_of(st.integers(), st.text(max_size=3), st.none(), st.floats())


def algorithm_of(primitive):
  valid = (*jaxcoll.algorithms(primitive), "auto")
  return st.one_of(not_in(valid), NOT_A_STRING, st.lists(st.sampled_from(valid), max_size=2))


COLLECTIVE_ARGUMENTS = {
    # (function of (x, value) inside shard_map, argument name, strategy of invalid values)
    "all_reduce": [
        (lambda x, v: jaxcoll.all_reduce(x, v), "axis_name",
         st.one_of(not_in({AXIS}).filter(bool), st.just(()), st.just((AXIS, AXIS)),
                   st.integers(), st.none())),
        (lambda x, v: jaxcoll.all_reduce(x, AXIS, algorithm=v), "algorithm",
         algorithm_of("all_reduce")),
        (lambda x, v: jaxcoll.all_reduce(x, AXIS, op=v), "op",
         st.one_of(not_in(("sum", "prod", "min", "max", "mean")), NOT_A_STRING)),
        (lambda x, v: jaxcoll.all_reduce(x, AXIS, accumulate_dtype=v), "accumulate_dtype",
         st.one_of(BAD_DTYPE, st.sampled_from(["float16", "bfloat16", "int32", "int8",
                                               "bool", "float8_e4m3fn"]))),
        (lambda x, v: jaxcoll.all_reduce(x, AXIS, wire_dtype=v, algorithm="ring"), "wire_dtype",
         st.one_of(BAD_DTYPE, st.sampled_from(["int32", "float16", "float64", "uint8",
                                               "complex64", "bool"]))),
        (lambda x, v: jaxcoll.all_reduce(x, AXIS, wire_dtype="int8", wire_block_size=v,
                                         algorithm="ring"), "wire_block_size",
         st.one_of(st.integers(-4, 1000).filter(lambda b: b < 1 or b & (b - 1)), NOT_AN_INT)),
    ],
    "reduce_scatter": [
        (lambda x, v: jaxcoll.reduce_scatter(x, AXIS, scatter_dimension=v, tiled=True),
         "scatter_dimension", st.one_of(st.integers().filter(lambda d: not -1 <= d < 1),
                                        NOT_AN_INT)),
        (lambda x, v: jaxcoll.reduce_scatter(x, AXIS, tiled=v), "tiled", NOT_A_FLAG),
        (lambda x, v: jaxcoll.reduce_scatter(x, AXIS, tiled=True, algorithm=v), "algorithm",
         algorithm_of("reduce_scatter")),
    ],
    "all_gather": [
        (lambda x, v: jaxcoll.all_gather(x, AXIS, axis=v), "axis",
         st.one_of(st.integers().filter(lambda d: not -2 <= d < 2), NOT_AN_INT)),
        (lambda x, v: jaxcoll.all_gather(x, AXIS, to=v), "to",
         st.one_of(not_in(("varying", "invarying", "invariant")), NOT_A_STRING)),
        (lambda x, v: jaxcoll.all_gather(x, AXIS, tiled=v), "tiled", NOT_A_FLAG),
        (lambda x, v: jaxcoll.all_gather(x, AXIS, algorithm=v), "algorithm",
         algorithm_of("all_gather")),
        (lambda x, v: jaxcoll.all_gather(x, AXIS, wire_dtype=v, algorithm="ring"), "wire_dtype",
         BAD_DTYPE),
    ],
    "broadcast": [
        (lambda x, v: jaxcoll.broadcast(x, AXIS, root=v), "root",
         st.one_of(st.integers().filter(lambda r: not 0 <= r < N), NOT_AN_INT)),
        (lambda x, v: jaxcoll.broadcast(x, AXIS, algorithm=v), "algorithm",
         algorithm_of("broadcast")),
    ],
    "reduce": [
        (lambda x, v: jaxcoll.reduce(x, AXIS, root=v), "root",
         st.one_of(st.integers().filter(lambda r: not 0 <= r < N), NOT_AN_INT)),
        (lambda x, v: jaxcoll.reduce(x, AXIS, op=v), "op", not_in(("sum", "prod", "min", "max",
                                                                   "mean"))),
    ],
    "all_to_all": [
        (lambda x, v: jaxcoll.all_to_all(x, AXIS, v, 0, tiled=True), "split_axis",
         st.one_of(st.integers().filter(lambda d: not -1 <= d < 1), NOT_AN_INT)),
        (lambda x, v: jaxcoll.all_to_all(x, AXIS, 0, v, tiled=True), "concat_axis",
         st.one_of(st.integers().filter(lambda d: not -1 <= d < 1), NOT_AN_INT)),
        (lambda x, v: jaxcoll.all_to_all(x, AXIS, 0, 0, tiled=True, algorithm=v), "algorithm",
         algorithm_of("all_to_all")),
    ],
    "shift": [
        (lambda x, v: jaxcoll.shift(x, AXIS, v), "offset", NOT_AN_INT),
        (lambda x, v: jaxcoll.shift(x, AXIS, 1, wrap=v), "wrap", NOT_A_FLAG),
        (lambda x, v: jaxcoll.shift(x, AXIS, 1, algorithm=v), "algorithm", algorithm_of("shift")),
    ],
}

CASES = [(p, i) for p, rows in COLLECTIVE_ARGUMENTS.items() for i in range(len(rows))]


@pytest.mark.parametrize("primitive,index", CASES,
                         ids=[f"{p}-{COLLECTIVE_ARGUMENTS[p][i][1]}" for p, i in CASES])
@settings(max_examples=20, deadline=None)
@given(data=st.data())
def test_every_collective_argument_refuses_invalid_values_by_name(primitive, index, data):
  fn, argument, values = COLLECTIVE_ARGUMENTS[primitive][index]
  value = data.draw(values, label=argument)
  refused(lambda: trace(lambda x: fn(x, value)), argument)


def test_the_cases_the_issue_named():
  """Each case of the no-silent-wrong-answers report, as it was written."""
  x = np.full((N, 4), 1e4, np.float32)
  refused(lambda: trace(lambda v: jaxcoll.all_reduce(v, AXIS, accumulate_dtype="float16",
                                                     algorithm="ring"), x=x),
          "accumulate_dtype")
  for wire in ("fp8", "INT8"):
    msg = refused(lambda w=wire: trace(lambda v: jaxcoll.all_reduce(v, AXIS, wire_dtype=w)),
                  "wire_dtype")
    assert "expected one of" in msg
  for call in (lambda: jaxcoll.calibrate(None), lambda: jaxcoll.explain("all_reduce", X[0], None,
                                                                        AXIS),
               lambda: jaxcoll.data_parallel(lambda p, o, b: (p, o, {}), None, AXIS)):
    refused(call, "mesh")
  tx = optax.sgd(0.1)
  refused(lambda: fsdp.train_step(lambda p, b: jnp.sum(p["w"]), tx, mesh(N), "y"), "axis_name")
  for fn in (lambda a: fsdp.gather(fsdp.Sharded(jnp.ones(2), (16,), 0), AXIS, algorithm=a),
             lambda a: fsdp.layer(lambda p: p, AXIS, algorithm=a)):
    for name in ("rnig", "halving_doubling"):   # unknown, and one all_gather lacks
      refused(lambda fn=fn, name=name: trace(lambda v: fn(name)), "algorithm")
  refused(lambda: fsdp.train_step(lambda p, b: 0.0, tx, mesh(N), AXIS, algorithm="rnig"),
          "algorithm")
  refused(lambda: trace(lambda v: jaxcoll.sync_gradients({"a": v}, AXIS,
                                                         accumulate_dtype="float16")),
          "accumulate_dtype")
  sds = jax.ShapeDtypeStruct((64, 16), jnp.float32)
  for k, cap, argument in ((0, 4, "k"), (2, -1, "capacity"), (2, 0, "capacity")):
    refused(lambda k=k, cap=cap: moe.explain(sds, k, num_experts=8, capacity=cap, mesh=mesh(N),
                                             axis_name=AXIS), argument)


def test_more_cases_found_the_same_way():
  """Found by the same method as the report's: each was a silent wrong answer or an error that
  named nothing the user wrote."""
  # float64 partial sums without x64 were silently float32
  refused(lambda: trace(lambda v: jaxcoll.all_reduce(v, AXIS, accumulate_dtype="float64",
                                                     algorithm="ring")), "accumulate_dtype")
  # gates [T, 1] broadcast against [T, k] weighted every choice by the first gate
  def combine_with(k):
    ids = jnp.zeros((2, 2), jnp.int32) + jnp.arange(2)
    def body(v):
      buf, state = moe.dispatch(v.reshape(2, 8), ids, num_experts=8, capacity=2,
                                axis_name=AXIS)
      return moe.combine(buf, state, jnp.ones((2, k)))
    return trace(body)
  combine_with(2)
  refused(lambda: combine_with(1), "gates")
  refused(lambda: jaxcoll.traffic(lambda v: v, None, X), "mesh")       # was AttributeError
  refused(lambda: jaxcoll.explain("all_reduce", [1, 2], mesh(N), AXIS), "x")  # RecursionError
  refused(lambda: trace(lambda v: jaxcoll.all_reduce(v, AXIS, op=None)), "op")  # KeyError
  refused(lambda: fsdp.shard({"w": np.ones(4)}, True), "num_shards")    # True was 1 shard
  refused(lambda: jaxcoll.WireFormat("int8", True), "wire_block_size")  # True was 1


def test_an_empty_array_on_a_compressed_wire_is_lax_s_empty_answer():
  got = jax.jit(jax.shard_map(
      lambda v: jaxcoll.all_reduce(v[:, :0], AXIS, wire_dtype="int8"), mesh=mesh(N),
      in_specs=P(AXIS), out_specs=P(AXIS)))(X)
  assert got.shape == (N, 0) and got.dtype == np.float32


INTEGRATION_ARGUMENTS = [
    # (call of value, argument name, invalid values)
    (lambda v: trace(lambda x: jaxcoll.sync_gradients({"g": x}, AXIS, op=v)), "op",
     not_in(("sum", "prod", "min", "max", "mean"))),
    (lambda v: trace(lambda x: jaxcoll.sync_gradients({"g": x}, AXIS, bucket_bytes=v)),
     "bucket_bytes", st.one_of(st.integers(max_value=0), NOT_AN_INT)),
    (lambda v: trace(lambda x: jaxcoll.sync_gradients({"g": x}, AXIS, first_bucket_bytes=v)),
     "first_bucket_bytes", st.one_of(st.integers(max_value=0), NOT_AN_INT)),
    (lambda v: trace(lambda x: jaxcoll.sync_gradients({"g": x}, AXIS, algorithm=v)),
     "algorithm", algorithm_of("all_reduce")),
    (lambda v: trace(lambda x: jaxcoll.sync_gradients({"g": x}, AXIS, wire_dtype=v)),
     "wire_dtype", BAD_DTYPE),
    (lambda v: trace(lambda x: jaxcoll.sync_in_backward({"g": x}, AXIS, algorithm=v)),
     "algorithm", algorithm_of("all_reduce")),
    (lambda v: jaxcoll.optax.sync(AXIS, wire_dtype=v), "wire_dtype", BAD_DTYPE),
    (lambda v: jaxcoll.optax.sync(AXIS, wire_dtype="int8", error_feedback=v), "error_feedback",
     NOT_A_FLAG),
    (lambda v: jaxcoll.optax.sync(AXIS, accumulate_dtype=v), "accumulate_dtype",
     st.one_of(BAD_DTYPE, st.sampled_from(["int32", "bool"]))),
    (lambda v: fsdp.layer(lambda p: p, AXIS, wire_dtype=v), "wire_dtype", BAD_DTYPE),
    (lambda v: fsdp.layer(lambda p: p, AXIS, grad_wire_dtype=v), "grad_wire_dtype", BAD_DTYPE),
    (lambda v: fsdp.layer(lambda p: p, AXIS, dtype=v), "dtype",
     st.one_of(BAD_DTYPE, st.sampled_from(["int32", "bool", "uint8"]))),
    (lambda v: fsdp.layers(lambda p, x: x, AXIS, prefetch=v), "prefetch",
     st.one_of(st.integers(max_value=-1), NOT_AN_INT)),
    (lambda v: fsdp.shard({"w": np.ones(4)}, v), "num_shards",
     st.one_of(st.integers(max_value=0), NOT_AN_INT)),
    (lambda v: fsdp.shard({"w": np.ones(4)}, 2, axis=v), "axis",
     st.one_of(st.integers().filter(lambda a: not -1 <= a < 1), NOT_AN_INT)),
    (lambda v: fsdp.train_step(lambda p, b: 0.0, optax.sgd(0.1), v, AXIS), "mesh",
     st.one_of(st.none(), st.integers(), st.text(max_size=3))),
    (lambda v: fsdp.train_step(lambda p, b: 0.0, v, mesh(N), AXIS), "optimizer",
     st.one_of(st.none(), st.integers(), st.just(optax.sgd))),
    (lambda v: fsdp.train_step(lambda p, b: 0.0, optax.sgd(0.1), mesh(N), AXIS, donate=v),
     "donate", NOT_A_FLAG),
    (lambda v: moe.capacity(v, 8, 2), "tokens", st.one_of(st.integers(max_value=-1),
                                                         NOT_AN_INT)),
    (lambda v: moe.capacity(64, v, 2), "num_experts", st.one_of(st.integers(max_value=0),
                                                               NOT_AN_INT)),
    (lambda v: moe.capacity(64, 8, v), "k", st.one_of(st.integers(max_value=0), NOT_AN_INT)),
    (lambda v: moe.capacity(64, 8, 2, v), "factor",
     st.one_of(st.floats(max_value=0), st.just(float("nan")), st.just(float("inf")),
               st.text(max_size=2), st.none())),
    (lambda v: moe.capacity(64, 8, 2, multiple=v), "multiple",
     st.one_of(st.integers(max_value=0), NOT_AN_INT)),
    (lambda v: moe.route(np.zeros((4, 8), np.float32), v), "k",
     st.one_of(st.integers().filter(lambda k: not 1 <= k <= 8), NOT_AN_INT)),
    (lambda v: moe.route(np.zeros((4, 8), np.float32), 2, num_experts=v), "num_experts",
     st.one_of(st.integers().filter(lambda e: e != 8), NOT_AN_INT.filter(lambda v: v is not None))),
    (lambda v: trace(lambda x: moe.dispatch(x.reshape(4, 4), jnp.zeros((4, 2), jnp.int32),
                                            num_experts=v, capacity=2, axis_name=AXIS)),
     "num_experts", st.one_of(st.integers().filter(lambda e: e < 1 or e % N), NOT_AN_INT)),
    (lambda v: trace(lambda x: moe.dispatch(x.reshape(4, 4), jnp.zeros((4, 2), jnp.int32),
                                            num_experts=8, capacity=v, axis_name=AXIS)),
     "capacity", st.one_of(st.integers(max_value=0), st.floats(), st.text(max_size=2))),
    (lambda v: trace(lambda x: moe.dispatch(x.reshape(4, 4), jnp.zeros((4, 2), jnp.int32),
                                            num_experts=8, capacity=2, axis_name=AXIS,
                                            algorithm=v)),
     "algorithm", st.one_of(not_in((*jaxcoll.algorithms("all_to_all"), "auto", "allgather")),
                            NOT_A_STRING)),
    (lambda v: trace(lambda x: moe.dispatch(x.reshape(4, 4), jnp.zeros((4, 2), jnp.int32),
                                            num_experts=8, capacity=None, axis_name=AXIS,
                                            chunk=v)),
     "chunk", st.one_of(st.integers().filter(lambda c: not 1 <= c <= 8),
                        NOT_AN_INT.filter(lambda v: v is not None))),
    (lambda v: trace(lambda x: moe.dispatch(x.reshape(4, 4), jnp.zeros((4, 2), jnp.int32),
                                            num_experts=8, capacity=2, axis_name=AXIS,
                                            chunk=v)),
     "chunk", st.integers(1, 8)),     # a chunk with a capacity does not apply
    (lambda v: trace(lambda x: moe.dispatch(x.reshape(4, 4), jnp.zeros((4, 2), jnp.int32),
                                            num_experts=8, capacity=None, axis_name=AXIS,
                                            layout=v)),
     "layout", st.one_of(not_in(("buffers", "sorted")), NOT_A_STRING)),
    (lambda v: trace(lambda x: moe.dispatch(x.reshape(4, 4), jnp.zeros((4, 2), jnp.int32),
                                            num_experts=8, capacity=None, axis_name=AXIS,
                                            layout="sorted", buffer_factor=v)),
     "buffer_factor", st.one_of(st.floats(max_value=0), st.just(float("nan")),
                                st.just(float("inf")), st.text(max_size=2))),
    (lambda v: trace(lambda x: moe.dispatch(x.reshape(4, 4), jnp.zeros((4, 2), jnp.int32),
                                            num_experts=8, capacity=None, axis_name=AXIS,
                                            layout="sorted", chunk=v)),
     "chunk", st.one_of(st.integers().filter(lambda c: not 1 <= c <= 8),
                        NOT_AN_INT.filter(lambda v: v is not None))),
    (lambda v: moe.route_experts(np.zeros((4, 8), np.float32), v), "capacity",
     st.one_of(st.integers().filter(lambda c: not 1 <= c <= 4), NOT_AN_INT)),
    (lambda v: moe.grouped_matmul(np.ones((4, 2)), np.ones((2, 2, 3)), np.array([2, 2]),
                                  tile=v), "tile",
     st.one_of(st.integers(max_value=0), NOT_AN_INT)),
    (lambda v: moe.grouped_matmul(np.ones((4, 2)), np.ones((2, 2, 3)), np.array([2, 2]),
                                  implementation=v), "implementation",
     st.one_of(not_in(("auto", "ragged_dot", "tiled")), NOT_A_STRING)),
    (lambda v: moe.init_layer(jax.random.key(0), 8, v, 4), "ffn",
     st.one_of(st.integers(max_value=0), NOT_AN_INT)),
    (lambda v: moe.explain(jax.ShapeDtypeStruct((64, 16), jnp.float32), 2, num_experts=8,
                           capacity=4, mesh=v, axis_name=AXIS), "mesh",
     st.one_of(st.none(), st.integers(), st.just({AXIS: 0}), st.just({AXIS: "8"}))),
    (lambda v: jaxcoll.explain("all_reduce", X[0], mesh(N), v), "axis_name",
     st.one_of(not_in({AXIS}).filter(bool), st.just(()), st.integers())),
    (lambda v: jaxcoll.explain(v, X[0], mesh(N), AXIS), "primitive",
     st.one_of(not_in(jaxcoll.PRIMITIVES), NOT_A_STRING.filter(lambda v: v is not None))),
    (lambda v: jaxcoll.explain("all_gather", X[0], mesh(N), AXIS, accumulate_dtype=v),
     "accumulate_dtype", st.sampled_from(["float32", "float64"])),   # does not apply
    (lambda v: jaxcoll.explain("broadcast", X[0], mesh(N), AXIS, wire_dtype=v),
     "wire_dtype", st.sampled_from(["int8", "bfloat16"])),           # does not apply
    (lambda v: jaxcoll.data_parallel(v, mesh(N), AXIS), "step",
     st.one_of(st.none(), st.integers())),
    (lambda v: jaxcoll.data_parallel(lambda *a: a, mesh(N), v), "axis_name",
     st.one_of(not_in({AXIS}).filter(bool), st.just(()), st.integers())),
    (lambda v: jaxcoll.data_parallel(lambda *a: a, mesh(N), AXIS, batch_argnums=(v,)),
     "batch_argnums", st.one_of(st.integers(max_value=-1), NOT_AN_INT)),
    (lambda v: jaxcoll.calibrate(mesh(N), sizes=(v,), progress=False), "sizes",
     st.one_of(st.integers(max_value=1024).filter(lambda s: s % 32 or s < 32), NOT_AN_INT)),
    (lambda v: jaxcoll.calibrate(mesh(N), reps=v, progress=False), "reps",
     st.one_of(st.integers(max_value=0), NOT_AN_INT)),
    (lambda v: jaxcoll.calibrate(mesh(N), v, progress=False), "axes",
     st.one_of(not_in({AXIS}).filter(bool), st.integers())),
    (lambda v: jaxcoll.calibrate(mesh(N), primitives=(v,), progress=False), "primitives",
     st.one_of(not_in(jaxcoll.tools.primitives(timed=True)), st.integers())),
    (lambda v: jaxcoll.use(lambda x: x, wire_dtype=v), "wire_dtype", BAD_DTYPE),
    (lambda v: jaxcoll.use(lambda x: x, algorithm=v), "algorithm",
     st.one_of(not_in({a for p in jaxcoll.PRIMITIVES for a in jaxcoll.algorithms(p)} | {"auto"}),
               st.integers(), st.none())),
    (lambda v: jaxcoll.config(fused_kernel=v), "fused_kernel",
     st.one_of(st.text(max_size=4).filter(lambda s: s != "auto"), st.integers(2, 9))),
    (lambda v: jaxcoll.schedule("all_reduce", "ring", v), "axis_size",
     st.one_of(st.integers(max_value=0), st.floats(), st.text(max_size=2))),
    (lambda v: jaxcoll.WireFormat("int8", v), "wire_block_size",
     st.one_of(st.integers(-4, 1000).filter(lambda b: b < 1 or b & (b - 1)), st.floats())),
]


@pytest.mark.parametrize("index", range(len(INTEGRATION_ARGUMENTS)),
                         ids=[f"{i}-{a[1]}" for i, a in enumerate(INTEGRATION_ARGUMENTS)])
@settings(max_examples=15, deadline=None)
@given(data=st.data())
def test_every_integration_and_tool_argument_refuses_invalid_values_by_name(index, data):
  call, argument, values = INTEGRATION_ARGUMENTS[index]
  value = data.draw(values, label=argument)
  refused(lambda: call(value), argument)


# ------------------------------------------------------------------ valid edge values

PRIMITIVES = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "reduce",
              "shift")


def jaxcoll_call(primitive, x, algorithm, wire):
  """The collective on a per-device array x of any shape, in lax's terms: reduce_scatter and
  all_to_all over x's first dimension untiled (its length must be N), all_gather stacked."""
  kw = {"algorithm": algorithm}
  if wire is not None and jaxcoll.spec(primitive).wire:
    kw["wire_dtype"] = wire
  if primitive == "reduce_scatter":
    return jaxcoll.reduce_scatter(x, AXIS, **kw)
  if primitive == "all_to_all":
    return jaxcoll.all_to_all(x, AXIS, 0, 0, **kw)
  if primitive in ("broadcast", "reduce"):
    return getattr(jaxcoll, primitive)(x, AXIS, root=lax.axis_size(AXIS) - 1, **kw)
  return getattr(jaxcoll, primitive)(x, AXIS, **kw)


def lax_call(primitive, x):
  n = lax.axis_size(AXIS)
  me = lax.axis_index(AXIS)
  wide = x.astype(jnp.int32) if x.dtype == bool else x
  return {
      "all_reduce": lambda: lax.psum(x, AXIS),
      "reduce_scatter": lambda: lax.psum_scatter(x, AXIS),
      "all_gather": lambda: lax.all_gather(x, AXIS),
      "all_to_all": lambda: lax.all_to_all(x, AXIS, 0, 0),
      "broadcast": lambda: lax.psum(jnp.where(me == n - 1, wide, 0), AXIS).astype(x.dtype),
      "reduce": lambda: jnp.where(me == n - 1, lax.psum(x, AXIS), 0).astype(x.dtype),
      "shift": lambda: lax.ppermute(x, AXIS, [(i, (i + 1) % n) for i in range(n)]),
  }[primitive]()


def run_both(primitive, n, shape, dtype, algorithm, wire):
  """(jaxcoll's, lax's) result on n devices of per-device arrays of ``shape``: small integers
  (exact in any reduction order), device r's differing from the others'."""
  local = shape if primitive not in ("reduce_scatter", "all_to_all") else (n, *shape)
  rng = np.random.default_rng(n * 100 + len(shape))
  host = rng.integers(-4, 5, (n, *local)).astype(dtype)
  m = mesh(n)
  x = jax.device_put(host, NamedSharding(m, P(AXIS)))
  out = []
  for body in (lambda v: jaxcoll_call(primitive, v, algorithm, wire),
               lambda v: lax_call(primitive, v)):
    f = jax.jit(jax.shard_map(lambda v, body=body: body(v[0])[None], mesh=m, in_specs=P(AXIS),
                              out_specs=P(AXIS), check_vma=False))
    out.append(np.asarray(f(x)))
  return out


SHAPES = st.one_of(st.just(()), st.lists(st.integers(0, 5), min_size=1, max_size=3).map(tuple))


@pytest.mark.parametrize("primitive", PRIMITIVES)
@settings(max_examples=20, deadline=None)
@given(n=st.sampled_from([1, 2, 3, 5, 8]), shape=SHAPES,
       dtype=st.sampled_from([np.float32, np.int32, ml_dtypes.bfloat16]),
       wire=st.sampled_from([None, "int8", "bfloat16"]), data=st.data())
def test_valid_edge_values_give_lax_s_answer(primitive, n, shape, dtype, wire, data):
  """Empty and 0-d arrays, lengths no axis size divides, one device, every algorithm;
  compressed (where the format applies to the data) within the format's bound."""
  algorithms = [a for a in jaxcoll.algorithms(primitive, num_axes=1) if a != "native"]
  algorithm = data.draw(st.sampled_from([*algorithms, "auto"]), label="algorithm")
  if primitive in ("reduce_scatter", "all_to_all") and not shape:
    shape = (1,)
  applies = wire is not None and jaxcoll.spec(primitive).wire and \
      jaxcoll.extend.compresses(wire, dtype) and algorithm != "native"
  if wire is not None and jaxcoll.spec(primitive).wire and not applies and \
      np.dtype(dtype) != np.dtype(getattr(ml_dtypes, wire, wire)):
    refused(lambda: run_both(primitive, n, shape, dtype, algorithm, wire), "wire_dtype")
    return
  got, want = run_both(primitive, n, shape, dtype, algorithm, wire if applies else None)
  assert got.shape == want.shape and got.dtype == want.dtype
  if not applies:
    np.testing.assert_array_equal(got, want)
  else:   # every hop errs by at most relative_error of its block's largest magnitude
    bound = 2 * n * jaxcoll.WireFormat(wire).relative_error * max(
        1.0, float(np.abs(want.astype(np.float32)).max(initial=0)))
    np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), atol=bound)


@pytest.mark.parametrize("primitive", PRIMITIVES)
@pytest.mark.parametrize("shape", [(4, 1), (1, 4), (1, 1)])
def test_a_tuple_with_one_element_axes_gives_lax_s_answer(primitive, shape):
  """Over ("a", "b") where one axis (or both) has a single device: every algorithm that runs
  over two axes, hierarchical included, equals lax."""
  m = jax.sharding.Mesh(np.array(jax.devices()[:int(np.prod(shape))]).reshape(shape), ("a", "b"))
  n = int(np.prod(shape))
  local = (n, 3) if primitive in ("reduce_scatter", "all_to_all") else (3,)
  host = np.random.default_rng(n).integers(-4, 5, (n, *local)).astype(np.float32)
  x = jax.device_put(host, NamedSharding(m, P(("a", "b"))))
  axes = ("a", "b")

  def lax_over(v):
    me = lax.axis_index(axes)
    return {"all_reduce": lambda: lax.psum(v, axes),
            "reduce_scatter": lambda: lax.psum_scatter(v, axes),
            "all_gather": lambda: lax.all_gather(v, axes),
            "all_to_all": lambda: lax.all_to_all(v, axes, 0, 0),
            "broadcast": lambda: lax.psum(jnp.where(me == n - 1, v, 0), axes),
            "reduce": lambda: jnp.where(me == n - 1, lax.psum(v, axes), 0),
            "shift": lambda: lax.ppermute(v, axes, [(i, (i + 1) % n) for i in range(n)]),
            }[primitive]()

  def ours(v, algorithm):
    kw = {"algorithm": algorithm}
    if primitive == "all_to_all":
      return jaxcoll.all_to_all(v, axes, 0, 0, **kw)
    if primitive in ("broadcast", "reduce"):
      kw["root"] = n - 1
    return getattr(jaxcoll, primitive)(v, axes, **kw)

  def run(body):
    return np.asarray(jax.jit(jax.shard_map(lambda v: body(v[0])[None], mesh=m,
                                            in_specs=P(axes), out_specs=P(axes),
                                            check_vma=False))(x))
  want = run(lax_over)
  for algorithm in (*jaxcoll.algorithms(primitive, num_axes=2), "auto"):
    np.testing.assert_array_equal(run(lambda v, a=algorithm: ours(v, a)), want,
                                  err_msg=algorithm)


def test_documented_errors_of_the_fsdp_moe_and_kernel_helpers_are_raised():
  """What the docstrings' Raises sections promise (each error names what is wrong)."""
  from jaxcoll import fsdp, kernels, moe
  params = {"w": jnp.ones((3, 2))}
  blocks = fsdp.shard(params, 4)
  with pytest.raises(ValueError, match=r"unshard: .*shape \(3, 2\).*\(1, 2\)"):
    fsdp.unshard({"w": fsdp.Sharded(jnp.ones((1, 2)), (3, 2), 0)})
  with pytest.raises(TypeError, match="axis_name=3"):
    fsdp.specs(blocks, 3)
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("x",))
  with pytest.raises(ValueError, match="axis_name='y' is not an axis of the mesh"):
    fsdp.place(blocks, mesh, "y")
  with pytest.raises(ValueError, match="does not split among 4 devices"):
    fsdp.place(fsdp.shard(params, 3), mesh, "x")
  with pytest.raises(ValueError, match=r"load_balancing_loss: expert_ids must be \[tokens, k\]"):
    moe.load_balancing_loss(jnp.ones((2, 3)), jnp.zeros((3, 1), jnp.int32))
  with pytest.raises(ValueError, match=r"load_balancing_loss: logits must be \[tokens"):
    moe.load_balancing_loss(jnp.ones((2, 2, 3)), jnp.zeros((2, 2, 1), jnp.int32))
  y, bits = jnp.ones(4), jnp.zeros(4, jnp.uint32)
  with pytest.raises(ValueError, match="y has dtype float16"):
    kernels.stochastic_round(y.astype(jnp.float16), jnp.bfloat16, bits)
  with pytest.raises(ValueError, match="out_dtype=.*int8.*expected bfloat16 or float16"):
    kernels.stochastic_round(y, jnp.int8, bits)
  with pytest.raises(ValueError, match=r"bits: expected uint32 of y's shape \(4,\)"):
    kernels.stochastic_round(y, jnp.bfloat16, bits[:3])
