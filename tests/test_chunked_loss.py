"""The loss never holds all the logits (draft/loss.py): run a chunk of pairs at a time, with
each chunk's gradient computed as it goes, it gives the unchunked loss, statistics and
gradients, for EAGLE-3's rows and DFlash's anchored blocks, the pairs whose target token lies
outside the draft vocabulary included (they add no loss and count as misses)."""

from __future__ import annotations

import pytest
import torch

import eyas.draft.loss as loss_module
from eyas.draft.loss import step_counts
from eyas.train.anchors import anchor_rows
from eyas.train.labels import make_labels
from test_ttt import K, VD, make_setup as eagle3_setup, reference_loss
from test_dflash import make_setup as dflash_setup

DECAY = 0.8


def _setup(kind: str):
    """A drafter with its inputs, labels and the rows it scores (DFlash: 3 anchors a sample)."""
    drafter, head, draft_ids, input_ids, hidden, loss_mask = (eagle3_setup if kind == "eagle3" else dflash_setup)()
    rows = None if kind == "eagle3" else anchor_rows(loss_mask, K, 3, (0, 5))
    labels = make_labels(head, hidden[:, :, -1], loss_mask, draft_ids)
    assert (labels.target_draft < 0).any() and (labels.target_draft >= 0).any()  # both kinds of pair occur
    weights = torch.tensor([DECAY ** k for k in range(K)]) / step_counts(loss_mask, K, rows).clamp_min(1)
    return drafter, input_ids, hidden[:, :, :3], labels, weights, rows


def _run(drafter, input_ids, aux, labels, weights, rows):
    params = [p for p in drafter.parameters() if p.requires_grad]
    loss, stats, row_loss = drafter(input_ids, aux, labels, weights, *([] if rows is None else [rows]))
    return loss.detach(), stats, row_loss, torch.autograd.grad(loss, params)


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_chunked_loss_equals_the_unchunked_one_values_and_gradients(kind, monkeypatch):
    """One pair a chunk, three, and all at once give the same loss, statistics, per-row loss
    and gradients, and equal the plain autograd loss over every scored pair's full logits
    (float32, 1e-5)."""
    drafter, input_ids, aux, labels, weights, rows = _setup(kind)
    results = {}
    for pairs in (1, 3, None):
        monkeypatch.setattr(loss_module, "LOSS_CHUNK", VD * pairs if pairs else 1 << 26)
        results[pairs] = _run(drafter, input_ids, aux, labels, weights, rows)

    params = [p for p in drafter.parameters() if p.requires_grad]
    logits = drafter.forward_ttt(input_ids, aux, K, rows)  # [K][B, T, Vd]: every logit held
    plain = reference_loss(logits, labels, DECAY, rows)
    plain_grads = torch.autograd.grad(plain, params)
    for pairs, (loss, stats, row_loss, grads) in results.items():
        torch.testing.assert_close(loss, plain.detach(), atol=1e-5, rtol=1e-5, msg=f"{pairs} pairs a chunk")
        torch.testing.assert_close(stats, results[None][1], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(row_loss, results[None][2], atol=1e-5, rtol=1e-5)
        for g, r in zip(grads, plain_grads):
            torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5)
    assert all(g.abs().sum() > 0 for g in plain_grads)
    assert results[None][1][:, 2].sum() > results[None][1][:, 3].sum()  # some trained pairs were misses


def test_without_gradients_the_loss_and_statistics_are_the_same(monkeypatch):
    """Scoring (no_grad) takes the same path without computing gradients."""
    monkeypatch.setattr(loss_module, "LOSS_CHUNK", VD * 2)
    drafter, input_ids, aux, labels, weights, rows = _setup("eagle3")
    loss, stats, row_loss, _ = _run(drafter, input_ids, aux, labels, weights, rows)
    with torch.no_grad():
        n_loss, n_stats, n_rows = drafter(input_ids, aux, labels, weights)
    assert not n_loss.requires_grad
    torch.testing.assert_close(n_loss, loss)
    torch.testing.assert_close(n_stats, stats)
    torch.testing.assert_close(n_rows, row_loss)


def test_chunked_loss_under_bf16_autocast_matches_one_chunk(monkeypatch):
    """Under bf16 autocast (as on CUDA) chunking changes no logit: the loss is the same to
    float32 rounding; gradients are summed over chunks in float32, so they agree with one
    chunk's to bf16 precision (1e-2 relative)."""
    drafter, input_ids, aux, labels, weights, rows = _setup("eagle3")
    results = []
    for chunk in (VD * 2, 1 << 26):
        monkeypatch.setattr(loss_module, "LOSS_CHUNK", chunk)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            results.append(_run(drafter, input_ids, aux, labels, weights, rows))
    (loss_a, stats_a, _, grads_a), (loss_b, stats_b, _, grads_b) = results
    torch.testing.assert_close(loss_a, loss_b, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(stats_a, stats_b, atol=1e-4, rtol=1e-5)
    for a, b in zip(grads_a, grads_b):
        assert a.dtype == b.dtype == torch.float32
        torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-2)


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_the_target_distribution_is_computed_once_per_label_position(kind, monkeypatch):
    """Pairs that share a label position (every step of EAGLE-3's chain, every anchor of
    DFlash's blocks) share one evaluation of the target's head there: the head sees as many
    rows as there are distinct scored positions, chunked or not."""
    drafter, input_ids, aux, labels, weights, rows = _setup(kind)
    scored_positions, scored_pairs = set(), 0
    B, T = labels.trained.shape
    for k in range(K):
        for b in range(B):
            for i in range(T - 1 - k):
                j = i + 1 + k
                if labels.trained[b, j] and (rows is None or rows[b, i]):
                    scored_positions.add((b, j))
                    scored_pairs += 1
    assert scored_pairs > len(scored_positions)  # positions are shared, or this test shows nothing
    teacher, seen = labels.teacher, []
    labels.teacher = lambda h: seen.append(h.shape[0]) or teacher(h)
    for pairs in (None, 2):
        seen.clear()
        monkeypatch.setattr(loss_module, "LOSS_CHUNK", VD * pairs if pairs else 1 << 26)
        drafter(input_ids, aux, labels, weights, *([] if rows is None else [rows]))
        if pairs is None:
            assert seen == [len(scored_positions)]
        else:  # a position split by a chunk's edge is evaluated in both chunks
            assert len(scored_positions) <= sum(seen) <= len(scored_positions) + len(seen) - 1
