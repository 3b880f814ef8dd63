"""The EAGLE-3 drafter: its config, the module, and checkpoints."""

from eyas.draft.checkpoint import load_drafter, save_drafter
from eyas.draft.config import DraftConfig
from eyas.draft.model import Eagle3Drafter, ttt_attention

__all__ = ["DraftConfig", "Eagle3Drafter", "load_drafter", "save_drafter", "ttt_attention"]
