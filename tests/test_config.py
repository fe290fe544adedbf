"""jaxcoll._src.config: ``jaxcoll.config(...)`` (set, nest, restore, validate) and the
``JAXCOLL_ALGORITHM`` overrides that ``algorithm="auto"`` defers to."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import jaxcoll
from jaxcoll._src import config as config_lib
from jaxcoll._src.auto.profile import PRESET_NAMES
from jaxcoll._src.wire import fused_combine
from tests.helpers import count_primitive, per_device

ENV = config_lib.ENV_ALGORITHM


@pytest.fixture(autouse=True)
def _no_environment(monkeypatch):
  """Each test starts without JAXCOLL_ALGORITHM and ends with the configuration it found."""
  monkeypatch.delenv(ENV, raising=False)
  before = config_lib.current()
  yield
  assert config_lib.current() == before, "a test left jaxcoll.config changed"


def mesh(n: int = 4) -> Mesh:
  return Mesh(np.array(jax.devices()[:n]), ("x",))


def test_with_block_sets_then_restores():
  before = config_lib.current()
  prof = jaxcoll.Profile.preset("dcn")
  with jaxcoll.config(algorithm={"all_reduce": "ring"}, profile=prof, fused_kernel=False,
                      debug=True) as c:
    assert isinstance(c, jaxcoll.config)
    now = config_lib.current()
    assert dict(now.algorithm) == {**dict(before.algorithm), "all_reduce": "ring"}
    assert now.profile is prof
    assert (now.fused_kernel, now.debug) == (False, True)
    assert now.mesh is before.mesh
  assert config_lib.current() == before


def test_no_arguments_change_nothing():
  before = config_lib.current()
  with jaxcoll.config():
    assert config_lib.current() == before


def test_nesting_merges_algorithms_and_keeps_unnamed_fields():
  m = mesh()
  with jaxcoll.config(algorithm={"all_reduce": "ring", "all_gather": "bruck"},
                      profile="dcn", mesh=m):
    outer = config_lib.current()
    with jaxcoll.config(algorithm={"all_reduce": "binomial_tree", "shift": "direct"},
                        fused_kernel=True):
      inner = config_lib.current()
      # the inner entry wins for its primitive; the outer's others stay
      assert dict(inner.algorithm) == {"all_reduce": "binomial_tree", "all_gather": "bruck",
                                       "shift": "direct"}
      assert [p for p, _ in inner.algorithm] == sorted(dict(inner.algorithm))
      assert inner.profile == jaxcoll.Profile.preset("dcn") and inner.mesh is m
      assert inner.fused_kernel is True
      with jaxcoll.config(profile="h100-nvlink", debug=False):
        innermost = config_lib.current()
        assert innermost.profile == jaxcoll.Profile.preset("h100-nvlink")
        assert innermost.algorithm == inner.algorithm
        assert (innermost.fused_kernel, innermost.debug, innermost.mesh) == (True, False, m)
      assert config_lib.current() == inner
    assert config_lib.current() == outer
    assert outer.fused_kernel == "auto"


def test_exit_restores_on_an_exception_and_lets_it_through():
  before = config_lib.current()
  with pytest.raises(KeyError, match="boom"):
    with jaxcoll.config(algorithm={"reduce": "binomial_tree"}):
      raise KeyError("boom")
  assert config_lib.current() == before


def test_a_call_without_with_sets_the_configuration_from_now_on():
  before = config_lib.current()
  setting = jaxcoll.config(profile="tpu-v5p-ici", algorithm={"broadcast": "scatter_allgather"})
  try:
    assert config_lib.current().profile == jaxcoll.Profile.preset("tpu-v5p-ici")
    assert config_lib.override("broadcast") == "scatter_allgather"
    with jaxcoll.config(profile="dcn"):
      assert config_lib.current().profile.name == "dcn"
    assert config_lib.current().profile.name == "tpu-v5p-ici"   # still set after the block
  finally:
    setting.__exit__(None, None, None)
  assert config_lib.current() == before


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_profile_by_preset_name(name):
  with jaxcoll.config(profile=name):
    assert config_lib.current().profile == jaxcoll.Profile.preset(name)
    assert config_lib.current().profile.name == name


def test_profile_object_is_kept_as_given():
  mine = dataclasses.replace(jaxcoll.Profile.preset("h200-nvlink"), name="mine", basis="given")
  with jaxcoll.config(profile=mine):
    assert config_lib.current().profile is mine


def test_profile_from_a_saved_file(tmp_path):
  mine = jaxcoll.Profile(links={"*": jaxcoll.Link(1e-5, 1e-9)}, overhead=2e-5, name="mine")
  mine.save(tmp_path / "mine.json")
  with jaxcoll.config(profile=str(tmp_path / "mine.json")):
    assert config_lib.current().profile == mine


@pytest.mark.parametrize("kwargs,match", [
    ({"fused_kernel": "yes"}, r"config\(fused_kernel='yes'\)"),
    ({"fused_kernel": "interpret"}, r"fused_kernel='interpret'.*True, False or 'auto'"),
    ({"debug": "INFO"}, r"config\(debug='INFO'\)"),
    ({"mesh": "x"}, r"config\(mesh='x'\): expected a jax.sharding.Mesh"),
    ({"mesh": ("x", 4)}, r"config\(mesh=\('x', 4\)\)"),
    ({"algorithm": "ring"}, r"config\(algorithm='ring'\): expected a mapping"),
    ({"algorithm": [("all_reduce", "ring")]}, r"config\(algorithm=\[.*expected a mapping"),
    ({"algorithm": {"all_to_some": "ring"}}, r"config\(algorithm=...\): 'all_to_some' is not "
                                             r"a collective"),
    ({"algorithm": {"all_reduce": "bruck"}},
     r"config\(algorithm=...\)\['all_reduce'\]='bruck' does not apply to all_reduce"),
    ({"algorithm": {"shift": "ring"}}, r"\['shift'\]='ring' does not apply to shift"),
    ({"algorithm": {"all_reduce": 3}}, r"\['all_reduce'\]=3: expected a name or an algorithm"),
    ({"algorithm": {"all_reduce": None}},
     r"\['all_reduce'\]=None: expected a name or an algorithm"),
    ({"profile": 3}, r"config\(profile=.*3"),
    ({"profile": "nvlink9"}, r"'nvlink9'"),
])
def test_invalid_arguments_are_named_and_change_nothing(kwargs, match):
  before = config_lib.current()
  with pytest.raises((ValueError, TypeError), match=match):
    jaxcoll.config(**kwargs)
  assert config_lib.current() == before


def test_one_bad_entry_rejects_the_whole_call():
  before = config_lib.current()
  with pytest.raises(ValueError, match="'bruck'"):
    jaxcoll.config(algorithm={"all_gather": "ring", "all_reduce": "bruck"}, profile="dcn")
  assert config_lib.current() == before


@pytest.mark.parametrize("primitive", jaxcoll.PRIMITIVES)
def test_every_algorithm_name_and_auto_is_accepted(primitive):
  for name in (*jaxcoll.algorithms(primitive), "auto"):
    with jaxcoll.config(algorithm={primitive: name}):
      assert config_lib.override(primitive) == name


def test_hierarchical_value_is_accepted_and_kept():
  choice = jaxcoll.Hierarchical(("recursive_doubling", "ring"), pieces=(2, 1))
  with jaxcoll.config(algorithm={"all_reduce": choice}):
    assert config_lib.override("all_reduce") is choice
    assert config_lib.override("all_gather") is None


@pytest.mark.parametrize("text,want", [
    ("", {}),
    ("   ", {}),
    ("all_reduce=ring", {"all_reduce": "ring"}),
    (" all_reduce = ring , all_gather=bruck,", {"all_reduce": "ring", "all_gather": "bruck"}),
    ("all_to_all=hierarchical,,shift=native", {"all_to_all": "hierarchical", "shift": "native"}),
    ("all_reduce=ring,all_reduce=binomial_tree", {"all_reduce": "binomial_tree"}),
])
def test_environment_is_parsed(monkeypatch, text, want):
  monkeypatch.setenv(ENV, text)
  assert dict(config_lib.env_value("algorithm") or ()) == want
  for primitive in jaxcoll.PRIMITIVES:
    assert config_lib.override(primitive) == want.get(primitive)


@pytest.mark.parametrize("text,match", [
    ("ring", r"JAXCOLL_ALGORITHM='ring': expected primitive=algorithm pairs"),
    ("all_reduce=ring;all_gather=bruck", r"JAXCOLL_ALGORITHM\['all_reduce'\]='ring;all_gather"),
    ("all_reduce=tree", r"JAXCOLL_ALGORITHM\['all_reduce'\]='tree' does not apply"),
    ("allreduce=ring", r"JAXCOLL_ALGORITHM: 'allreduce' is not a collective"),
])
def test_environment_errors_name_the_variable(monkeypatch, text, match):
  monkeypatch.setenv(ENV, text)
  with pytest.raises(ValueError, match=match):
    dict(config_lib.env_value("algorithm") or ())
  with pytest.raises(ValueError, match=match):
    config_lib.override("all_gather")


def test_config_override_beats_the_environment(monkeypatch):
  monkeypatch.setenv(ENV, "all_reduce=recursive_doubling,all_gather=bruck")
  assert config_lib.override("all_reduce") == "recursive_doubling"
  with jaxcoll.config(algorithm={"all_reduce": "binomial_tree"}):
    assert config_lib.override("all_reduce") == "binomial_tree"
    assert config_lib.override("all_gather") == "bruck"      # not configured: the environment
    assert config_lib.override("reduce_scatter") is None
  assert config_lib.override("all_reduce") == "recursive_doubling"


@pytest.mark.parametrize("setting", [True, False])
def test_fused_kernel_true_or_false_decides_for_every_chunk(setting):
  with jaxcoll.config(fused_kernel=setting):
    for nbytes in (4, fused_combine.FUSED_MIN_BYTES - 1, fused_combine.FUSED_MIN_BYTES, 1 << 30):
      for dtype in (jnp.float32, jnp.bfloat16, jnp.int8, jnp.uint32):
        assert fused_combine.use_fused_kernel(nbytes, dtype) is setting
      for dtype in (jnp.bool_, jnp.complex64):   # the kernel combines neither
        assert fused_combine.use_fused_kernel(nbytes, dtype) is False


def test_fused_kernel_auto_needs_a_compiling_backend_and_a_large_chunk(monkeypatch):
  assert config_lib.current().fused_kernel == "auto"
  compiles = fused_combine.backend_compiles()
  assert compiles == (jax.default_backend() in ("gpu", "cuda", "rocm", "tpu"))
  for nbytes in (fused_combine.FUSED_MIN_BYTES - 1, fused_combine.FUSED_MIN_BYTES):
    want = compiles and nbytes >= fused_combine.FUSED_MIN_BYTES
    assert fused_combine.use_fused_kernel(nbytes, jnp.float32) is want
  # where the backend compiles the kernel: the threshold alone decides
  monkeypatch.setattr(fused_combine, "backend_compiles", lambda: True)
  assert fused_combine.use_fused_kernel(fused_combine.FUSED_MIN_BYTES - 1, jnp.float32) is False
  assert fused_combine.use_fused_kernel(fused_combine.FUSED_MIN_BYTES, jnp.float32) is True
  assert fused_combine.use_fused_kernel(1 << 20, jnp.complex64) is False


def test_configuration_is_read_when_a_function_is_traced():
  """A jitted function keeps the algorithm it was traced with until it is traced again."""
  n = 4
  x = np.arange(n * 8, dtype=np.float32).reshape(n, 8)
  fresh = lambda: per_device(lambda v: jaxcoll.all_reduce(v, "x"), n)   # noqa: E731
  ppermutes = lambda f: count_primitive(jax.make_jaxpr(f)(x), "ppermute")   # noqa: E731
  traced_outside = fresh()
  assert ppermutes(traced_outside) == 0                  # auto on the cpu preset: native
  with jaxcoll.config(algorithm={"all_reduce": "ring"}):
    assert ppermutes(traced_outside) == 0                # already traced: keeps native
    ring = fresh()
    assert ppermutes(ring) > 0                           # the ring's steps
    got = np.asarray(ring(x))
  assert ppermutes(ring) > 0                             # and keeps the ring after the block
  assert ppermutes(fresh()) == 0
  np.testing.assert_array_equal(got, np.broadcast_to(x.sum(0), x.shape))


def test_a_plain_call_inside_a_block_outlives_it_and_the_block_still_wins_inside():
  before = config_lib.current()
  try:
    with jaxcoll.config(profile="dcn", algorithm={"all_reduce": "ring"}):
      plain = jaxcoll.config(profile="tpu-v5p-ici", algorithm={"all_gather": "bruck"})
      assert config_lib.current().profile.name == "dcn"                 # the block's own field
      assert config_lib.override("all_gather") == "bruck"               # the plain call's
      assert config_lib.override("all_reduce") == "ring"
    assert config_lib.current().profile.name == "tpu-v5p-ici"           # kept after the block
    assert config_lib.override("all_gather") == "bruck"
    assert config_lib.override("all_reduce") is None
  finally:
    plain.__exit__(None, None, None)   # undoes the plain call
  assert config_lib.current() == before


def test_a_block_is_seen_by_its_own_thread_only_and_a_plain_call_by_every_thread():
  import threading
  inside, seen = threading.Event(), {}
  release = threading.Event()

  def worker():
    with jaxcoll.config(algorithm={"reduce": "binomial_tree"}):
      seen["worker"] = config_lib.override("reduce")
      inside.set()
      release.wait(10)
    seen["worker after"] = config_lib.override("reduce")

  t = threading.Thread(target=worker)
  t.start()
  assert inside.wait(10)
  seen["main"] = config_lib.override("reduce")   # while the worker is inside its block
  release.set()
  t.join(10)
  assert seen == {"worker": "binomial_tree", "main": None, "worker after": None}

  setting = jaxcoll.config(algorithm={"reduce": "binomial_tree"})
  try:
    got = []
    t = threading.Thread(target=lambda: got.append(config_lib.override("reduce")))
    t.start()
    t.join(10)
    assert got == ["binomial_tree"]
  finally:
    setting.__exit__(None, None, None)


def test_the_environment_is_parsed_once_per_value(monkeypatch):
  config_lib._parsed.cache_clear()   # noqa: SLF001
  monkeypatch.setenv(ENV, "all_reduce=ring")
  for _ in range(3):
    assert dict(config_lib.env_value("algorithm") or ()) == {"all_reduce": "ring"}
  assert config_lib._parsed.cache_info().misses == 1   # noqa: SLF001
  monkeypatch.setenv(ENV, "all_reduce=recursive_doubling")
  assert config_lib.override("all_reduce") == "recursive_doubling"
