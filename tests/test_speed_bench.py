"""bench/speed_gpu.py's own pieces compute what they claim (CPU, tiny shapes): the timed
training step is the trainer's step, the plain peer-style step trains the same
objective, and the FLOP formula counts what it says."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
speed = pytest.importorskip("speed_gpu")

from eyas.draft.config import DraftConfig  # noqa: E402
from eyas.models.target_head import TargetHead  # noqa: E402
from eyas.train.config import TrainConfig  # noqa: E402
from eyas.draft.loss import step_counts  # noqa: E402
from eyas.train.labels import make_labels  # noqa: E402

V, H, K = 64, 32, 3


def tiny_draft(draft_vocab: int = V) -> DraftConfig:
    target = {"model": "tiny", "config_hash": "c", "tokenizer_hash": "t", "num_layers": 6, "hidden_size": H, "vocab_size": V}
    return DraftConfig(hidden_size=H, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                       vocab_size=V, draft_vocab_size=draft_vocab, aux_layer_ids=(1, 3, 4), label_layer_id=6, target=target,
                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, ttt_steps=K)


def tiny_run(lengths=(9, 12, 7, 12, 5, 10)):
    torch.manual_seed(0)
    draft = tiny_draft(draft_vocab=40)
    head = TargetHead(torch.randn(V, H), torch.nn.RMSNorm(H, eps=1e-5), torch.randn(V, H) * 0.5)
    source = speed.InMemorySource(list(lengths), draft, torch.device("cpu"))
    cfg = TrainConfig(out="unused", store="(in memory)", batch_tokens=24, ttt_steps=K, lr=1e-2, warmup=0,
                      eval_fraction=0.0)
    return speed.in_memory_run(cfg, draft, head, source, torch.device("cpu"))


def test_a_timed_step_is_the_trainers_step_and_times_each_part():
    """train_parts times the trainer's own step (loop.StepTimer): the same weights after each
    step as an untimed run, and a duration for every part of it."""
    from eyas.train.loop import StepTimer, train_step

    a, b = tiny_run(), tiny_run()
    timer = StepTimer(torch.device("cpu"))
    for _ in range(3):
        train_step(a)
        train_step(b, timer)
    assert a.step == b.step == 3
    for (name, pa), (_, pb) in zip(a.model.named_parameters(), b.model.named_parameters()):
        torch.testing.assert_close(pa, pb, rtol=0, atol=0, msg=name)
    assert set(timer.seconds) == {"weights", "load", "labels", "forward", "backward", "clip", "checks", "optimizer",
                                  "weight_check"}
    assert all(s > 0 for s in timer.seconds.values())


def test_plain_step_trains_eyas_objective():
    """With every target token in the draft vocabulary, the peer-style loss (per-step means,
    weighted decay^k) equals eyas's TTT loss on the same sample, and so do the gradients."""
    torch.manual_seed(0)
    draft = tiny_draft()
    from eyas.draft.model import Eagle3Drafter

    drafter = Eagle3Drafter(draft, torch.randn(V, H))
    for p in drafter.parameters():
        if p.requires_grad:
            p.data.normal_(0, 0.3)
    draft_ids = torch.arange(V)
    drafter.set_vocab(draft_ids)
    head = TargetHead(torch.randn(V, H), torch.nn.RMSNorm(H, eps=1e-5), torch.randn(V, H) * 0.5)
    T = 13
    ids = torch.randint(0, V, (1, T))
    hidden = torch.randn(1, T, 4, H)
    mask = torch.rand(1, T) < 0.7

    counts = step_counts(mask, K)
    weights = torch.tensor([0.8 ** k for k in range(K)]) / counts.clamp_min(1)
    labels = make_labels(head, hidden[:, :, -1], mask, draft_ids)
    loss, _, _ = drafter(ids, hidden[:, :, :-1], labels, weights)
    loss.backward()
    want = {n: p.grad.clone() for n, p in drafter.named_parameters() if p.requires_grad}
    drafter.zero_grad()

    keep = torch.optim.SGD([p for p in drafter.parameters() if p.requires_grad], lr=0.0)
    grads = {}
    keep.step = lambda: grads.update({n: p.grad.clone() for n, p in drafter.named_parameters() if p.requires_grad})
    got = speed.plain_step(drafter, head, keep, draft_ids, ids, hidden[:, :, :-1], hidden[:, :, -1], mask, K)
    torch.testing.assert_close(got, loss.detach(), rtol=1e-5, atol=1e-6)
    norm = torch.stack([g.norm() for g in want.values()]).norm()
    scale = min(1.0, 0.5 / (norm.item() + 1e-6))  # plain_step clips to 0.5 before its step, as the trainer does
    for n in want:
        torch.testing.assert_close(grads[n], want[n] * scale, rtol=1e-4, atol=1e-6, msg=n)


def test_flop_formula_counts_matrix_work():
    draft = tiny_draft()
    lengths = [10, 20]
    f = speed.train_flops(draft, V, lengths, steps=2)
    n = 30
    q = kv_per_head = 8
    qd, kvd = 4 * q, 2 * kv_per_head
    per_step = 2 * (2 * H * qd + 2 * 2 * H * kvd + qd * H + 3 * H * 48 + H * V)
    pairs = 10 * 11 / 2 + 20 * 21 / 2
    attention = 4 * qd * pairs + 4 * qd * (pairs + n)
    fc = 2 * 3 * H * H * n
    assert f["labels"] == 2 * H * V * n
    assert f["forward"] == fc + 2 * n * per_step + attention
    assert f["total"] == f["labels"] + 3 * (2 * n * per_step + attention) + 2 * fc
