"""jaxcoll.fsdp: sharded-parameter training (FSDP / ZeRO-3) with ZeRO++'s quantized and
hierarchical options."""

from jaxcoll._src.training.fsdp import (
  Sharded,
  gather,
  layer,
  layers,
  place,
  shard,
  specs,
  unshard,
)
from jaxcoll._src.training.fsdp_step import State, TrainStep, train_step

__all__ = ("Sharded", "State", "TrainStep", "gather", "layer", "layers", "place", "shard",
           "specs", "train_step", "unshard")
