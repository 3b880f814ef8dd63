"""Context parallelism: one long sample's positions split over processes.

Process r of W holds positions [start, start + length) of a sample padded to W * length. In a
TTT step only step 0's keys and values cross positions (each later step adds one key at the
query's own position, draft/model.py), so each process computes its own positions through
every layer and step, and gathers each layer's step-0 keys and values from every process once,
for all steps, with PyTorch's context-parallel all-gather (`flex_cp_allgather`, whose backward
reduce-scatters their gradients back to their owners). Its queries then attend causally from
their global positions. What else crosses the shard's end is read, not
computed: the tokens a later step embeds and the labels it is scored on, the `halo` of
positions after the shard.

The loss on each process is its share of the whole sample's loss (the normaliser is the
whole sample's), so summing the processes' gradients gives the one-process gradient. The
chains greedy decoding would draft along a sample (draft/reach.py) run from one end to the
other: each process walks the whole sample from every shard's accepted lengths and keeps its
rows' chains.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _get_process_group_name
from torch.distributed.tensor.experimental._context_parallel import flex_cp_allgather


@dataclass(frozen=True)
class Shard:
    """This process's part of a sample: positions [start, start + length) of `world` * length."""

    group: dist.ProcessGroup
    rank: int
    world: int
    length: int

    @property
    def start(self) -> int:
        return self.rank * self.length

    def gather(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every process's step-0 keys and values, in position order: k [B, nKV, length, d],
        v [B, nKV, length, d_v] -> [B, nKV, world * length, .]."""
        return flex_cp_allgather(k.contiguous(), v.contiguous(), 2, _get_process_group_name(self.group))

    @property
    def total(self) -> int:
        return self.world * self.length

    @torch.no_grad()
    def whole(self, t: torch.Tensor) -> torch.Tensor:
        """t [B, length, ...] (this shard's rows; no gradient) -> [B, total, ...]: every shard's, in
        position order. For what is walked along a whole sample: decoding's chains."""
        parts = [torch.empty_like(t) for _ in range(self.world)]
        dist.all_gather(parts, t.contiguous(), group=self.group)
        return torch.cat(parts, dim=1)

    def own(self, t: torch.Tensor, width: int) -> torch.Tensor:
        """t [B, total, ...] -> this shard's rows, zero-padded to `width` (its labels' positions)."""
        return _padded(t[:, self.start : self.start + self.length], width)

    def slice(self, t: torch.Tensor, halo: int = 0) -> torch.Tensor:
        """t [B, T, ...] (a whole sample, T <= total) -> this shard's positions and the `halo`
        after them, [B, length + h, ...]: zeros (False) past T, no halo after the last shard."""
        end = min(self.start + self.length + halo, self.total)
        return _padded(t[:, self.start : end], end - self.start)


def _padded(t: torch.Tensor, width: int) -> torch.Tensor:
    """t [B, n, ...] -> [B, width, ...], zeros (False) after its n positions."""
    short = width - t.shape[1]
    return torch.cat([t, t.new_zeros(t.shape[0], short, *t.shape[2:])], dim=1) if short > 0 else t


def shard_length(tokens: int, world: int, align: int = 1) -> int:
    """Positions per process for a sample of `tokens`: equal shards (the all-gather needs them),
    each a multiple of `align` (flex attention's block, so every shard starts on a block)."""
    per = -(-tokens // world)
    return -(-per // align) * align
