"""The training-time-test objective: labels from the target, the drafter unrolled over
`ttt_steps` steps, soft cross-entropy weighted decay^k, and per-step metric sums.

Alignment (position i of a sample, step k = 0..K-1): the drafter reads token i+1+k and
predicts the target's next-token distribution at position j = i+1+k, i.e. the target's
guess for token j+1. The pair counts ("is trained") iff token j+1 exists and is an
assistant token. Labels are the target's softmax restricted to the draft vocabulary;
positions whose target argmax lies outside it add no loss but count as misses, so the
reported accuracy is the share of trained positions where the drafter's top-1 token
equals the target's (greedy) token.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn as nn

from eyas.draft.flex import limited
from eyas.draft.model import Eagle3Drafter
from eyas.models.target_head import TargetHead

# Columns of the per-step statistics: summed over trained positions.
LOSS, CORRECT, COUNT, IN_VOCAB = range(4)


@dataclass
class Labels:
    probs: torch.Tensor  # [B, T, Vd] the target's distribution over the draft vocab, at each position j
    target_draft: torch.Tensor  # [B, T] long: draft id of the target's argmax at j, -1 if outside
    trained: torch.Tensor  # [B, T] bool: position j is trained (token j+1 is an assistant token)


def trained_positions(loss_mask: torch.Tensor) -> torch.Tensor:
    """loss_mask [B, T] (assistant tokens) -> [B, T]: positions whose next token is trained."""
    trained = torch.zeros_like(loss_mask)
    trained[:, :-1] = loss_mask[:, 1:]
    return trained


def step_counts(loss_mask: torch.Tensor, steps: int, rows: torch.Tensor | None = None) -> torch.Tensor:
    """[steps] float: trained pairs at each TTT step (of the rows [B, T] bool that anchor a
    DFlash block, when given); known before any forward, so processes can agree on the loss
    normaliser first."""
    trained = trained_positions(loss_mask)
    return torch.stack([_at_rows(trained[:, 1 + k :], rows).sum() for k in range(steps)]).float()


def _at_rows(pairs: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """pairs [B, T-1-k] (label positions 1+k.. of step k) -> those whose row i is in `rows`."""
    return pairs if rows is None else pairs & rows[:, : pairs.shape[1]]


@torch.no_grad()
def make_labels(head: TargetHead, last_hidden: torch.Tensor, loss_mask: torch.Tensor,
                draft_ids: torch.Tensor) -> Labels:
    """last_hidden [B, T, H] (id N), loss_mask [B, T] bool, draft_ids [Vd] (target ids)."""
    B, T, _ = last_hidden.shape
    target_to_draft = torch.full((head.lm_head_weight.shape[0],), -1, dtype=torch.long, device=last_hidden.device)
    target_to_draft[draft_ids] = torch.arange(len(draft_ids), device=last_hidden.device)
    # The draft vocabulary's logits come from its own rows of lm_head, contiguous, instead of a
    # column gather out of a float32 copy of the full [rows, T, V] logits: for a small target
    # those copies and gathers move more bytes than its matrix products. The full logits serve
    # only the argmax, in the dtype they are computed in (a float32 copy changes no value).
    # Both go through the family's own transform (head.logits: Granite's scale, Gemma-2's cap).
    rows = max(1, LABEL_CHUNK // (T * head.lm_head_weight.shape[0]))  # bounds the [rows, T, V] logits
    probs, target_draft = [], []
    for b in range(0, B, rows):
        hidden = last_hidden[b : b + rows]  # [rows, T, H]
        target_draft.append(target_to_draft[head.logits(hidden).argmax(-1)])  # [rows, T]
        probs.append(torch.softmax(head.logits(hidden, draft_ids), -1, dtype=torch.float32))  # [rows, T, Vd]
    return Labels(torch.cat(probs), torch.cat(target_draft), trained_positions(loss_mask))


LABEL_CHUNK = 1 << 28  # target logits computed at once (1 GiB in float32): rows, not the batch


class TTTObjective(nn.Module):
    """Wraps the drafter so that DDP/FSDP see one forward per micro-batch."""

    def __init__(self, drafter: Eagle3Drafter):
        super().__init__()
        self.drafter = drafter

    def forward(self, input_ids: torch.Tensor, aux_hidden: torch.Tensor, labels: Labels,
                weights: torch.Tensor, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """input_ids [B, T], aux_hidden [B, T, L_aux, H], weights [K] (decay^k / normaliser_k),
        rows [B, T] bool: the rows anchoring a DFlash block (train/anchors.py), the only ones scored.

        Returns the loss (sum_k weights[k] * summed soft CE of step k), per-step statistics
        [K, 4] (loss sum, correct, trained, target argmax in draft vocab) and the per-row
        loss [B] (to name a sample whose loss is not finite).
        """
        K = len(weights)
        B, T = input_ids.shape
        anchored = {} if rows is None else {"rows": rows}
        states = self.drafter.forward_ttt_states(input_ids, aux_hidden, K, **anchored)  # K x [B, T, H]
        # Step k at position i is scored iff its label position j = i+1+k is trained and the
        # target's token there is in the draft vocabulary. Only scored positions go through
        # lm_head and the loss (prompts, padding and the steps' overhang are ~30% of a batch);
        # one nonzero for all steps keeps it to one host sync per micro-batch.
        scored = torch.zeros(K, B, T, dtype=torch.bool, device=input_ids.device)
        trained = torch.zeros(K, device=input_ids.device)
        for k in range(min(K, T - 1)):
            target = labels.target_draft[:, 1 + k :]  # [B, T-1-k]
            scored[k, :, : T - 1 - k] = _at_rows(labels.trained[:, 1 + k :] & (target >= 0), rows)
            trained[k] = _at_rows(labels.trained[:, 1 + k :], rows).sum()
        counts = scored.flatten(1).sum(1)  # [K]: scored positions per step
        where = scored.nonzero().split(counts.tolist())  # K x [N_k, 3]: (k, b, i)
        loss = aux_hidden.new_zeros((), dtype=torch.float32)
        row_loss = aux_hidden.new_zeros(B, dtype=torch.float32)
        stats = []
        for k, (normed, idx) in enumerate(zip(states, where)):
            if len(idx) == 0:  # an empty slice keeps every weight in the graph: backward and DDP need it
                loss = loss + self.drafter.lm_head(normed.flatten(0, 1)[:0]).float().sum()
                stats.append(torch.stack([loss.new_zeros(()), loss.new_zeros(()), trained[k], loss.new_zeros(())]))
                continue
            b, i = idx[:, 1], idx[:, 2]
            logits = self.drafter.lm_head(normed[b, i])  # [N_k, Vd]
            ce = step_loss(logits.is_cuda)(logits[None], labels.probs[b, i + 1 + k][None],
                                           torch.ones_like(b, dtype=torch.bool)[None])[0]  # [N_k]
            rows = row_loss.new_zeros(B).index_add(0, b, ce)  # [B]
            loss = loss + weights[k] * ce.sum()
            row_loss = row_loss + rows.detach()
            with torch.no_grad():
                correct = (logits.argmax(-1) == labels.target_draft[b, i + 1 + k]).sum()
                stats.append(torch.stack([ce.sum().detach(), correct.float(), trained[k], counts[k].float()]))
        return loss, torch.stack(stats), row_loss


def soft_cross_entropy(logits: torch.Tensor, probs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """logits [B, n, Vd] (any float dtype), probs [B, n, Vd] float32, mask [B, n] bool ->
    per-position soft cross-entropy [B, n] float32, zero where masked."""
    return -(probs * logits.float().log_softmax(-1)).sum(-1) * mask


@functools.cache
def step_loss(cuda: bool):
    """The loss of one TTT step; on CUDA compiled, to fuse the float32 passes that eager makes
    over [B, n, Vd] (cast, log-softmax, product, sum, and their backward): for a small head
    they move more bytes than its matrix products."""
    return limited(torch.compile(soft_cross_entropy, dynamic=True)) if cuda else soft_cross_entropy


def simulated_acceptance(acc: list[float]) -> float:
    """tau_sim = 1 + sum_k prod_{j<=k} acc_j: the acceptance length of a chain draft whose
    step-k token is accepted with probability acc_k given the earlier ones were."""
    tau, run = 1.0, 1.0
    for a in acc:
        run *= a
        tau += run
    return tau
