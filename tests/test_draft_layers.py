"""eyas's own drafter layers (draft/layers.py) against what they replace.

1. Checkpoints trained before the change (tests/data/pre_layers: an EAGLE-3 GQA drafter with
   llama3 rope, an MLA one with YaRN, a two-layer DFlash one with YaRN; and before the kind
   records and the one config.json writer, tests/data/pre_kinds: a P-EAGLE drafter with llama3
   rope and both EAGLE 3.1 options; how they were made is in the commits that added them) load
   and give the logits saved with them. float32 on the CPU: the same operations in the same
   order, so the tolerance is 1e-6 (it is exact here).
2. Each layer against transformers' Llama module as the reference, in float32 and bf16:
   RMSNorm, the MLP, apply_rotary_pos_emb and the rotary embedding for every rope type the
   drafter takes (draft/rope.py ROPE_TYPES), scaled ones included, over positions short of
   and past the lengths where dynamic and longrope switch. Exact (0 difference) in both.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig
from transformers.models.llama import modeling_llama as llama

from eyas.draft import load_drafter
from eyas.draft.layers import GatedMLP, RMSNorm, RotaryEmbedding, apply_rotary_pos_emb
from eyas.draft.rope import ROPE_TYPES
from eyas.errors import EyasError

FIXTURES = Path(__file__).parent / "data"
HEAD, MAX_POS = 16, 64


def llama_config(cfg) -> LlamaConfig:
    """The LlamaConfig eyas built its drafter's layers from before it owned them (a reference)."""
    return LlamaConfig(
        hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size, hidden_act=cfg.hidden_act,
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps, max_position_embeddings=cfg.max_position_embeddings,
        rope_parameters=dict(cfg.rope_parameters), mlp_bias=False, attention_bias=False)


@pytest.mark.parametrize("name", ["pre_layers/eagle3_llama3", "pre_layers/eagle3_mla_yarn", "pre_layers/dflash_yarn",
                                  "pre_kinds/peagle_llama3"])
def test_a_checkpoint_trained_before_the_change_gives_the_same_logits(name):
    ref = load_file(FIXTURES / name / "reference.safetensors")
    drafter = load_drafter(FIXTURES / name, ref["embed"]).eval()
    with torch.no_grad():
        logits = torch.stack(drafter.forward_ttt(ref["input_ids"], ref["aux_hidden"]))
    assert logits.shape == ref["logits"].shape
    torch.testing.assert_close(logits, ref["logits"], atol=1e-6, rtol=1e-6)
    assert ref["logits"].abs().mean() > 0.1


def rope_settings(kind: str) -> dict:
    """Settings of `kind` with every optional field that changes the frequencies set."""
    half = HEAD // 2
    return {
        "default": {"rope_theta": 10000.0},
        "linear": {"rope_theta": 10000.0, "factor": 4.0},
        "dynamic": {"rope_theta": 10000.0, "factor": 2.0},
        "yarn": {"rope_theta": 50000.0, "factor": 8.0, "original_max_position_embeddings": 16, "beta_fast": 32.0,
                 "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.7},
        "longrope": {"rope_theta": 10000.0, "original_max_position_embeddings": 16,
                     "short_factor": [1.0 + 0.1 * i for i in range(half)],
                     "long_factor": [2.0 + 0.5 * i for i in range(half)]},
        "llama3": {"rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 16},
        "proportional": {"rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    }[kind] | {"rope_type": kind}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ROPE_TYPES)
def test_rotary_embedding_equals_transformers_llama_for_every_rope_type(kind, dtype):
    rope = rope_settings(kind)
    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=HEAD, max_position_embeddings=MAX_POS,
                      rope_parameters=dict(rope))
    x = torch.randn(2, 5, 64, dtype=dtype)
    ours = RotaryEmbedding(HEAD, rope, MAX_POS)
    for last in (12, 40, 100):  # short of and past original (16) and max (64) positions
        positions = torch.stack([torch.arange(last - 12, last), torch.arange(12) * last // 12])
        reference = llama.LlamaRotaryEmbedding(cfg)(x, positions)  # a fresh module: no length remembered
        for got, want in zip(ours(x, positions), reference):
            assert got.dtype == want.dtype == dtype
            torch.testing.assert_close(got, want, atol=0, rtol=0)
    cos, _ = ours(x, positions)
    if kind != "default":  # the scaling changes what the plain rope would give
        plain = RotaryEmbedding(HEAD, {"rope_type": "default", "rope_theta": rope["rope_theta"]}, MAX_POS)(x, positions)
        assert not torch.equal(cos, plain[0])


def test_the_drafter_takes_exactly_the_rope_types_it_computes():
    for kind in ROPE_TYPES:
        RotaryEmbedding(HEAD, rope_settings(kind), MAX_POS)
    with pytest.raises(EyasError, match="'axial' is not one the drafter computes"):
        RotaryEmbedding(HEAD, {"rope_type": "axial", "rope_theta": 1e4}, MAX_POS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_mlp_and_rotation_equal_transformers_llama(dtype):
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=48, num_attention_heads=4, head_dim=8, hidden_act="silu",
                      mlp_bias=False)
    x = torch.randn(2, 7, 32, dtype=dtype) * 3
    norm, ref_norm = RMSNorm(32, eps=1e-5), llama.LlamaRMSNorm(32, eps=1e-5)
    mlp, ref_mlp = GatedMLP(32, 48, "silu").to(dtype), llama.LlamaMLP(cfg).to(dtype)
    assert list(mlp.state_dict()) == list(ref_mlp.state_dict())
    assert list(norm.state_dict()) == list(ref_norm.state_dict())
    with torch.no_grad():
        ref_norm.weight.normal_(1, 0.3)
        norm.weight.copy_(ref_norm.weight)
        ref_mlp.load_state_dict({k: torch.randn_like(v) * 0.3 for k, v in ref_mlp.state_dict().items()})
        mlp.load_state_dict(ref_mlp.state_dict())
        torch.testing.assert_close(norm(x), ref_norm(x), atol=0, rtol=0)
        torch.testing.assert_close(mlp(x), ref_mlp(x), atol=0, rtol=0)
    q, k = torch.randn(2, 4, 7, 8, dtype=dtype), torch.randn(2, 2, 7, 8, dtype=dtype)
    cos, sin = RotaryEmbedding(8, rope_settings("llama3"), MAX_POS)(q, torch.arange(7).expand(2, 7))
    for got, want in zip(apply_rotary_pos_emb(q, k, cos, sin), llama.apply_rotary_pos_emb(q, k, cos, sin)):
        torch.testing.assert_close(got, want, atol=0, rtol=0)
