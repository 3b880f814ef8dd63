"""A KV cache of fixed buffers for decoding: one sequence in eval (the target and the drafters),
a batch of rows in regeneration.

Every layer's keys and values live in one buffer [B, nKV, capacity, d]. A pass writes its rows
at the slots it names and reads the whole buffer, its attention mask deciding what each row
sees; so no pass reallocates, and a CUDA graph recorded once (models/graphs.py) stays valid
until the cache grows.
"""

from __future__ import annotations

import torch
from transformers import Cache

ALIGN = 256  # a grown cache's capacity is a multiple of this many slots


class SlotCache(Cache):
    """transformers' `Cache` contract (`update(key, value, layer_idx)`), for the target's own
    forward as for the drafters' layers: the rows go to `slots` [q], and the pass reads the
    first `width` slots, both set before the forward (`aim`)."""

    def __init__(self, capacity: int, batch: int | None = None):
        super().__init__(layers=[])
        self.capacity = capacity
        self.batch = batch  # rows of every buffer; None: those of the first pass
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.slots: torch.Tensor | None = None  # [q]
        self.width: int | None = None  # slots a pass reads (its mask's width); None: all (a recorded pass)
        self.start = 0  # the first slot a pass reads
        self.rows: slice | None = None  # the batch rows a pass computes; None: all
        self.seen = 0  # committed tokens, for a model that asks the cache its length

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """key_states, value_states [B, nKV, q, d] -> the layer's buffers [B, nKV, width, d]: an eager
        pass reads only the slots its mask covers (a CPU step then costs what the growing cache's
        did); a recorded one reads them all, its shapes fixed."""
        if layer_idx not in self.keys:  # allocated by the first pass, which is never a recorded one
            for store, new in ((self.keys, key_states), (self.values, value_states)):
                store[layer_idx] = new.new_zeros(self.batch or new.shape[0], new.shape[1], self.capacity, new.shape[-1])
        out = []
        for store, new in ((self.keys, key_states), (self.values, value_states)):
            buf = store[layer_idx] if self.rows is None else store[layer_idx][self.rows]  # a view: written in place
            buf.index_copy_(2, self.slots, new)
            out.append(buf[:, :, self.start:self.width])
        return tuple(out)

    def aim(self, slots: torch.Tensor, width: int, start: int = 0, rows: slice | None = None) -> None:
        """The next pass writes at `slots` [q] and reads slots start .. width - 1, of the batch
        rows `rows` (all if None): regeneration prefills a batch a few rows of like length at a
        time, each reading only past its own rows' padding."""
        self.slots, self.width, self.start, self.rows = slots, (None if width >= self.capacity else width), start, rows

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen

    def reserve(self, slots: int) -> bool:
        """Room for `slots` slots: else grow to the larger of them and twice the capacity (a
        multiple of ALIGN), keeping the contents. True when it grew, so graphs reading the old
        buffers must be recorded again."""
        if slots <= self.capacity:
            return False
        capacity = ALIGN * -(-max(slots, 2 * self.capacity) // ALIGN)
        for store in (self.keys, self.values):
            for i, old in store.items():
                store[i] = torch.cat([old, old.new_zeros(*old.shape[:2], capacity - old.shape[2], old.shape[3])], 2)
        self.capacity = capacity
        return True

    def gather(self, start: int, sources: torch.Tensor) -> None:
        """Copy the slots `sources` [n] to start .. start + n - 1 in every layer (gathered first,
        so overlapping ranges copy what was there before)."""
        for store in (self.keys, self.values):
            for buf in store.values():
                buf[:, :, start:start + len(sources)] = buf.index_select(2, sources)

    def keep_rows(self, keep: torch.Tensor) -> None:
        """Keep only the batch rows `keep` [b'] of every buffer (a batch whose other rows stopped)."""
        for store in (self.keys, self.values):
            for i, buf in store.items():
                store[i] = buf[keep]
