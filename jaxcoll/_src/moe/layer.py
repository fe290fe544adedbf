"""A whole MoE layer as one function: router, dispatch, the experts' FFN, combine, losses.

:func:`layer` runs inside ``shard_map`` over the expert-parallel axis and calls only
:mod:`jaxcoll.moe`'s public functions, so every dispatch option reaches it. Its parameters
are a plain dict (:func:`init_layer`), flax-friendly: a flax module holds them as params
(the router bias as a non-trained variable) and calls :func:`layer` in ``__call__``.

Parameters (global shapes; the expert weights are sharded over the axis, the rest
replicated):

- ``router``: ``[d, E]``; ``bias``: ``[E]`` (``router="sigmoid"`` only, moved by
  :func:`jaxcoll.moe.update_bias` outside the gradient).
- ``w_gate``, ``w_up``: ``[E, d, f]`` and ``w_out``: ``[E, f, d]`` for SwiGLU experts
  (silu(x w_gate) * (x w_up) w_out); ``w_in`` ``[E, d, f]`` and ``w_out`` for an MLP with
  ``activation`` ("gelu", "relu", "silu").
- ``shared``: the same FFN weights without the E axis, run on every token beside the
  routed experts and added to their output (DeepSeek-MoE's shared experts; ``f`` the
  shared experts' width together).

Which dispatch: ``capacity_factor`` set gives the buffers layout (pairs past the capacity
dropped, as GShard, Switch and MaxText's dense path); None is dropless, the sorted layout
(``layout="auto"``): at the balanced load it sends the same bytes as the buffers layout's
dropless exchange (both send what is routed, rounded to a chunk), and holds R =
``buffer_factor`` * T * k rows instead of E * T * k (docs/guide/moe.md has the memory
table). The all_to_all algorithm, and for the buffers layout the ring of experts, are
``algorithm="auto"``'s choice by the cost model (:func:`jaxcoll.moe.explain`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxcoll._src.moe.cost import capacity
from jaxcoll._src.moe.dispatch_combine import (
  combine,
  dispatch,
  dispatch_chosen,
  expert_load,
  total_dropped,
)
from jaxcoll._src.moe.grouped_matmul import grouped_matmul
from jaxcoll._src.moe.routers import LAYER_OPTIONS, ROUTERS
from jaxcoll.extend import axis_size, check_int, check_number, check_one_of, normalize_axes

ACTIVATIONS = {"swiglu": None, "gelu": jax.nn.gelu, "relu": jax.nn.relu, "silu": jax.nn.silu}


def _weight_names(activation: str) -> tuple[str, ...]:
  """An expert's weights for ``activation``: SwiGLU's gate, up and out; an MLP's in and out."""
  return ("w_gate", "w_up", "w_out") if activation == "swiglu" else ("w_in", "w_out")


def init_layer(key, d: int, ffn: int, num_experts: int, *, activation: str = "swiglu",
               shared_ffn: int = 0, bias: bool = False, dtype=jnp.float32) -> dict:
  """Parameters for :func:`layer` (module docstring), global shapes; shard the expert
  weights over the expert axis (``jax.P(axis)``), replicate the rest.

  Args:
    key: a ``jax.random`` key.
    d: the model width.
    ffn: each expert's hidden width f.
    num_experts: E.
    activation: "swiglu" (three weights per expert) or an MLP's "gelu", "relu", "silu".
    shared_ffn: the shared experts' hidden width (0: none).
    bias: add the ``[E]`` router bias (zeros) of ``router="sigmoid"``.
    dtype: of every weight.

  Returns:
    A dict of arrays: ``router``, the expert weights, and ``shared``, ``bias`` if asked.

  Raises:
    ValueError: a size below 1 (``shared_ffn`` below 0), an unknown ``activation``.

  Example:
    >>> import jax, jaxcoll
    >>> params = jaxcoll.moe.init_layer(jax.random.key(0), 16, 32, 8, shared_ffn=64)
    >>> {k: v.shape for k, v in params.items() if k != "shared"}
    {'router': (16, 8), 'w_gate': (8, 16, 32), 'w_up': (8, 16, 32), 'w_out': (8, 32, 16)}
  """
  for value, where in ((d, "d"), (ffn, "ffn"), (num_experts, "num_experts")):
    check_int(value, where, least=1)
  check_int(shared_ffn, "shared_ffn", least=0)
  check_one_of(activation, tuple(ACTIVATIONS), "activation")
  keys = iter(jax.random.split(key, 8))

  def ffn_weights(lead: tuple, width: int) -> dict:
    normal = lambda shape, fan_in: (jax.random.normal(next(keys), lead + shape, dtype)
                                    / jnp.sqrt(fan_in).astype(dtype))
    return {name: normal((width, d), width) if name == "w_out" else normal((d, width), d)
            for name in _weight_names(activation)}

  params = {"router": jax.random.normal(next(keys), (d, num_experts), dtype) * 0.02,
            **ffn_weights((num_experts,), ffn)}
  if shared_ffn:
    params["shared"] = ffn_weights((), shared_ffn)
  if bias:
    params["bias"] = jnp.zeros((num_experts,), jnp.float32)
  return params


def _ffn(weights: dict, h, activation: str, matmul):
  """The FFN of ``weights`` on ``h`` with ``matmul(h, w)`` the product by each weight."""
  if activation == "swiglu":
    hidden = jax.nn.silu(matmul(h, weights["w_gate"])) * matmul(h, weights["w_up"])
  else:
    hidden = ACTIVATIONS[activation](matmul(h, weights["w_in"]))
  return matmul(hidden, weights["w_out"])


def layer(params: dict, x, *, axis_name, k: int | None = None, router: str = "softmax",
          capacity_factor: float | None = 1.25, layout: str = "auto",
          activation: str = "swiglu", key=None, groups: int = 1, top_groups: int = 1,
          buffer_factor: float | None = None, algorithm="auto", wire_dtype=None,
          combine_wire_dtype=None):
  """One MoE layer on this device's tokens, inside ``shard_map`` over ``axis_name``.

  Args:
    params: :func:`init_layer`'s dict, the expert weights this device's ``[E/N, ...]``.
    x: this device's tokens ``[T, d]``.
    axis_name: the expert-parallel mesh axis (or tuple).
    k: experts per token (default 2); not for ``router="experts"``, where the experts
      choose.
    router: "softmax" (:func:`route`: top-k, Switch's load-balancing loss and the router
      z-loss), "sigmoid" (:func:`route_biased` by ``params["bias"]``: DeepSeek-V3, no
      balancing loss; ``groups`` and ``top_groups`` limit the groups a token reaches), or
      "experts" (:func:`route_experts`: each expert takes capacity(T, E, 1,
      capacity_factor) tokens; never drops, needs a ``capacity_factor``).
    capacity_factor: slots per expert over the balanced load (:func:`capacity`, GShard's
      convention); None: dropless.
    layout: "auto" (buffers with a capacity, sorted when dropless), "buffers" or "sorted"
      (:func:`dispatch`).
    activation: "swiglu", "gelu", "relu" or "silu", as ``params`` were made.
    key: a ``jax.random`` key for the softmax router's Gumbel noise (:func:`route`).
    groups, top_groups: group-limited routing of ``router="sigmoid"``.
    buffer_factor: the sorted layout's bound (:func:`dispatch`).
    algorithm, wire_dtype: the dispatch's; ``combine_wire_dtype`` the combine's.

  Returns:
    ``(y [T, d], aux)``: the routed experts' gated outputs plus the shared experts', and a
    dict: ``load_balancing_loss`` and ``router_z_loss`` (this device's, float32; 0 for
    routers that need none), ``dropped`` (pairs dropped over the whole axis) and ``load``
    (``[E]`` pairs per expert over the axis: :func:`update_bias`'s input).

  Raises:
    ValueError: an unknown ``router``, ``layout`` or ``activation``; expert weights not
      this device's ``[E/N, ...]``; options that do not apply (a ``key`` with a router other
      than softmax, a ``bias`` missing for sigmoid, expert choice with a ``k``, without a
      capacity factor or with the sorted layout, groups without the sigmoid router); and
      :func:`dispatch`'s errors.

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np, jaxcoll
    >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("expert",))
    >>> params = jaxcoll.moe.init_layer(jax.random.key(0), 16, 32, 8, shared_ffn=32)
    >>> specs = jax.tree.map(lambda _: jax.P(), params)
    >>> specs.update({w: jax.P("expert") for w in ("w_gate", "w_up", "w_out")})
    >>> def step(params, x):
    ...   y, aux = jaxcoll.moe.layer(params, x, axis_name="expert", capacity_factor=None)
    ...   return y, aux["dropped"][None]
    >>> f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(specs, jax.P("expert")),
    ...                           out_specs=(jax.P("expert"), jax.P())))
    >>> y, dropped = f(params, jnp.ones((64, 16)))
    >>> y.shape, int(dropped[0])
    ((64, 16), 0)
  """
  check_one_of(router, tuple(ROUTERS), "router")
  check_one_of(layout, ("auto", "buffers", "sorted"), "layout")
  check_one_of(activation, tuple(ACTIVATIONS), "activation")
  if capacity_factor is not None:
    check_number(capacity_factor, "capacity_factor", above=0)
  chosen = ROUTERS[router]
  options = _router_options(chosen, key=key, groups=groups, top_groups=top_groups)
  for name in chosen.params:
    if name not in params:
      raise ValueError(f"router={router!r} chooses by params[{name!r}] (init_layer(..., "
                       f"{name}=True))")
  x = jnp.asarray(x)
  logits = x @ params["router"].astype(x.dtype)
  t, e = logits.shape
  n = axis_size(normalize_axes(axis_name))
  local = _local(params, e // n, activation)
  sorted_ = layout == "sorted" or (layout == "auto" and capacity_factor is None)
  if chosen.expert_choice:
    if k is not None:
      raise ValueError(f"k={k!r} applies to the token-choice routers; with router={router!r} "
                       f"each expert chooses its tokens")
    if capacity_factor is None or layout == "sorted":
      raise ValueError(f"router={router!r} fills every expert to capacity(T, E, 1, "
                       "capacity_factor) in the buffers layout: give a capacity_factor and "
                       "layout 'auto' or 'buffers'")
    tokens, gates, losses = chosen.route(logits, capacity(t, e, 1, capacity_factor), params,
                                         **options)
    h, state = dispatch_chosen(x, tokens, axis_name=axis_name, algorithm=algorithm,
                               wire_dtype=wire_dtype)
  else:
    k = 2 if k is None else k
    ids, gates, losses = chosen.route(logits, k, params, **options)
    h, state = dispatch(x, ids, num_experts=e, capacity=None if capacity_factor is None
                        else capacity(t, e, k, capacity_factor), axis_name=axis_name,
                        algorithm=algorithm, wire_dtype=wire_dtype,
                        layout="sorted" if sorted_ else "buffers", buffer_factor=buffer_factor)
  zero = jnp.zeros((), jnp.float32)
  aux = {"load_balancing_loss": zero, "router_z_loss": zero, **losses}
  if state.layout == "sorted":
    matmul = lambda a, w: grouped_matmul(a, w.astype(a.dtype), state.group_sizes)
  else:
    matmul = lambda a, w: jnp.einsum("lcd,ldf->lcf", a, w.astype(a.dtype))
  y = combine(_ffn(local, h, activation, matmul), state, gates,
                  wire_dtype=combine_wire_dtype)
  if "shared" in params:
    y = y + _ffn(params["shared"], x, activation, lambda a, w: a @ w.astype(a.dtype))
  aux.update(dropped=total_dropped(state), load=expert_load(state))
  return y, aux


def _router_options(chosen, **given) -> dict:
  """The routing options ``chosen`` takes, from the layer's (``given``); an error for one it
  does not take that was given a value other than its default."""
  def is_default(name):
    default = LAYER_OPTIONS[name]
    return given[name] is None if default is None else given[name] == default
  stray = [name for name in given if name not in chosen.options and not is_default(name)]
  if stray:
    takers = [r.name for r in ROUTERS.values() if set(stray) & set(r.options)]
    named = [n if LAYER_OPTIONS[n] is None else f"{n}={given[n]!r}" for n in stray]
    raise ValueError(f"{', '.join(named)} appl{'ies' if len(stray) == 1 else 'y'} to router="
                     f"{' or '.join(map(repr, takers)) or 'none'}; this layer's router is "
                     f"{chosen.name!r}")
  return {name: given[name] for name in chosen.options}


def _local(params: dict, local: int, activation: str) -> dict:
  """The expert weights, checked to be this device's ``[E/N, ...]``."""
  names = _weight_names(activation)
  missing = [w for w in names if w not in params]
  if missing:
    raise ValueError(f"params lack {missing} for activation={activation!r} (init_layer makes "
                     f"them)")
  for w in names:
    if params[w].ndim != 3 or params[w].shape[0] != local:
      raise ValueError(f"params[{w!r}] must be this device's experts [E/N = {local}, ...] "
                       f"(shard them over the axis), got shape {params[w].shape}")
  return {w: params[w] for w in names}
