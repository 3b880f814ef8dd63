"""The DFlash drafter: its training step against a plain reference, decoding against training,
and decoding that loses nothing (T = 0) and keeps the target's distribution (T > 0).

The reference recomputes every (anchor row i, block slot s) pair on its own with loops: the
block [token i+1, mask x K] at positions i+1..i+1+K, each layer's keys from the context states
at 0..i and from the block's own slots, a softmax over exactly those, the MLP, the logits and
the soft cross-entropy weighted decay^(s-1). Both run in float32 and agree to 1e-5 (logits,
loss) and 1e-4 relative (gradients).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_mask
from transformers import AutoConfig

from eyas.draft.build import new_drafter
from eyas.draft.dflash import block_attention, block_mask_dense
from eyas.errors import EyasError
from eyas.evaluate.dflash import DFlash, DFlashSession
from eyas.evaluate.generate import generate
from eyas.evaluate.target import TargetSession
from eyas.models.layers import resolve_layer_ids
from eyas.models.target_head import TargetHead
from eyas.options import AUTO_LAYERS_DFLASH
from eyas.train import TrainConfig
from eyas.train.anchors import anchor_rows
from eyas.draft.loss import step_counts
from eyas.train.labels import make_labels
from test_adversarial import cli, fails, train_args
from test_eval_sampling import T as TEMPERATURE, V as TOY_V, build_toy, check_sampling
from test_store_damage import tiny_prepared, tiny_store  # noqa: F401
from test_ttt import K, V, H, VD, check_against_reference, reference_loss, rope, tiny_config

LAYERS = 2


def make_setup(**options):
    torch.manual_seed(0)
    cfg = tiny_config(**{"drafter": "dflash", "num_hidden_layers": LAYERS, "mask_token_id": V - 1, **options})
    drafter = new_drafter(cfg, torch.randn(V, H))
    for p in drafter.parameters():  # larger than the default init (norm weights too), so every term matters
        if p.requires_grad:
            p.data.normal_(0, 0.3)
    draft_ids = torch.randperm(V)[:VD].sort().values
    drafter.set_vocab(draft_ids)
    head = TargetHead(torch.randn(V, H), torch.nn.RMSNorm(H, eps=1e-5), torch.randn(V, H) * 0.5)
    B, T = 3, 10
    input_ids = torch.randint(0, V - 1, (B, T))
    hidden = torch.randn(B, T, 4, H)  # three aux states and id N
    loss_mask = torch.rand(B, T) < 0.7
    loss_mask[2, 7:] = False  # row 2 is padding after 7 tokens
    input_ids[2, 7:] = 0
    return drafter, head, draft_ids, input_ids, hidden, loss_mask


def rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    return w * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def reference_block(m, ids: list[int], ctx_aux: torch.Tensor) -> torch.Tensor:
    """The block's slot logits [S, Vd], one query at a time: ids [S] at positions C..C+S-1
    after the context aux states ctx_aux [C, 3, H]; in `causal_layers` slot s sees slots 0..s."""
    C, S = ctx_aux.shape[0], len(ids)
    ctx = [rms(m.fc.weight @ ctx_aux[c].reshape(-1), m.hidden_norm.weight) for c in range(C)]
    x = [m.embed_tokens.weight[t] for t in ids]
    for li, layer in enumerate(m.layers):
        a = layer.self_attn
        nH, nKV, d = a.n_heads, a.n_kv, a.head_dim

        def keys_values(z, pos):
            k = rope(rms((a.k_proj.weight @ z).view(nKV, d), a.k_norm.weight), pos)
            return k, (a.v_proj.weight @ z).view(nKV, d)

        kv = [keys_values(ctx[c], c) for c in range(C)]
        h = [rms(xs, layer.input_layernorm.weight) for xs in x]
        kv += [keys_values(h[s], C + s) for s in range(S)]
        out = []
        for s in range(S):
            q = rope(rms((a.q_proj.weight @ h[s]).view(nH, d), a.q_norm.weight), C + s)
            seen = kv[: C + s + 1] if li in m.config.causal_layers else kv
            heads = []
            for hd in range(nH):
                g = hd // (nH // nKV)
                w = torch.stack([q[hd] @ k[g] for k, _ in seen]).div(math.sqrt(d)).softmax(0)
                heads.append(sum(w[j] * v[g] for j, (_, v) in enumerate(seen)))
            y = x[s] + a.o_proj.weight @ torch.cat(heads)
            z = rms(y, layer.post_attention_layernorm.weight)
            mlp = layer.mlp
            out.append(y + mlp.down_proj.weight @ (F.silu(mlp.gate_proj.weight @ z) * (mlp.up_proj.weight @ z)))
        x = out
    return torch.stack([m.lm_head.weight @ rms(xs, m.norm.weight) for xs in x])


def reference_dflash(m, input_ids, hidden, labels, decay: float, rows: torch.Tensor | None = None):
    """Logits [K][B, T, Vd] (valid pairs only) and the loss: anchor i+1 (rows i in `rows`, else
    every row), slot k+1 scored against the target's distribution at i+1+k, mean per slot over
    the trained pairs of those rows."""
    B, T = input_ids.shape
    logits = [torch.zeros(B, T, VD) for _ in range(K)]
    for b in range(B):
        for i in range(T - 1):
            if rows is not None and not rows[b, i]:
                continue
            block = reference_block(m, [int(input_ids[b, i + 1])] + [m.config.mask_token_id] * K, hidden[b, : i + 1, :3])
            for k in range(min(K, T - 1 - i)):
                logits[k][b, i] = block[k + 1]
    return logits, reference_loss(logits, labels, decay, rows)


@pytest.mark.parametrize("causal_layers", [(), (1,)])
def test_training_step_matches_plain_reference_forward_and_gradients(causal_layers):
    """Also with a layer whose slots see only the block's slots up to their own (speculators')."""
    check_against_reference(*make_setup(causal_layers=causal_layers), reference_dflash)


def test_sampled_anchors_train_as_the_reference_on_those_rows():
    """With 3 anchors drawn per sample (train/anchors.py), the objective's loss, statistics and
    gradients equal the reference's over exactly those rows (1e-5; gradients 1e-4 relative),
    and the normaliser counts their trained pairs only."""
    drafter, head, draft_ids, input_ids, hidden, loss_mask = make_setup()
    rows = anchor_rows(loss_mask, K, 3, (0, 5))
    assert (rows.sum(1) <= 3).all() and rows.sum() >= 7
    assert (rows & ~eligible_rows_of(loss_mask)).sum() == 0
    labels = make_labels(head, hidden[:, :, -1], loss_mask, draft_ids)
    counts = step_counts(loss_mask, K, rows)
    assert (counts < step_counts(loss_mask, K)).any() and (counts > 0).all()
    decay = 0.8
    weights = torch.tensor([decay ** k for k in range(K)]) / counts
    params = [p for p in drafter.parameters() if p.requires_grad]
    loss, stats, _ = drafter(input_ids, hidden[:, :, :3], labels, weights, rows)
    grads = torch.autograd.grad(loss, params)
    ref_logits, ref_loss = reference_dflash(drafter, input_ids, hidden, labels, decay, rows)
    ref_grads = torch.autograd.grad(ref_loss, params)
    fast = drafter.forward_ttt(input_ids, hidden[:, :, :3], K, rows)
    T = input_ids.shape[1]
    for k in range(K):
        scored = rows[:, : T - 1 - k]
        torch.testing.assert_close(fast[k][:, : T - 1 - k][scored], ref_logits[k][:, : T - 1 - k][scored],
                                   atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, atol=1e-6, rtol=1e-4)
    assert stats[:, 2].tolist() == counts.tolist()


def eligible_rows_of(loss_mask: torch.Tensor) -> torch.Tensor:
    """[B, T]: rows i whose block trains a pair (a label position j = i+1..i+K whose next
    token j+1 is trained), by that definition."""
    B, T = loss_mask.shape
    out = torch.zeros(B, T, dtype=torch.bool)
    for b in range(B):
        for i in range(T):
            out[b, i] = any(bool(loss_mask[b, j + 1]) for j in range(i + 1, min(i + 1 + K, T - 1)))
    return out


def test_anchor_draws_are_keyed_bounded_and_cover_the_eligible_rows():
    """The draw depends only on its key; with room for all, every eligible row anchors."""
    mask = torch.rand(2, 200, generator=torch.Generator().manual_seed(1)) < 0.6
    mask[1, 150:] = False
    a, b, c = (anchor_rows(mask, K, 16, key) for key in ((0, 1, 7), (0, 1, 7), (0, 2, 7)))
    assert torch.equal(a, b) and not torch.equal(a, c) and a.sum(1).tolist() == [16, 16]
    assert (a & ~eligible_rows_of(mask)).sum() == 0
    assert torch.equal(anchor_rows(mask, K, 1000, (0, 1, 7)), eligible_rows_of(mask))


def test_anchors_one_per_s_tokens_draw_by_each_samples_length():
    """--anchors 1/S anchors ceil(length / S) rows of each sample (at least 1, at most its
    eligible rows), each sample its own count in one keyed draw; a count N draws N of each, as
    the draw of one count always did. A resumed run compares what the spec means."""
    from types import SimpleNamespace

    from eyas.train.anchors import batch_rows
    from eyas.train.config import anchors_per_sample, anchors_spec

    masks = [torch.ones(n, dtype=torch.bool) for n in (200, 33, 5)]
    source = SimpleNamespace(tokens=lambda p: (None, masks[p]), sample_index=[10, 11, 12])
    rows = batch_rows(source, [0, 1, 2], K, "1/16", seed=0, step=3)  # [3, 200]
    eligible = [int(eligible_rows_of(m[None]).sum()) for m in masks]
    assert rows.sum(1).tolist() == [min(math.ceil(n / 16), e) for n, e in zip((200, 33, 5), eligible)] == [13, 3, 1]
    assert (rows & ~eligible_rows_of(_padded_masks(masks))).sum() == 0
    assert torch.equal(rows, batch_rows(source, [0, 1, 2], K, "1/16", seed=0, step=3))
    assert not torch.equal(rows, batch_rows(source, [0, 1, 2], K, "1/16", seed=0, step=4))
    same = anchor_rows(_padded_masks(masks), K, 4, (0, 3, 10, 11, 12))
    assert torch.equal(batch_rows(source, [0, 1, 2], K, 4, seed=0, step=3), same)
    assert same.sum(1).tolist() == [4, 4, min(4, eligible[2])]
    assert [anchors_per_sample("1/16", n) for n in (1, 16, 17)] == [1, 1, 2] and anchors_per_sample(9, 4) == 4
    assert anchors_spec("45") == anchors_spec(45) == 45 and anchors_spec(" 1/8") == "1/8"
    assert TrainConfig(out="x", store="s", drafter="dflash").anchors == "1/16"  # the default
    assert TrainConfig(out="x", store="s", drafter="dflash", anchors="45").anchors == 45  # as a resume compares it
    old_run = {**dataclasses.asdict(TrainConfig(out="x", store="s", drafter="dflash")), "anchors": 512}
    with pytest.raises(EyasError, match=r"this command changes: anchors '1/16' \(the run has 512\)\. Repeat"):
        TrainConfig(out="x", store="s", drafter="dflash").check_resumable(old_run)  # a run from before 1/16
    TrainConfig(out="x", store="s", drafter="dflash", anchors="512").check_resumable(old_run)
    for bad in ("0", "2/16", "1/0", "x", True, -1):
        with pytest.raises(EyasError, match=r"^--anchors .*: give rows a sample \(e\.g\. 45\) or one row per S tokens"):
            anchors_spec(bad)


def _padded_masks(masks: list[torch.Tensor]) -> torch.Tensor:
    out = torch.zeros(len(masks), max(len(m) for m in masks), dtype=torch.bool)
    for b, m in enumerate(masks):
        out[b, : len(m)] = m
    return out


def test_block_attention_sees_each_anchors_context_and_its_own_block():
    """The mask: query (slot s, anchor n) sees context keys 0..anchor n and the S block keys of
    anchor n; the flex block mask built from the same anchors marks the same blocks, and flex
    attention compiled as training compiles it on CUDA (here forward only, as the CPU allows)
    equals the dense attention."""
    from eyas.draft.dflash import _block_mask_flex

    T, S = 6, 3
    anchor = torch.tensor([[0, 2, 5], [1, 3, 0]])
    mask = block_mask_dense(anchor, S, T)
    N = anchor.shape[1]
    for b in range(2):
        for s in range(S):
            for n in range(N):
                seen = mask[b, s * N + n].nonzero().flatten().tolist()
                assert seen == list(range(int(anchor[b, n]) + 1)) + [T + j * N + n for j in range(S)]
    torch.manual_seed(2)
    T, S, N = 150, 4, 40
    anchor = torch.stack([torch.randperm(T)[:N].sort().values for _ in range(2)])
    dense_mask = block_mask_dense(anchor, S, T)
    flex_mask = _block_mask_flex(anchor, S, T)
    assert torch.equal(flex_mask.to_dense().bool(), _blocks(dense_mask, flex_mask.BLOCK_SIZE))
    causal = block_mask_dense(anchor, S, T, causal=True)  # slot s: the block's slots 0..s
    slot = torch.arange(S * N) // N
    assert torch.equal(causal[..., T:], dense_mask[..., T:] & (slot[None, :] <= slot[:, None]))
    assert torch.equal(causal[..., :T], dense_mask[..., :T])
    assert torch.equal(create_mask(_block_mask_flex(anchor, S, T, causal=True).mask_mod, 2, None, S * N,
                                   T + S * N, device="cpu")[:, 0], causal)
    q, k, v = torch.randn(2, 2, S * N, 16), torch.randn(2, 2, T + S * N, 16), torch.randn(2, 2, T + S * N, 16)
    dense = block_attention(q, k, v, dense_mask[:, None])
    w = (q @ k.transpose(-1, -2) / 4).masked_fill(~dense_mask[:, None], float("-inf")).softmax(-1)
    torch.testing.assert_close(dense, w @ v, atol=1e-6, rtol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(block_attention(q, k, v, flex_mask), dense, atol=1e-5, rtol=1e-5)


def _blocks(mask: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """[B, Q, KV] bool -> [B, 1, ceil(Q/bq), ceil(KV/bk)]: the blocks holding a visible pair."""
    bq, bk = size
    B, Q, KV = mask.shape
    padded = F.pad(mask, (0, -KV % bk, 0, -Q % bq))
    return padded.view(B, padded.shape[1] // bq, bq, padded.shape[2] // bk, bk).any(4).any(2)[:, None]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled flex path trains only on CUDA")
def test_compiled_flex_block_attention_on_cuda_equals_dense_across_lengths():
    """Training on CUDA runs the block attention as compiled flex attention, its mask built per
    batch from the anchors. Values and gradients equal the dense path's for each length and
    anchor count in turn, the last with causal blocks (float32; 1e-4); a drafter with a causal
    layer gives the CPU's logits, and a bf16 training step of it runs with sampled anchors (head
    dim 16: flex's compiled kernel needs at least 16)."""
    from eyas.draft.dflash import _block_mask_flex

    g = torch.Generator(device="cuda").manual_seed(5)
    for (T, S, N), causal in zip(((300, 8, 300), (1000, 8, 96), (130, 4, 130), (64, 8, 7), (200, 8, 50)),
                                 (False, False, False, False, True)):
        anchor = torch.stack([torch.randperm(T, device="cuda", generator=g)[:N].sort().values for _ in range(2)])
        leaves = [torch.randn(2, 3, S * N + extra, 64, device="cuda", generator=g, requires_grad=True)
                  for extra in (0, T, T)]
        weight = torch.linspace(-1, 1, S * N, device="cuda")[:, None]
        out = {}
        for name, mask in (("flex", _block_mask_flex(anchor, S, T, causal)),
                           ("dense", block_mask_dense(anchor, S, T, causal)[:, None])):
            y = block_attention(*leaves, mask)
            out[name] = (y.detach(), torch.autograd.grad((y * weight).sum(), leaves))
        torch.testing.assert_close(out["flex"][0], out["dense"][0], atol=1e-4, rtol=1e-4)
        for a, b in zip(out["flex"][1], out["dense"][1]):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    drafter, head, draft_ids, input_ids, hidden, loss_mask = make_setup(head_dim=16, causal_layers=(1,))
    rows = anchor_rows(loss_mask, K, 3, (0, 0))
    with torch.no_grad():  # a causal layer's flex mask gives the dense path's logits
        dense = drafter.forward_ttt(input_ids, hidden[:, :, :3], K, rows)
        flex = drafter.cuda().forward_ttt(input_ids.cuda(), hidden[:, :, :3].cuda(), K, rows.cuda())
    for a, b in zip(flex, dense):
        torch.testing.assert_close(a.cpu(), b, atol=1e-4, rtol=1e-4)
    head, rows = head.to("cuda"), rows.cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        labels = make_labels(head, hidden[:, :, -1].cuda(), loss_mask.cuda(), draft_ids.cuda())
        loss = drafter(input_ids.cuda(), hidden[:, :, :3].cuda(), labels, torch.ones(K, device="cuda"),
                                     rows)[0]
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in drafter.parameters() if p.requires_grad)


@pytest.mark.parametrize("causal_layers", [(), (0,)])
def test_decoding_block_equals_the_training_rows(causal_layers):
    """DFlashSession (cached context, one pass per block) proposes what training scored at
    the same anchor, row by row, also after extending the context in pieces."""
    drafter, _, _, input_ids, hidden, _ = make_setup(causal_layers=causal_layers)
    drafter.eval()
    with torch.no_grad():
        logits = drafter.forward_ttt(input_ids, hidden[:, :, :3])
    session = DFlashSession(drafter)
    T = input_ids.shape[1]
    for i in range(T - 1):
        session.reset()
        session.extend(hidden[0, : i // 2 + 1, :3])
        if i // 2 + 1 < i + 1:
            session.extend(hidden[0, i // 2 + 1 : i + 1, :3])
        block = session.block(int(input_ids[0, i + 1]))
        torch.testing.assert_close(block, torch.stack([lg[0, i] for lg in logits]), atol=1e-5, rtol=1e-5)


def test_a_dflash_config_refuses_what_it_cannot_hold():
    with pytest.raises(EyasError, match="mask token id"):
        tiny_config(drafter="dflash", num_hidden_layers=1)
    with pytest.raises(EyasError, match="EAGLE-3 options"):
        tiny_config(drafter="dflash", mask_token_id=3, fc_norm=True)
    with pytest.raises(EyasError, match="exactly one layer"):
        tiny_config(drafter="peagle", mask_token_id=3, num_hidden_layers=2)
    with pytest.raises(EyasError, match="causal_layers"):
        tiny_config(drafter="dflash", mask_token_id=3, num_hidden_layers=2, causal_layers=(2,))
    with pytest.raises(EyasError, match="block drafter"):
        tiny_config(causal_layers=(0,))


def test_a_drafter_with_causal_layers_is_written_at_the_version_that_holds_them():
    """causal_layers came with `eyas` block version 2: such a drafter is written at 2, which an eyas
    reading only version 1 refuses (instead of running its layers bidirectionally); one without
    them stays at 1, which every eyas reads; both read back equal."""
    from eyas.draft.config import CONFIG_VERSION, DraftConfig

    causal = tiny_config(drafter="dflash", mask_token_id=3, num_hidden_layers=2, causal_layers=(1,))
    plain = dataclasses.replace(causal, causal_layers=())
    assert (causal.to_hf_dict()["eyas"]["config_version"], plain.to_hf_dict()["eyas"]["config_version"]) == (2, 1)
    assert CONFIG_VERSION == 2
    for config in (causal, plain):
        assert DraftConfig.from_hf_dict(config.to_hf_dict(), "x") == config


def toy_dflash(draft_std: float):
    """The sampling test's toy target with a random DFlash drafter that disagrees with it."""
    from eyas.draft import DraftConfig
    from eyas.models import ModelIdentity

    target, _ = build_toy(0.3, 0.1)
    cfg = DraftConfig.for_target(target.config, ModelIdentity("toy", "c", "t", 3, 16, TOY_V), (0, 1, 2, 3), TOY_V - 1,
                                 drafter="dflash", num_hidden_layers=2, mask_token_id=TOY_V - 1, ttt_steps=2)
    torch.manual_seed(3)
    drafter = new_drafter(cfg, target.get_input_embeddings().weight.detach()).eval()
    with torch.no_grad():
        for p in drafter.parameters():
            if p.dim() > 1 and p.requires_grad:
                p.normal_(0, draft_std)
    drafter.set_vocab(torch.tensor([0, 1, 2, 3, 5]))  # token 4 can never be drafted
    return target, drafter


def test_dflash_sampling_preserves_the_target_distribution(one_thread):
    target, drafter = toy_dflash(0.1)
    session = TargetSession(target, drafter.config.aux_layer_ids)
    g = torch.Generator().manual_seed(7)
    proposer = DFlash(DFlashSession(drafter), steps=2, temperature=TEMPERATURE, generator=g)
    check_sampling(target, session, proposer, g)


def test_dflash_greedy_equals_plain_greedy_on_the_toy(one_thread):
    """At T = 0 the block's drafts change only the speed: the same tokens as plain decoding."""
    from eyas.evaluate.proposers import Proposer

    target, drafter = toy_dflash(0.6)
    session = TargetSession(target, drafter.config.aux_layer_ids)
    for prompt in ([1, 4, 2], [3, 3, 0, 5, 1]):
        plain = generate(session, Proposer(), prompt, 24, eos_ids=set())
        drafted = generate(session, DFlash(DFlashSession(drafter), steps=2), prompt, 24, eos_ids=set())
        assert drafted.generated_ids == plain.generated_ids
        assert len(drafted.accept_counts) < len(plain.accept_counts) or sum(drafted.accept_counts) == 0


def test_eval_refuses_a_tree_for_a_block_drafter_as_the_recipe_plans_none(one_thread):
    """A DFlash block is verified as a chain: `eyas eval --tree` says so in one line, and the
    recipe, by the same rule (the kind record's drafts_trees), plans no tree stage for it."""
    from eyas.draft import kinds
    from eyas.evaluate.config import EvalConfig
    from eyas.evaluate.run import drafter_proposer

    _, drafter = toy_dflash(0.6)
    with pytest.raises(EyasError, match="A DFlash drafter proposes one block, verified as a chain; drop --tree"):
        drafter_proposer(drafter, EvalConfig(model="unused", tree=True), None)
    assert isinstance(drafter_proposer(drafter, EvalConfig(model="unused"), None), DFlash)
    assert [kinds.get(k).drafts_trees for k in ("eagle3", "dflash", "peagle")] == [True, False, False]


@pytest.fixture(scope="module")
def tiny_llama_data(tiny_llama_dir, tmp_path_factory):
    from eyas.capture.run import capture
    from eyas.capture.config import CaptureConfig
    from eyas.data.prepare import prepare
    from eyas.data.config import PrepareConfig

    root = tmp_path_factory.mktemp("dflash-data")
    prepare(PrepareConfig(model=str(tiny_llama_dir), data=["packaged:chitchat"], out=str(root / "prep"), max_len=64,
                          limit=8), progress=False)
    capture(CaptureConfig(model=str(tiny_llama_dir), data=str(root / "prep"), out=str(root / "store"), dtype="fp32"),
            progress=False)
    return root / "prep", root / "store"


def test_train_dflash_offline_equals_online_and_reloads(tiny_llama_dir, tiny_llama_data, tmp_path, capsys):
    """`eyas train --drafter dflash` from a store and online from the same prepared data take
    the same steps (the same anchors drawn); the folder reloads as the same DFlash drafter,
    block size and layers kept."""
    import json

    from safetensors.torch import load_file

    from eyas.draft import load_drafter
    from eyas.train import TrainConfig, train

    prep, store = tiny_llama_data
    common = dict(steps=3, batch_tokens=128, drafter="dflash", block_size=4, draft_layers=2, eval_fraction=0.25,
                  progress=False, lr=1e-3, anchors=5)  # 5 of each sample's rows, drawn per step
    offline = train(TrainConfig(out=str(tmp_path / "off"), store=str(store), **common))
    online = train(TrainConfig(out=str(tmp_path / "on"), online=True, model=str(tiny_llama_dir), data=str(prep),
                               **common))
    assert len(offline["eval"]["acc_per_step"]) == 3  # one accuracy per drafted block position
    out = capsys.readouterr().out
    # Its sampled anchors' accuracy is not what decoding accepts: the table says where the walk is.
    assert f"eyas eval --draft {tmp_path / 'off'} --teacher-forced DATA --held-out" in out
    # The online run names the target layers `auto` read, and why DFlash reads three (offline, the store's).
    n = AutoConfig.from_pretrained(tiny_llama_dir).num_hidden_layers
    said = [line for line in out.splitlines() if "--layers auto:" in line]
    aux = ",".join(map(str, resolve_layer_ids("auto", n)[:-1]))
    assert len(said) == 1 and f"layer ids {aux} (2, N//2, N-3) and {n}, the label source" in said[0]
    assert said[0].endswith(AUTO_LAYERS_DFLASH)
    assert online["eval"]["loss_per_step"] == pytest.approx(offline["eval"]["loss_per_step"], rel=1e-5)
    a, b = load_file(tmp_path / "off" / "model.safetensors"), load_file(tmp_path / "on" / "model.safetensors")
    assert {k.split(".")[0] for k in a} == {"fc", "hidden_norm", "layers", "norm", "lm_head", "d2t", "t2d"}
    for key in a:
        torch.testing.assert_close(b[key], a[key], atol=1e-5, rtol=1e-4)
    config = json.loads((tmp_path / "off" / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["block_size"] == 4
    assert config["num_hidden_layers"] == 2 and config["dflash_config"]["mask_token_id"] == config["vocab_size"] - 1
    drafter = load_drafter(tmp_path / "off")
    assert type(drafter).__name__ == "DFlashDrafter" and drafter.block_size == 4
    for flag, option in (("--block-size", {"block_size": 4}), ("--anchors", {"anchors": 5})):
        with pytest.raises(EyasError, match=f"^{flag} is for --drafter dflash, not eagle3"):
            TrainConfig(out="x", store=str(store), **option)


def causal_args(store, out, *extra) -> list:
    """A two-layer DFlash run of blocks of 4, with speculators' other DFlash losses and weights."""
    return train_args(store, out, "--drafter", "dflash", "--draft-layers", "2", "--ttt-steps", "3", "--steps", "2",
                      "--loss", "hard-ce", "--position-weights", "dpace", "--lr", "1e-2", *extra)


def test_train_causal_layers_records_them_trains_the_reference_and_must_agree_on_init_and_resume(
        tmp_path, capsys, tiny_store):  # noqa: F811
    """`eyas train --causal-layers all` builds a drafter whose config has every layer causal;
    its forward at every anchor equals `reference_block`'s slot logits, causal layers included,
    and differs from the same weights without them (float32, 1e-5). A --resume or --init that
    asks for other layers is refused in one line; `0,1` of two layers is `all`."""
    import json

    from eyas.draft import load_drafter

    out = tmp_path / "run"
    got, err = cli(capsys, *causal_args(tiny_store, out, "--causal-layers", "all"))
    assert got == 0, err
    assert json.loads((out / "config.json").read_text())["eyas"]["causal_layers"] == [0, 1]
    trainer = json.loads((out / "checkpoints" / "step-0000002" / "trainer.json").read_text())["config"]
    assert trainer["causal_layers"] == "all" and trainer["loss"] == "hard-ce"
    g = torch.Generator().manual_seed(0)
    cfg = load_drafter(out).config
    drafter = load_drafter(out, torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g)).eval()
    assert drafter.config.causal_layers == (0, 1)
    T = 6
    input_ids = torch.randint(0, cfg.vocab_size - 1, (1, T), generator=g)
    aux = torch.randn(1, T, 3, cfg.hidden_size, generator=g)
    steps = drafter.config.ttt_steps
    with torch.no_grad():
        logits = drafter.forward_ttt(input_ids, aux, steps)
        unmasked = new_drafter(dataclasses.replace(drafter.config, causal_layers=()), drafter.embed_tokens.weight)
        unmasked.load_state_dict(drafter.state_dict())
        plain = unmasked.eval().forward_ttt(input_ids, aux, steps)
        for i in range(T - 1):
            block = reference_block(drafter, [int(input_ids[0, i + 1])] + [drafter.config.mask_token_id] * steps,
                                    aux[0, : i + 1])
            for k in range(min(steps, T - 1 - i)):
                torch.testing.assert_close(logits[k][0, i], block[k + 1], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(logits[0][0, : T - 1], plain[0][0, : T - 1], atol=1e-3)

    fails(capsys, tmp_path, out, *causal_args(tiny_store, out, "--causal-layers", "none", "--steps", "3", "--resume"),
          match=r"causal-layers 'none' \(the run has 'all'\)")
    fails(capsys, tmp_path, tmp_path / "init", *causal_args(tiny_store, tmp_path / "init", "--causal-layers", "1",
                                                            "--init", out),
          match=rf"--causal-layers 1: --init {out} has all; a run from it keeps its shape")
    got, err = cli(capsys, *causal_args(tiny_store, tmp_path / "init", "--causal-layers", "1,0", "--init", out))
    assert got == 0, err
    assert load_drafter(tmp_path / "init").config.causal_layers == (0, 1)


@pytest.mark.parametrize("kind, spec, message", [
    ("eagle3", "all", r"--causal-layers is for --drafter dflash, not eagle3\.$"),
    ("peagle", "none", r"--causal-layers is for --drafter dflash, not peagle\.$"),
    ("dflash", "first", r"--causal-layers 'first': give none, all or drafter layer indices such as 0,2\.$"),
    ("dflash", "0,-1", r"--causal-layers '0,-1': give none, all"),
    ("dflash", "0,2", r"--causal-layers 0,2 names layer 2: the drafter \(--draft-layers\) has layers 0\.\.1\.$"),
])
def test_causal_layers_that_cannot_be_are_refused_in_one_line(tmp_path, capsys, tiny_store, kind, spec,
                                                               message):  # noqa: F811
    extra = ["--drafter", kind, "--causal-layers", spec] + (["--draft-layers", "2"] if kind != "peagle" else [])
    fails(capsys, tmp_path, tmp_path / "run", *train_args(tiny_store, tmp_path / "run", *extra),
          match=rf"^eyas train: error: {message}")


def test_causal_layers_past_the_default_depth_are_refused_once_the_target_is_known(tmp_path, capsys,
                                                                                   tiny_store):  # noqa: F811
    """The 8-layer tiny target gives a DFlash drafter one layer unless --draft-layers says more."""
    fails(capsys, tmp_path, tmp_path / "run", *train_args(tiny_store, tmp_path / "run", "--drafter", "dflash",
                                                          "--causal-layers", "1"),
          match=r"--causal-layers 1 names layer 1: the drafter \(--draft-layers\) has layers 0\.\.0\.$")


def test_export_writes_vllms_dflash_layout_and_refuses_the_others(tmp_path):
    """`--to vllm` writes DFlashDraftModel's config and weights under vLLM's own names; the
    layouts vLLM 0.32 and SGLang do not serve for DFlash are refused with one line."""
    import json

    from safetensors.torch import load_file

    from eyas.draft import save_drafter
    from eyas.export import export_drafter
    from eyas.export.config import ExportConfig

    drafter = make_setup()[0]
    save_drafter(drafter, tmp_path / "ckpt")
    summary = export_drafter(ExportConfig(ckpt=str(tmp_path / "ckpt"), to="vllm", out=str(tmp_path / "vllm")))
    config = json.loads((tmp_path / "vllm" / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["block_size"] == K + 1 and config["num_hidden_layers"] == LAYERS
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    assert config["dflash_config"] == {"mask_token_id": V - 1, "target_layer_ids": [0, 2, 3]}
    weights = load_file(tmp_path / "vllm" / "model.safetensors")
    assert "layers.1.self_attn.k_norm.weight" in weights and "hidden_norm.weight" in weights
    assert not any(k.startswith(("embed_tokens", "midlayer")) for k in weights)
    assert f'"num_speculative_tokens": {K}' in summary["serve_command"] and '"method": "dflash"' in summary["serve_command"]
    for layout in ("sglang", "speculators"):
        with pytest.raises(EyasError, match="exports only --to vllm"):
            export_drafter(ExportConfig(ckpt=str(tmp_path / "ckpt"), to=layout, out=str(tmp_path / layout)))
    causal = make_setup(causal_layers=(1,))[0]  # as imported from speculators' sliding-window layers
    save_drafter(causal, tmp_path / "causal")
    with pytest.raises(EyasError, match=r"Layers \[1\] .* causally .* eyas eval only"):
        export_drafter(ExportConfig(ckpt=str(tmp_path / "causal"), to="vllm", out=str(tmp_path / "causal-vllm")))
