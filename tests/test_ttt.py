"""The training-time-test objective against a plain step-by-step reference.

The reference below recomputes every (step k, position i) pair on its own: its query, the
keys it may see (step-0 keys at positions <= i and the position-i key of each step 1..k),
its softmax, its MLP, its logits and its soft cross-entropy, with loops instead of masks.
Both run in float32; they agree to 1e-5 (logits, loss) and 1e-4 relative (gradients), with
and without each drafter option (fc_norm, norm_output).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import eyas.draft.model as dm
from eyas.draft import DraftConfig, Eagle3Drafter, ttt_attention
from eyas.models.target_head import TargetHead
from eyas.draft.loss import step_counts, trained_positions
from eyas.train.labels import make_labels

V, H, VD, K = 97, 32, 41, 4


def tiny_config(**overrides) -> DraftConfig:
    target = {"model": "tiny", "config_hash": "c", "tokenizer_hash": "t", "num_layers": 6, "hidden_size": H,
              "vocab_size": V}
    kwargs = dict(hidden_size=H, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  vocab_size=V, draft_vocab_size=VD, aux_layer_ids=(1, 3, 4), label_layer_id=6, target=target,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, ttt_steps=K)
    kwargs.update(overrides)
    return DraftConfig(**kwargs)


OPTIONS = {"plain": {}, "fc_norm": {"fc_norm": True}, "norm_output": {"norm_output": True},
           "both": {"fc_norm": True, "norm_output": True}}


@pytest.fixture
def setup():
    return make_setup()


def make_setup(**options):
    torch.manual_seed(0)
    cfg = tiny_config(**options)
    drafter = Eagle3Drafter(cfg, torch.randn(V, H))
    for p in drafter.parameters():  # larger than the default init (norm weights too), so every term matters
        if p.requires_grad:
            p.data.normal_(0, 0.3)
    draft_ids = torch.randperm(V)[:VD].sort().values
    drafter.set_vocab(draft_ids)
    head = TargetHead(torch.randn(V, H), torch.nn.RMSNorm(H, eps=1e-5), torch.randn(V, H) * 0.5)
    B, T = 3, 11
    input_ids = torch.randint(0, V, (B, T))
    hidden = torch.randn(B, T, 4, H)  # three aux states and id N
    loss_mask = torch.rand(B, T) < 0.7
    loss_mask[2, 8:] = False  # row 2 is padding after 8 tokens
    input_ids[2, 8:] = 0
    return drafter, head, draft_ids, input_ids, hidden, loss_mask


def rope(x: torch.Tensor, pos: int, theta: float = 10000.0) -> torch.Tensor:
    """x [n, d] at position `pos`, rotate-half convention."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    angle = torch.cat([pos * inv, pos * inv])
    rotated = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], dim=-1)
    return x * angle.cos() + rotated * angle.sin()


def fuse(m: Eagle3Drafter, aux: torch.Tensor) -> torch.Tensor:
    """aux [3, H] -> fc's output [H], each aux state through its own RMSNorm first with fc_norm."""
    if m.config.fc_norm:
        aux = torch.stack([m.fc_norm[j](aux[j]) for j in range(len(aux))])
    return m.fc(aux.reshape(-1))


def gqa_heads(m: Eagle3Drafter, x: torch.Tensor, pos: int):
    """The Llama layer's query, key and value heads [nH, d] for one input x [2H] at `pos`
    (each KV head shared by its group of query heads), and the softmax scale d^-0.5."""
    a = m.midlayer.self_attn
    nH, nKV, d = a.n_heads, a.n_kv, a.head_dim
    group = nH // nKV
    q = rope((x @ a.q_proj.weight.T).view(nH, d), pos)
    k = rope((x @ a.k_proj.weight.T).view(nKV, d), pos).repeat_interleave(group, 0)
    v = (x @ a.v_proj.weight.T).view(nKV, d).repeat_interleave(group, 0)
    return q, k, v, 1 / math.sqrt(d)


def reference_ttt(m: Eagle3Drafter, input_ids, hidden, labels, decay: float, heads=gqa_heads):
    """Logits [K][B, T, Vd] (valid pairs only, others zero) and the loss, one pair at a time;
    `heads(m, x, pos)` gives the attention's per-head query, key, value and softmax scale."""
    a = m.midlayer.self_attn
    B, T = input_ids.shape
    logits = [torch.zeros(B, T, VD) for _ in range(K)]
    for b in range(B):
        h_prev = [fuse(m, hidden[b, i, :3]) for i in range(T)]  # step 0's hidden input
        keys, values = {}, {}  # (step, position) -> [nH, d]
        for k in range(K):
            n = T - 1 - k
            queries, residuals = {}, {}
            for i in range(n):
                e = m.embed_tokens.weight[input_ids[b, i + 1 + k]]
                x = torch.cat([m.midlayer.input_layernorm(e), m.midlayer.hidden_norm(h_prev[i])])
                residuals[i] = h_prev[i]
                queries[i], keys[k, i], values[k, i], scale = heads(m, x, i + k)
            h_next = {}
            for i in range(n):
                seen = [(0, p) for p in range(i + 1)] + [(j, i) for j in range(1, k + 1)]
                outs = []
                for h in range(len(queries[i])):
                    scores = torch.stack([queries[i][h] @ keys[s][h] for s in seen]) * scale
                    w = scores.softmax(0)
                    outs.append(sum(w[t] * values[s][h] for t, s in enumerate(seen)))
                out = a.o_proj(torch.cat(outs)) + residuals[i]
                z = m.midlayer.post_attention_layernorm(out)
                mlp = m.midlayer.mlp
                out = out + mlp.down_proj(F.silu(mlp.gate_proj(z)) * mlp.up_proj(z))
                h_next[i] = m.norm(out) if m.config.norm_output else out  # what step k + 1 reads
                logits[k][b, i] = m.lm_head(m.norm(out))
            h_prev = h_next
    return logits, reference_loss(logits, labels, decay)


def soft_cross_entropy(logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """One pair: logits [Vd], the target's distribution p [Vd] -> -sum p log softmax(logits)."""
    return -(p * logits.log_softmax(-1)).sum()


def reference_loss(logits: list[torch.Tensor], labels, decay: float, rows: torch.Tensor | None = None,
                   pair=soft_cross_entropy) -> torch.Tensor:
    """Step k's logits at i [K][B, T, Vd] against the target's distribution at j = i+1+k: the
    `pair` loss (soft cross-entropy), mean per step over its trained pairs (misses outside the
    draft vocab count in the mean and add no loss), weighted decay^k; only rows i in `rows`
    [B, T] when given."""
    B, T = labels.trained.shape
    loss = torch.zeros(())
    for k in range(len(logits)):
        total, count = torch.zeros(()), 0
        for b in range(B):
            for i in range(T - 1 - k):
                j = i + 1 + k
                if labels.trained[b, j] and (rows is None or rows[b, i]):
                    count += 1
                    if labels.target_draft[b, j] >= 0:
                        total = total + pair(logits[k][b, i], labels.probs(b, j))
        if count:
            loss = loss + decay ** k * total / count
    return loss


@pytest.mark.parametrize("options", list(OPTIONS))
def test_objective_matches_reference_forward_and_gradients(options):
    drafter, head, draft_ids, input_ids, hidden, loss_mask = make_setup(**OPTIONS[options])
    loss, stats = assert_objective_matches_reference(drafter, head, draft_ids, input_ids, hidden, loss_mask)
    assert stats[:, 2].tolist() == step_counts(loss_mask, K).tolist()
    assert loss.item() > 0


def assert_objective_matches_reference(drafter, head, draft_ids, input_ids, hidden, loss_mask, heads=gqa_heads):
    """`check_against_reference` with reference_ttt over the attention `heads` (GQA's, or MLA's)."""
    return check_against_reference(drafter, head, draft_ids, input_ids, hidden, loss_mask,
                                   lambda m, ids, h, labels, decay: reference_ttt(m, ids, h, labels, decay, heads))


def check_against_reference(drafter, head, draft_ids, input_ids, hidden, loss_mask, reference):
    """The objective's loss, the drafter's logits and the gradients equal `reference`'s
    (drafter, input_ids, hidden, labels, decay) -> (logits, loss), in float32 (1e-5; gradients
    1e-4 relative); returns the loss and the per-step statistics."""
    labels = make_labels(head, hidden[:, :, -1], loss_mask, draft_ids)
    decay = 0.8
    counts = step_counts(loss_mask, K)
    weights = torch.tensor([decay ** k for k in range(K)]) / counts

    params = [p for p in drafter.parameters() if p.requires_grad]
    loss, stats, _ = drafter(input_ids, hidden[:, :, :3], labels, weights)
    grads = torch.autograd.grad(loss, params)
    fast_logits = drafter.forward_ttt(input_ids, hidden[:, :, :3], K)

    ref_logits, ref_loss = reference(drafter, input_ids, hidden, labels, decay)
    ref_grads = torch.autograd.grad(ref_loss, params)

    T = input_ids.shape[1]
    for k in range(K):
        torch.testing.assert_close(fast_logits[k][:, : T - 1 - k], ref_logits[k][:, : T - 1 - k], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, atol=1e-6, rtol=1e-4)
    assert all(g.abs().sum() > 0 for g in grads)
    return loss, stats


def test_padding_rows_do_not_change_real_rows(setup):
    """A sample padded inside a batch gets the same loss as on its own: padded keys are
    never visible to real queries (causal + same-position only)."""
    drafter, head, draft_ids, input_ids, hidden, loss_mask = setup
    weights = torch.ones(K)
    labels = make_labels(head, hidden[:, :, -1], loss_mask, draft_ids)
    _, batched, rows = drafter(input_ids, hidden[:, :, :3], labels, weights)
    one = make_labels(head, hidden[2:, :8, -1], loss_mask[2:, :8], draft_ids)
    _, alone, row_alone = drafter(input_ids[2:, :8], hidden[2:, :8, :3], one, weights)
    torch.testing.assert_close(rows[2], row_alone[0], atol=1e-5, rtol=1e-5)
    garbage = hidden.clone()
    garbage[2, 8:] = 1e3  # what sits in padded positions must not matter
    labels_g = make_labels(head, garbage[:, :, -1], loss_mask, draft_ids)
    _, _, rows_g = drafter(input_ids, garbage[:, :, :3], labels_g, weights)
    torch.testing.assert_close(rows_g, rows, atol=1e-5, rtol=1e-5)
    assert alone[:, 2].sum() <= batched[:, 2].sum()


def test_ttt_attention_matches_plain_softmax():
    torch.manual_seed(1)
    B, nH, T, d, steps = 2, 3, 7, 5, 3
    q, k0, v0 = (torch.randn(B, nH, T, d) for _ in range(3))
    extra = [(torch.randn(B, nH, T, d), torch.randn(B, nH, T, d)) for _ in range(steps)]
    out = ttt_attention(q, k0, v0, extra)
    for b in range(B):
        for h in range(nH):
            for i in range(T):
                ks = [k0[b, h, p] for p in range(i + 1)] + [kj[b, h, i] for kj, _ in extra]
                vs = [v0[b, h, p] for p in range(i + 1)] + [vj[b, h, i] for _, vj in extra]
                w = (torch.stack(ks) @ q[b, h, i] / math.sqrt(d)).softmax(0)
                torch.testing.assert_close(out[b, h, i], (w[:, None] * torch.stack(vs)).sum(0), atol=1e-6, rtol=1e-5)


def test_labels_are_the_target_distribution_restricted_to_the_draft_vocab(setup):
    _, head, draft_ids, _, hidden, loss_mask = setup
    labels = make_labels(head, hidden[:, :, -1], loss_mask, draft_ids)
    logits = head.norm(hidden[:, :, -1]) @ head.lm_head_weight.T  # [B, T, V]
    torch.testing.assert_close(labels.probs(), logits[..., draft_ids].softmax(-1))
    argmax = logits.argmax(-1)
    inside = torch.isin(argmax, draft_ids)
    assert inside.any() and (~inside).any()  # both cases occur in this draw
    assert (labels.target_draft[inside] >= 0).all() and (labels.target_draft[~inside] == -1).all()
    assert torch.equal(draft_ids[labels.target_draft[inside]], argmax[inside])
    assert torch.equal(trained_positions(loss_mask)[:, :-1], loss_mask[:, 1:])
    assert not trained_positions(loss_mask)[:, -1].any()


@pytest.mark.parametrize("loss", ["soft-ce", "hard-ce"])
def test_compiled_chunk_loss_equals_eager(loss):
    """The compiled chunk loss (what CUDA runs, on bf16 logits under autocast) gives the eager
    loss and logits gradient, for two chunk sizes (the dynamic graph serves both), and the
    gradient it returns is autograd's; hard CE's targets include -1 (outside the draft
    vocabulary: no loss, no gradient). Tolerance: the loss is float32 (1e-5); the gradient is
    float32 from the same float32 softmax (1e-5)."""
    from eyas.draft.loss import chunk_loss

    g = torch.Generator().manual_seed(0)
    base = torch.randn(21, 64, generator=g).to(torch.bfloat16)
    probs = torch.softmax(torch.randn(21, 64, generator=g) * 3, -1)
    weight = torch.rand(21, generator=g)
    inside = torch.rand(21, generator=g) * 0.5 + 0.5
    target = probs.argmax(-1)
    target[::5] = -1
    hard = F.one_hot(target.clamp_min(0), 64).float() * (target >= 0)[:, None]  # all zero at -1
    labels = probs if loss == "soft-ce" else hard
    compiled = torch.compile(chunk_loss, dynamic=True)
    for n in (21, 13):
        logits = base[:n].float().requires_grad_(True)
        ce, accept, grad = chunk_loss(logits.detach(), probs[:n], target[:n], weight[:n], inside[:n], loss)
        auto_ce = -(labels[:n] * logits.log_softmax(-1)).sum(-1)
        (auto,) = torch.autograd.grad((auto_ce * weight[:n]).sum(), logits)
        torch.testing.assert_close(ce, auto_ce.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(grad, auto, rtol=1e-5, atol=1e-6)
        assert (ce[target[:n] >= 0] > 0).all() and grad.abs().sum() > 0
        c_ce, c_accept, c_grad = compiled(base[:n], probs[:n], target[:n], weight[:n], inside[:n], loss)
        torch.testing.assert_close(c_ce, ce, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(c_accept, accept, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(c_grad, grad, rtol=1e-5, atol=1e-6)


def test_flex_ttt_attention_with_padded_positions_equals_dense(monkeypatch):
    """The flex path pads positions to a multiple of its block size so that block masks are
    reused across batch lengths; real rows must come out exactly as the dense path's. (CUDA
    runs it compiled; here flex attention runs eagerly, forward only, as the CPU allows.)"""
    from torch.nn.attention.flex_attention import flex_attention

    monkeypatch.setattr(dm, "_compiled_flex", lambda: flex_attention)
    g = torch.Generator().manual_seed(3)
    for T, steps in ((150, 3), (dm.FLEX_PAD, 2), (5, 1)):
        q, k0, v0 = (torch.randn(2, 3, T, 16, generator=g) for _ in range(3))
        extra = [(torch.randn(2, 3, T, 16, generator=g), torch.randn(2, 3, T, 16, generator=g)) for _ in range(steps - 1)]
        flex = dm.ttt_attention_flex(q, k0, v0, extra)
        assert flex.shape == q.shape
        torch.testing.assert_close(flex, dm.ttt_attention_dense(q, k0, v0, extra), atol=1e-5, rtol=1e-5)


def test_merging_later_steps_into_step0_attention_by_its_logsumexp_equals_dense_with_gradients():
    """The flex path attends to step-0 keys alone and merges each later step's same-position key
    through the step-0 log-sum-exp. CPU flex has no backward, so step-0's (out, lse) here come
    from plain causal scores: values and gradients of every input, through lse included, must
    be the dense path's (float32, 1e-5; MLA-like dims, q/k 24 and v 16)."""


    g = torch.Generator().manual_seed(6)
    T, steps, scale = 37, 4, 0.3
    dims = [24, 24, 16] + [24, 16] * (steps - 1)  # q, k0, v0, then (k_j, v_j)
    leaves = [torch.randn(2, 3, T, d, generator=g, requires_grad=True) for d in dims]
    q, k0, v0, rest = leaves[0], leaves[1], leaves[2], leaves[3:]
    extra = list(zip(rest[0::2], rest[1::2]))

    def merged():
        scores = (q @ k0.transpose(-1, -2) * scale).masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
        return dm.merge_same_position(scores.softmax(-1) @ v0, scores.logsumexp(-1), q, extra, scale)

    weights = torch.linspace(-1, 1, T)[:, None]
    out = {}
    for name, fn in (("merged", merged), ("dense", lambda: dm.ttt_attention_dense(q, k0, v0, extra, scale))):
        y = fn()
        out[name] = (y.detach(), torch.autograd.grad((y * weights).sum(), leaves))
    torch.testing.assert_close(out["merged"][0], out["dense"][0], atol=1e-5, rtol=1e-5)
    for a, b in zip(out["merged"][1], out["dense"][1]):
        assert b.abs().sum() > 0
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_labels_are_the_targets_softmax_over_the_draft_vocab_and_its_argmax(setup):
    """Labels by their definition, from the full logits: the softmax of the target's logits
    restricted to the draft vocabulary, and the target's argmax mapped into it (or -1)."""
    _, head, draft_ids, _, hidden, loss_mask = setup
    labels = make_labels(head, hidden[:, :, -1], loss_mask, draft_ids)
    full = head.logits(hidden[:, :, -1]).float()  # [B, T, V]
    torch.testing.assert_close(labels.probs(), full[..., draft_ids].softmax(-1), atol=1e-6, rtol=1e-5)
    to_draft = {int(t): d for d, t in enumerate(draft_ids)}
    expected = torch.tensor([[to_draft.get(int(t), -1) for t in row] for row in full.argmax(-1)])
    assert torch.equal(labels.target_draft, expected)
    assert (expected >= 0).any() and (expected < 0).any()  # both kinds occur


def test_labels_do_not_depend_on_how_tokens_are_chunked(setup, monkeypatch):
    """Chunks of 3 tokens: they cross sample boundaries and do not divide a sample's length, so
    one long sample's logits are never held whole and nothing shifts at the seams."""
    import eyas.train.labels as objective

    _, head, draft_ids, input_ids, hidden, loss_mask = setup
    whole = make_labels(head, hidden[:, :, -1], loss_mask, draft_ids, input_ids)
    T, V = hidden.shape[1], head.lm_head_weight.shape[0]
    monkeypatch.setattr(objective, "LABEL_CHUNK", 4 * V - 1)  # 3 tokens per chunk
    assert hidden.shape[0] >= 2 and T % 3
    chunked = objective.make_labels(head, hidden[:, :, -1], loss_mask, draft_ids, input_ids)
    torch.testing.assert_close(chunked.probs(), whole.probs())
    torch.testing.assert_close(chunked.full_lse, whole.full_lse)
    for name in ("target_draft", "trained", "greedy"):
        assert torch.equal(getattr(chunked, name), getattr(whole, name)), name


def test_a_batch_with_nothing_to_score_still_trains_every_weight(setup):
    """Only scored positions reach lm_head and the loss; a micro-batch with none (all prompt)
    must still give a zero loss connected to every trainable weight, or backward (and DDP,
    which expects a gradient for each) fails."""
    drafter, head, draft_ids, input_ids, hidden, loss_mask = setup
    labels = make_labels(head, hidden[:, :, -1], torch.zeros_like(loss_mask), draft_ids)
    weights = torch.full((K,), 0.25)
    loss, stats, rows = drafter(input_ids, hidden[:, :, :3], labels, weights)
    loss.backward()
    assert loss.item() == 0 and (stats == 0).all() and (rows == 0).all()
    for name, p in drafter.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and (p.grad == 0).all(), name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled flex path runs only on CUDA")
def test_compiled_flex_on_cuda_equals_dense_across_lengths():
    """Training on CUDA runs flex attention compiled with dynamic shapes, its block mask cached
    per padded length; batches of many lengths follow one another in one process. Values and
    gradients (through flex's log-sum-exp too) must stay the dense path's for every length in turn:
    float32 within 1e-4 at head dim 64. MLA's head dims (q/k 192, v 128) run in bf16, as training
    runs them (flex's float32 kernel at 192 needs more shared memory than an H200 has), against
    the dense path in float32 on the same bf16 inputs, within bf16's rounding (2e-2)."""


    g = torch.Generator(device="cuda").manual_seed(5)
    for T, steps, dk, dv in ((300, 7, 64, 64), (1000, 7, 64, 64), (130, 3, 64, 64), (700, 7, 192, 128),
                             (300, 2, 64, 64), (64, 7, 192, 128)):  # 192/128: MLA's q/k and v head dims
        dtype, tol = (torch.float32, 1e-4) if dk == 64 else (torch.bfloat16, 2e-2)
        dims = [dk, dk, dv] + [dk, dv] * (steps - 1)
        leaves = [torch.randn(2, 3, T, d, device="cuda", generator=g).to(dtype).requires_grad_() for d in dims]
        out = {}
        for name, fn, cast in (("flex", dm.ttt_attention_flex, dtype), ("dense", dm.ttt_attention_dense, torch.float32)):
            inputs = [t.to(cast) for t in leaves]
            q, k0, v0, rest = inputs[0], inputs[1], inputs[2], inputs[3:]
            y = fn(q, k0, v0, list(zip(rest[0::2], rest[1::2])))
            grads = torch.autograd.grad((y.float() * torch.linspace(-1, 1, T, device="cuda")[:, None]).sum(), leaves)
            out[name] = (y.detach().float(), [gr.float() for gr in grads])
        torch.testing.assert_close(out["flex"][0], out["dense"][0], atol=tol, rtol=tol)
        for a, b in zip(out["flex"][1], out["dense"][1]):
            torch.testing.assert_close(a, b, atol=tol, rtol=tol)


@pytest.mark.parametrize("T,S,offset", [(1, 1, 0), (5, 5, 0), (2, 6, 2), (2, 6, 4)])  # in blocks of FLEX_PAD
def test_causal_block_mask_built_from_blocks_equals_create_block_mask(T, S, offset):
    """TTT's causal block mask is built from its blocks (create_block_mask evaluates all T^2
    pairs first: 128 GiB at 128k positions); it must be the same mask, block for block, also
    for a context-parallel shard's queries (at positions offset..) against all keys."""
    from torch.nn.attention.flex_attention import create_block_mask

    T, S, offset = (n * dm.FLEX_PAD for n in (T, S, offset))
    ours = dm.causal_block_mask.__wrapped__(T, torch.device("cpu"), S, offset)
    ref = create_block_mask(lambda b, h, q, k: k <= q + offset, B=None, H=None, Q_LEN=T, KV_LEN=S, device="cpu")
    assert torch.equal(ours.to_dense(), ref.to_dense()) and ours.seq_lengths == ref.seq_lengths
    for counts, indices in (("kv_num_blocks", "kv_indices"), ("full_kv_num_blocks", "full_kv_indices"),
                            ("q_num_blocks", "q_indices"), ("full_q_num_blocks", "full_q_indices")):
        n = getattr(ours, counts)
        assert torch.equal(n, getattr(ref, counts)), counts
        for i in range(n.shape[-1]):  # the blocks each row reads (the rest of a row is never read)
            read = [getattr(m, indices)[0, 0, i, : n[0, 0, i]].sort().values for m in (ours, ref)]
            assert torch.equal(*read), (indices, i)


def test_flex_ttt_attention_of_a_shard_equals_dense(monkeypatch):
    """A context-parallel shard's queries (positions 128..383) against all 512 step-0 keys and
    their own later steps' keys: flex (eager here, forward only) equals the dense path."""
    from torch.nn.attention.flex_attention import flex_attention

    monkeypatch.setattr(dm, "_compiled_flex", lambda: flex_attention)
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 4, 256, 16, generator=g)
    k0, v0 = torch.randn(1, 2, 512, 16, generator=g), torch.randn(1, 2, 512, 16, generator=g)
    extra = [(torch.randn(1, 2, 256, 16, generator=g), torch.randn(1, 2, 256, 16, generator=g))]
    flex = dm.ttt_attention_flex(q, k0, v0, extra, offset=dm.FLEX_PAD)
    dense = dm.ttt_attention_dense(q, k0, v0, extra, offset=dm.FLEX_PAD)
    torch.testing.assert_close(flex, dense, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="not on a 128-position block"):
        dm.ttt_attention_flex(q, k0, v0, extra, offset=64)
