"""The drafter's config from the target's real settings: rope per attention type (following
the full-attention layers), M-RoPE, unmappable settings as errors, the choice recorded in the
checkpoint; and the DeepSeek-style router fields vLLM needs stated (no vLLM import here)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import transformers

from eyas.draft import DraftConfig
from eyas.draft.checkpoint import load_config, save_config
from eyas.draft.rope import drafter_rope
from eyas.errors import EyasError
from eyas.models.identity import ModelIdentity
from eyas.vllm.preflight import check_router


def test_gemma3_rope_follows_the_full_attention_layers(tmp_path):
    config = transformers.Gemma3TextConfig(num_hidden_layers=4)
    full, sliding = (config.rope_parameters[k]["rope_theta"] for k in ("full_attention", "sliding_attention"))
    assert full != sliding
    identity = ModelIdentity("gemma", "c", "t", 4, config.hidden_size, config.vocab_size)
    cfg = DraftConfig.for_target(config, identity, (1, 2, 3, 4), 64)
    assert cfg.rope_parameters == {"rope_type": "default", "rope_theta": full}
    save_config(cfg, tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["rope_theta"] == 1_000_000.0 and saved["rope_scaling"] is None
    assert saved["eyas"]["rope_source"] == "the target's full_attention layers (not its sliding_attention layers)"
    assert load_config(tmp_path).rope_source == cfg.rope_source


def test_scaled_and_legacy_rope_settings_are_kept():
    llama3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    config = transformers.LlamaConfig(rope_parameters=llama3, max_position_embeddings=131072)
    assert drafter_rope(config) == (llama3, "the target's rope_parameters")
    legacy = SimpleNamespace(rope_parameters=None, rope_theta=20000.0, rope_scaling={"type": "linear", "factor": 2.0})
    assert drafter_rope(legacy) == ({"factor": 2.0, "rope_theta": 20000.0, "rope_type": "linear"},
                                    "the target's rope_theta and rope_scaling")
    mrope = SimpleNamespace(rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]})
    rope, source = drafter_rope(mrope)
    assert rope == {"rope_type": "default", "rope_theta": 1e6} and "M-RoPE as plain 1-D rope" in source


@pytest.mark.parametrize("rope, message", [
    ({"sliding_attention": {"rope_type": "default", "rope_theta": 1e4}, "chunked_attention": {"rope_theta": 1e4}},
     r"per layer type \['chunked_attention', 'sliding_attention'\] but none for full_attention"),
    ({"rope_type": "axial", "rope_theta": 1e4}, r"rope_type 'axial' has no Llama equivalent"),
    ({"rope_type": "default"}, r"have no rope_theta"),
    (None, r"states no rotary settings"),
])
def test_unmappable_rope_is_an_error_not_a_default(rope, message):
    with pytest.raises(EyasError, match=message):
        drafter_rope(SimpleNamespace(rope_parameters=rope))


def test_deepseek_router_fields_must_be_stated():
    """transformers' DeepseekV3Config does not write topk_method / scoring_func; vLLM would
    fall back to softmax routing without the correction bias."""
    plain = transformers.DeepseekV3Config(num_hidden_layers=2)
    assert "topk_method" not in plain.to_dict()
    with pytest.raises(EyasError, match=r"does not set topk_method and scoring_func .* to its config\.json"):
        check_router(plain, "ds")
    wrapped = transformers.Kimi_K25Config(text_config=plain.to_dict())
    with pytest.raises(EyasError, match="to its text_config"):
        check_router(wrapped, "kimi")
    check_router(transformers.DeepseekV3Config(topk_method="noaux_tc", scoring_func="sigmoid"), "ds")
    check_router(transformers.Qwen3MoeConfig(), "qwen3-moe")  # not DeepSeek-style: nothing to state


def test_a_tokenizer_refusal_says_what_differs():
    """Two identities whose tokenizers differ only in special tokens (what two transformers
    versions made of one GGUF) are refused with the difference named; old artifacts without
    the parts still get the plain refusal."""
    from eyas.errors import EyasError
    from eyas.models.identity import ModelIdentity

    parts = {"vocab": "v1", "chat_template": "c1", "special": {"eos_token": "<|im_end|>", "pad_token": "<|im_end|>"}}
    here = ModelIdentity("m", "cfg", "tok-a", 2, 8, 16, parts)
    gguf_517 = {**parts, "special": {"eos_token": "<|im_start|>"}}
    there = ModelIdentity.from_dict({**here.to_dict(), "tokenizer_hash": "tok-b", "tokenizer_parts": gguf_517})
    with pytest.raises(EyasError) as e:
        here.check_same(there, "The drafter d")
    message = str(e.value)
    assert "eos_token '<|im_start|>' there, '<|im_end|>' here" in message
    assert "pad_token None there, '<|im_end|>' here" in message
    assert "Vocabulary and chat template are the same" in message
    old = {k: v for k, v in there.to_dict().items() if k != "tokenizer_parts"}
    with pytest.raises(EyasError) as e:
        here.check_same(ModelIdentity.from_dict(old), "The drafter d")
    assert "What differs" not in str(e.value)
    with pytest.raises(EyasError, match="What differs: the vocabulary"):
        here.check_same(ModelIdentity.from_dict({**there.to_dict(), "tokenizer_parts": {**parts, "vocab": "v2"}}), "x")
    assert here == ModelIdentity.from_dict({**here.to_dict(), "tokenizer_parts": None})
    hash(here)
