"""The DFlash drafter during decoding, as vLLM runs it: each layer caches keys and values
projected from the committed context's states (one entry per position, from the target's
aux states there), and one forward pass over the block [last token, mask x K] at positions
P..P+K proposes K tokens, slot s predicting the token at P+s. The block attends to the whole
cached context and to itself, without a causal mask; its own entries are never cached.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from eyas.draft.dflash import DFlashDrafter
from eyas.evaluate.drafter import pick
from eyas.evaluate.proposers import Proposer
from eyas.evaluate.tree import DraftTree


class DFlashSession:
    def __init__(self, drafter: DFlashDrafter):
        self.m = drafter
        self.keys: list[torch.Tensor] = []  # per layer [1, nKV, C, d]: the committed context
        self.values: list[torch.Tensor] = []

    @property
    def length(self) -> int:
        return self.keys[0].shape[-2] if self.keys else 0

    def reset(self) -> None:
        self.keys, self.values = [], []

    def _rope(self, x: torch.Tensor, start: int, n: int):
        return self.m.rotary(x, torch.arange(start, start + n, device=x.device)[None])

    @torch.inference_mode()
    def extend(self, aux: torch.Tensor) -> None:
        """Commit the target's aux states [n, L, H] at the next n positions."""
        ctx = self.m.context(aux.to(self.m.fc.weight))[None]  # [1, n, H]
        cos, sin = self._rope(ctx, self.length, ctx.shape[1])
        for i, layer in enumerate(self.m.layers):
            k, v = layer.self_attn.key_value(ctx, cos, sin)  # [1, nKV, n, d]
            if len(self.keys) <= i:
                self.keys.append(k)
                self.values.append(v)
            else:
                self.keys[i] = torch.cat([self.keys[i], k], dim=-2)
                self.values[i] = torch.cat([self.values[i], v], dim=-2)

    @torch.inference_mode()
    def block(self, last: int) -> torch.Tensor:
        """One forward over [last, mask x K] at positions C..C+K (C = committed length) ->
        draft-vocabulary logits [K, Vd] of slots 1..K."""
        m = self.m
        S = m.block_size
        x = m.block_embeds(torch.tensor([[last]], device=m.fc.weight.device), S)[:, :, 0]  # [1, S, H]
        cos, sin = self._rope(x, self.length, S)
        for layer, ck, cv in zip(m.layers, self.keys, self.values):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = attn.query(h, cos, sin)  # [1, nH, S, d]
            kb, vb = attn.key_value(h, cos, sin)
            k, v = attn.repeat(torch.cat([ck, kb], dim=-2)), attn.repeat(torch.cat([cv, vb], dim=-2))
            out = F.scaled_dot_product_attention(q, k, v)  # every query sees the context and the whole block
            x = layer.finish(x, out.transpose(1, 2).flatten(2))
        return m.lm_head(m.norm(x[0, 1:]))


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
