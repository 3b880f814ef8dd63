"""Train an EAGLE-3 drafter with training-time test: offline from a store or online beside
the target, on one process or under torchrun (DDP, FSDP2)."""

from eyas.train.config import TrainConfig
from eyas.train.loop import train

__all__ = ["TrainConfig", "train"]
