"""Which rows anchor a DFlash block in training: up to `per_sequence` of each sample's rows,
drawn afresh at every step, among the rows whose block holds a trained pair.

Anchoring every row multiplies the block tokens a batch runs through the drafter by the
block size; a fixed number per sample bounds them at per_sequence x block size per sample,
whatever the samples' lengths (SpecForge and speculators draw 512 per sequence). The draw
depends only on (seed, step, the sample's prepared index), so the loss normaliser, computed
from the samples before any forward, a resumed run and every process see the same anchors.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from eyas.train.objective import trained_positions

HELD_OUT = -1  # the step of the held-out pass's draw: the same anchors at every evaluation


def eligible_rows(loss_mask: torch.Tensor, steps: int) -> torch.Tensor:
    """loss_mask [T] bool -> [T] bool: rows i whose block trains a pair (some label position
    i+1..i+steps is trained)."""
    T = len(loss_mask)
    before = F.pad(trained_positions(loss_mask[None])[0].long().cumsum(0), (1, 0))  # [T+1]: trained before j
    i = torch.arange(T)
    return before[(i + 1 + steps).clamp(max=T)] > before[(i + 1).clamp(max=T)]


def anchor_rows(loss_mask: torch.Tensor, steps: int, per_sequence: int, key: tuple[int, ...]) -> torch.Tensor:
    """loss_mask [T] bool -> [T] bool: the eligible rows, or `per_sequence` of them drawn by `key`."""
    chosen = eligible_rows(loss_mask, steps).nonzero().flatten()
    if len(chosen) > per_sequence:
        g = torch.Generator().manual_seed(hash(key) & (2**63 - 1))
        chosen = chosen[torch.randperm(len(chosen), generator=g)[:per_sequence]]
    rows = torch.zeros(len(loss_mask), dtype=torch.bool)
    rows[chosen] = True
    return rows


def batch_rows(source, positions: list[int], steps: int, per_sequence: int, seed: int, step: int) -> torch.Tensor:
    """[B, T] bool on the host (T the batch's longest sample) for the samples at `positions`."""
    T = max(source.lengths[p] for p in positions)
    rows = torch.zeros(len(positions), T, dtype=torch.bool)
    for b, p in enumerate(positions):
        mask = source.tokens(p)[1]
        rows[b, : len(mask)] = anchor_rows(mask, steps, per_sequence, (seed, step, source.sample_index[p]))
    return rows
