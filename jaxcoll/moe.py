"""jaxcoll.moe: expert-parallel mixture-of-experts routing, dispatch and combine."""

from jaxcoll._src.moe.cost import MoECall, MoEExplanation, capacity
from jaxcoll._src.moe.cost import explain_moe as explain
from jaxcoll._src.moe.dispatch_combine import (
  RoutingState,
  combine,
  dispatch,
  dispatch_chosen,
  expert_load,
  jitter,
  load_balancing_loss,
  route,
  router_z_loss,
  total_dropped,
)
from jaxcoll._src.moe.grouped_matmul import grouped_matmul
from jaxcoll._src.moe.layer import init_layer, layer
from jaxcoll._src.moe.routers import (
  Router,
  register_router,
  route_biased,
  route_experts,
  unregister_router,
  update_bias,
)

__all__ = ("MoECall", "MoEExplanation", "Router", "RoutingState", "capacity", "combine",
           "dispatch", "register_router", "unregister_router",
           "dispatch_chosen", "expert_load", "explain", "grouped_matmul", "init_layer", "jitter",
           "layer", "load_balancing_loss", "route", "route_biased", "route_experts",
           "router_z_loss", "total_dropped", "update_bias")
