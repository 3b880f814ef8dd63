"""The draft vocabulary: which tokens, in which order, and how the drafter stores them."""

from __future__ import annotations

import pytest
import torch

from eyas.draft import Eagle3Drafter
from eyas.draft.vocab import TokenCounter, build_draft_vocab, coverage, default_draft_vocab_size
from eyas.errors import EyasError
from test_ttt import tiny_config


def counter_of(vocab: int, samples: list[tuple[list[int], list[int]]]) -> TokenCounter:
    return TokenCounter(vocab).update((torch.tensor(ids), torch.tensor(mask, dtype=torch.bool)) for ids, mask in samples)


def test_most_frequent_trained_tokens_win_ties_go_to_overall_frequency_then_id():
    c = counter_of(10, [
        ([5, 5, 5, 7, 7, 3, 9, 9, 9, 9], [1, 1, 1, 1, 1, 1, 0, 0, 0, 0]),  # trained: 5 x3, 7 x2, 3 x1; 9 prompt-only
        ([2, 3, 8], [0, 0, 1]),  # trained: 8 x1; 3 also seen once untrained
    ])
    # 3 and 8 both trained once; 3 is seen twice overall, so it comes first.
    assert build_draft_vocab(c, 3).tolist() == [3, 5, 7]
    assert build_draft_vocab(c, 4).tolist() == [3, 5, 7, 8]
    # Beyond the 4 trained tokens: 9 (seen 4x), then 2 (seen once), then the lowest ids.
    assert build_draft_vocab(c, 6).tolist() == [2, 3, 5, 7, 8, 9]
    assert build_draft_vocab(c, 8).tolist() == [0, 1, 2, 3, 5, 7, 8, 9]
    assert coverage(c, build_draft_vocab(c, 2)) == pytest.approx(5 / 7)


def test_vocab_errors_are_clear():
    c = counter_of(10, [([1, 2], [1, 1])])
    with pytest.raises(EyasError, match="--draft-vocab must lie in 1..10"):
        build_draft_vocab(c, 11)
    with pytest.raises(EyasError, match="no trained"):
        build_draft_vocab(counter_of(10, [([1, 2], [0, 0])]), 4)
    with pytest.raises(EyasError, match="outside the target vocabulary"):
        counter_of(10, [([1, 12], [1, 1])])
    assert default_draft_vocab_size(49152) == 32000 and default_draft_vocab_size(512) == 512


def test_drafter_stores_the_vocab_as_vllm_reads_it():
    cfg = tiny_config()
    ids = torch.randperm(cfg.vocab_size)[: cfg.draft_vocab_size].sort().values
    drafter = Eagle3Drafter(cfg)
    drafter.set_vocab(ids)
    assert torch.equal(drafter.draft_to_target(torch.arange(cfg.draft_vocab_size)), ids)  # target = draft + d2t[draft]
    assert torch.equal(drafter.t2d.nonzero().flatten(), ids)
