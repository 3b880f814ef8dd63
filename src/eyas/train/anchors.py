"""Which rows anchor a DFlash block in training: up to --anchors of each sample's rows (a
count, or one per S tokens of the sample), drawn afresh at every step, among the rows whose
block holds a trained pair.

Anchoring every row multiplies the block tokens a batch runs through the drafter by the
block size; anchoring some bounds them at anchors x block size per sample. speculators draws
512 per packed row of 8,192 tokens, one per 16 tokens whatever the samples' lengths: eyas's
default 1/16 keeps that density in unpacked samples. The draw depends only on (seed, step,
the batch's prepared indices), so the loss normaliser, computed from the samples before any
forward, and a resumed run see the same anchors.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from eyas.draft.loss import trained_positions
from eyas.train.config import anchors_per_sample

HELD_OUT = -1  # the step of the held-out pass's draw: the same anchors at every evaluation


def eligible_rows(loss_mask: torch.Tensor, steps: int) -> torch.Tensor:
    """loss_mask [B, T] bool -> [B, T] bool: rows i whose block trains a pair (some label
    position i+1..i+steps is trained)."""
    T = loss_mask.shape[1]
    before = F.pad(trained_positions(loss_mask).long().cumsum(1), (1, 0))  # [B, T+1]: trained before j
    i = torch.arange(T)
    return before[:, (i + 1 + steps).clamp(max=T)] > before[:, (i + 1).clamp(max=T)]


def anchor_rows(loss_mask: torch.Tensor, steps: int, per_sequence: int | torch.Tensor,
                key: tuple[int, ...]) -> torch.Tensor:
    """loss_mask [B, T] bool (on the host) -> [B, T] bool: each sample's eligible rows, or
    `per_sequence` of them (one count, or [B] counts >= 1), drawn by `key` (one draw for the
    batch, so one sort)."""
    rows = eligible_rows(loss_mask, steps)
    B, T = rows.shape
    counts = torch.as_tensor(per_sequence).expand(B).clamp(max=T)  # [B]
    if bool((counts == T).all()):
        return rows
    g = torch.Generator().manual_seed(hash(key) & (2**63 - 1))
    score = torch.rand(rows.shape, generator=g).masked_fill(~rows, 2.0)  # [B, T]: the lowest scores are drawn
    return rows & (score <= score.sort(1).values.gather(1, counts[:, None] - 1))


def loss_masks(source, positions: list[int]) -> torch.Tensor:
    """[B, T] bool on the host: the loss masks of the samples at `positions`, T the longest."""
    return _padded([source.tokens(p)[1] for p in positions])


def _padded(masks: list[torch.Tensor]) -> torch.Tensor:
    out = torch.zeros(len(masks), max(len(m) for m in masks), dtype=torch.bool)
    for b, m in enumerate(masks):
        out[b, : len(m)] = m
    return out


def batch_rows(source, positions: list[int], steps: int, anchors: int | str, seed: int, step: int) -> torch.Tensor:
    """[B, T] bool on the host: the anchor rows of the samples at `positions` at `step`, as many
    of each as --anchors gives a sample of its length."""
    key = (seed, step, *(source.sample_index[p] for p in positions))
    masks = [source.tokens(p)[1] for p in positions]
    counts = torch.tensor([anchors_per_sample(anchors, len(m)) for m in masks])  # [B]
    return anchor_rows(_padded(masks), steps, counts, key)
