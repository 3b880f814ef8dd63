"""What eval does with its prompts (eyas.prompts reads and renders them): the order that deals
them to workers."""

from __future__ import annotations

from eyas.prompts import EvalPrompt


def stratified(prompts: list[EvalPrompt]) -> list[int]:
    """Prompt indices round-robin over categories (in order of first appearance), so that any
    prefix, and every worker's share of `order[w::n]`, covers the categories alike."""
    by_category: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        by_category.setdefault(p.category, []).append(i)
    queues = list(by_category.values())
    return [q[k] for k in range(max(map(len, queues), default=0)) for q in queues if k < len(q)]
