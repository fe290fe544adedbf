"""jaxcoll: custom collective communication for JAX, built from ppermute schedules."""

from jaxcoll._src.algorithms import algorithms, schedule
from jaxcoll._src.collectives import all_gather, all_reduce, broadcast, reduce, reduce_scatter
from jaxcoll._src.schedule import PRIMITIVES, Schedule, Step, Transfer

__version__ = "0.1.0"

__all__ = (
    "PRIMITIVES",
    "Schedule",
    "Step",
    "Transfer",
    "algorithms",
    "all_gather",
    "all_reduce",
    "broadcast",
    "reduce",
    "reduce_scatter",
    "schedule",
)
