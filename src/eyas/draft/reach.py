"""What a drafter reaches when it drafts and the target verifies: the pairs on-policy training
scores (`--position-weights on-policy`).

Greedy decoding with a chain of K drafts, in draft/loss.py's alignment (row i reads token i+1
and its step k predicts the target's greedy token at position j = i+1+k): a chain drafted from
row s is verified, its first `a` drafts are accepted, and the target's own token follows them,
so the next chain is drafted from row s + a + 1. From row s decoding thus reaches steps
0..min(a, K-1): the accepted drafts and the first rejected one, whose label is the target's
distribution where the drafter went wrong. Each answer token is reached once, at the step that
drafts it, except the bonus token after a chain the target accepts whole.

Along a stored answer, step k from row i "passes" when the drafter's greedy token equals the
target's greedy token at j and the answer goes on with that token (it does wherever the answer
is the target's own greedy answer, as `eyas regenerate --temperature 0` writes; elsewhere the
chain ends where the answer leaves the target's path). The first chain of an assistant turn is
drafted from its first token's row (the target's prefill emits that token), and the walk from
it follows the turn: the rows and steps it reaches are exactly those a draft -> verify loop
with this drafter reaches on that answer (tests/test_on_policy.py runs that loop).
"""

from __future__ import annotations

import torch


def accepted_lengths(passes: torch.Tensor) -> torch.Tensor:
    """passes [K, B, T] bool (step k from row i passes) -> [B, T] long: the drafts a chain from
    each row would have accepted (its leading passing steps)."""
    return passes.long().cumprod(0).sum(0)


def chain_reach(accepted: torch.Tensor, trained: torch.Tensor, steps: int) -> torch.Tensor:
    """accepted [B, T] long (`accepted_lengths`), trained [B, T] bool (label position j is an
    assistant token's) -> reach [B, T] long: the steps decoding reaches from each row (0 where
    no chain is drafted). Walked on the host: one chain in ~tau tokens, a few thousand a batch."""
    a, runs = accepted.cpu().tolist(), trained.cpu().tolist()
    reach = [[0] * len(row) for row in runs]
    for b, row in enumerate(runs):
        T = len(row)
        j = 0
        while j < T:
            if not row[j]:
                j += 1
                continue
            end = j
            while end + 1 < T and row[end + 1]:
                end += 1
            # Labels j..end are one turn's: j (its first token) is the target's prefill; the first
            # chain is drafted from row j, whose step 0 predicts label j + 1.
            s = j
            while s + 1 <= end:
                reach[b][s] = min(a[b][s] + 1, steps)
                s += a[b][s] + 1
            j = end + 1
    return torch.tensor(reach, dtype=torch.long, device=accepted.device)


def reached_pairs(reach: torch.Tensor, steps: int) -> torch.Tensor:
    """reach [B, T] -> [K, B, T] bool: step k of row i is reached."""
    return torch.arange(steps, device=reach.device)[:, None, None] < reach[None]
