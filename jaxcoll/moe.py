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

__all__ = ("RoutingState", "capacity", "combine", "dispatch", "load_balancing_loss", "route",
           "router_z_loss")
