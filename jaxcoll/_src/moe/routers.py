"""Routers beside :func:`jaxcoll.moe.route`: DeepSeek-V3's biased, group-limited top-k, and
expert choice.

DeepSeek-V3 (arXiv:2412.19437, section 2.1.2) scores experts with a sigmoid, picks a token's
k experts by score + a per-expert bias, and gates them by the score alone, normalised over
the k. The bias balances the load without an auxiliary loss: after each step it moves by
a fixed rate toward the mean load (down for an expert above it, up below it), outside the
gradient. Group-limited routing first keeps the ``top_groups`` of ``groups`` equal groups of
experts (each group scored by the sum of its two best biased scores), then picks the k
among them: with groups laid out by device or node, a token reaches at most ``top_groups``
of them. The selection and gates equal MaxText's ``deepseek_routing`` (with its
``GateLogit`` scores and ``deepseek_scale_weights``), the JAX reference of DeepSeek-V3's
``Gate`` (``tests/test_moe.py``).

Expert choice (Zhou et al., arXiv:2202.09368) turns the choice around: each expert takes
the C tokens with the highest router probability for it (softmax over the experts), so
every expert is exactly full, a token may go to several experts or none, and no
balancing loss is needed. As flaxformer's ``ExpertsChooseMaskedRouter``, the tokens are
this device's (its group); not for decoders, whose tokens would see the future.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
from jax import lax

from jaxcoll._src.declarations import Declarations
from jaxcoll._src.moe.dispatch_combine import (
  _logits,
  load_balancing_loss,
  route,
  router_z_loss,
)
from jaxcoll.extend import check_int, check_number, check_one_of

SCORES = {"sigmoid": jax.nn.sigmoid, "softmax": lambda s: jax.nn.softmax(s, axis=-1)}


def route_biased(logits, k: int, bias=None, *, score: str = "sigmoid", groups: int = 1,
                 top_groups: int = 1, scale: float = 1.0):
  """Top-k routing by ``score(logits) + bias``, gated by the score alone (DeepSeek-V3).

  Args:
    logits: ``[T, E]`` router logits.
    k: choices per token, at most the experts in ``top_groups`` groups.
    bias: ``[E]`` added to the scores to choose (:func:`update_bias`), never to the gates;
      None: no bias.
    score: "sigmoid" (DeepSeek-V3: the k gates are then normalised to sum to 1) or
      "softmax" (over the E experts; the gates are not renormalised).
    groups: split the E experts into this many equal groups (consecutive ids).
    top_groups: keep each token's this many best groups (a group scores the sum of its
      two best biased scores), then choose its k experts among them.
    scale: multiply the gates by this (DeepSeek-V3's ``route_scale``).

  Returns:
    ``(expert_ids [T, k] int32, gates [T, k])``, gates in the logits' dtype, for
    :func:`jaxcoll.moe.dispatch` and :func:`jaxcoll.moe.combine`.

  Raises:
    ValueError: ``logits`` not 2-D; a ``bias`` not ``[E]``; ``groups`` that does not divide
      E; ``top_groups`` outside [1, groups]; ``k`` outside [1, the experts of top_groups
      groups]; an unknown ``score``; a ``scale`` that is not a finite number above 0.

  Example:
    >>> import jax.numpy as jnp, jaxcoll
    >>> logits = jnp.array([[2.0, 1.0, 0.0, -1.0]])
    >>> ids, gates = jaxcoll.moe.route_biased(logits, 2, jnp.array([0.0, 0.0, 1.0, 0.0]))
    >>> ids.tolist()                      # the bias lifts expert 2 above expert 1
    [[2, 0]]
    >>> round(float(gates.sum()), 4)      # gates: the sigmoid scores, normalised
    1.0
  """
  logits = _logits(logits, "route_biased")
  t, e = logits.shape
  check_one_of(score, tuple(SCORES), "score")
  check_int(groups, "groups", least=1, most=e)
  if e % groups:
    raise ValueError(f"groups={groups} must divide the {e} experts")
  check_int(top_groups, "top_groups", least=1, most=groups)
  per_group = e // groups
  check_int(k, "k", least=1, most=top_groups * per_group)
  check_number(scale, "scale", above=0)
  scores = SCORES[score](logits.astype(jnp.float32))
  choose_by = scores
  if bias is not None:
    bias = jnp.asarray(bias)
    if bias.shape != (e,):
      raise ValueError(f"bias must be [E] = [{e}], got shape {bias.shape}")
    choose_by = scores + bias.astype(jnp.float32)
  if top_groups < groups:
    grouped = choose_by.reshape(t, groups, per_group)
    group_scores = jnp.sum(lax.top_k(grouped, min(2, per_group))[0], axis=-1)    # [T, groups]
    kept = jnp.sum(jax.nn.one_hot(lax.top_k(group_scores, top_groups)[1], groups), axis=-2)
    choose_by = jnp.where(kept[..., None] > 0, grouped, -jnp.inf).reshape(t, e)
  ids = lax.top_k(choose_by, k)[1]
  gates = jnp.take_along_axis(scores, ids, axis=-1)
  if score == "sigmoid":
    gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
  return ids.astype(jnp.int32), (gates * scale).astype(logits.dtype)


def update_bias(bias, load, rate: float = 1e-3):
  """DeepSeek-V3's auxiliary-loss-free balancing step: each expert's bias moves by ``rate``
  toward the mean load (``bias + rate * sign(mean(load) - load)``). Call it outside the
  gradient, once a step, with the global load (:func:`jaxcoll.moe.expert_load`).

  Args:
    bias: ``[E]`` the bias :func:`route_biased` chooses by.
    load: ``[E]`` pairs routed to each expert (over the whole axis, so every device moves
      its bias alike).
    rate: the step (DeepSeek-V3's bias update speed, 0.001 for most of its training).

  Returns:
    The new ``[E]`` bias, in ``bias``'s dtype.

  Raises:
    ValueError: ``bias`` and ``load`` not both ``[E]``; a negative ``rate``.

  Example:
    >>> import jax.numpy as jnp, jaxcoll
    >>> jaxcoll.moe.update_bias(jnp.zeros(3), jnp.array([6, 2, 4]), 0.5).tolist()
    [-0.5, 0.5, 0.0]
  """
  bias, load = jnp.asarray(bias), jnp.asarray(load)
  if bias.ndim != 1 or load.shape != bias.shape:
    raise ValueError(f"update_bias: bias and load must both be [E], got shapes {bias.shape} "
                     f"and {load.shape}")
  check_number(rate, "rate", least=0)
  load = load.astype(jnp.float32)
  return (bias + rate * jnp.sign(jnp.mean(load) - load)).astype(bias.dtype)


def route_experts(logits, capacity: int):
  """Expert-choice routing: each expert's top ``capacity`` tokens of this device by router
  probability (softmax over the experts, in float32), and those probabilities as gates.

  Equal to flaxformer's ``ExpertsChooseMaskedRouter`` (``tests/test_moe_sorted.py``); feed
  :func:`jaxcoll.moe.dispatch_chosen` and :func:`jaxcoll.moe.combine`.

  Args:
    logits: ``[T, E]`` router logits.
    capacity: C, tokens per expert, at most T (:func:`jaxcoll.moe.capacity` with k = 1 gives
      the usual C = T * f / E).

  Returns:
    ``(token_ids [E, C] int32, gates [E, C])``, each expert's tokens in descending
    probability, gates in the logits' dtype.

  Raises:
    ValueError: ``logits`` not 2-D, ``capacity`` outside [1, T].

  Example:
    >>> import jax.numpy as jnp, jaxcoll
    >>> logits = jnp.array([[3.0, 0.0], [2.0, 0.0], [0.0, 1.0]])
    >>> tokens, gates = jaxcoll.moe.route_experts(logits, 2)
    >>> tokens.tolist()        # expert 0 takes tokens 0 and 1, expert 1 tokens 2 and 1
    [[0, 1], [2, 1]]
  """
  logits = _logits(logits, "route_experts")
  check_int(capacity, "capacity", least=1, most=logits.shape[0])
  probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
  gates, tokens = lax.top_k(probs.T, capacity)
  return tokens.astype(jnp.int32), gates.astype(logits.dtype)


# ---- the routers of jaxcoll.moe.layer: one declaration each ----

@dataclasses.dataclass(frozen=True)
class Router:
  """A router :func:`jaxcoll.moe.layer` runs by name: one declaration (:func:`register_router`)
  holds what the layer checks and calls.

  Attributes:
    name: what ``layer(router=...)`` names it by.
    route: token choice: ``route(logits [T, E], k, params, **options) -> (expert ids [T, k],
      gates [T, k], losses)``; expert choice: ``route(logits, capacity, params, **options) ->
      (token ids [E, C], gates [E, C], losses)``. ``losses``: a dict of the auxiliary losses
      it adds (``load_balancing_loss``, ``router_z_loss``; those it leaves out are 0).
    options: the layer's routing options it takes, by name, with the layer's defaults
      (``key``, ``groups``, ``top_groups``): any other given a value other than its default
      is an error naming the routers that take it.
    params: the entries of the layer's ``params`` it reads besides ``router`` (checked
      present).
    expert_choice: each expert chooses its tokens (no ``k``; a capacity factor and the
      buffers layout needed).
  """

  name: str
  route: Callable
  options: Mapping[str, object] = dataclasses.field(default_factory=dict)
  params: tuple[str, ...] = ()
  expert_choice: bool = False


ROUTERS: Declarations = Declarations("router")
LAYER_OPTIONS = {"key": None, "groups": 1, "top_groups": 1}   # the layer's routing options


def register_router(router: Router, *, built_in: bool = False) -> Router:
  """Declares a router for :func:`jaxcoll.moe.layer` (``layer(router=router.name)``).

  Args:
    router: the declaration (:class:`Router`).
    built_in: jaxcoll's own (never removed).

  Returns:
    ``router``.

  Raises:
    ValueError: a name already declared; an option the layer does not have.

  Example:
    >>> import jax, jaxcoll
    >>> from jaxcoll.moe import Router, register_router, unregister_router
    >>> def top1(logits, k, params):
    ...   ids, gates = jaxcoll.moe.route(logits, k)
    ...   return ids, gates, {}
    >>> _ = register_router(Router("plain", top1))
    >>> unregister_router("plain")
  """
  unknown = sorted(set(router.options) - set(LAYER_OPTIONS))
  if unknown:
    raise ValueError(f"router {router.name!r} takes options {unknown} the layer does not have; "
                     f"expected some of {sorted(LAYER_OPTIONS)}")
  return ROUTERS.add(router.name, router, built_in=built_in)


def unregister_router(name: str) -> None:
  """Removes a router :func:`register_router` declared.

  Args:
    name: the router's name (absent: nothing to do).

  Returns:
    None.

  Raises:
    ValueError: a built-in router.

  Example:
    >>> import jaxcoll
    >>> jaxcoll.moe.unregister_router("softmax")
    Traceback (most recent call last):
    ...
    ValueError: router 'softmax' is built in
  """
  ROUTERS.remove(name)


def _softmax(logits, k, params, *, key=None):
  ids, gates = route(logits, k, key=key)
  return ids, gates, {"load_balancing_loss": load_balancing_loss(logits, ids),
                      "router_z_loss": router_z_loss(logits)}


def _sigmoid(logits, k, params, *, groups=1, top_groups=1):
  ids, gates = route_biased(logits, k, jax.lax.stop_gradient(params["bias"]), groups=groups,
                            top_groups=top_groups)
  return ids, gates, {}


def _experts(logits, capacity, params):
  tokens, gates = route_experts(logits, capacity)
  return tokens, gates, {}


for _router in (Router("softmax", _softmax, {"key": None}),
                Router("sigmoid", _sigmoid, {"groups": 1, "top_groups": 1}, ("bias",)),
                Router("experts", _experts, expert_choice=True)):
  register_router(_router, built_in=True)
