"""The drafter's optimizer: AdamW, or Muon on its weight matrices with AdamW on the rest.

Muon (torch.optim.Muon) orthogonalises each matrix's momentum before the update. It is
speculators' default, so bench/peers.py can match that peer's optimizer too;
bench/optimizer_quality.py measures it against AdamW in eyas alone.

Muon only takes matrices; by common practice the output head (a vocabulary projection) stays
with AdamW, as do norms, vectors and the frozen embedding (which has no gradient). Both
optimizers share --lr and --weight-decay; Muon's update is scaled to AdamW's RMS
(adjust_lr_fn="match_rms_adamw"), yet it still did best at ~10x AdamW's learning rate in
bench/optimizer_quality.py.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from eyas.train.config import OPTIMIZERS

ADAMW_ONLY = ("lm_head", "embed")  # name parts of matrices Muon leaves to AdamW


def muon_split(model: nn.Module) -> tuple[list[tuple[str, nn.Parameter]], list[tuple[str, nn.Parameter]]]:
    """(Muon's, AdamW's) trainable parameters: Muon takes every 2-D matrix whose sides are both
    > 1, except the output head and embeddings."""
    muon, adamw = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        matrix = p.ndim == 2 and min(p.shape) > 1 and not any(part in name for part in ADAMW_ONLY)
        (muon if matrix else adamw).append((name, p))
    return muon, adamw


def build_optimizers(model: nn.Module, kind: str, lr: float, weight_decay: float) -> list[torch.optim.Optimizer]:
    """The optimizers a step drives, in order: [AdamW] or [Muon, AdamW]."""
    if kind not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {kind!r}")
    adamw_kw = dict(lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay)
    if kind == "adamw":
        return [torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], **adamw_kw)]
    muon, adamw = muon_split(model)
    out: list[torch.optim.Optimizer] = []
    if muon:
        out.append(torch.optim.Muon([p for _, p in muon], lr=lr, weight_decay=weight_decay,
                                    adjust_lr_fn="match_rms_adamw"))
    if adamw:
        out.append(torch.optim.AdamW([p for _, p in adamw], **adamw_kw))
    return out
