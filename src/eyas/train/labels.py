"""The labels a drafter learns: the target's next-token distribution over the draft
vocabulary at every position, from the stored last state through the target's own output
head (models/target_head.py: the family's transforms included). Only the argmax and the
full distribution's normaliser are computed here, in chunks of tokens so that the
full-vocabulary logits of a batch, or of one long sample, are never held at once; the
distribution is computed by the loss, chunk by chunk, at the pairs it scores (draft/loss.py)."""

from __future__ import annotations

import torch

from eyas.draft.loss import Labels, trained_positions
from eyas.models.target_head import TargetHead


@torch.no_grad()
def make_labels(head: TargetHead, last_hidden: torch.Tensor, loss_mask: torch.Tensor,
                draft_ids: torch.Tensor, input_ids: torch.Tensor | None = None) -> Labels:
    """last_hidden [B, T, H] (id N), loss_mask [B, T] bool, draft_ids [Vd] (target ids); with the
    samples' input_ids [B, T], also where each sample goes on with the target's greedy token
    (what on-policy training's walk follows, draft/reach.py)."""
    B, T, _ = last_hidden.shape
    target_to_draft = torch.full((head.lm_head_weight.shape[0],), -1, dtype=torch.long, device=last_hidden.device)
    target_to_draft[draft_ids] = torch.arange(len(draft_ids), device=last_hidden.device)
    # The full logits serve only the argmax, in the dtype they are computed in (a float32 copy
    # changes no value), and their log-sum-exp, the normaliser of the target's whole
    # distribution. The draft vocabulary's logits come from its own rows of lm_head,
    # contiguous, in the loss (`head.restricted`), instead of a column gather out of the full
    # logits: for a small target those copies and gathers move more bytes than its matrix
    # products. Both go through the family's own transform (Granite's scale, Gemma-2's cap).
    # Chunks of tokens, not of samples: one 131,072-token sample's float32 logits over a
    # 128,256-token vocabulary alone are 63 GiB.
    flat = last_hidden.reshape(B * T, -1)  # [B*T, H]
    size = max(1, LABEL_CHUNK // head.lm_head_weight.shape[0])  # tokens whose [size, V] logits are held at once
    argmax, full_lse = torch.empty(B * T, dtype=torch.long, device=flat.device), torch.empty(B * T, device=flat.device)
    for i in range(0, B * T, size):
        logits = head.logits(flat[i : i + size])  # [size, V]
        argmax[i : i + size] = logits.argmax(-1)
        full_lse[i : i + size] = torch.logsumexp(logits.float(), -1)
    argmax, full_lse = argmax.view(B, T), full_lse.view(B, T)  # target ids; float32
    greedy = None
    if input_ids is not None:
        greedy = torch.zeros_like(argmax, dtype=torch.bool)
        greedy[:, :-1] = argmax[:, :-1] == input_ids[:, 1:]
    return Labels(last_hidden, head.restricted(draft_ids), target_to_draft[argmax], trained_positions(loss_mask),
                  full_lse, greedy)

LABEL_CHUNK = 1 << 28  # target logits computed at once (1 GiB in float32): tokens, not the batch
