"""jaxcoll.moe: expert-parallel mixture-of-experts routing, dispatch and combine."""

from jaxcoll._src.integrations.moe import (
  RoutingState,
  capacity,
  combine,
  dispatch,
  load_balancing_loss,
  route,
  router_z_loss,
)
from jaxcoll._src.integrations.moe_cost import MoECall, MoEExplanation
from jaxcoll._src.integrations.moe_cost import explain_moe as explain

__all__ = ("MoECall", "MoEExplanation", "RoutingState", "capacity", "combine", "dispatch",
           "explain", "load_balancing_loss", "route", "router_z_loss")
