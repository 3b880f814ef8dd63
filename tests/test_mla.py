"""The MLA drafter (draft/mla.py) against a plain reference written from the DeepSeek-V2
paper's equations (section 2.1), one token and one head at a time:

    c_Q = RMSNorm(W_DQ x)            q_C,h = W_UQ,h c_Q      q_R,h = RoPE(W_QR,h c_Q)
    c_KV = RMSNorm(W_DKV x)          k_C,h = W_UK,h c_KV     v_C,h = W_UV,h c_KV      k_R = RoPE(W_KR x)
    o_t,h = sum_j softmax_j([q_C,h; q_R,h] . [k_C,h; k_R] * s) v_C,h    u_t = W_O [o_t,1; ...; o_t,nH]

with s = (d_nope + d_rope)^-0.5 (times YaRN's mscale^2), RoPE on interleaved pairs (DeepSeek's
weight layout, vLLM's is_neox_style=False). The module computes it with expanded keys and
values (training) and in absorbed form over the latent cache (decoding): both must equal the
reference in float32 (1e-5), with default and YaRN rope and without a query LoRA. Training-time
test with the MLA drafter must equal the step-by-step reference of test_ttt.py, loss and
gradients, as the Llama drafter does.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from eyas.draft import DraftConfig, Eagle3Drafter
from eyas.draft.checkpoint import load_config, save_config
from test_draft_layers import llama_config as _llama_config
from eyas.errors import EyasError
from test_ttt import H, V, VD, assert_objective_matches_reference, make_setup, tiny_config

SIZES = {"q_lora_rank": 12, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 6}
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 8,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
VARIANTS = {
    "default": {},
    "yarn": {"rope_parameters": YARN},
    "no_q_lora": {"mla": {**SIZES, "q_lora_rank": None}},
}


def mla_config(**overrides) -> DraftConfig:
    return tiny_config(**{"attention": "mla", "mla": dict(SIZES), "num_key_value_heads": 4,
                          "head_dim": SIZES["qk_rope_head_dim"], **overrides})


def mla_drafter(**overrides) -> Eagle3Drafter:
    torch.manual_seed(0)
    m = Eagle3Drafter(mla_config(**overrides), torch.randn(V, H))
    for p in m.parameters():  # far from the default init, norm weights included, so every term matters
        if p.requires_grad:
            p.data.normal_(0, 0.3)
    return m


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * x / torch.sqrt(x.pow(2).mean() + eps)


def rope_pairs(x: torch.Tensor, pos: int, rope: dict, dim: int, cfg: DraftConfig) -> torch.Tensor:
    """x [..., r]: pair (x_2i, x_2i+1) rotated by pos * inv_freq_i, YaRN's attention factor on
    cos and sin (frequencies and factor from transformers' own rope table)."""
    if rope["rope_type"] == "default":
        inv, factor = 1.0 / rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim), 1.0
    else:
        inv, factor = ROPE_INIT_FUNCTIONS["yarn"](_llama_config(cfg), "cpu")
    out = torch.empty_like(x)
    for i in range(dim // 2):
        c, s = math.cos(pos * inv[i]) * factor, math.sin(pos * inv[i]) * factor
        a, b = x[..., 2 * i], x[..., 2 * i + 1]
        out[..., 2 * i], out[..., 2 * i + 1] = a * c - b * s, b * c + a * s
    return out


def paper_heads(m: Eagle3Drafter, x: torch.Tensor, pos: int):
    """One token's per-head query, key and value [nH, .] and the softmax scale, by the equations."""
    a, cfg = m.midlayer.self_attn, m.config
    sz, nH, eps = cfg.mla, cfg.num_attention_heads, cfg.rms_norm_eps
    nope, r, dv, c = sz["qk_nope_head_dim"], sz["qk_rope_head_dim"], sz["v_head_dim"], sz["kv_lora_rank"]
    if sz["q_lora_rank"]:
        c_q = rms(a.q_a_proj.weight @ x, a.q_a_layernorm.weight, eps)
        w_q = a.q_b_proj.weight.view(nH, nope + r, -1)  # per head: W_UQ rows, then W_QR rows
    else:
        c_q, w_q = x, a.q_proj.weight.view(nH, nope + r, -1)
    w_dkv, w_kr = a.kv_a_proj_with_mqa.weight[:c], a.kv_a_proj_with_mqa.weight[c:]
    c_kv = rms(w_dkv @ x, a.kv_a_layernorm.weight, eps)
    k_r = rope_pairs(w_kr @ x, pos, cfg.rope_parameters, r, cfg)
    w_up = a.kv_b_proj.weight.view(nH, nope + dv, c)  # per head: W_UK rows, then W_UV rows
    qs, ks, vs = [], [], []
    for h in range(nH):
        qs.append(torch.cat([w_q[h, :nope] @ c_q, rope_pairs(w_q[h, nope:] @ c_q, pos, cfg.rope_parameters, r, cfg)]))
        ks.append(torch.cat([w_up[h, :nope] @ c_kv, k_r]))
        vs.append(w_up[h, nope:] @ c_kv)
    scale = (nope + r) ** -0.5
    rope = cfg.rope_parameters
    if rope["rope_type"] == "yarn":  # DeepSeek-V2's YaRN: mscale = 0.1 ln(factor) mscale_all_dim + 1, squared
        mscale = 0.1 * rope["mscale_all_dim"] * math.log(rope["factor"]) + 1.0
        scale *= mscale ** 2
    return torch.stack(qs), torch.stack(ks), torch.stack(vs), scale


def paper_attention(m: Eagle3Drafter, xs: torch.Tensor) -> torch.Tensor:
    """xs [T, 2H] at positions 0..T-1, causal -> u [T, H]."""
    a = m.midlayer.self_attn
    parts = [paper_heads(m, x, t) for t, x in enumerate(xs)]
    out = []
    for t, (q, _, _, scale) in enumerate(parts):
        heads = []
        for h in range(len(q)):
            w = torch.stack([q[h] @ parts[j][1][h] for j in range(t + 1)]).mul(scale).softmax(0)
            heads.append(sum(w[j] * parts[j][2][h] for j in range(t + 1)))
        out.append(a.o_proj.weight @ torch.cat(heads))
    return torch.stack(out)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_mla_equals_the_papers_equations_expanded_and_absorbed(variant):
    m = mla_drafter(**VARIANTS[variant])
    a = m.midlayer.self_attn
    T = 9
    xs = torch.randn(1, T, 2 * H)
    cos, sin = m.rope(xs, torch.arange(T)[None])
    with torch.no_grad():
        reference = paper_attention(m, xs[0])
        q, k, v = a.qkv(xs, cos, sin)  # per head
        expanded = a.o_proj(a.merge_heads(F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=a.scale)))
        q, k, v = a.latent_qkv(xs, cos, sin)  # one latent head for all
        assert k.shape == (1, 1, T, SIZES["kv_lora_rank"] + SIZES["qk_rope_head_dim"])
        latent = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=a.scale, enable_gqa=True)
        absorbed = a.o_proj(a.merge_latent(latent))
    torch.testing.assert_close(expanded[0], reference, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(absorbed[0], reference, atol=1e-5, rtol=1e-5)
    assert reference.abs().mean() > 0.1


@pytest.mark.parametrize("variant", ["default", "yarn"])
def test_ttt_with_the_mla_drafter_equals_the_step_by_step_reference(variant):
    """The same objective, dense TTT attention and reference as the Llama drafter's test, with
    the per-head projections taken from the paper's equations."""
    _, head, draft_ids, input_ids, hidden, loss_mask = make_setup()
    drafter = mla_drafter(**VARIANTS[variant])
    drafter.set_vocab(draft_ids)
    assert_objective_matches_reference(drafter, head, draft_ids, input_ids, hidden, loss_mask, heads=paper_heads)


def test_flex_ttt_attention_takes_mla_shapes(monkeypatch):
    """Keys of nope + rope dims, values of v_head_dim, the MLA scale: flex (eager here) equals dense."""
    from torch.nn.attention.flex_attention import flex_attention

    import eyas.draft.model as dm

    monkeypatch.setattr(dm, "_compiled_flex", lambda: flex_attention)
    g = torch.Generator().manual_seed(4)
    T, steps = 150, 3
    q, k0 = (torch.randn(2, 4, T, 24, generator=g) for _ in range(2))
    v0 = torch.randn(2, 4, T, 16, generator=g)
    extra = [(torch.randn(2, 4, T, 24, generator=g), torch.randn(2, 4, T, 16, generator=g)) for _ in range(steps - 1)]
    flex = dm.ttt_attention_flex(q, k0, v0, extra, 0.3)
    assert flex.shape == (2, 4, T, 16)
    torch.testing.assert_close(flex, dm.ttt_attention_dense(q, k0, v0, extra, 0.3), atol=1e-5, rtol=1e-5)


def test_draft_attention_follows_the_target(tmp_path):
    """auto = MLA for a DeepseekV3 target and a Kimi-K2.5 wrapper nesting one, GQA for Llama; the MLA
    sizes and YaRN rope are the target's unless overridden; a checkpoint restores them."""
    from transformers import DeepseekV3Config, LlamaConfig

    from eyas.models.identity import ModelIdentity

    ident = ModelIdentity("t", "c", "t", 4, 64, 100)
    rope = {**YARN, "original_max_position_embeddings": 64}
    ds = DeepseekV3Config(hidden_size=64, num_attention_heads=4, num_hidden_layers=4, vocab_size=100, kv_lora_rank=32,
                          q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12,
                          num_key_value_heads=4, max_position_embeddings=256, rope_parameters=rope)
    cfg = DraftConfig.for_target(ds, ident, (1, 2, 3, 4), 50, attention="auto")
    assert cfg.attention == "mla" and cfg.rope_parameters["rope_type"] == "yarn"
    assert cfg.mla == {"q_lora_rank": 24, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
                       "v_head_dim": 12}
    save_config(cfg, tmp_path)
    assert load_config(tmp_path) == cfg
    small = DraftConfig.for_target(ds, ident, (1, 2, 3, 4), 50, attention="mla", mla_overrides={"kv_lora_rank": 8})
    assert small.mla["kv_lora_rank"] == 8 and small.mla["q_lora_rank"] == 24
    gqa = DraftConfig.for_target(ds, ident, (1, 2, 3, 4), 50, attention="gqa")
    # heads of the target's v_head_dim, not its config's head_dim (the rotary width there)
    assert gqa.attention == "gqa" and gqa.head_dim == 12 != ds.head_dim and gqa.num_attention_heads == 4
    llama = LlamaConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=4, vocab_size=100)
    assert DraftConfig.for_target(llama, ident, (1, 2, 3, 4), 50, attention="auto").attention == "gqa"
    with pytest.raises(EyasError, match="no MLA"):
        DraftConfig.for_target(llama, ident, (1, 2, 3, 4), 50, attention="mla")


def test_auto_picks_mla_inside_a_kimi_wrapper(tmp_path, tiny_tokenizer_dir):
    from transformers import AutoConfig

    from tiny import build_model
    from eyas.models.identity import ModelIdentity

    folder = build_model(tmp_path / "kimi", "kimi_k25", layers=4, tokenizer_dir=tiny_tokenizer_dir)
    config = AutoConfig.from_pretrained(folder)
    cfg = DraftConfig.for_target(config, ModelIdentity("k", "c", "t", 4, 64, 520), (1, 2, 3, 4), 50, attention="auto")
    assert cfg.attention == "mla" and cfg.mla["kv_lora_rank"] == 512 and cfg.mla["qk_rope_head_dim"] == 64
    assert cfg.rope_parameters["rope_theta"] == 50000.0


def test_mla_drafter_decodes_losslessly_chain_and_tree(tmp_path, tiny_tokenizer_dir):
    """eyas eval's decoding with an MLA drafter (its cache the latent, one entry for all heads) on
    a tiny DeepseekV3 target: chain and tree emit exactly transformers' greedy answer, and the
    drafter, fitted on that answer's first half, gets drafts accepted."""
    from test_export_vllm import capture, fit_drafter
    from tiny import build_model
    from eyas.evaluate.drafter import DrafterSession
    from eyas.evaluate.generate import generate
    from eyas.prompts import render
    from eyas.evaluate.proposers import Eagle3
    from eyas.evaluate.run import load_checked_drafter
    from eyas.models.eos import eos_ids
    from eyas.evaluate.target import TargetSession
    from eyas.models import load_target, model_identity

    folder = str(build_model(tmp_path / "deepseek", "deepseek_v3", tokenizer_dir=tiny_tokenizer_dir))
    model, tokenizer = load_target(folder, dtype="float32")
    ids = render(tokenizer, [{"role": "user", "content": "hello there, how are you?"}])
    with torch.inference_mode():
        expected = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, eos_token_id=[],
                                  pad_token_id=0)[0, len(ids):].tolist()
    ckpt = fit_drafter(capture([ids + expected[:12]], model=folder), tmp_path / "drafter", steps=40, attention="mla")
    drafter = load_checked_drafter(str(ckpt), model, model_identity(folder, model.config, tokenizer))
    assert drafter.config.attention == "mla"
    target = TargetSession(model, drafter.config.aux_layer_ids)
    for tree in (False, True):
        session = DrafterSession(drafter)
        g = generate(target, Eagle3(session, steps=3, tree=tree, top_k=3, max_nodes=8), ids, 24, set(eos_ids(model.generation_config, tokenizer)))
        assert g.generated_ids == expected, tree
        assert sum(g.accept_counts) >= 6, g.accept_counts
        assert session.cache.keys[0].shape[1] == 1  # the latent cache: [1, 1, S, kv_lora_rank + qk_rope_head_dim]


@pytest.mark.parametrize("to", ["vllm", "sglang"])
def test_mla_export_names_what_the_engines_load_and_imports_back(tmp_path, to):
    """vLLM's Eagle3DeepseekV3ForCausalLM / SGLang's Eagle3DeepseekV2ForCausalLM fields and
    DeepSeek weight names; `eyas import` gives back the same config and tensors; speculators refuses."""
    from safetensors.torch import load_file

    from eyas.draft import save_drafter
    from eyas.export import export_drafter
    from eyas.export.config import ExportConfig
    from eyas.export.importer import import_drafter

    m = mla_drafter(fc_norm=True, norm_output=True)
    m.set_vocab(torch.randperm(V)[:VD].sort().values)
    save_drafter(m, tmp_path / "ckpt")
    export_drafter(ExportConfig(ckpt=str(tmp_path / "ckpt"), to=to, out=str(tmp_path / to)))
    config = json.loads((tmp_path / to / "config.json").read_text())
    assert config["architectures"] == [{"vllm": "Eagle3DeepseekV3ForCausalLM", "sglang": "Eagle3DeepseekV2ForCausalLM"}[to]]
    assert config["model_type"] == "deepseek_v2" and config["fc_norm"] and config["norm_output"]
    assert {k: config[k] for k in SIZES} == SIZES and config["num_hidden_layers"] == 1
    weights = load_file(tmp_path / to / "model.safetensors")
    for name in ("q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj"):
        assert f"midlayer.self_attn.{name}.weight" in weights, name
    import_drafter(tmp_path / to, tmp_path / "back")
    back = load_file(tmp_path / "back" / "model.safetensors")
    original = load_file(tmp_path / "ckpt" / "model.safetensors")
    assert back.keys() == original.keys() and all(torch.equal(back[k], original[k]) for k in back)
    assert load_config(tmp_path / "back") == m.config
    with pytest.raises(EyasError, match="speculators"):
        export_drafter(ExportConfig(ckpt=str(tmp_path / "ckpt"), to="speculators", out=str(tmp_path / "spec")))


def test_sglang_export_refuses_an_mla_drafter_without_query_lora(tmp_path):
    from eyas.draft import save_drafter
    from eyas.export import export_drafter
    from eyas.export.config import ExportConfig

    save_drafter(mla_drafter(**VARIANTS["no_q_lora"]), tmp_path / "ckpt")
    with pytest.raises(EyasError, match="q_lora_rank"):
        export_drafter(ExportConfig(ckpt=str(tmp_path / "ckpt"), to="sglang", out=str(tmp_path / "sglang")))


def test_a_run_recorded_before_draft_attention_existed_resumes():
    """Such a run's drafter comes back from its checkpoint with the attention it was built with;
    a recorded choice that differs is still refused."""
    from eyas.train.config import TrainConfig

    cfg = TrainConfig(out="x", store="s")
    recorded = {k: v for k, v in cfg.to_dict().items() if k != "draft_attention"}
    cfg.check_resumable(recorded)
    with pytest.raises(EyasError, match="draft-attention"):
        cfg.check_resumable({**recorded, "draft_attention": "gqa"})
