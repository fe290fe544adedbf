"""``use`` lowered and compiled ahead of time, as ``jax.jit`` is: from the arguments' types
(``jax.ShapeDtypeStruct`` with shardings; MaxText's ``train_compile.py`` compiles a step
for a machine it is not on this way) or from a mix of arrays and types, in each of the three
forms a user writes (``use(step)``, ``jax.jit(use(step))``, ``use(jax.jit(step))``). The
executable is the one a call on arrays of those types compiles (the same scheduled module),
and run here it returns the concrete call's values."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcoll

pytestmark = pytest.mark.quick   # reads jaxprs: on every supported jax


def loss(p, x):
  return jnp.mean((jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"]) ** 2)


def step(p, x):
  value, g = jax.value_and_grad(loss)(p, x)
  return jax.tree.map(lambda a, b: a - 0.1 * b, p, g), value


LAYOUTS = {   # mesh shape, axis names, explicit, parameter specs
    "dp8": ((8,), ("data",), False, {"w1": P(), "b1": P(), "w2": P()}),
    "dp_tp_2x4": ((2, 4), ("data", "model"), False,
                  {"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None)}),
    "explicit_dp8": ((8,), ("data",), True, {"w1": P(), "b1": P(), "w2": P()}),
}
FORMS = {
    "use(step)": lambda: jaxcoll.use(step, algorithm="ring"),
    "jit(use(step))": lambda: jax.jit(jaxcoll.use(step, algorithm="ring")),
    "use(jit(step))": lambda: jaxcoll.use(jax.jit(step), algorithm="ring"),
}


def setup(layout):
  shape, names, explicit, specs = LAYOUTS[layout]
  mesh = jax.make_mesh(shape, names, axis_types=(
      AxisType.Explicit if explicit else AxisType.Auto,) * len(shape))
  keys = jax.random.split(jax.random.key(0), 3)
  p = {"w1": jax.random.normal(keys[0], (16, 32)) / 4, "b1": jnp.zeros(32),
       "w2": jax.random.normal(keys[1], (32, 4)) / 6}
  p = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in p.items()}
  x = jax.device_put(jax.random.normal(keys[2], (64, 16)), NamedSharding(mesh, P("data")))
  return mesh, p, x


def program(compiled) -> str:
  """The scheduled module without source locations (where a value was traced from)."""
  text = compiled.as_text().split("\nFileNames")[0]
  return re.sub(r"(, )?metadata=\{[^}]*\}", "", text)


def abstract(a):
  return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding)


@pytest.mark.parametrize("given", ["abstract", "mixed"])
@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_use_compiles_ahead_of_time_from_types(layout, form, given):
  mesh, p, x = setup(layout)
  args = (jax.tree.map(abstract, p), abstract(x)) if given == "abstract" else (p, abstract(x))
  with jax.set_mesh(mesh):
    want = jax.jit(step)(p, x)
    f = FORMS[form]()
    compiled = f.lower(*args).compile()
    from_arrays = f.lower(p, x).compile()
    got = compiled(p, x)
  assert program(compiled) == program(from_arrays)
  hlo = compiled.as_text()
  assert "collective-permute" in hlo and "all-reduce" not in hlo and "all-gather" not in hlo
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    assert g.sharding.is_equivalent_to(w.sharding, g.ndim), (g.sharding, w.sharding)
    scale = 1 + float(jnp.max(jnp.abs(w)))
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=64 * np.finfo(np.float32).eps * scale)


def test_an_executable_called_with_other_arguments_is_a_type_error():
  mesh, p, x = setup("dp8")
  with jax.set_mesh(mesh):
    compiled = jaxcoll.use(step).lower(jax.tree.map(abstract, p), abstract(x)).compile()
    with pytest.raises(TypeError):
      compiled({"w1": p["w1"]}, x)


def test_the_maxtext_decoder_compiles_from_types_as_train_compile_does():
  """The MaxText-style decoder step (``tests/maxtext_decoder.py``: logical axis rules,
  ``nn.scan`` + ``nn.remat``, AdamW) on data x fsdp x tensor, lowered from its arguments'
  types with no mesh in context (as MaxText's ``train_compile.py``; flax's logical
  constraints then name no mesh): the executable equals jit's step on arrays."""
  import maxtext_decoder as mt
  mesh = jax.make_mesh((2, 2, 2), mt.MESH_AXES, axis_types=(AxisType.Auto,) * 3)
  step, types = mt.setup(mesh, mt.Config(scan_layers=True), abstract=True)
  _, args = mt.setup(mesh, mt.Config(scan_layers=True))
  compiled = jaxcoll.use(step, algorithm="ring").lower(*types).compile()
  hlo = compiled.as_text()
  assert "all-reduce" not in hlo and "all-gather" not in hlo
  got, want = compiled(*args), step(*args)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    scale = 1 + float(jnp.max(jnp.abs(w)))
    np.testing.assert_allclose(g, w, rtol=2e-5, atol=1e-5 * scale)
