"""The losses beside soft cross-entropy (`eyas train --loss`, draft/loss.py): hard
cross-entropy against the target's greedy token and the LK losses (arXiv 2602.23881), each
against a hand-written reference differentiated by autograd: per pair, chunk by chunk, and as
the whole training-time-test objective of EAGLE-3 and DFlash, in values and gradients. The
closed-form gradients the chunked loss computes in its forward are what autograd gives."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import eyas.draft.loss as loss_module
from eyas.draft.loss import ACCEPT, COUNT, IN_VOCAB, LK_EPS, chunk_loss, step_counts
from eyas.draft.objective import LOSSES, Objective
from eyas.train.anchors import anchor_rows
from eyas.train.labels import make_labels
from test_adversarial import cli, train_args
from test_chunked_loss import DECAY, _setup
from test_dflash import make_setup as dflash_setup
from test_store_damage import tiny_prepared, tiny_store  # noqa: F401
from test_ttt import K, VD, make_setup, reference_loss, soft_cross_entropy

ETA = 3.0


def reference_pair(loss: str, eta: float = ETA):
    """The paper's per-pair losses, written out: logits [Vd], p [Vd] -> scalar."""

    def pair(logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        if loss == "soft-ce":
            return soft_cross_entropy(logits, p)
        if loss == "hard-ce":  # against the target's greedy token
            return -logits.log_softmax(-1)[p.argmax()]
        q = logits.softmax(-1)
        alpha = torch.minimum(p, q).sum()  # the acceptance rate of speculative sampling
        if loss == "lk-alpha":
            return -torch.log(alpha + LK_EPS)
        lam = torch.exp(-eta * alpha.detach())  # stop-gradient on the blend weight
        kl = (p * (p.log() - logits.log_softmax(-1))).sum()
        return lam * kl + (1 - lam) * (1 - alpha)

    return pair


def _loss(logits: torch.Tensor, probs: torch.Tensor, weight: torch.Tensor, loss: str, eta: float = ETA):
    """chunk_loss's value and gradient (the acceptance it also returns is tested below), the
    target's token its distribution's argmax."""
    value, _, grad = chunk_loss(logits, probs, probs.argmax(-1), weight, torch.ones(len(probs)), loss, eta)
    return value, grad


def _draw(n: int = 9, v: int = 48, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, v, generator=g) * 2
    probs = torch.softmax(torch.randn(n, v, generator=g) * 3, -1)
    weight = torch.rand(n, generator=g) + 0.5
    return logits, probs, weight


@pytest.mark.parametrize("loss", LOSSES)
def test_each_loss_and_its_gradient_equal_the_reference(loss):
    """Per pair (float32, 1e-5): the value, and the logits' gradient times the pair's weight."""
    logits, probs, weight = _draw()
    value, grad = _loss(logits, probs, weight, loss, ETA)
    leaf = logits.clone().requires_grad_(True)
    ref = torch.stack([reference_pair(loss)(leaf[n], probs[n]) for n in range(len(probs))])
    (ref_grad,) = torch.autograd.grad((ref * weight).sum(), leaf)
    torch.testing.assert_close(value, ref.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-6)
    assert grad.abs().sum() > 0 and torch.isfinite(value).all()


def test_the_losses_meet_their_limits():
    """lk-alpha is cross-entropy when the target is one token; lk-hybrid is KL at eta = 0 and
    total variation (1 - acceptance) when eta is large."""
    logits, probs, weight = _draw()
    one_hot = torch.nn.functional.one_hot(probs.argmax(-1), probs.shape[-1]).float()
    alpha_value, alpha_grad = _loss(logits, one_hot, weight, "lk-alpha")
    ce_value, ce_grad = _loss(logits, one_hot, weight, "soft-ce")
    q = torch.exp(-ce_value)  # the drafter's probability of the one token, = alpha
    torch.testing.assert_close(alpha_value, -torch.log(q + LK_EPS), rtol=1e-5, atol=1e-6)  # CE but for LK_EPS
    torch.testing.assert_close(alpha_grad, ce_grad * (q / (q + LK_EPS))[:, None], rtol=1e-5, atol=1e-7)

    kl = (probs * (probs.log() - logits.log_softmax(-1))).sum(-1)
    value, grad = _loss(logits, probs, weight, "lk-hybrid", 0.0)
    torch.testing.assert_close(value, kl, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, _loss(logits, probs, weight, "soft-ce")[1], rtol=1e-5, atol=1e-7)
    tv = 1 - torch.minimum(probs, logits.softmax(-1)).sum(-1)
    torch.testing.assert_close(_loss(logits, probs, weight, "lk-hybrid", 1e4)[0], tv, rtol=1e-5, atol=1e-6)

    # Where the drafter's distribution is the target's, the LK losses are at their minimum (the
    # acceptance rate is 1), and nowhere lower.
    at_target = {loss: _loss(probs.log(), probs, weight, loss, ETA)[0] for loss in ("lk-hybrid", "lk-alpha")}
    torch.testing.assert_close(at_target["lk-hybrid"], torch.zeros(len(probs)), rtol=0, atol=1e-5)
    torch.testing.assert_close(at_target["lk-alpha"], torch.full((len(probs),), -torch.log(torch.tensor(1 + LK_EPS)).item()),
                               rtol=0, atol=1e-5)
    for loss, best in at_target.items():
        assert (_loss(logits, probs, weight, loss, ETA)[0] > best).all(), loss


@pytest.mark.parametrize("loss", ["hard-ce", "lk-hybrid", "lk-alpha"])
@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_the_whole_objective_equals_the_reference(kind, loss, monkeypatch):
    """The drafter's own loss with --loss: one pair a chunk, three, and all at once equal the
    reference over every scored pair's full logits, in values and gradients (float32, 1e-5).
    The reference takes hard CE's token as the argmax of the target's distribution over the
    draft vocabulary and skips the pairs whose greedy token lies outside it (there are some)."""
    drafter, input_ids, aux, labels, weights, rows = _setup(kind)
    params = [p for p in drafter.parameters() if p.requires_grad]
    logits = drafter.forward_ttt(input_ids, aux, K, rows)
    ref = reference_loss(logits, labels, DECAY, rows, pair=reference_pair(loss))
    ref_grads = torch.autograd.grad(ref, params)
    objective = Objective(loss, ETA)
    for pairs in (1, 3, None):
        monkeypatch.setattr(loss_module, "LOSS_CHUNK", VD * pairs if pairs else 1 << 26)
        got, stats, _ = drafter(input_ids, aux, labels, weights, rows, objective)
        torch.testing.assert_close(got.detach(), ref.detach(), atol=1e-5, rtol=1e-5, msg=f"{pairs} pairs a chunk")
        for g, r in zip(torch.autograd.grad(got, params), ref_grads):
            torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5)
    soft = reference_loss(logits, labels, DECAY, rows)
    assert abs(ref.item() - soft.item()) > 1e-3  # the loss chosen is not soft CE under another name


@pytest.mark.parametrize("loss", LOSSES)
def test_acceptance_at_temperature_1_is_the_overlap_with_the_targets_full_distribution(loss, monkeypatch):
    """Statistics column ACCEPT: per step, the sum over trained pairs of sum_v min(p_v, q_v),
    p the target's probabilities of the draft tokens under its full-vocabulary softmax (the
    mass outside the draft vocabulary is out of reach), q the drafter's; pairs whose target
    token lies outside the draft vocabulary included. The same for every loss, chunked or not."""
    drafter, head, draft_ids, input_ids, hidden, loss_mask = make_setup()
    labels = make_labels(head, hidden[:, :, -1], loss_mask, draft_ids)
    assert (labels.inside < 0.99).all() and (labels.inside > 0).all()  # the draft vocabulary misses mass
    weights = torch.ones(K) / step_counts(loss_mask, K).clamp_min(1)
    full = head.logits(hidden[:, :, -1]).float().softmax(-1)[..., draft_ids]  # [B, T, Vd]
    with torch.no_grad():
        logits = drafter.forward_ttt(input_ids, hidden[:, :, :3], K)
    B, T = input_ids.shape
    expected = torch.zeros(K)
    for k in range(K):
        for b in range(B):
            for i in range(T - 1 - k):
                if labels.trained[b, i + 1 + k]:
                    expected[k] += torch.minimum(full[b, i + 1 + k], logits[k][b, i].softmax(-1)).sum()
    for pairs in (2, None):
        monkeypatch.setattr(loss_module, "LOSS_CHUNK", VD * pairs if pairs else 1 << 26)
        _, stats, _ = drafter(input_ids, hidden[:, :, :3], labels, weights, None, Objective(loss))
        torch.testing.assert_close(stats[:, ACCEPT], expected, rtol=1e-5, atol=1e-5)
    assert (stats[:, IN_VOCAB] < stats[:, COUNT]).any()  # out-of-vocabulary pairs were among them
    assert ((stats[:, ACCEPT] > 0) & (stats[:, ACCEPT] < stats[:, COUNT])).all()


def test_hard_ce_gives_no_loss_and_no_gradient_outside_the_draft_vocabulary():
    """A pair whose greedy token lies outside the draft vocabulary (-1) adds nothing whatever its
    weight; the others are soft CE against that token one-hot (float32, 1e-6)."""
    logits, probs, weight = _draw()
    target = probs.argmax(-1)
    target[::3] = -1
    value, _, grad = chunk_loss(logits, probs, target, weight, torch.ones(len(probs)), "hard-ce")
    one_hot = torch.nn.functional.one_hot(target.clamp_min(0), probs.shape[-1]).float()
    soft_value, soft_grad = _loss(logits, one_hot, weight, "soft-ce")
    out = target < 0
    assert out.any() and (value[out] == 0).all() and (grad[out] == 0).all()
    torch.testing.assert_close(value[~out], soft_value[~out], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad[~out], soft_grad[~out], rtol=1e-6, atol=1e-6)


WEIGHTINGS = {"decay": Objective(), "dpace": Objective(dpace_alpha=0.3), "on-policy": Objective(on_policy=True)}


@pytest.mark.parametrize("kind, weighting", [("eagle3", w) for w in WEIGHTINGS] + [("dflash", "decay"),
                                                                                   ("dflash", "dpace")])
def test_hard_ce_under_each_position_weighting_is_soft_ce_against_the_greedy_token(kind, weighting, monkeypatch):
    """Each --position-weights option (on-policy: EAGLE-3's only) weighs hard CE's pairs as it
    weighs soft CE's: with the target's distribution made one-hot at its greedy token (its
    logits scaled 1e6), soft CE's objective is hard CE's in loss, statistics, per-row loss and
    gradients, one pair a chunk or all at once (float32, 1e-5). Soft CE under each weighting
    equals its reference in test_chunked_loss.py, test_position_weights.py and
    test_on_policy.py."""
    drafter, head, draft_ids, input_ids, hidden, loss_mask = (make_setup if kind == "eagle3" else dflash_setup)()
    input_ids[:, 1:] = head.logits(hidden[:, :-1, -1]).argmax(-1)  # the target's greedy path: on-policy walks it
    rows = None if kind == "eagle3" else anchor_rows(loss_mask, K, 3, (0, 5))
    labels = make_labels(head, hidden[:, :, -1], loss_mask, draft_ids, input_ids)
    sharp = dataclasses.replace(labels, teacher=lambda h: labels.teacher(h) * 1e6)
    assert (labels.target_draft < 0).any()  # pairs outside the draft vocabulary are among them
    weights = torch.full((K,), 1.0) / step_counts(loss_mask, K, rows).sum()
    params = [p for p in drafter.parameters() if p.requires_grad]
    objective = WEIGHTINGS[weighting]
    for pairs in (1, None):
        monkeypatch.setattr(loss_module, "LOSS_CHUNK", VD * pairs if pairs else 1 << 26)
        runs = []
        for loss in ("hard-ce", "soft-ce"):
            got, stats, row_loss = drafter(input_ids, hidden[:, :, :3], sharp, weights, rows,
                                           dataclasses.replace(objective, loss=loss))
            runs.append((got.detach(), stats, row_loss, torch.autograd.grad(got, params)))
        (hard, stats, row_loss, grads), (soft, soft_stats, soft_row_loss, soft_grads) = runs
        assert hard > 0 and all(g.abs().sum() > 0 for g in grads)
        for a, b in zip((hard, stats, row_loss, *grads), (soft, soft_stats, soft_row_loss, *soft_grads)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_an_unknown_loss_is_refused():
    with pytest.raises(ValueError, match="unknown loss"):
        Objective("tv")


def test_training_with_an_lk_loss_records_it_and_a_resume_keeps_it(tmp_path, capsys, tiny_store):  # noqa: F811
    """`eyas train --loss lk-hybrid --lk-eta 2` trains with finite losses, records both, and a
    resume that asks for another loss is refused as a changed setting."""
    out = tmp_path / "run"
    got, _ = cli(capsys, *train_args(tiny_store, out, "--steps", "2", "--ttt-steps", "2", "--loss", "lk-hybrid",
                                     "--lk-eta", "2"))
    assert got == 0
    text = json.dumps(json.loads((out / "checkpoints" / "step-0000002" / "trainer.json").read_text()))
    assert '"loss": "lk-hybrid"' in text and '"lk_eta": 2.0' in text
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows and all(0 <= r["loss"] < 10 for r in rows if "loss" in r)
    got, err = cli(capsys, *train_args(tiny_store, out, "--steps", "4", "--ttt-steps", "2", "--loss", "lk-alpha",
                                       "--resume"))
    assert got != 0 and "loss 'lk-alpha' (the run has 'lk-hybrid')" in err
