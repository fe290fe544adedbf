"""A router declared outside the package, as a user would add one: Mixtral's.

Mixtral (mistralai/mistral-src, ``moe.py``, ``MoeLayer.forward``) picks each token's k
experts by the router's logits and gates them by a softmax over those k logits alone:
``weights, selected_experts = torch.topk(gate_logits, k); weights = softmax(weights)``.
No auxiliary loss. Built only from the public API: one :class:`jaxcoll.moe.Router`.
"""

from __future__ import annotations

import jax

from jaxcoll.moe import Router


def top_k_softmax(logits, k: int, params):
  """``(expert ids [T, k], gates [T, k], losses)``: the k largest logits, their softmax."""
  values, ids = jax.lax.top_k(logits, k)
  return ids, jax.nn.softmax(values.astype("float32"), axis=-1).astype(logits.dtype), {}


MIXTRAL = Router("mixtral", top_k_softmax)
