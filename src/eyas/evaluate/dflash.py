"""The DFlash drafter during decoding, as vLLM runs it: each layer caches keys and values
projected from the committed context's states (one entry per position, from the target's
aux states there), and one forward pass over the block [last token, mask x K] at positions
P..P+K proposes K tokens, slot s predicting the token at P+s. The block attends to the whole
cached context and to itself, without a causal mask (in the drafter's `causal_layers`, slot s
to slots 0..s of it); its own entries are never cached.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from eyas.draft.dflash import DFlashDrafter
from eyas.evaluate.drafter import EXTEND_ROWS, pick
from eyas.evaluate.proposers import Proposer
from eyas.models.slots import SlotCache
from eyas.evaluate.tree import DraftTree
from eyas.models.graphs import Recorder, bucket


class DFlashSession:
    """Context entries at slot = position in a `SlotCache`; the block writes its own after
    them, where the next commit overwrites them. On CUDA the block and commits of up to
    EXTEND_ROWS positions replay CUDA graphs; the prompt's commit runs eagerly."""

    def __init__(self, drafter: DFlashDrafter, capacity: int = 2048, graphs: bool | None = None):
        self.m = drafter
        self.device = drafter.fc.weight.device
        self.cache = SlotCache(capacity)
        self.graphs = Recorder(self.device, graphs is not False, "the dflash drafter")
        self._slot_ids = torch.arange(capacity, device=self.device)
        self.length = 0  # committed context positions

    def reset(self) -> None:
        self.length = 0

    def _reserve(self, entries: int) -> None:
        if self.cache.reserve(self.length + entries):
            self._slot_ids = torch.arange(self.cache.capacity, device=self.device)
            self.graphs.drop()

    def _context(self, aux: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        """Each layer's keys and values of the context states from aux [n, L, H], at slots start [1] ...
        Returns the context states [1, n, H]: a replayed graph's output is how `Recorder.run`
        tells that it ran (None: run this eagerly), so the commit must not return None."""
        ctx = self.m.context(aux)[None]  # [1, n, H]
        self.cache.aim(start + torch.arange(ctx.shape[1], device=self.device), 0)  # writes only
        cos, sin = self.m.rotary(ctx, self.cache.slots[None])
        for i, layer in enumerate(self.m.layers):
            self.cache.update(*layer.self_attn.key_value(ctx, cos, sin), i)  # [1, nKV, n, d]
        return ctx

    @torch.inference_mode()
    def extend(self, aux: torch.Tensor) -> None:
        """Commit the target's aux states [n, L, H] at the next n positions."""
        n = len(aux)
        rows = bucket(n, EXTEND_ROWS)
        self._reserve(rows or n)
        aux = aux.to(self.m.fc.weight)
        start = torch.tensor([self.length], device=self.device)
        padded = {"aux": torch.cat([aux, aux.new_zeros(rows - n, *aux.shape[1:])]), "start": start} if rows else None
        if rows is None or self.graphs.run(("extend", rows), padded, lambda s: self._context(s["aux"], s["start"])) is None:
            self._context(aux, start)
        self.length += n

    def _block(self, last: torch.Tensor, start: torch.Tensor, width: int | None = None) -> torch.Tensor:
        """The block [last, mask x (S-1)] at positions start [1] ..., seeing the context and itself
        -> draft-vocabulary logits [S - 1, Vd] of slots 1.."""
        m = self.m
        S = m.block_size
        x = m.block_embeds(last[None], S)[:, :, 0]  # [1, S, H]
        slots = start + torch.arange(S, device=self.device)
        cos, sin = m.rotary(x, slots[None])
        visible = self._slot_ids[None, :width] < start + S  # [1, W]: every query, the context and the block
        # [S, W]: slot s sees the context and slots 0..s; built only for a drafter with causal layers
        causal = self._slot_ids[None, :width] <= slots[:, None] if m.config.causal_layers else None
        self.cache.aim(slots, visible.shape[-1])
        for i, layer in enumerate(m.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            k, v = self.cache.update(*attn.key_value(h, cos, sin), i)  # [1, nKV, W, d]
            mask = causal if i in m.config.causal_layers else visible
            out = F.scaled_dot_product_attention(attn.query(h, cos, sin), k, v, attn_mask=mask, enable_gqa=True)
            x = layer.finish(x, out.transpose(1, 2).flatten(2))
        return m.lm_head(m.norm(x[0, 1:]))

    @torch.inference_mode()
    def block(self, last: int) -> torch.Tensor:
        """One forward over [last, mask x K] at positions C..C+K (C = committed length) ->
        draft-vocabulary logits [K, Vd] of slots 1..K."""
        self._reserve(self.m.block_size)
        inputs = {"last": torch.tensor([last], device=self.device), "start": torch.tensor([self.length], device=self.device)}
        out = self.graphs.run("block", inputs, lambda s: self._block(s["last"], s["start"]))
        return out.clone() if out is not None else self._block(inputs["last"], inputs["start"],
                                                               self.length + self.m.block_size)


class DFlash(Proposer):
    """A block of the drafter's K tokens from one forward pass, verified as a chain. At T > 0
    each slot is sampled from its own distribution, which is the proposal the acceptance
    test divides by, so decoding keeps the target's distribution."""

    name = "dflash"
    needs_aux = True

    def __init__(self, session: DFlashSession, steps: int, temperature: float = 0.0,
                 generator: torch.Generator | None = None):
        self.session, self.steps = session, steps
        self.temperature, self.generator = temperature, generator

    def start(self, prompt_ids: list[int], first: int, aux: torch.Tensor | None) -> None:
        self.session.reset()
        self.session.extend(aux)

    def propose(self, sequence: list[int], budget: int) -> DraftTree:
        depth = min(self.steps, budget, self.session.m.block_size - 1)
        if depth <= 0:
            return DraftTree()
        assert self.session.length == len(sequence) - 1, "the context must end right before the last token"
        return block_chain(self.session.m, self.session.block(sequence[-1])[:depth], self.temperature, self.generator)

    def update(self, emitted: list[int], aux: torch.Tensor | None) -> None:
        self.session.extend(aux)


def block_chain(m, logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> DraftTree:
    """A block's slot logits [K, Vd] -> the chain to verify: each slot's argmax, or at T > 0 a
    sample of its own distribution, which is the proposal the acceptance test divides by."""
    if temperature <= 0:  # one read of the device for the whole block
        return DraftTree.chain(m.draft_to_target(logits.argmax(-1)).tolist())
    tree = DraftTree()
    for d in range(len(logits)):
        draft_id, dense = pick(m, logits[d], temperature, generator)
        tree.add(m.draft_to_target(draft_id).item(), d - 1, dense)
    return tree
