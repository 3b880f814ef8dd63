"""Position weighting of the loss (draft/loss.py), each against a hand-written reference:
D-PACE (speculators' DFlash default) weights each trained pair by the drafter's own chance of
reaching and passing the steps from it on; SpecForge's exp(-(k-1)/gamma) is the decay
weighting with --ttt-decay exp(-1/gamma)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from eyas.draft.loss import dpace_weights, step_counts
from eyas.draft.objective import Objective
from eyas.train.anchors import anchor_rows
from eyas.train.labels import make_labels
from test_adversarial import cli, train_args
from test_dflash import make_setup as dflash_setup
from test_store_damage import tiny_prepared, tiny_store  # noqa: F401
from test_ttt import K, make_setup as eagle3_setup, reference_loss

ALPHA = 0.3


def reference_dpace(q: list[float], m: list[bool], alpha: float) -> list[float]:
    """One chain (or block) of steps, as the paper writes it: s_k = (1-alpha) q_k + alpha where
    trained (1 elsewhere), P_k = s_0 ... s_k, w_k = m_k (m_k P_k + m_k+1 P_k+1 + ...)."""
    s = [(1 - alpha) * qk + alpha if mk else 1.0 for qk, mk in zip(q, m)]
    P = [math.prod(s[: k + 1]) for k in range(len(s))]
    return [float(m[k]) * sum(float(m[j]) * P[j] for j in range(k, len(s))) for k in range(len(s))]


def test_dpace_weights_equal_the_written_formula():
    g = torch.Generator().manual_seed(0)
    q = torch.rand(5, 3, 7, generator=g)
    pairs = torch.rand(5, 3, 7, generator=g) < 0.7
    w = dpace_weights(q, pairs, ALPHA)
    for b in range(3):
        for i in range(7):
            expected = reference_dpace(q[:, b, i].tolist(), pairs[:, b, i].tolist(), ALPHA)
            torch.testing.assert_close(w[:, b, i], torch.tensor(expected), atol=1e-6, rtol=1e-6)
    assert (w[~pairs] == 0).all() and (w[pairs] > 0).all()
    # A sure drafter (q = 1) weighs step k by the trained steps from k on; alpha = 1 does the same.
    ones = dpace_weights(torch.ones(4, 1, 1), torch.ones(4, 1, 1, dtype=torch.bool), ALPHA)
    assert ones[:, 0, 0].tolist() == [4.0, 3.0, 2.0, 1.0]


def reference_dpace_loss(logits, labels, rows, alpha: float) -> torch.Tensor:
    """sum over trained pairs of w x soft CE / (trained pairs), w from `reference_dpace` on the
    drafter's probability of the target's token per row's chain (0 outside the draft vocab;
    no gradient through w)."""
    B, T = labels.trained.shape
    total, count = torch.zeros(()), 0
    for b in range(B):
        for i in range(T - 1):
            if rows is not None and not rows[b, i]:
                continue
            steps = range(min(K, T - 1 - i))
            m = [bool(labels.trained[b, i + 1 + k]) for k in steps]
            t = [int(labels.target_draft[b, i + 1 + k]) for k in steps]
            q = [float(logits[k][b, i].detach().softmax(-1)[t[k]]) if t[k] >= 0 else 0.0 for k in steps]
            w = reference_dpace(q, m, alpha)
            for k in steps:
                count += m[k]
                if m[k] and t[k] >= 0:
                    total = total - w[k] * (labels.probs(b, i + 1 + k) * logits[k][b, i].log_softmax(-1)).sum()
    return total / count


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_dpace_loss_equals_the_reference_values_and_gradients(kind):
    drafter, head, draft_ids, input_ids, hidden, loss_mask = (eagle3_setup if kind == "eagle3" else dflash_setup)()
    rows = None if kind == "eagle3" else anchor_rows(loss_mask, K, 3, (0, 5))
    labels = make_labels(head, hidden[:, :, -1], loss_mask, draft_ids)
    counts = step_counts(loss_mask, K, rows)
    weights = torch.full((K,), 1.0) / counts.sum()  # what training passes under D-PACE
    params = [p for p in drafter.parameters() if p.requires_grad]
    loss, stats, _ = drafter(input_ids, hidden[:, :, :3], labels, weights, rows, Objective(dpace_alpha=ALPHA))
    grads = torch.autograd.grad(loss, params)
    logits = drafter.forward_ttt(input_ids, hidden[:, :, :3], K, rows)
    ref = reference_dpace_loss(logits, labels, rows, ALPHA)
    ref_grads = torch.autograd.grad(ref, params)
    torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-5)
    for a, r in zip(grads, ref_grads):
        torch.testing.assert_close(a, r, atol=1e-5, rtol=1e-5)
    # It is not the decay weighting under another name.
    decay = reference_loss(logits, labels, 0.8, rows)
    assert not torch.isclose(decay, ref, rtol=1e-2)
    assert stats[:, 2].tolist() == counts.tolist()


def test_specforge_gamma_is_the_decay_weighting_with_decay_exp_minus_one_over_gamma():
    """SpecForge weighs DFlash block slot s (1 = the first drafted token) exp(-(s-1)/gamma): the
    loss trained with decay exp(-1/gamma) equals that reference, written per slot (each slot's
    mean over its trained pairs), values and gradients (float32, 1e-5)."""
    gamma = 7.0
    drafter, head, draft_ids, input_ids, hidden, loss_mask = dflash_setup()
    rows = anchor_rows(loss_mask, K, 3, (0, 5))
    labels = make_labels(head, hidden[:, :, -1], loss_mask, draft_ids)
    counts = step_counts(loss_mask, K, rows)
    weights = torch.tensor([math.exp(-1 / gamma) ** k for k in range(K)]) / counts
    params = [p for p in drafter.parameters() if p.requires_grad]
    loss = drafter(input_ids, hidden[:, :, :3], labels, weights, rows)[0]
    grads = torch.autograd.grad(loss, params)

    logits = drafter.forward_ttt(input_ids, hidden[:, :, :3], K, rows)
    B, T = input_ids.shape
    ref = torch.zeros(())
    for slot in range(1, K + 1):
        total, n = torch.zeros(()), 0
        for b in range(B):
            for i in range(T - slot):
                j = i + slot  # slot s of the block anchored after row i predicts position i + s
                if rows[b, i] and labels.trained[b, j]:
                    n += 1
                    if labels.target_draft[b, j] >= 0:
                        total = total - (labels.probs(b, j) * logits[slot - 1][b, i].log_softmax(-1)).sum()
        ref = ref + math.exp(-(slot - 1) / gamma) * total / n
    torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-5)
    for a, r in zip(grads, torch.autograd.grad(ref, params)):
        torch.testing.assert_close(a, r, atol=1e-5, rtol=1e-5)


def test_training_with_dpace_runs_and_records_it(tmp_path, capsys, tiny_store):  # noqa: F811
    """`eyas train --position-weights dpace` trains, records the choice, and a resume with the
    other weighting is refused as a changed setting."""
    out = tmp_path / "run"
    got, _ = cli(capsys, *train_args(tiny_store, out, "--steps", "2", "--ttt-steps", "2", "--position-weights",
                                     "dpace", "--dpace-alpha", "0.4"))
    assert got == 0
    text = json.dumps(json.loads((out / "checkpoints" / "step-0000002" / "trainer.json").read_text()))
    assert '"position_weights": "dpace"' in text and '"dpace_alpha": 0.4' in text
    got, err = cli(capsys, *train_args(tiny_store, out, "--steps", "4", "--ttt-steps", "2", "--resume"))
    assert got != 0 and "position-weights" in err
