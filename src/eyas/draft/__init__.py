"""The drafters eyas trains (EAGLE-3, DFlash and P-EAGLE): their config, modules and checkpoints."""

from eyas.lazy import lazy_exports

__all__ = ["DraftConfig", "Eagle3Drafter", "load_config", "load_drafter", "save_drafter", "ttt_attention"]
__getattr__ = lazy_exports(__name__, {
    "eyas.draft.checkpoint": ("load_config", "load_drafter", "save_drafter"),
    "eyas.draft.config": ("DraftConfig",),
    "eyas.draft.model": ("Eagle3Drafter", "ttt_attention"),
})
