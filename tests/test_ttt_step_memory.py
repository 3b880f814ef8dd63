"""Changes brought in from speculators' step (issue 21) keep the TTT objective's numbers:
grouped kv heads attended without copies, the step's parts around attention compiled, and
the target's lm_head held in bf16 where labels are computed under bf16 autocast."""

from __future__ import annotations

import torch

import eyas.draft.model as dm
from eyas.draft.loss import step_counts
from eyas.train.labels import make_labels
from eyas.models.target_head import TargetHead
from test_ttt import K, make_setup


def test_grouped_kv_heads_attend_as_repeated_ones_in_both_paths(monkeypatch):
    """k/v with fewer heads than q (GQA, as `qkv` now returns them) give the attention of the
    same heads repeated, dense and flex (flex eagerly, forward only, as the CPU allows)."""
    from torch.nn.attention.flex_attention import flex_attention

    monkeypatch.setattr(dm, "_compiled_flex", lambda: flex_attention)
    g = torch.Generator().manual_seed(0)
    T, heads, kv = 150, 8, 2
    q = torch.randn(2, heads, T, 16, generator=g)
    k0, v0 = (torch.randn(2, kv, T, 16, generator=g) for _ in range(2))
    extra = [(torch.randn(2, kv, T, 16, generator=g), torch.randn(2, kv, T, 16, generator=g)) for _ in range(2)]

    def rep(t):
        return t.repeat_interleave(heads // kv, dim=1)

    expected = dm.ttt_attention_dense(q, rep(k0), rep(v0), [(rep(a), rep(b)) for a, b in extra])
    torch.testing.assert_close(dm.ttt_attention_dense(q, k0, v0, extra), expected, rtol=0, atol=0)
    torch.testing.assert_close(dm.ttt_attention_flex(q, k0, v0, extra), expected, atol=1e-5, rtol=1e-5)
    # Head h reads kv head h // 4: pairing them otherwise gives another result.
    wrong = k0.repeat(1, heads // kv, 1, 1)
    assert not torch.allclose(dm.ttt_attention_dense(q, wrong, v0.repeat(1, heads // kv, 1, 1), []),
                              dm.ttt_attention_dense(q, k0, v0, []), atol=1e-3)


def _loss_and_grads(options: dict):
    drafter, head, draft_ids, input_ids, hidden, loss_mask = make_setup(**options)
    labels = make_labels(head, hidden[:, :, -1], loss_mask, draft_ids)
    weights = 0.8 ** torch.arange(K) / step_counts(loss_mask, K).clamp_min(1)
    loss, stats, _ = drafter(input_ids, hidden[:, :, :-1], labels, weights)
    loss.backward()
    return loss.detach(), stats, {n: p.grad.clone() for n, p in drafter.named_parameters() if p.requires_grad}


def test_compiled_step_parts_give_the_eager_loss_and_gradients(monkeypatch):
    """CUDA runs the parts around attention through torch.compile; here the same trace and the
    same min-cut partition of forward and backward (what decides what is kept for backward and
    what is recomputed) run on the CPU, with every drafter option and stacked layers."""
    compiled = tuple(torch.compile(part, backend="aot_eager_decomp_partition", dynamic=True)
                     for part in (dm._pre_attention, dm._stacked_pre_attention, dm._mid_attention, dm._post_attention))
    for options in ({}, {"fc_norm": True, "norm_output": True, "norm_before_residual": True},
                    {"num_hidden_layers": 3, "norm_output": True}):
        loss, stats, grads = _loss_and_grads(options)
        with monkeypatch.context() as m:
            calls = []
            m.setattr(dm, "_step_parts", lambda on: calls.append(on) or compiled)
            c_loss, c_stats, c_grads = _loss_and_grads(options)
        assert calls  # the compiled parts ran
        torch.testing.assert_close(c_loss, loss, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(c_stats, stats, rtol=1e-5, atol=1e-5)
        assert set(c_grads) == set(grads) and all(g.abs().sum() > 0 for g in grads.values())
        for name, g in grads.items():
            torch.testing.assert_close(c_grads[name], g, rtol=1e-4, atol=1e-6, msg=name)


def test_a_bf16_lm_head_gives_the_same_labels_under_bf16_autocast():
    """TargetHead.to('cuda') keeps lm_head in bf16; autocast casts a float32 one to the same
    bf16 values for each product, so the labels are the same bits (CPU autocast here)."""
    _, head, draft_ids, _, hidden, loss_mask = make_setup()
    half = TargetHead(head.embed_weight, head.norm, head.lm_head_weight.bfloat16())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        full = make_labels(head, hidden[:, :, -1], loss_mask, draft_ids)
        ours = make_labels(half, hidden[:, :, -1], loss_mask, draft_ids)
        assert torch.equal(ours.probs(), full.probs())  # the loss computes them under the same autocast
    assert torch.equal(ours.target_draft, full.target_draft)
    assert (full.target_draft >= 0).any()
