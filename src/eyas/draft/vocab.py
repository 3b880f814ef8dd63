"""The draft vocabulary: the N target tokens the drafter can propose.

EAGLE-3 heads predict over a reduced vocabulary so that `lm_head` (the costliest part of a
draft step) stays small. The tokens are the most frequent *trained* (loss-masked) tokens
of the training data; ties, and the remainder when the data holds fewer than N distinct
trained tokens, go to the most frequent tokens overall, then to the lowest ids, so the
choice is deterministic. The result is stored in the drafter as `d2t` (offsets: target =
draft + d2t[draft]) and `t2d` (a bool mask over the target vocabulary).
"""

from __future__ import annotations

from typing import Iterable

import torch

from eyas.errors import EyasError

DEFAULT_DRAFT_VOCAB = 32000


class TokenCounter:
    """Counts token ids over samples: `trained` over loss-masked positions, `seen` over all."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.trained = torch.zeros(vocab_size, dtype=torch.int64)
        self.seen = torch.zeros(vocab_size, dtype=torch.int64)

    def add(self, input_ids: torch.Tensor, loss_mask: torch.Tensor) -> None:
        """input_ids [T] int, loss_mask [T] bool."""
        if len(input_ids) and (input_ids.min() < 0 or input_ids.max() >= self.vocab_size):
            raise EyasError(f"Token ids outside the target vocabulary 0..{self.vocab_size - 1}.")
        self.seen += torch.bincount(input_ids, minlength=self.vocab_size)
        self.trained += torch.bincount(input_ids[loss_mask], minlength=self.vocab_size)

    def update(self, samples: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> "TokenCounter":
        for input_ids, loss_mask in samples:
            self.add(input_ids, loss_mask)
        return self


def default_draft_vocab_size(vocab_size: int) -> int:
    return min(DEFAULT_DRAFT_VOCAB, vocab_size)


def build_draft_vocab(counter: TokenCounter, size: int) -> torch.Tensor:
    """The draft vocabulary as target ids [size] int64, ascending (draft id d <-> target id)."""
    if not 0 < size <= counter.vocab_size:
        raise EyasError(f"--draft-vocab must lie in 1..{counter.vocab_size} (the target vocabulary), not {size}.")
    if counter.trained.sum() == 0:
        raise EyasError("The training data holds no trained (assistant) token: nothing to build a draft vocabulary from.")
    ids = torch.arange(counter.vocab_size)
    # Sort by (trained count desc, overall count desc, id asc): lexsort via stable sorts, last key first.
    order = ids
    for key in (counter.seen, counter.trained):
        order = order[torch.sort(-key[order], stable=True).indices]
    return order[:size].sort().values


def coverage(counter: TokenCounter, draft_to_target: torch.Tensor) -> float:
    """Share of trained tokens that the draft vocabulary contains."""
    return float(counter.trained[draft_to_target].sum()) / max(int(counter.trained.sum()), 1)
