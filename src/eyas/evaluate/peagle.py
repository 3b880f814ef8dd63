"""The P-EAGLE drafter during decoding, as vLLM's parallel drafting runs it: the EAGLE-3 cache
over the committed context (draft/peagle.py), whose last entry reads the next token and the
target's states there and gives slot 0; then one pass of the layer over K-1 masked entries
(the mask token and `combine(mask_hidden)`, at the next positions, causal among themselves)
gives slots 1..K-1. The block is verified as a chain; masked entries are never cached.
vLLM runs the committed entries and the masked ones in one pass; here the commit is the
EAGLE-3 session's `extend`, and the block is one more pass.
"""

from __future__ import annotations

import torch

from eyas.evaluate.dflash import block_chain
from eyas.evaluate.drafter import DrafterSession
from eyas.evaluate.proposers import Eagle3
from eyas.evaluate.tree import DraftTree


class PEagle(Eagle3):
    """K tokens from one pass of the P-EAGLE drafter, verified as a chain; at T > 0 each slot
    is sampled from its own distribution, so decoding keeps the target's."""

    def __init__(self, session: DrafterSession, steps: int, temperature: float = 0.0,
                 generator: torch.Generator | None = None):
        super().__init__(session, steps, temperature=temperature, generator=generator)
        self.name = "peagle"

    def propose(self, sequence: list[int], budget: int) -> DraftTree:
        depth = min(self.steps, budget, self.session.m.config.ttt_steps)
        if depth <= 0:
            return DraftTree()
        return block_chain(self.session.m, self.session.parallel_block(depth), self.temperature, self.generator)
