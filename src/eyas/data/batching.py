"""Token-budget batches: samples sorted by length so padding stays small."""

from __future__ import annotations


def token_budget_batches(indices: list[int], lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Group `indices` (longest first) so that batch size x longest length <= batch_tokens;
    a sample longer than the budget forms a batch of its own."""
    order = sorted(indices, key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        if current and (len(current) + 1) * lengths[current[0]] > batch_tokens:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches
