"""A drafter module of its config's kind (the class its record in kinds.py names)."""

from __future__ import annotations

import torch

from eyas.draft.config import DraftConfig


def drafter_class(cfg: DraftConfig) -> type[torch.nn.Module]:
    return cfg.kind.module_class()


def new_drafter(cfg: DraftConfig, embed_weight: torch.Tensor | None = None) -> torch.nn.Module:
    return drafter_class(cfg)(cfg, embed_weight)
