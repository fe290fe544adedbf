"""What auto did, visible in a real program: JAXCOLL_DEBUG=INFO log lines, named scopes in
the lowered and compiled HLO, and explain on pytrees."""

from __future__ import annotations

import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxcoll
from jaxcoll._src.auto import debug_log

pytestmark = pytest.mark.quick

MESH = Mesh(np.array(jax.devices()[:8]), ("x",))
SDS = jax.ShapeDtypeStruct


def program(fn, x):
  """``fn`` on one device's block of ``x`` inside shard_map over "x", jitted and lowered."""
  f = jax.jit(jax.shard_map(lambda v: jax.tree.map(lambda y: y[None], fn(
      jax.tree.map(lambda a: a[0], v))), mesh=MESH, in_specs=P("x"), out_specs=P("x")))
  return f, f.lower(x)


def rows(*shape, dtype=np.float32):
  return np.ones((8, *shape), dtype)


@pytest.fixture
def log(caplog, monkeypatch):
  debug_log._seen.clear()
  monkeypatch.setenv("JAXCOLL_DEBUG", "INFO")
  caplog.set_level(logging.INFO, logger="jaxcoll")
  yield lambda: [r.getMessage() for r in caplog.records if r.name == "jaxcoll"]
  debug_log._seen.clear()


@pytest.mark.parametrize("profile,size", [("cpu", 256), ("cpu", 1 << 20),
                                          ("h100-nvlink", 256)])
def test_each_choice_is_logged_once_with_what_explain_says(log, profile, size):
  with jaxcoll.config(profile=profile):
    why = jaxcoll.explain("all_reduce", SDS((size,), np.float32), MESH, "x")
    f, _ = program(lambda v: jaxcoll.all_reduce(v, "x"), rows(size))
    program(lambda v: jaxcoll.all_reduce(v, "x") * 2, rows(size))     # a retrace: quiet
  (line,) = log()
  assert line.startswith(f"all_reduce float32[{size}] over x (8; links process): {why.chosen}, "
                         f"predicted {why.predicted_s * 1e3:.3g} ms")
  assert line.endswith(f"profile {profile}")
  if profile == "h100-nvlink":
    assert "was not measured on this backend: native kept" in line
  else:
    assert "a schedule must be 1.25x faster" in line


def test_overrides_and_wire_formats_say_why(log):
  with jaxcoll.config(algorithm={"all_gather": "bruck"}):
    program(lambda v: jaxcoll.all_gather(v, "x"), rows(64))
  program(lambda v: jaxcoll.all_reduce(v, "x", wire_dtype="int8"), rows(4096))
  override, wire = log()
  assert override == ("all_gather float32[64] over x (8): bruck (overridden by jaxcoll.config / "
                      "JAXCOLL_ALGORITHM)")
  assert wire.startswith("all_reduce float32[4096] wire int8 over x")
  assert "native cannot send a wire format" in wire


def test_debug_config_beats_the_environment_and_bad_values_are_named(log, monkeypatch):
  with jaxcoll.config(debug=False):
    program(lambda v: jaxcoll.all_reduce(v, "x"), rows(64))
  assert log() == []
  monkeypatch.setenv("JAXCOLL_DEBUG", "LOUD")
  with pytest.raises(ValueError, match="JAXCOLL_DEBUG='LOUD': expected INFO"):
    program(lambda v: jaxcoll.all_reduce(v, "x"), rows(64))
  monkeypatch.delenv("JAXCOLL_DEBUG")
  with jaxcoll.config(debug=True):
    program(lambda v: jaxcoll.all_reduce(v, "x"), rows(64))
  assert len(log()) == 1
  with pytest.raises(ValueError, match="config\\(debug='yes'\\)"):
    jaxcoll.config(debug="yes")


CALLS = {
    "all_reduce": lambda v, a: jaxcoll.all_reduce(v, "x", algorithm=a),
    "reduce_scatter": lambda v, a: jaxcoll.reduce_scatter(v, "x", tiled=True, algorithm=a),
    "all_gather": lambda v, a: jaxcoll.all_gather(v, "x", tiled=True, algorithm=a),
    "all_to_all": lambda v, a: jaxcoll.all_to_all(v, "x", 0, 0, tiled=True, algorithm=a),
    "broadcast": lambda v, a: jaxcoll.broadcast(v, "x", algorithm=a),
    "reduce": lambda v, a: jaxcoll.reduce(v, "x", algorithm=a),
    "shift": lambda v, a: jaxcoll.shift(v, "x", 1, algorithm=a),
}


@pytest.mark.parametrize("primitive", sorted(CALLS))
def test_every_collective_runs_under_a_named_scope(primitive):
  """jaxcoll.<primitive>.<algorithm> in the lowered module's locations and in the compiled
  HLO's op_name metadata, for native and for a schedule."""
  for algorithm in ("native", jaxcoll.algorithms(primitive)[-1]):
    f, lowered = program(lambda v, a=algorithm: CALLS[primitive](v, a), rows(64))
    scope = f"jaxcoll.{primitive}.{algorithm}"
    assert scope in lowered.as_text(debug_info=True), scope
    assert re.search(f'op_name="[^"]*{re.escape(scope)}', lowered.compile().as_text()), scope


def test_explain_prices_a_pytree_leaf_by_leaf_as_the_collective_runs_it(log):
  tree = {"big": SDS((1 << 20,), np.float32), "small": [SDS((8,), np.float32),
                                                        SDS((4, 4), jnp.bfloat16)]}
  with jaxcoll.config(profile="cpu"):
    why = jaxcoll.explain("all_reduce", tree, MESH, "x")
    alone = [jaxcoll.explain("all_reduce", leaf, MESH, "x") for leaf in jax.tree.leaves(tree)]
    _, lowered = program(lambda v: jaxcoll.all_reduce(v, "x"),
                         jax.tree.map(lambda s: np.ones((8, *s.shape), s.dtype), tree))
  assert isinstance(why, jaxcoll.Explanations)
  assert list(why.chosen) == ["['big']", "['small'][0]", "['small'][1]"]
  assert list(why.chosen.values()) == [e.chosen for e in alone]
  assert why.predicted_s == pytest.approx(sum(e.predicted_s for e in alone))
  text = str(why)
  assert "all_reduce of 3 leaves" in text and "['small'][1]" in text
  scopes = set(re.findall(r"jaxcoll\.all_reduce\.(\w+)", lowered.as_text(debug_info=True)))
  assert scopes == set(why.chosen.values())
  assert len(log()) == len(alone)     # one line per distinct leaf call
