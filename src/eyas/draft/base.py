"""What every drafter module is: a frozen copy of the target's embeddings, a draft vocabulary
mapped onto the target's, an unrolled training-time test (`forward_ttt_states`, the kind's
own), and a forward that returns its loss and metrics (speculators' way), so that training
runs any kind without knowing which."""

from __future__ import annotations

import torch
import torch.nn as nn

from eyas.draft.config import DraftConfig
from eyas.draft.context import Shard
from eyas.draft.layers import RMSNorm, RotaryEmbedding
from eyas.draft.loss import Labels, ttt_loss
from eyas.draft.objective import Objective


class Drafter(nn.Module):
    config: DraftConfig

    def add_head(self, cfg: DraftConfig) -> None:
        """What follows every kind's layers, added last (parameters are created, hence drawn,
        in this order): the final norm, `lm_head` over the draft vocabulary, the rotary
        embedding, and the draft-to-target tables."""
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_parameters, cfg.max_position_embeddings)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))  # target = draft + d2t[draft]
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))  # target ids in the draft vocab

    def set_vocab(self, draft_to_target: torch.Tensor) -> None:
        """draft_to_target [Vd] int64: the target id of each draft id (ascending)."""
        self.d2t.copy_(draft_to_target - torch.arange(len(draft_to_target), device=draft_to_target.device))
        self.t2d.zero_()
        self.t2d[draft_to_target] = True

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def forward_ttt_states(self, input_ids: torch.Tensor, aux_hidden: torch.Tensor, steps: int | None = None,
                           rows: torch.Tensor | None = None, shard: Shard | None = None) -> list[torch.Tensor]:
        """`steps` normed outputs [B, T, H] aligned as draft/loss.py says (the kind's own unroll);
        with a context-parallel `shard`, the shard's positions (draft/context.py)."""
        raise NotImplementedError

    def forward_ttt(self, input_ids: torch.Tensor, aux_hidden: torch.Tensor, steps: int | None = None,
                    rows: torch.Tensor | None = None) -> list[torch.Tensor]:
        """K logits tensors [B, T, Vd], aligned as `forward_ttt_states`."""
        return [self.lm_head(n) for n in self.forward_ttt_states(input_ids, aux_hidden, steps, rows)]

    def forward(self, input_ids: torch.Tensor, aux_hidden: torch.Tensor, labels: Labels, weights: torch.Tensor,
                rows: torch.Tensor | None = None, objective: Objective = Objective(), shard: Shard | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """input_ids [B, T], aux_hidden [B, T, L_aux, H], weights [K] -> (loss, statistics [K, 4],
        per-row loss [B]) of draft/loss.py `ttt_loss`; one call per micro-batch, so DDP and
        FSDP wrap the drafter itself. Under context parallelism, the shard's part of them."""
        states = self.forward_ttt_states(input_ids, aux_hidden, len(weights), rows, shard)  # K x [B, T, H]
        return ttt_loss(self.lm_head, states, labels, weights, rows, objective, shard)

    @classmethod
    def step_bytes(cls, cfg: DraftConfig, rows: int, length: int, anchors: int | None, device: torch.device) -> int | None:
        """The bytes a training step's largest tensors take on a micro-batch of `rows` samples of
        up to `length` tokens, where the kind can say before allocating (None: no estimate)."""
        return None
