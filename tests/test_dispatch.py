"""jaxcoll._src.auto.dispatch: what ``algorithm=`` resolves to for one call.

Real profiles (the presets, and trusted copies of them) and the real candidates; the rule
auto follows is checked against predictions made here with :mod:`jaxcoll._src.auto.cost` and
against the schedules' results in NumPy.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
import pytest

import jaxcoll
from jaxcoll._src import config as config_lib
from jaxcoll._src.auto import cost, dispatch
from jaxcoll._src.auto.profile import PRESET_NAMES, Profile
from tests import helpers

HIERARCHICAL = [p for p in jaxcoll.PRIMITIVES if "hierarchical" in jaxcoll.algorithms(p)]
FLAT = ("x",), (8,)
TWO_AXES = ("node", "local"), (2, 4)
NBYTES = (1 << 10, 1 << 18, 1 << 26)
UNTRUSTED = [name for name in PRESET_NAMES
             if not Profile.preset(name).trusted(jax.default_backend())]


@pytest.fixture(autouse=True)
def _no_environment(monkeypatch):
  monkeypatch.delenv(config_lib.ENV_ALGORITHM, raising=False)
  monkeypatch.delenv("JAXCOLL_DEBUG", raising=False)


def resolve(primitive, algorithm="auto", shape=FLAT, nbytes=1 << 20, **kw):
  names, sizes = shape
  return dispatch.resolve(dispatch.Call(primitive, names, sizes, nbytes, **kw), algorithm)


def auto_label(primitive, names, sizes, nbytes, profile, *, native_allowed=True):
  """What auto runs for the call, as explain and the benchmarks name it (one process)."""
  call = dispatch.Call(primitive, names, sizes, nbytes, native_allowed=native_allowed)
  return dispatch.decide(call, pricing=dispatch.Pricing(profile)).label


def trusted_copy(preset: str, **changes) -> Profile:
  """A preset's figures, as if the user had given them (auto may act on them)."""
  return dataclasses.replace(Profile.preset(preset), basis="given", **changes)


def axis_traffic(sched, sizes=None) -> list[float]:
  """Steps and bytes per mesh axis (M = 1), flat."""
  return [v for t in sched.traffic(1.0, sizes) for v in (t.steps, t.bytes)]


def check_runs(primitive, algorithm, options, n):
  """The resolved (algorithm, options) build a schedule that computes the collective."""
  sched = jaxcoll.schedule(primitive, algorithm, n, **options)
  assert (sched.primitive, sched.axis_size) == (primitive, n)
  rng = np.random.default_rng(n)
  xs = [rng.integers(-9, 9, 3 * n).astype(np.int64) for _ in range(n)]
  for got, want in zip(sched.simulate(xs), jaxcoll.spec(primitive).expected(xs)):
    np.testing.assert_array_equal(got, want)
  return sched


# ------------------------------------------------------------------------------ profiles

def test_default_profile_is_the_preset_of_the_backend():
  assert config_lib.current().profile is None
  want = Profile.preset(dispatch.DEFAULT_PRESET[jax.default_backend()])
  assert dispatch.profile_in_use() == want
  assert dispatch.profile_in_use().name == "cpu"   # the tests run on the CPU backend
  assert dispatch.trusted(dispatch.profile_in_use())   # measured here


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_profile_in_use_precedence(name):
  other = "dcn" if name != "dcn" else "h100-nvlink"
  mine = trusted_copy(other, name="mine")
  assert dispatch.profile_in_use(name) == Profile.preset(name)
  assert dispatch.profile_in_use(mine) is mine
  with jaxcoll.config(profile=name):
    assert dispatch.profile_in_use() == Profile.preset(name)        # configured beats default
    assert dispatch.profile_in_use(other) == Profile.preset(other)  # the argument beats both
    assert dispatch.profile_in_use(mine) is mine
    with jaxcoll.config(profile=mine):
      assert dispatch.profile_in_use() is mine                      # the innermost config
    assert dispatch.profile_in_use() == Profile.preset(name)
  assert dispatch.profile_in_use() == Profile.preset("cpu")


def test_trusted_means_measured_on_this_backend_or_given():
  backend = jax.default_backend()
  assert dispatch.trusted(Profile.preset("cpu")) == (backend == "cpu")
  for name in ("h100-nvlink", "h200-nvlink", "infiniband-ndr400", "tpu-v5p-ici", "dcn"):
    assert not dispatch.trusted(Profile.preset(name)), name   # data sheets: never measured
    assert dispatch.trusted(trusted_copy(name))
  assert dispatch.trusted(dataclasses.replace(Profile.preset("dcn"), basis=backend))
  other = "tpu" if backend != "tpu" else "gpu"
  assert not dispatch.trusted(dataclasses.replace(Profile.preset("dcn"), basis=other))


# -------------------------------------------------------------------- explicit algorithms

@pytest.mark.parametrize("primitive", jaxcoll.PRIMITIVES)
def test_an_explicit_name_resolves_to_itself_whatever_is_configured(primitive, monkeypatch):
  names = jaxcoll.algorithms(primitive, num_axes=1)
  monkeypatch.setenv(config_lib.ENV_ALGORITHM, f"{primitive}={names[0]}")
  with jaxcoll.config(algorithm={primitive: names[-1]}, profile="dcn"):
    for name in names:
      for shape in (FLAT, (("x",), (1,)), (("x",), (3,))):
        algorithm, options = resolve(primitive, name, shape)
        assert algorithm == name
        if name == "native":
          assert options == {}
        else:
          check_runs(primitive, algorithm, options, shape[1][0])


@pytest.mark.parametrize("primitive,algorithm,match", [
    ("all_reduce", "bogus", r"algorithm='bogus' does not apply to all_reduce"),
    ("all_reduce", "bruck", r"algorithm='bruck' does not apply to all_reduce"),
    ("shift", "ring", r"algorithm='ring' does not apply to shift"),
    ("broadcast", "hierarchical", r"algorithm='hierarchical' does not apply to broadcast"),
    ("broadcast", jaxcoll.Hierarchical(), r"'hierarchical' does not apply to broadcast"),
    ("all_reduce", 3, r"algorithm=3: expected a name"),
    ("all_reduce", None, r"algorithm=None: expected a name"),
    ("all_reduce", ("ring",), r"algorithm=\('ring',\): expected a name"),
    ("all_to_some", "ring", r"primitive='all_to_some' is not a collective"),
])
def test_bad_algorithms_are_errors_that_name_them(primitive, algorithm, match):
  with pytest.raises((ValueError, TypeError), match=match):
    resolve(primitive, algorithm)


@pytest.mark.parametrize("primitive", HIERARCHICAL)
@pytest.mark.parametrize("algorithm", ["hierarchical", jaxcoll.Hierarchical(),
                                       jaxcoll.Hierarchical(pieces=(2,))])
def test_hierarchical_over_one_axis_is_an_error(primitive, algorithm):
  for sizes in ((8,), (1,)):
    with pytest.raises(ValueError, match=r"tuple of .*mesh axes.*axis_name names"):
      resolve(primitive, algorithm, (("x",), sizes))
  with jaxcoll.config(algorithm={primitive: algorithm}):   # through auto too
    with pytest.raises(ValueError, match=r"tuple of .*mesh axes"):
      resolve(primitive, "auto", (("x",), (8,)))


PER_AXIS = {"all_reduce": ("recursive_doubling", "halving_doubling"),
            "reduce_scatter": ("halving_doubling", "direct"),
            "all_gather": ("bruck", None),
            "all_to_all": ("bruck", "direct")}


@pytest.mark.parametrize("primitive", HIERARCHICAL)
@pytest.mark.parametrize("shape", [(2, 4), (4, 2), (1, 8), (2, 2, 2)])
@pytest.mark.parametrize("kind", ["name", "default", "per_axis", "pieces"])
def test_hierarchical_values_resolve_to_their_schedule(primitive, shape, kind):
  k = len(shape)
  names = ("a", "b", "c")[:k]
  per_axis = PER_AXIS[primitive] if k == 2 else (None,) * k
  value = {"name": "hierarchical", "default": jaxcoll.Hierarchical(),
           "per_axis": jaxcoll.Hierarchical(per_axis),
           "pieces": jaxcoll.Hierarchical(pieces=(3,) + (1,) * (k - 1))}[kind]
  n = math.prod(shape)
  want = jaxcoll.schedule(primitive, "hierarchical", n, axis_sizes=shape,
                          **({"per_axis": per_axis} if kind == "per_axis" else {}),
                          **({"stage_pieces": value.pieces} if kind == "pieces" else {}))
  for how in ("argument", "config"):
    if how == "argument":
      algorithm, options = resolve(primitive, value, (names, shape))
    else:
      with jaxcoll.config(algorithm={primitive: value}):
        algorithm, options = resolve(primitive, "auto", (names, shape))
    assert algorithm == "hierarchical"
    sched = check_runs(primitive, algorithm, options, n)
    assert sched.axis_sizes == shape
    assert sched.num_steps == want.num_steps
    assert axis_traffic(sched) == pytest.approx(axis_traffic(want))


# -------------------------------------------------------------------------------- auto

@pytest.mark.parametrize("primitive", jaxcoll.PRIMITIVES)
def test_auto_on_one_device_is_native_under_any_profile(primitive):
  eager = trusted_copy("dcn", native=(jaxcoll.NativeTimes(primitive, (1,), (1.0,), (1e3,)),))
  for prof in (*PRESET_NAMES, eager):
    with jaxcoll.config(profile=prof):
      for shape in ((("x",), (1,)), (("a", "b"), (1, 1))):
        for native_allowed in (True, False):
          assert resolve(primitive, shape=shape, native_allowed=native_allowed) == ("native", {})
        assert auto_label(primitive, *shape, 1 << 20,
                                   dispatch.profile_in_use()) == "native"


@pytest.mark.parametrize("primitive", jaxcoll.PRIMITIVES)
def test_an_override_precedes_native_on_one_device(primitive):
  name = jaxcoll.algorithms(primitive, num_axes=1)[0]
  with jaxcoll.config(algorithm={primitive: name}):
    assert resolve(primitive, shape=(("x",), (1,))) == (name, {})
    assert auto_label(primitive, ("x",), (1,), 64, dispatch.profile_in_use()) == name


def test_overrides_are_applied_most_specific_first(monkeypatch):
  monkeypatch.setenv(config_lib.ENV_ALGORITHM, "all_reduce=recursive_doubling")
  assert resolve("all_reduce")[0] == "recursive_doubling"            # env beats the model
  with jaxcoll.config(algorithm={"all_reduce": "binomial_tree"}):
    assert resolve("all_reduce")[0] == "binomial_tree"                # config beats env
    assert resolve("all_reduce", "ring")[0] == "ring"                 # the argument beats all
    assert resolve("all_gather")[0] == "native"                       # other primitives: auto
  monkeypatch.setenv(config_lib.ENV_ALGORITHM, "all_reduce=bogus")
  with pytest.raises(ValueError, match="JAXCOLL_ALGORITHM"):
    resolve("all_reduce")


@pytest.mark.parametrize("primitive", jaxcoll.PRIMITIVES)
@pytest.mark.parametrize("name", UNTRUSTED)
def test_untrusted_presets_keep_native_unless_it_is_not_allowed(primitive, name):
  with jaxcoll.config(profile=name):
    for shape in (FLAT, TWO_AXES):
      for nbytes in NBYTES:
        assert resolve(primitive, shape=shape, nbytes=nbytes) == ("native", {})
        weighed = dispatch.candidates(primitive, *shape, nbytes, Profile.preset(name))
        best = min(weighed[1:], key=lambda c: c.predicted_s)
        got = resolve(primitive, shape=shape, nbytes=nbytes, native_allowed=False)
        assert got == (best.algorithm, dict(best.options))
        assert auto_label(primitive, *shape, nbytes, Profile.preset(name),
                                   native_allowed=False) == best.label


def predictions(primitive, prof, shape, nbytes):
  """Native's and every flat algorithm's (default options) predicted seconds, from cost."""
  names, sizes = shape
  n = math.prod(sizes)
  native = cost.predict_native(primitive, prof, names, sizes, nbytes)
  flat = {a: cost.predict(jaxcoll.schedule(primitive, a, n), prof, names, sizes, nbytes)
          for a in jaxcoll.algorithms(primitive, num_axes=1) if a != "native"}
  return native, flat


@pytest.mark.parametrize("primitive", jaxcoll.PRIMITIVES)
@pytest.mark.parametrize("name", ["h100-nvlink", "infiniband-ndr400", "dcn"])
def test_auto_under_a_trusted_profile_follows_the_margin_rule(primitive, name):
  """Native unless the fastest schedule is predicted NATIVE_MARGIN times faster; then the
  fastest (never slower than any flat algorithm with default options)."""
  prof = trusted_copy(name)
  picked_a_schedule = False
  with jaxcoll.config(profile=prof):
    for shape in (FLAT, TWO_AXES):
      for nbytes in NBYTES:
        native_s, flat = predictions(primitive, prof, shape, nbytes)
        algorithm, options = resolve(primitive, shape=shape, nbytes=nbytes)
        if algorithm == "native":
          assert all(t * dispatch.NATIVE_MARGIN >= native_s for t in flat.values())
          continue
        picked_a_schedule = True
        n = math.prod(shape[1])
        sched = jaxcoll.schedule(primitive, algorithm, n, **options)
        t = cost.predict(sched, prof, *shape, nbytes)
        assert t * dispatch.NATIVE_MARGIN < native_s
        assert t <= min(flat.values()) * (1 + 1e-12)
  if primitive == "all_reduce":   # NCCL's ring/tree lose to halving-doubling somewhere
    assert picked_a_schedule


def measured_native(primitive, prof, sizes, seconds):
  times = jaxcoll.NativeTimes(primitive, tuple(sizes), (1.0,), (seconds,))
  return dataclasses.replace(prof, native=(times,))


@pytest.mark.parametrize("primitive", ["all_reduce", "all_gather", "all_to_all", "broadcast"])
@pytest.mark.parametrize("shape", [FLAT, TWO_AXES])
def test_native_is_kept_up_to_exactly_the_margin(primitive, shape):
  nbytes = 1 << 20
  prof = measured_native(primitive, trusted_copy("infiniband-ndr400"), shape[1], 1e3)
  weighed = dispatch.candidates(primitive, *shape, nbytes, prof)
  best = min(weighed[1:], key=lambda c: c.predicted_s)
  edge = best.predicted_s * dispatch.NATIVE_MARGIN
  for native_s, want in ((edge * 0.99, "native"), (edge, "native"),
                         (edge * 1.01, best.algorithm), (edge * 100, best.algorithm)):
    with jaxcoll.config(profile=measured_native(primitive, prof, shape[1], native_s)):
      algorithm, options = resolve(primitive, shape=shape, nbytes=nbytes)
    assert algorithm == want, (native_s / edge, algorithm)
    if want != "native":
      assert options == dict(best.options)


def test_pick_rule_on_real_candidates():
  weighed = dispatch.candidates("all_reduce", *FLAT, 1 << 22, Profile.preset("cpu"))
  native, *scheduled = weighed
  best = min(scheduled, key=lambda c: c.predicted_s)
  with_native = lambda s: [dataclasses.replace(native, predicted_s=s), *scheduled]  # noqa: E731
  edge = best.predicted_s * dispatch.NATIVE_MARGIN
  for native_s, trusted, allowed, want in [
      (edge, True, True, "native"),                  # exactly the margin: native kept
      (edge * 0.999, True, True, "native"),
      (edge * 1.001, True, True, "best"),
      (edge * 1e6, False, True, "native"),           # untrusted: native wherever allowed
      (best.predicted_s / 1e6, True, False, "best"),  # not allowed: the fastest schedule
      (edge * 1e6, False, False, "best")]:
    weighed = with_native(native_s)
    got = dispatch.pick(weighed, trusted=trusted, native_allowed=allowed)
    assert got is (weighed[0] if want == "native" else best), (native_s / edge, trusted, allowed)
  assert dispatch.pick([native]) is native                     # nothing else to weigh
  # ties go to the order of algorithms(): the first candidate of the tied ones
  tied = [dataclasses.replace(c, predicted_s=1.0) for c in scheduled]
  order = [a for a in jaxcoll.algorithms("all_reduce", num_axes=1) if a != "native"]
  assert [c.algorithm for c in scheduled if c.algorithm in order][0] == order[0]
  assert dispatch.pick([dataclasses.replace(native, predicted_s=10.0), *tied]) is tied[0]
  assert dispatch.pick([dataclasses.replace(native, predicted_s=10.0), *tied[::-1]]) \
      is tied[-1]


@pytest.mark.parametrize("primitive", jaxcoll.PRIMITIVES)
@pytest.mark.parametrize("shape", [FLAT, TWO_AXES, (("a", "b", "c"), (2, 2, 2))])
def test_candidates_are_native_then_every_algorithm_that_runs_here(primitive, shape):
  names, sizes = shape
  n = math.prod(sizes)
  prof = Profile.preset("h100-nvlink")
  weighed = dispatch.candidates(primitive, names, sizes, 1 << 20, prof)
  native, *scheduled = weighed
  assert (native.label, native.algorithm, native.options, native.schedule) == (
      "native", "native", (), None)
  assert native.predicted_s == cost.predict_native(primitive, prof, names, sizes, 1 << 20)
  runs_here = set(jaxcoll.algorithms(primitive, num_axes=len(sizes))) - {"native"}
  assert {c.algorithm for c in scheduled} == runs_here
  assert len({c.label for c in weighed}) == len(weighed)       # labels tell them apart
  for c in scheduled:
    assert 0 < c.predicted_s < math.inf
    assert (c.schedule.primitive, c.schedule.axis_size) == (primitive, n)
    rebuilt = jaxcoll.schedule(primitive, c.algorithm, n, **dict(c.options))
    assert rebuilt.num_steps == c.schedule.num_steps
    assert axis_traffic(rebuilt, sizes) == pytest.approx(axis_traffic(c.schedule, sizes))
    assert c.predicted_s == pytest.approx(cost.predict(c.schedule, prof, names, sizes, 1 << 20))


@pytest.mark.parametrize("primitive", jaxcoll.PRIMITIVES)
def test_auto_label_names_what_resolve_runs(primitive):
  for prof in ("cpu", trusted_copy("infiniband-ndr400"), trusted_copy("dcn")):
    with jaxcoll.config(profile=prof):
      for shape in (FLAT, TWO_AXES):
        for nbytes in NBYTES:
          profile = dispatch.profile_in_use()
          label = auto_label(primitive, *shape, nbytes, profile)
          got = resolve(primitive, shape=shape, nbytes=nbytes)
          assert got == resolve(primitive, shape=shape, nbytes=nbytes)   # pure
          match = [c for c in dispatch.candidates(primitive, *shape, nbytes, profile)
                   if c.label == label]
          assert len(match) == 1
          assert (match[0].algorithm, dict(match[0].options)) == got


def test_a_hierarchical_override_for_a_primitive_without_it_is_rejected():
  """Accepted or not by jaxcoll.config, it must never resolve for broadcast."""
  with pytest.raises(ValueError, match=r"hierarchical.*broadcast"):
    with jaxcoll.config(algorithm={"broadcast": jaxcoll.Hierarchical()}):
      resolve("broadcast", shape=TWO_AXES)


@pytest.mark.quick
def test_the_decision_is_one_for_calls_explain_the_log_and_the_bench():
  """One process: what a traced call runs, explain, the debug log and jaxcoll-bench agree
  (tests/mp_worker.py checks the same across two processes, under both launch modes)."""
  mesh = jax.make_mesh((2, 4), ("node", "local"))
  assert helpers.auto_disagreements(mesh, trusted_copy("cpu")) == []
  assert helpers.auto_disagreements(mesh, "cpu") == []
