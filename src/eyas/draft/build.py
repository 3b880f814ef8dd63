"""A drafter module of its config's kind (see kinds.py)."""

from __future__ import annotations

import torch

from eyas.draft.config import DraftConfig
from eyas.draft.dflash import DFlashDrafter
from eyas.draft.model import Eagle3Drafter
from eyas.draft.peagle import PEagleDrafter


def drafter_class(cfg: DraftConfig) -> type[torch.nn.Module]:
    return {"dflash": DFlashDrafter, "peagle": PEagleDrafter}.get(cfg.drafter, Eagle3Drafter)


def new_drafter(cfg: DraftConfig, embed_weight: torch.Tensor | None = None) -> torch.nn.Module:
    return drafter_class(cfg)(cfg, embed_weight)
