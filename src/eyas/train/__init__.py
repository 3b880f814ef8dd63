"""Train an EAGLE-3 drafter with training-time test: offline from a store or online beside
the target, on one process or under torchrun (DDP, FSDP2)."""

from eyas.lazy import lazy_exports

__all__ = ["TrainConfig", "train"]
__getattr__ = lazy_exports(__name__, {"eyas.train.config": ("TrainConfig",), "eyas.train.loop": ("train",)})
