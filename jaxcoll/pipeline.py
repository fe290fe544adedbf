"""jaxcoll.pipeline: pipeline parallelism (GPipe, 1F1B, interleaved, zero-bubble) as one SPMD
program over a mesh axis, every stage transfer a ``jaxcoll.shift``."""

from jaxcoll._src.pipeline.run import run, schedule, stack
from jaxcoll._src.pipeline.schedules import SCHEDULES, Table

__all__ = ("SCHEDULES", "Table", "run", "schedule", "stack")
