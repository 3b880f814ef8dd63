"""The P-EAGLE drafter: EAGLE-3 that drafts its K tokens in one forward pass (vLLM's
`parallel_drafting`).

The layer, weights and names are EAGLE-3's, plus `mask_hidden` [L_aux * H]: a learned stand-in
for the target's aux states. A block sits after the committed context ending at position P:
the entry at P reads the next token and the target's states there, as in EAGLE-3, and
predicts token P+2; the entries at P+1..P+K-1 read `mask_token_id` and `combine(mask_hidden)`
and predict tokens P+3..P+K+1. The block's entries attend causally to the context and to each
other, so every block position is known before any drafted token is, and one pass proposes
all K. In training this is the TTT unroll with step k >= 1 reading the mask token and the
mask state instead of the drafted token and the previous step's output: the same attention,
objective and alignment (vLLM's llama_eagle3 loads `mask_hidden`; its proposer writes the
mask token and `combine_hidden_states(mask_hidden)` into the extra slots).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from eyas.draft.config import DraftConfig
from eyas.draft.model import Eagle3Drafter


class PEagleDrafter(Eagle3Drafter):
    def __init__(self, cfg: DraftConfig, embed_weight: torch.Tensor | None = None):
        super().__init__(cfg, embed_weight)
        self.mask_hidden = nn.Parameter(torch.zeros(len(cfg.aux_layer_ids) * cfg.hidden_size))

    def mask_state(self) -> torch.Tensor:
        """[H]: the hidden state the block's masked entries read, `combine(mask_hidden)`."""
        return self.combine(self.mask_hidden.view(len(self.config.aux_layer_ids), -1).to(self.fc.weight.dtype))

    def step_inputs(self, k: int, tokens: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if k == 0:
            return super().step_inputs(k, tokens, hidden)
        mask = self.embed_tokens.weight[self.config.mask_token_id]  # [H]
        return mask.expand(hidden.shape), self.mask_state().expand(hidden.shape)
