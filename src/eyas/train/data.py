"""What training reads: samples from a store (offline) or captured on the fly (online),
a held-out split, and a deterministic stream of token-budget batches.

Samples are addressed by position in the source; the split and the order depend only on
the samples' prepared-data indices and the seed, never on the order a store holds them
in, so a resumed run (or another process of a DDP run) sees exactly the same batches.
"""

from __future__ import annotations

import math
import queue
import random
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Protocol

import torch

from eyas.data.batching import token_budget_batches
from eyas.data.prepared import PreparedData
from eyas.errors import EyasError
from eyas.models.identity import ModelIdentity
from eyas.models.dtype import model_dtype
from eyas.models.states import TargetStates
from eyas.store.format import dequantize
from eyas.store.reader import Store


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, T] long, right-padded with 0
    loss_mask: torch.Tensor  # [B, T] bool, False on padding
    hidden: torch.Tensor  # [B, T, L, H] float, the aux ids then id N
    sample_index: list[int]  # prepared-data index of each row (for error messages)
    rows: tuple[int, int] | None = None  # hidden holds only positions lo..hi-1 (a context-parallel shard's)


@dataclass
class HostBatch:
    """A store batch on the host, padded in the store's own dtype (pinned when bound for a GPU):
    2-4x fewer bytes to copy than float32; `to` dequantises on the device."""
    input_ids: torch.Tensor  # [B, T] long
    loss_mask: torch.Tensor  # [B, T] bool
    hidden: torch.Tensor  # [B, T, L, H] bf16/fp16/fp32/fp8
    scale: torch.Tensor | None  # [B, T, L] float32 (fp8 stores; 0 on padding), else None
    sample_index: list[int]
    rows: tuple[int, int] | None = None  # hidden and scale hold only positions lo..hi-1

    def to(self, device: torch.device) -> Batch:
        def move(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, non_blocking=True)  # asynchronous from pinned memory

        # The same arithmetic as Store.sample's (format.dequantize), so the same bits.
        hidden = dequantize(move(self.hidden), None if self.scale is None else move(self.scale))
        return Batch(move(self.input_ids), move(self.loss_mask), hidden, self.sample_index, self.rows)


def _pad(rows: list[torch.Tensor], T: int, pin: bool = False) -> torch.Tensor:
    """rows of [T_i, ...] -> [B, T, ...], zero-padded on the right (in pinned memory if `pin`)."""
    out = torch.empty(len(rows), T, *rows[0].shape[1:], dtype=rows[0].dtype, pin_memory=pin)
    for b, row in enumerate(rows):
        out[b, : len(row)] = row
        out[b, len(row) :] = 0
    return out


class Prefetch:
    """Reads batches on the host in a background thread, `depth` ahead, in the order of `items`.

    `take(positions)` hands over the next batch read if it is that one, else None (the caller
    reads it itself): a batch depends only on its positions, so a hit is always the right data.
    An error reading a batch is raised by the `take` that asks for that batch, not before.
    """

    def __init__(self, read: Callable[[list[int]], HostBatch], items: Iterable[list[int]], depth: int = 2):
        self._queue: queue.Queue = queue.Queue(depth)
        self._head: tuple | None = None  # the next batch read: (positions, HostBatch or the error reading it)
        self._done = False  # the reader has finished
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(read, items), daemon=True, name="eyas-prefetch")
        self._thread.start()

    def _run(self, read, items) -> None:
        for positions in items:
            try:
                item = (positions, read(positions))
            except Exception as e:  # raised where that batch is used
                item = (positions, e)
            self._queue.put(item)
            if self._stop.is_set() or isinstance(item[1], Exception):
                return
        self._queue.put(None)  # the items are done

    def take(self, positions: list[int]) -> HostBatch | None:
        if self._head is None and not self._done:
            self._head = self._queue.get()
            self._done = self._head is None
        if self._head is None or self._head[0] != positions:
            return None
        (_, batch), self._head = self._head, None
        if isinstance(batch, Exception):
            self._done = True  # the reader stopped there: later batches are read by the caller
            raise batch
        return batch

    def close(self) -> None:
        self._stop.set()
        while self._thread.is_alive():  # unblock a reader waiting on a full queue
            try:
                self._queue.get(timeout=0.05)
            except queue.Empty:
                pass


class SampleSource(Protocol):
    """Where training reads its samples, addressed by position 0..len(sample_index) - 1:
    a store (`StoreSource`, offline) or the target itself (`OnlineSource`)."""

    identity: ModelIdentity  # the target the states come from
    chat_template: dict | None  # how the samples were rendered, passed on to the drafter
    layer_ids: tuple[int, ...]  # the aux ids, then id N
    hidden_size: int
    sample_index: list[int]  # prepared-data index of each position
    lengths: list[int]  # tokens of each position, after the crop
    cropped: int  # samples longer than the crop
    fingerprint: str | None  # of the prepared data the samples come from (data/prepared.py), if known
    excluded_prompts: list[str] | None  # the eval prompt sets that data was kept free of, if known

    def tokens(self, pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids [T] long, loss_mask [T] bool) of one position, cropped."""
        ...

    def load(self, positions: list[int], device: torch.device, rows: tuple[int, int] | None = None) -> Batch:
        """The batch of `positions`, hidden states included, on `device`; with `rows` (lo, hi), a
        source that can read a slice of each sample's states reads only those positions' (and
        says so in `Batch.rows`)."""
        ...

    def read_ahead(self, items: Iterable[list[int]], device: torch.device,
                   rows_of: Callable[[list[int]], tuple[int, int] | None] | None = None) -> None:
        """Start preparing the batches `items`, in that order, in the background (once), each
        with the `rows` that `rows_of` gives it."""
        ...

    def close(self) -> None:
        """Stop what `read_ahead` started."""
        ...


class StoreSource:
    """Offline: samples from a hidden-state store, cropped to `crop` tokens."""

    def __init__(self, path: str | Path, crop: int):
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
        self.fingerprint: str | None = self.store.manifest.get("prepared")
        excluded = self.store.manifest.get("excluded_prompts")
        self.excluded_prompts: list[str] | None = list(excluded) if isinstance(excluded, list) else None
        self._tokens = self._read_tokens()
        self.lengths = [min(len(ids), crop) for ids, _ in self._tokens]
        self.cropped = sum(len(ids) > crop for ids, _ in self._tokens)
        self.ahead: Prefetch | None = None

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

    def read(self, positions: list[int], pin: bool = False, rows: tuple[int, int] | None = None) -> HostBatch:
        """The batch of `positions` on the host, as stored (thread-safe: the shards are read-only);
        with `rows` (lo, hi), the states of those positions only, zeros past a sample's end."""
        T = max(self.lengths[p] for p in positions)
        lo, hi = (0, T) if rows is None else rows
        samples = [self.store.stored(p, None if rows is None else (lo, max(lo, min(hi, self.crop)))) for p in positions]

        def pad(key: str, length: int) -> torch.Tensor:
            return _pad([s[key][:length] for s in samples], length, pin)

        return HostBatch(pad("input_ids", T), pad("loss_mask", T), pad("hidden", hi - lo),
                         None if samples[0]["scale"] is None else pad("scale", hi - lo),
                         [self.sample_index[p] for p in positions], rows)

    def read_ahead(self, items: Iterable[list[int]], device: torch.device,
                   rows_of: Callable[[list[int]], tuple[int, int] | None] | None = None) -> None:
        """Read the batches `items` (in that order) in the background, for `load` to take; a
        source already reading ahead keeps its reader."""
        if self.ahead is None:
            self.ahead = Prefetch(lambda positions: self.read(positions, device.type == "cuda",
                                                              rows_of(positions) if rows_of else None), items)

    def close(self) -> None:
        if self.ahead is not None:
            self.ahead.close()
            self.ahead = None

    def load(self, positions: list[int], device: torch.device, rows: tuple[int, int] | None = None) -> Batch:
        host = self.ahead.take(positions) if self.ahead is not None else None
        if host is None or host.rows != rows:  # not read ahead, or read ahead for other rows
            host = self.read(positions, device.type == "cuda", rows)
        return host.to(device)


class OnlineSource:
    """Online: prepared samples whose hidden states the target computes when a batch is loaded."""

    def __init__(self, model: str, data: str | Path, layers: str, crop: int, device: torch.device):
        self.prepared = PreparedData(data)
        self.target = TargetStates(model, layers=layers, dtype=model_dtype(None, device.type), device=str(device))
        self.target.identity.check_same(self.prepared.identity, f"The prepared data in {data}")
        self.crop = crop
        self.identity: ModelIdentity = self.target.identity
        self.chat_template: dict | None = template.to_dict() if (template := self.prepared.chat_template) else None
        self.layer_ids = self.target.layer_ids
        self.hidden_size = self.target.hidden_size
        self.sample_index = list(range(len(self.prepared)))
        self.fingerprint: str | None = self.prepared.fingerprint
        self.excluded_prompts: list[str] | None = self.prepared.excluded_prompts
        self.lengths = [min(self.prepared.length(i), crop) for i in range(len(self.prepared))]
        self.cropped = sum(self.prepared.length(i) > crop for i in range(len(self.prepared)))

    def tokens(self, pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.prepared[pos]
        return s.input_ids[: self.crop], s.loss_mask[: self.crop]

    def load(self, positions: list[int], device: torch.device, rows: tuple[int, int] | None = None) -> Batch:
        """The target computes every position's states (`rows` are not a slice it can skip to)."""
        T = max(self.lengths[p] for p in positions)
        rows = [self.tokens(p) for p in positions]
        input_ids = _pad([ids for ids, _ in rows], T)
        loss_mask = _pad([mask for _, mask in rows], T)
        attention = _pad([torch.ones(len(ids), dtype=torch.long) for ids, _ in rows], T)
        hidden = self.target.states(input_ids, attention)  # [B, T, L, H] on the device
        # The forward ran in inference mode; a clone is an ordinary tensor autograd may save.
        return Batch(input_ids.to(device), loss_mask.to(device), hidden.to(device).clone(),
                     [self.sample_index[p] for p in positions])

    def read_ahead(self, items: Iterable[list[int]], device: torch.device, rows_of=None) -> None:
        """Nothing to read: the target computes a batch's states when it is loaded."""

    def close(self) -> None:
        """Nothing runs in the background."""


def split(sample_index: list[int], eval_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Positions of the training and held-out samples: a seeded draw over prepared indices."""
    order = sorted(range(len(sample_index)), key=lambda p: sample_index[p])
    random.Random(seed).shuffle(order)
    n_eval = math.ceil(eval_fraction * len(order)) if len(order) > 1 else 0
    return sorted(order[n_eval:]), sorted(order[:n_eval])


class BatchStream:
    """An endless, deterministic stream of token-budget batches over `positions`.

    `batches` groups the samples by length with ties broken by prepared index: a fixed grouping,
    for held-out passes. Training regroups every epoch instead: ties among equal lengths (common,
    since many samples are cut at the crop length) are broken by a seeded permutation, so the same
    neighbours do not share a batch every epoch (random regrouping measured ~0.01 better held-out
    accuracy). Only ties move, so every epoch has the same batch count, sizes and longest lengths
    as `batches` (same steps, memory and compiled shapes). Each epoch's batches are visited in a
    seeded order; item s depends only on (seed, s), so a resumed run sees the same stream. Step s
    of the run consumes items s*G .. s*G+G-1 (G = processes x accumulation), and process r takes
    items r, r+W, ...
    """

    def __init__(self, positions: list[int], lengths: list[int], sample_index: list[int], batch_tokens: int, seed: int):
        # In prepared-index order, so the batches do not depend on the store's order.
        self._order = sorted(positions, key=lambda p: sample_index[p])
        self._lengths = lengths
        self._batch_tokens = batch_tokens
        self.batches = self._group(self._order)
        self.seed = seed
        self._epochs: dict[int, list[list[int]]] = {}  # epoch -> its batches in visiting order

    def _group(self, order: list[int]) -> list[list[int]]:
        """Token-budget batches of `order`'s positions, ties among equal lengths kept in `order`'s order."""
        local = token_budget_batches(list(range(len(order))), [self._lengths[p] for p in order], self._batch_tokens)
        return [[order[i] for i in batch] for batch in local]

    def _epoch(self, epoch: int) -> list[list[int]]:
        """The epoch's regrouped batches, in its seeded visiting order."""
        rng = random.Random(self.seed * 1_000_003 + epoch)
        order = list(self._order)
        rng.shuffle(order)  # only the ties' order survives the sort by length
        batches = self._group(order)
        assert [(len(b), self._lengths[b[0]]) for b in batches] == \
            [(len(b), self._lengths[b[0]]) for b in self.batches], "regrouping changed the batch shapes"
        rng.shuffle(batches)
        return batches

    def __len__(self) -> int:
        return len(self.batches)

    def item(self, s: int) -> list[int]:
        epoch, i = divmod(s, len(self.batches))
        epochs = self._epochs  # read once, and replaced whole: the prefetch thread calls this too
        if epoch not in epochs:
            # Keep the last epoch built too: at a boundary the prefetch thread is one epoch ahead.
            self._epochs = epochs = dict([*list(epochs.items())[-1:], (epoch, self._epoch(epoch))])
        return epochs[epoch][i]

    def for_step(self, step: int, group: int, rank: int, world: int) -> list[list[int]]:
        """The micro-batches process `rank` trains on at `step`."""
        return [self.item(step * group + j) for j in range(rank, group, world)]
