"""jaxcoll: custom collective communication for JAX, built from ppermute schedules."""

from jaxcoll import distributed, extend, fsdp, kernels, moe, optax, pipeline, tools
from jaxcoll._src.auto.explain import Explanation, Explanations, explain
from jaxcoll._src.auto.profile import Link, NativeTimes, Profile
from jaxcoll._src.calibrate import calibrate
from jaxcoll._src.collective_matmul import (
  all_gather_matmul,
  matmul_all_reduce,
  matmul_reduce_scatter,
)
from jaxcoll._src.collectives import (
  all_gather,
  all_reduce,
  all_to_all,
  broadcast,
  reduce,
  reduce_scatter,
  shift,
)
from jaxcoll._src.config import config
from jaxcoll._src.register import register
from jaxcoll._src.schedules.algorithms import algorithms, schedule
from jaxcoll._src.schedules.algorithms.hierarchical import Hierarchical
from jaxcoll._src.schedules.schedule import PRIMITIVES, AxisTraffic, Schedule, Step, Transfer
from jaxcoll._src.spec import CollectiveSpec, spec
from jaxcoll._src.table import Table
from jaxcoll._src.traffic import Traffic, traffic
from jaxcoll._src.training.data_parallel import data_parallel
from jaxcoll._src.training.gradient_sync import sync_gradients, sync_in_backward
from jaxcoll._src.training.per_device import PerDevice
from jaxcoll._src.use.api import use
from jaxcoll._src.use.step_report import StepReport, explain_step
from jaxcoll._src.wire.formats import WIRE_DTYPES, WireFormat, wire_dtypes

__version__ = "0.1.0"

__all__ = (
    "PRIMITIVES",
    "WIRE_DTYPES",
    "AxisTraffic",
    "CollectiveSpec",
    "Explanation",
    "Explanations",
    "Hierarchical",
    "Link",
    "NativeTimes",
    "PerDevice",
    "Profile",
    "Schedule",
    "StepReport",
    "Step",
    "Table",
    "Traffic",
    "Transfer",
    "WireFormat",
    "algorithms",
    "all_gather",
    "all_gather_matmul",
    "all_reduce",
    "all_to_all",
    "broadcast",
    "calibrate",
    "config",
    "data_parallel",
    "distributed",
    "explain",
    "explain_step",
    "extend",
    "fsdp",
    "kernels",
    "matmul_all_reduce",
    "matmul_reduce_scatter",
    "moe",
    "optax",
    "pipeline",
    "reduce",
    "reduce_scatter",
    "register",
    "schedule",
    "shift",
    "spec",
    "sync_gradients",
    "sync_in_backward",
    "tools",
    "traffic",
    "use",
    "wire_dtypes",
)
