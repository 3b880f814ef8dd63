"""The training-time-test loss every kind trains with, computed by the drafter's own forward
(draft/base.py): soft cross-entropy against the target's distribution, weighted decay^k per
step, and per-step metric sums.

Alignment (position i of a sample, step k = 0..K-1): the drafter reads token i+1+k and
predicts the target's next-token distribution at position j = i+1+k, i.e. the target's
guess for token j+1. The pair counts ("is trained") iff token j+1 exists and is an
assistant token. Labels are the target's softmax restricted to the draft vocabulary;
positions whose target argmax lies outside it add no loss but count as misses, so the
reported accuracy is the share of trained positions where the drafter's top-1 token
equals the target's (greedy) token. A kind drafting blocks (DFlash) is scored only at the
rows [B, T] that anchor one: entry k of row i is its slot k+1, aligned the same way.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn as nn

from eyas.draft.flex import limited

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
    block, when given); known before any forward, so processes can agree on the loss
    normaliser first."""
    trained = trained_positions(loss_mask)
    return torch.stack([_at_rows(trained[:, 1 + k :], rows).sum() for k in range(steps)]).float()


def _at_rows(pairs: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """pairs [B, T-1-k] (label positions 1+k.. of step k) -> those whose row i is in `rows`."""
    return pairs if rows is None else pairs & rows[:, : pairs.shape[1]]


def ttt_loss(lm_head: nn.Module, states: list[torch.Tensor], labels: Labels, weights: torch.Tensor,
             rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """states: K normed outputs [B, T, H] (a drafter's `forward_ttt_states`), weights [K]
    (decay^k / normaliser_k), rows [B, T] bool: the rows anchoring a block, the only ones scored.

    Returns the loss (sum_k weights[k] * summed soft CE of step k), per-step statistics
    [K, 4] (loss sum, correct, trained, target argmax in draft vocab) and the per-row
    loss [B] (to name a sample whose loss is not finite).
    """
    K = len(weights)
    B, T = labels.trained.shape
    device = labels.trained.device
    # Step k at position i is scored iff its label position j = i+1+k is trained and the
    # target's token there is in the draft vocabulary. Only scored positions go through
    # lm_head and the loss (prompts, padding and the steps' overhang are ~30% of a batch);
    # one nonzero for all steps keeps it to one host sync per micro-batch.
    scored = torch.zeros(K, B, T, dtype=torch.bool, device=device)
    trained = torch.zeros(K, device=device)
    for k in range(min(K, T - 1)):
        target = labels.target_draft[:, 1 + k :]  # [B, T-1-k]
        scored[k, :, : T - 1 - k] = _at_rows(labels.trained[:, 1 + k :] & (target >= 0), rows)
        trained[k] = _at_rows(labels.trained[:, 1 + k :], rows).sum()
    counts = scored.flatten(1).sum(1)  # [K]: scored positions per step
    where = scored.nonzero().split(counts.tolist())  # K x [N_k, 3]: (k, b, i)
    loss = states[0].new_zeros((), dtype=torch.float32)
    row_loss = states[0].new_zeros(B, dtype=torch.float32)
    stats = []
    for k, (normed, idx) in enumerate(zip(states, where)):
        if len(idx) == 0:  # an empty slice keeps every weight in the graph: backward and DDP need it
            loss = loss + lm_head(normed.flatten(0, 1)[:0]).float().sum()
            stats.append(torch.stack([loss.new_zeros(()), loss.new_zeros(()), trained[k], loss.new_zeros(())]))
            continue
        b, i = idx[:, 1], idx[:, 2]
        logits = lm_head(normed[b, i])  # [N_k, Vd]
        ce = step_loss(logits.is_cuda)(logits[None], labels.probs[b, i + 1 + k][None],
                                       torch.ones_like(b, dtype=torch.bool)[None])[0]  # [N_k]
        loss = loss + weights[k] * ce.sum()
        row_loss = row_loss + row_loss.new_zeros(B).index_add(0, b, ce).detach()
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
