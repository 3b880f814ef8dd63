"""What an MLA drafter is, without its tensors: the sizes and rope settings it takes from a
DeepseekV2/V3 target, the attention choice, and the config fields the engines read. Kept apart
from draft/mla.py (the layer) so that config, export and the CLI need no torch.
"""

from __future__ import annotations

import math
from typing import Any

from eyas.errors import EyasError

# The MLA sizes a drafter records (DeepseekV2/V3 config field names, as both engines read them).
MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
GQA, MLA = "gqa", "mla"  # a drafter layer's attentions: Llama-style (draft/model.py), latent (draft/mla.py)
AUTO_ATTENTION = "auto"  # `--draft-attention auto`: the target's own kind (see resolve_attention)
ATTENTION_CHOICES = (AUTO_ATTENTION, GQA, MLA)
# What vLLM and SGLang load an MLA EAGLE-3 head as (vLLM registers both names, SGLang the V2 one).
VLLM_ARCHITECTURE = "Eagle3DeepseekV3ForCausalLM"
SGLANG_ARCHITECTURE = "Eagle3DeepseekV2ForCausalLM"
ARCHITECTURES = (VLLM_ARCHITECTURE, SGLANG_ARCHITECTURE)


def target_uses_mla(text_config) -> bool:
    """DeepseekV2/V3 text models (and wrappers nesting them, e.g. Kimi-K2.5) state a kv_lora_rank."""
    return getattr(text_config, "kv_lora_rank", None) is not None


def resolve_attention(choice: str, text_config) -> str:
    """`--draft-attention`: auto = the target's own kind (MLA for DeepSeek-V2/V3-style targets)."""
    if choice not in ATTENTION_CHOICES:
        raise EyasError(f"--draft-attention must be one of {', '.join(ATTENTION_CHOICES)}, not {choice!r}.")
    if choice == AUTO_ATTENTION:
        return MLA if target_uses_mla(text_config) else GQA
    if choice == MLA and not target_uses_mla(text_config):
        raise EyasError(f"--draft-attention mla takes its latent ranks and head dims from the target, but "
                        f"{type(text_config).__name__} has no MLA (no kv_lora_rank); use gqa.")
    return choice


def mla_sizes(text_config, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The target's MLA sizes, each replaced by `overrides` where given."""
    sizes = {k: getattr(text_config, k, None) for k in MLA_FIELDS}
    sizes.update(overrides or {})
    check_sizes(sizes)
    return sizes


def check_sizes(sizes: dict[str, Any]) -> None:
    missing = [k for k in MLA_FIELDS if k not in sizes or (sizes[k] is None and k != "q_lora_rank")]
    if missing:
        raise EyasError(f"The MLA drafter needs {', '.join(missing)}.")
    if sizes["qk_rope_head_dim"] % 2:
        raise EyasError(f"qk_rope_head_dim must be even (rotary pairs), not {sizes['qk_rope_head_dim']}.")


def check_rope(rope: dict[str, Any]) -> None:
    """vLLM's MLA layer serves default and DeepSeek-YaRN rotary settings; a YaRN with
    attention_factor 1.0 becomes its 'deepseek_llama_scaling', which the drafter does not compute."""
    kind = rope.get("rope_type", "default")
    if kind not in ("default", "yarn"):
        raise EyasError(f"The MLA drafter computes default or YaRN rope as vLLM's MLA layer does, not {kind!r}.")
    if kind == "yarn" and rope.get("attention_factor") == 1.0:
        raise EyasError("A YaRN rope with attention_factor 1.0 is served by vLLM as 'deepseek_llama_scaling', "
                        "which the MLA drafter does not compute.")


def softmax_scale(qk_head_dim: int, rope: dict[str, Any]) -> float:
    """(nope + rope)^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN (DeepSeek-V2 and vLLM)."""
    scale = qk_head_dim ** -0.5
    if rope.get("rope_type", "default") == "yarn":
        mscale = _yarn_mscale(rope["factor"], float(rope.get("mscale_all_dim") or 0.0))
        scale *= mscale * mscale
    return scale


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def kv_cache_bytes_per_token(cfg, dtype_bytes: int = 2) -> int:
    """What one token costs in the drafter's KV cache as the engines keep it: the latent
    [c_kv | k_rope] for MLA, keys and values of every KV head otherwise."""
    if cfg.attention == "mla":
        return (cfg.mla["kv_lora_rank"] + cfg.mla["qk_rope_head_dim"]) * dtype_bytes
    return 2 * cfg.num_key_value_heads * cfg.head_dim * dtype_bytes


def hf_fields(cfg) -> dict[str, Any]:
    """config.json fields of an MLA drafter (DeepseekV2Config names), over the Llama ones."""
    return {
        "architectures": [VLLM_ARCHITECTURE],
        # deepseek_v2, not v3: vLLM 0.32 turns a deepseek_v3 draft config into its MTP model
        # (SpeculativeConfig.hf_config_override); DeepseekV2Config carries the same MLA fields.
        "model_type": "deepseek_v2",
        **{k: cfg.mla[k] for k in MLA_FIELDS},
        "num_key_value_heads": cfg.num_attention_heads,
        "head_dim": cfg.mla["qk_rope_head_dim"],
        "rope_parameters": dict(cfg.rope_parameters),
        "rope_interleave": True,
    }
