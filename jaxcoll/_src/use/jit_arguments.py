"""What ``use`` keeps of ``jax.jit``: which arguments are traced, static or donated, the
program's cache key, and the layouts a jitted function, ``use``'s own shardings or the
arguments declare for inputs and outputs (docs/guide/training.md, "What use keeps from
jit")."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxcoll._src import compat
from jaxcoll._src.use.placement import entries, explicit

ABSTRACT_OR_ARRAY = (jax.Array, np.ndarray, np.generic, jax.core.Tracer, jax.ShapeDtypeStruct)


def arguments(fun, args, kwargs) -> tuple[list, object, list[int], set[int]]:
  """``(leaves, tree, dynamic, donated)``: the argument leaves of ``(args, kwargs)``, the
  positions of those traced (``dynamic``) and of those donated.

  Traced: arrays, tracers and ``jax.ShapeDtypeStruct``s (an argument given by its type
alone, to lower ahead of time); for a function ``jax.jit`` wrapped, also Python numbers
  outside its static arguments (weakly typed, as jit traces them: a new learning rate is
  no new program), and its donated arguments are donated. Any other leaf (a function, a
  config field, a Python number given to a plain function) passes to the function as it
  is, as jit passes its static arguments."""
  flat, tree = jax.tree_util.tree_flatten_with_path((args, kwargs))
  jitted = compat.jit_arguments(fun)
  static, static_names, donate, donate_names = jitted or ((),) * 4

  def where(path):   # ("pos", index) or ("name", keyword) of the argument a leaf is in
    top, arg = path[0].idx, path[1]
    return ("pos", arg.idx) if top == 0 else ("name", arg.key)

  dynamic, donated = [], set()
  for i, (path, x) in enumerate(flat):
    kind, arg = where(path)
    is_static = arg in (static if kind == "pos" else static_names)
    if isinstance(x, ABSTRACT_OR_ARRAY) or (
        jitted is not None and not is_static and isinstance(x, (bool, int, float, complex))):
      dynamic.append(i)
      if arg in (donate if kind == "pos" else donate_names):
        donated.add(i)
  return [x for _, x in flat], tree, dynamic, donated


def type_key(x):
  """What a traced argument's program depends on: its shape, dtype and weak type (an
  array and the ``ShapeDtypeStruct`` of its type alike)."""
  if isinstance(x, jax.ShapeDtypeStruct):
    return tuple(x.shape), np.dtype(x.dtype), bool(x.weak_type)
  return jnp.shape(x), jnp.result_type(x), jax.typeof(x).weak_type


def static_key(x):
  try:
    hash(x)
    return ("static", type(x), x)
  except TypeError:
    return ("static", id(x))


def in_memory(x, sharding):
  """``x`` moved to the memory a declared output sharding names (``memory_kind``, e.g.
  "pinned_host"), as jit's ``out_shardings`` moves it; as it is for device memory."""
  kind = getattr(sharding, "memory_kind", None)
  if kind is None or kind == "device":
    return x
  return jax.device_put(x, sharding)


def leaf_names(in_tree, dynamic) -> list[str]:
  """The names of the array arguments, as ``jax.jit``'s errors write them
  (``args[0]['w']``)."""
  tree = jax.tree.unflatten(in_tree, list(range(in_tree.num_leaves)))
  paths = {i: jax.tree_util.keystr(path) for path, i in
           jax.tree_util.tree_flatten_with_path(tree)[0]}
  return ["args" + paths[i][3:] if paths[i].startswith("[0]") else "kwargs" + paths[i][3:]
          for i in dynamic]


def merge(first, second):
  """Per leaf, ``first``'s sharding where it has one, else ``second``'s."""
  if first is None or second is None:
    return first or second
  return [a if a is not None else b for a, b in zip(first, second)]


def jit_layouts(jaxpr) -> tuple[list | None, list | None]:
  """A program that is one jitted function: the NamedShardings its ``in_shardings`` and
  ``out_shardings`` give the program's inputs and outputs (None where unspecified)."""
  if len(jaxpr.eqns) != 1 or jaxpr.eqns[0].primitive.name not in ("pjit", "jit"):
    return None, None
  eqn = jaxpr.eqns[0]

  def named(s):
    return s if isinstance(s, jax.sharding.NamedSharding) else None

  is_var = lambda v: not isinstance(v, jax.extend.core.Literal)   # noqa: E731
  ins = [None] * len(jaxpr.invars)
  position = {v: i for i, v in enumerate(jaxpr.invars)}
  for v, s in zip(eqn.invars, eqn.params["in_shardings"]):
    if is_var(v) and v in position and named(s) is not None:
      ins[position[v]] = named(s)
  made = dict(zip(eqn.outvars, eqn.params["out_shardings"]))
  outs = [named(made.get(v)) if is_var(v) else None for v in jaxpr.outvars]
  return (ins if any(ins) else None), (outs if any(outs) else None)


def typed_layouts(outvars, manual) -> list | None:
  """The layouts the outputs' types give where the manual axes are Explicit (JAX's
  explicit sharding: a type's spec is where jit puts the value); None elsewhere."""
  def typed(v):
    sharding = getattr(v.aval, "sharding", None)
    return sharding if manual and explicit(getattr(sharding, "mesh", None), manual) else None
  out = [typed(v) for v in outvars]
  return out if any(s is not None for s in out) else None


def flat_shardings(given, tree, argument: str):
  """``given`` (NamedSharding or PartitionSpec leaves: one for all, or a pytree prefix of the
  positional arguments, as ``jax.jit``'s ``in_shardings``, or of the outputs) flattened to
  ``tree``'s leaves (``(args, kwargs)`` or the outputs'); None if not given."""
  if given is None:
    return None
  is_leaf = lambda x: x is None or isinstance(x, (P, jax.sharding.Sharding))  # noqa: E731
  if argument == "in_shardings" and not is_leaf(given):
    given = (tuple(given) if isinstance(given, (tuple, list)) else (given,), None)
  try:
    if is_leaf(given):
      return [given] * tree.num_leaves
    example = jax.tree.unflatten(tree, list(range(tree.num_leaves)))
    out = [None] * tree.num_leaves

    def fill(s, sub):
      for i in jax.tree.leaves(sub):
        out[i] = s
    jax.tree.map(fill, given, example, is_leaf=is_leaf)
    return out
  except ValueError as e:
    raise ValueError(f"use({argument}=...): expected a pytree prefix of the "
                     f"{'arguments (args, kwargs)' if argument == 'in_shardings' else 'outputs'}"
                     f" with NamedSharding or PartitionSpec leaves ({e})") from None


def laid_out(flat) -> tuple | None:
  """The arguments' shardings (None for a NumPy array or a Python number) when none is
  traced and some is laid out over a mesh (split, unreduced or reduced); else None."""
  if not flat or any(isinstance(x, jax.core.Tracer) for x in flat):
    return None
  shardings = tuple(x.sharding if isinstance(x, (jax.Array, jax.ShapeDtypeStruct)) else None
                    for x in flat)
  if not any(isinstance(s, jax.sharding.NamedSharding) and (
      any(entries(s.spec)) or s.spec.unreduced or s.spec.reduced) for s in shardings):
    return None
  return shardings
