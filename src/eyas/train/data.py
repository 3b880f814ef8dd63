"""What training reads: samples from a store (offline) or captured on the fly (online),
a held-out split, and a deterministic stream of token-budget batches.

Samples are addressed by position in the source; the split and the order depend only on
the samples' prepared-data indices and the seed, never on the order a store holds them
in, so a resumed run (or another process of a DDP run) sees exactly the same batches.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from eyas.capture.batching import token_budget_batches
from eyas.errors import EyasError
from eyas.models.identity import ModelIdentity


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, T] long, right-padded with 0
    loss_mask: torch.Tensor  # [B, T] bool, False on padding
    hidden: torch.Tensor  # [B, T, L, H] float, the aux ids then id N
    sample_index: list[int]  # prepared-data index of each row (for error messages)


def _pad(rows: list[torch.Tensor], T: int) -> torch.Tensor:
    """rows of [T_i, ...] -> [B, T, ...], zero-padded on the right."""
    out = rows[0].new_zeros(len(rows), T, *rows[0].shape[1:])
    for b, row in enumerate(rows):
        out[b, : len(row)] = row
    return out


class StoreSource:
    """Offline: samples from a hidden-state store, cropped to `crop` tokens."""

    def __init__(self, path: str | Path, crop: int):
        from eyas.store import Store

        self.store = Store(path)
        self.store.check()  # structure only: the sha256 and NaN/inf scan are `eyas inspect --verify`'s
        if len(self.store) == 0:
            raise EyasError(f"The store {path} holds no samples; capture into it first (eyas capture).")
        self.crop = crop
        self.identity: ModelIdentity = self.store.identity
        self.chat_template: dict | None = self.store.manifest.get("chat_template")
        self.layer_ids = self.store.layer_ids
        self.hidden_size = self.store.hidden_size
        self.sample_index = self.store.sample_indices().tolist()
        self._tokens = self._read_tokens()
        self.lengths = [min(len(ids), crop) for ids, _ in self._tokens]
        self.cropped = sum(len(ids) > crop for ids, _ in self._tokens)

    def _read_tokens(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(input_ids [T] long, loss_mask [T] bool) of every sample, from the shards' small tensors."""
        out = []
        for i in range(len(self.store.manifest["shards"])):
            ids = self.store.shard_tensor(i, "input_ids").long()
            mask = self.store.shard_tensor(i, "loss_mask").bool()
            off = self.store.shard_tensor(i, "offsets").tolist()
            out += [(ids[a:b], mask[a:b]) for a, b in zip(off[:-1], off[1:])]
        return out

    def tokens(self, pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids, mask = self._tokens[pos]
        return ids[: self.crop], mask[: self.crop]

    def load(self, positions: list[int], device: torch.device) -> Batch:
        samples = [self.store.sample(p) for p in positions]
        T = max(self.lengths[p] for p in positions)
        hidden = _pad([s["hidden"][: self.crop] for s in samples], T)  # [B, T, L, H]
        return Batch(
            input_ids=_pad([s["input_ids"][: self.crop] for s in samples], T).to(device),
            loss_mask=_pad([s["loss_mask"][: self.crop] for s in samples], T).to(device),
            hidden=hidden.to(device, non_blocking=True),
            sample_index=[self.sample_index[p] for p in positions],
        )


class OnlineSource:
    """Online: prepared samples whose hidden states the target computes when a batch is loaded."""

    def __init__(self, model: str, data: str | Path, layers: str, crop: int, device: torch.device):
        from eyas.capture.hf import HFCapturer
        from eyas.capture.run import default_model_dtype
        from eyas.data.prepared import PreparedData

        self.prepared = PreparedData(data)
        self.capturer = HFCapturer(model, layers=layers, dtype=default_model_dtype(device.type), device=str(device))
        self.capturer.identity.check_same(self.prepared.identity, f"The prepared data in {data}")
        self.crop = crop
        self.identity: ModelIdentity = self.capturer.identity
        self.chat_template: dict | None = self.prepared.meta.get("chat_template")
        self.layer_ids = self.capturer.layer_ids
        self.hidden_size = self.capturer.hidden_size
        self.sample_index = list(range(len(self.prepared)))
        self.lengths = [min(self.prepared.length(i), crop) for i in range(len(self.prepared))]
        self.cropped = sum(self.prepared.length(i) > crop for i in range(len(self.prepared)))

    def tokens(self, pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.prepared[pos]
        return s.input_ids[: self.crop], s.loss_mask[: self.crop]

    def load(self, positions: list[int], device: torch.device) -> Batch:
        T = max(self.lengths[p] for p in positions)
        rows = [self.tokens(p) for p in positions]
        input_ids = _pad([ids for ids, _ in rows], T)
        loss_mask = _pad([mask for _, mask in rows], T)
        attention = _pad([torch.ones(len(ids), dtype=torch.long) for ids, _ in rows], T)
        hidden = self.capturer.capture_padded(input_ids, attention)  # [B, T, L, H] on the device
        # The capture ran in inference mode; a clone is an ordinary tensor autograd may save.
        return Batch(input_ids.to(device), loss_mask.to(device), hidden.to(device).clone(),
                     [self.sample_index[p] for p in positions])


def split(sample_index: list[int], eval_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Positions of the training and held-out samples: a seeded draw over prepared indices."""
    order = sorted(range(len(sample_index)), key=lambda p: sample_index[p])
    random.Random(seed).shuffle(order)
    n_eval = math.ceil(eval_fraction * len(order)) if len(order) > 1 else 0
    return sorted(order[n_eval:]), sorted(order[:n_eval])


class BatchStream:
    """An endless, deterministic stream of token-budget batches over `positions`.

    Each epoch visits every batch once in a seeded order; step s of the run consumes stream
    items s*G .. s*G+G-1 (G = processes x accumulation), and process r takes items r, r+W, ...
    """

    def __init__(self, positions: list[int], lengths: list[int], sample_index: list[int], batch_tokens: int, seed: int):
        # Batch in prepared-index order, so the batches do not depend on the store's order.
        order = sorted(positions, key=lambda p: sample_index[p])
        local = token_budget_batches(list(range(len(order))), [lengths[p] for p in order], batch_tokens)
        self.batches = [[order[i] for i in batch] for batch in local]
        self.seed = seed
        self._orders: dict[int, list[int]] = {}

    def __len__(self) -> int:
        return len(self.batches)

    def item(self, s: int) -> list[int]:
        epoch, i = divmod(s, len(self.batches))
        if epoch not in self._orders:
            self._orders = {epoch: list(range(len(self.batches)))}
            random.Random(self.seed * 1_000_003 + epoch).shuffle(self._orders[epoch])
        return self.batches[self._orders[epoch][i]]

    def for_step(self, step: int, group: int, rank: int, world: int) -> list[list[int]]:
        """The micro-batches process `rank` trains on at `step`."""
        return [self.item(step * group + j) for j in range(rank, group, world)]
