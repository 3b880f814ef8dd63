"""Where drafts come from. One small class per method behind one interface, so plain
decoding, prompt lookup and the EAGLE-3 drafter run through the same decoding loop and are
timed the same way.

A proposer sees the sequence as it grows: `start` after the prefill, `propose` before each
verification step (an empty tree means a plain one-token step), `update` with what the
step emitted.
"""

from __future__ import annotations

import torch

from eyas.evaluate.drafter import DrafterSession
from eyas.evaluate.tree import DraftTree


class Proposer:
    name = "plain"
    needs_aux = False  # whether `start`/`update` need the target's aux states

    def start(self, prompt_ids: list[int], first: int, aux: torch.Tensor | None) -> None:
        """After the prefill: `first` is the token the target emitted, aux [T, L, H]."""

    def propose(self, sequence: list[int], budget: int) -> DraftTree:
        """A draft of at most `budget` levels below the last token of `sequence`."""
        return DraftTree()

    def update(self, emitted: list[int], aux: torch.Tensor | None) -> None:
        """After a step: `emitted` tokens, aux [len(emitted), L, H] of the rows that produced them."""


class PromptLookup(Proposer):
    """n-gram drafting: find the latest earlier occurrence of the sequence's last n tokens
    (n from `max_ngram` down to 1) and propose the tokens that followed it."""

    name = "prompt-lookup"

    def __init__(self, num_tokens: int, max_ngram: int = 3):
        self.num_tokens, self.max_ngram = num_tokens, max_ngram

    def propose(self, sequence: list[int], budget: int) -> DraftTree:
        k = min(self.num_tokens, budget)
        if k <= 0:
            return DraftTree()
        for n in range(min(self.max_ngram, len(sequence) - 1), 0, -1):
            tail = sequence[-n:]
            for start in range(len(sequence) - n - 1, -1, -1):
                if sequence[start : start + n] == tail:
                    follow = sequence[start + n : start + n + k]
                    return DraftTree.chain(follow)
        return DraftTree()


class Eagle3(Proposer):
    """The EAGLE-3 drafter: a chain of `steps` tokens, or with `top_k`/`max_nodes` a dynamic
    tree `steps` levels deep."""

    needs_aux = True

    def __init__(self, session: DrafterSession, steps: int, tree: bool = False, top_k: int = 10,
                 max_nodes: int = 60, temperature: float = 0.0, generator: torch.Generator | None = None):
        self.session, self.steps, self.is_tree = session, steps, tree
        self.top_k, self.max_nodes = top_k, max_nodes
        self.temperature, self.generator = temperature, generator
        self.name = "eagle3-tree" if tree else "eagle3-chain"

    def start(self, prompt_ids: list[int], first: int, aux: torch.Tensor | None) -> None:
        self.session.reset()
        self.session.extend(torch.tensor([*prompt_ids[1:], first]), aux)

    def propose(self, sequence: list[int], budget: int) -> DraftTree:
        depth = min(self.steps, budget)
        if depth <= 0:
            return DraftTree()
        if self.is_tree:
            return self.session.tree(depth, self.top_k, self.max_nodes)
        return self.session.chain(depth, self.temperature, self.generator)

    def update(self, emitted: list[int], aux: torch.Tensor | None) -> None:
        self.session.extend(torch.tensor(emitted), aux)
