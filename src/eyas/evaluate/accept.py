"""Which drafted tokens the target accepts: the rule that makes speculative decoding lossless.

Temperature 0: walk down the tree while the target's argmax is one of the current node's
children; the first argmax that is not becomes the bonus token. The output is greedy
decoding of the target, token for token.

Temperature T > 0, with p the target's distribution at the current node (softmax of
logits / T) and q the distribution a child x was drawn from (a point mass when the proposer
chose x deterministically, as trees and prompt lookup do):

    accept x with probability min(1, p(x) / q(x));
    otherwise p <- normalise(max(p - q, 0)) and try the next child;
    when no child is accepted, the bonus token is a sample of the final p.

For one sampled child this is the standard speculative-sampling rule; for point masses it
accepts x with probability p(x) and otherwise removes x from p, so each emitted token is
distributed exactly as p (Chen et al. 2023, Leviathan et al. 2023; SpecInfer's recursive
form for several children).
"""

from __future__ import annotations

import torch

from eyas.evaluate.tree import DraftTree


def accept_greedy(tree: DraftTree, logits: torch.Tensor) -> tuple[list[int], int]:
    """logits [M + 1, V] from `TargetSession.verify` -> (accepted node path, bonus token)."""
    best = logits.argmax(-1).tolist()
    children = tree.children()
    path: list[int] = []
    row = 0
    while True:
        nxt = next((c for c in children[row] if tree.tokens[c] == best[row]), None)
        if nxt is None:
            return path, best[row]
        path.append(nxt)
        row = nxt + 1


def accept_sampled(tree: DraftTree, logits: torch.Tensor, temperature: float,
                   generator: torch.Generator | None) -> tuple[list[int], int]:
    """The rejection-sampling rule above; returns (accepted node path, bonus token)."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)  # [M + 1, V]
    children = tree.children()
    path: list[int] = []
    row = 0
    while True:
        p = probs[row]
        for c in children[row]:
            x, q = tree.tokens[c], tree.proposals[c]
            qx = 1.0 if q is None else float(q[x])
            if float(torch.rand((), generator=generator, device=p.device)) * qx < float(p[x]):
                path.append(c)
                row = c + 1
                break
            p = residual(p, x, q)
        else:
            return path, int(torch.multinomial(p, 1, generator=generator))


def residual(p: torch.Tensor, x: int, q: torch.Tensor | None) -> torch.Tensor:
    """normalise(max(p - q, 0)); q None is the point mass on x."""
    if q is None:
        r = p.clone()
        r[x] = 0
    else:
        r = (p - q).clamp_min(0)
    total = r.sum()
    return r / total if total > 0 else p


def sample_or_argmax(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> int:
    """The target's own next token (logits [V]): what plain decoding emits."""
    if temperature <= 0:
        return int(logits.argmax())
    return int(torch.multinomial(torch.softmax(logits.float() / temperature, -1), 1, generator=generator))
