"""The P-EAGLE drafter (EAGLE-3 with parallel drafting): its training step against a plain
reference, decoding against training, lossless decoding (T = 0) that keeps the target's
distribution (T > 0), and the export vLLM loads.

The reference computes each (anchor row i, block slot k) on its own with loops: the context
entries 0..i (entry p reads token p+1 and the target's aux states at p, at position p), then
slot k >= 1 reads the mask token and fc(mask_hidden) at position i+k, attending to the
context entries and to slots 1..k; softmax, the MLP, logits and the soft cross-entropy
weighted decay^k. Both run in float32 and agree to 1e-5 (logits, loss) and 1e-4 relative
(gradients). The MLA variants take each entry's heads from the DeepSeek-V2 paper's equations
(test_mla.py's paper_heads) instead of the Llama layer's.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from eyas.draft.build import new_drafter
from eyas.errors import EyasError
from eyas.evaluate.drafter import DrafterSession
from eyas.evaluate.generate import generate
from eyas.evaluate.peagle import PEagle
from eyas.evaluate.proposers import Proposer
from eyas.evaluate.target import TargetSession
from test_dflash import make_setup as dflash_setup
from test_eval_sampling import T as TEMPERATURE, V as TOY_V, build_toy, check_sampling
from test_mla import SIZES, YARN, paper_heads
from test_ttt import K, V, H, VD, check_against_reference, fuse, gqa_heads, reference_loss

MLA = {"attention": "mla", "mla": dict(SIZES), "num_key_value_heads": 4, "head_dim": SIZES["qk_rope_head_dim"]}


def make_setup(**options):
    """test_dflash's drafter, target head and batch, with a P-EAGLE drafter."""
    return dflash_setup(drafter="peagle", num_hidden_layers=1, **options)


def reference_peagle(m, input_ids, hidden, labels, decay: float):
    """Logits [K][B, T, Vd] (valid pairs only) and the loss, one (row, slot) at a time."""
    layer = m.midlayer
    project = paper_heads if m.config.attention == "mla" else gqa_heads  # per-head q, k, v, scale
    B, T = input_ids.shape
    mask_embed = m.embed_tokens.weight[m.config.mask_token_id]
    mask_state = fuse(m, m.mask_hidden.view(3, H))

    def entry(embed, state, pos):
        x = torch.cat([layer.input_layernorm(embed), layer.hidden_norm(state)])
        return (*project(m, x, pos), state)  # q, k, v, scale, residual

    logits = [torch.zeros(B, T, VD) for _ in range(K)]
    for b in range(B):
        context = [entry(m.embed_tokens.weight[input_ids[b, p + 1]], fuse(m, hidden[b, p, :3]), p) for p in range(T - 1)]
        for i in range(T - 1):
            block = [context[i]] + [entry(mask_embed, mask_state, i + j) for j in range(1, K)]
            for k in range(min(K, T - 1 - i)):
                q, _, _, scale, residual = block[k]
                seen = context[: i + 1] + block[1 : k + 1]
                heads = []
                for h in range(len(q)):
                    w = (torch.stack([q[h] @ e[1][h] for e in seen]) * scale).softmax(0)
                    heads.append(sum(w[t] * e[2][h] for t, e in enumerate(seen)))
                out = layer.self_attn.o_proj(torch.cat(heads)) + residual
                z = layer.post_attention_layernorm(out)
                out = out + layer.mlp.down_proj(F.silu(layer.mlp.gate_proj(z)) * layer.mlp.up_proj(z))
                logits[k][b, i] = m.lm_head(m.norm(out))
    return logits, reference_loss(logits, labels, decay)


@pytest.mark.parametrize("options", [{}, {"fc_norm": True, "norm_output": True}, MLA,
                                     {**MLA, "rope_parameters": YARN, "fc_norm": True, "norm_output": True}],
                         ids=["gqa", "gqa-eagle31", "mla", "mla-yarn-eagle31"])
def test_training_step_matches_plain_reference_forward_and_gradients(options):
    drafter = make_setup(**options)
    loss, _ = check_against_reference(*drafter, reference_peagle)
    assert loss.item() > 0


@pytest.mark.parametrize("options", [{}, MLA], ids=["gqa", "mla"])
def test_decoding_block_equals_the_training_rows(options):
    """One parallel pass after committing the context (DrafterSession; MLA's cache its latent)
    proposes what training scored at the same row, slot by slot."""
    drafter, _, _, input_ids, hidden, _ = make_setup(**options)
    drafter.eval()
    with torch.no_grad():
        logits = drafter.forward_ttt(input_ids, hidden[:, :, :3])
    session = DrafterSession(drafter)
    T = input_ids.shape[1]
    for i in range(T - 1):
        session.reset()
        session.extend(input_ids[0, 1 : i + 2], hidden[0, : i + 1, :3])
        block = session.parallel_block(K)
        torch.testing.assert_close(block, torch.stack([lg[0, i] for lg in logits]), atol=1e-5, rtol=1e-5)


def toy_peagle(draft_std: float):
    """The sampling test's toy target with a random P-EAGLE drafter that disagrees with it."""
    from eyas.draft import DraftConfig
    from eyas.models import ModelIdentity

    target, _ = build_toy(0.3, 0.1)
    cfg = DraftConfig.for_target(target.config, ModelIdentity("toy", "c", "t", 3, 16, TOY_V), (0, 1, 2, 3), TOY_V - 1,
                                 drafter="peagle", mask_token_id=TOY_V - 1, ttt_steps=3)
    torch.manual_seed(3)
    drafter = new_drafter(cfg, target.get_input_embeddings().weight.detach()).eval()
    with torch.no_grad():
        for p in drafter.parameters():
            if p.requires_grad:
                p.normal_(0, draft_std if p.dim() > 1 else 1.0)
    drafter.set_vocab(torch.tensor([0, 1, 2, 3, 5]))  # token 4 can never be drafted
    return target, drafter


def test_peagle_sampling_preserves_the_target_distribution(one_thread):
    target, drafter = toy_peagle(0.1)
    session = TargetSession(target, drafter.config.aux_layer_ids)
    g = torch.Generator().manual_seed(7)
    check_sampling(target, session, PEagle(DrafterSession(drafter), 3, temperature=TEMPERATURE, generator=g), g)


def test_peagle_greedy_equals_plain_greedy_on_the_toy(one_thread):
    """At T = 0 the block's drafts change only the speed: the same tokens as plain decoding."""
    target, drafter = toy_peagle(0.6)
    session = TargetSession(target, drafter.config.aux_layer_ids)
    accepted = 0
    for prompt in ([1, 4, 2], [3, 3, 0, 5, 1]):
        plain = generate(session, Proposer(), prompt, 24, eos_ids=set())
        drafted = generate(session, PEagle(DrafterSession(drafter), 3), prompt, 24, eos_ids=set())
        assert drafted.generated_ids == plain.generated_ids
        assert all(0 <= a <= 3 for a in drafted.accept_counts)
        accepted += sum(drafted.accept_counts)
    assert accepted > 0


def test_export_writes_vllms_eagle3_layout_with_mask_hidden(tmp_path):
    """`--to vllm` writes LlamaForCausalLMEagle3's config with the mask token and the
    `mask_hidden` weight vLLM loads for parallel drafting; the serve line asks for it; the
    folder reloads as the same P-EAGLE drafter. Other layouts are refused in one line."""
    import json

    from safetensors.torch import load_file

    from eyas.draft import load_drafter, save_drafter
    from eyas.export import export_drafter
    from eyas.export.config import ExportConfig

    drafter = make_setup()[0]
    save_drafter(drafter, tmp_path / "ckpt")
    reloaded = load_drafter(tmp_path / "ckpt")
    assert type(reloaded).__name__ == "PEagleDrafter"
    torch.testing.assert_close(reloaded.mask_hidden, drafter.mask_hidden)
    summary = export_drafter(ExportConfig(ckpt=str(tmp_path / "ckpt"), to="vllm", out=str(tmp_path / "vllm")))
    config = json.loads((tmp_path / "vllm" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["mask_token_id"] == V - 1
    weights = load_file(tmp_path / "vllm" / "model.safetensors")
    torch.testing.assert_close(weights["mask_hidden"], drafter.mask_hidden.detach())
    assert "midlayer.self_attn.q_proj.weight" in weights
    spec = json.loads(summary["serve_command"].split("--speculative-config ")[1].strip("'"))
    assert spec["method"] == "eagle3" and spec["parallel_drafting"] is True and spec["num_speculative_tokens"] == K
    for layout in ("sglang", "speculators"):
        with pytest.raises(EyasError, match="exports only --to vllm"):
            export_drafter(ExportConfig(ckpt=str(tmp_path / "ckpt"), to=layout, out=str(tmp_path / layout)))


@pytest.fixture(scope="module")
def deepseek_dir(tmp_path_factory, tiny_tokenizer_dir):
    from tiny import build_model

    return str(build_model(tmp_path_factory.mktemp("peagle-deepseek"), "deepseek_v3", tokenizer_dir=tiny_tokenizer_dir))


def test_mla_peagle_decodes_losslessly_and_vllm_export_is_refused(deepseek_dir, tmp_path, one_thread):
    """An MLA P-EAGLE drafter on a tiny DeepseekV3 target, fitted on the first half of the
    target's greedy answer: eyas eval's parallel blocks emit exactly transformers' greedy answer
    with drafts accepted. vLLM 0.32's MLA head (Eagle3DeepseekV3ForCausalLM) has no mask_hidden
    for parallel drafting, so `export --to vllm` refuses it in one line and writes nothing."""
    from test_export_vllm import capture, fit_drafter
    from eyas.prompts import render
    from eyas.evaluate.run import load_checked_drafter
    from eyas.export import export_drafter
    from eyas.export.config import ExportConfig
    from eyas.models import load_target, model_identity

    model, tokenizer = load_target(deepseek_dir, dtype="float32")
    ids = render(tokenizer, [{"role": "user", "content": "hello there, how are you?"}])
    with torch.inference_mode():
        expected = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, eos_token_id=[],
                                  pad_token_id=0)[0, len(ids):].tolist()
    ckpt = fit_drafter(capture([ids + expected[:12]], model=deepseek_dir), tmp_path / "drafter", steps=40,
                       attention="mla", drafter="peagle", mask_token_id=model.config.vocab_size - 1)
    drafter = load_checked_drafter(str(ckpt), model, model_identity(deepseek_dir, model.config, tokenizer))
    assert type(drafter).__name__ == "PEagleDrafter" and drafter.config.attention == "mla"
    session = DrafterSession(drafter)
    g = generate(TargetSession(model, drafter.config.aux_layer_ids), PEagle(session, 3), ids, 24, eos_ids=set())
    assert g.generated_ids == expected
    assert sum(g.accept_counts) >= 6, g.accept_counts
    assert session.cache.keys[0].shape[1] == 1  # the latent cache
    with pytest.raises(EyasError, match="Eagle3DeepseekV3ForCausalLM \\(no mask_hidden\\)"):
        export_drafter(ExportConfig(ckpt=str(ckpt), to="vllm", out=str(tmp_path / "vllm")))
    assert not (tmp_path / "vllm").exists()


def test_train_peagle_draft_attention_on_an_mla_target(deepseek_dir, tmp_path, capsys):
    """`eyas train --drafter peagle` on a DeepseekV3 target: auto keeps the Llama layer vLLM
    serves with parallel drafting and says why; explicit mla trains an MLA P-EAGLE drafter;
    DFlash refuses mla in one line."""
    import json

    from eyas.capture.run import capture
    from eyas.capture.config import CaptureConfig
    from eyas.data.prepare import prepare
    from eyas.data.config import PrepareConfig
    from eyas.train import TrainConfig, train

    prepare(PrepareConfig(model=deepseek_dir, data=["packaged:chitchat"], out=str(tmp_path / "prep"), max_len=64,
                          limit=4), progress=False)
    capture(CaptureConfig(model=deepseek_dir, data=str(tmp_path / "prep"), out=str(tmp_path / "store"), dtype="fp32"),
            progress=False)
    common = dict(store=str(tmp_path / "store"), drafter="peagle", steps=2, batch_tokens=128, ttt_steps=2,
                  progress=False)
    for attention, written in (("auto", "gqa"), ("mla", "mla")):
        capsys.readouterr()
        train(TrainConfig(out=str(tmp_path / attention), draft_attention=attention, **common))
        config = json.loads((tmp_path / attention / "config.json").read_text())
        assert config["eyas"]["drafter"] == "peagle" and config["eyas"]["attention"] == written
        assert ("takes a GQA layer on this MLA target" in capsys.readouterr().out) == (attention == "auto")
    assert config["architectures"] == ["Eagle3DeepseekV3ForCausalLM"] and config["mask_token_id"] is not None
    with pytest.raises(EyasError, match="--draft-attention mla is for --drafter eagle3 or peagle"):
        TrainConfig(out="x", store="s", drafter="dflash", draft_attention="mla")
