"""A drafter's `config.json` as vLLM 0.32 loads it: the one writer, for checkpoints and for
`eyas export --to vllm` alike (the SGLang and speculators layouts in export/layouts.py start
from `layer_fields`). No torch: the config and its checks import this.

Per kind (draft/kinds.py names the writer):
- EAGLE-3: `LlamaForCausalLMEagle3` (model_executor/models/llama_eagle3.py), or for an MLA
  layer `Eagle3DeepseekV3ForCausalLM` (deepseek_eagle3.py, draft/mla_config.py's fields);
  aux ids from top-level `eagle_aux_hidden_state_layer_ids`, `fc` sized by
  `num_aux_hidden_states`; EAGLE 3.1's `fc_norm`, `norm_output` and speculators'
  `norm_before_fc` at top level.
- P-EAGLE: EAGLE-3's, plus `mask_token_id`, which vLLM's proposer writes into the parallel
  slots when served with `parallel_drafting`.
- DFlash: `DFlashDraftModel` (models/qwen3_dflash.py, config/speculative.py): Qwen3 layer
  fields, `block_size`, and `dflash_config` with the mask token and `target_layer_ids`
  counted one lower than eyas's ids (as z-lab's heads do).
Every kind carries eyas's own record under `eyas` (DraftConfig.to_hf_dict adds it).
"""

from __future__ import annotations

from typing import Any

from eyas.draft import mla_config as mla

DraftConfig = Any  # draft/config.py's, which imports this module through draft/kinds.py

# The drafter options vLLM 0.32 serves and SGLang does not: field -> what it means.
EAGLE31_OPTIONS = {
    "fc_norm": "an RMSNorm on each aux state before fc",
    "norm_output": "the normed output fed back between drafting steps",
    "norm_before_fc": "one RMSNorm over the concatenated aux states before fc",
}


def layer_fields(cfg: DraftConfig) -> dict[str, Any]:
    """The decoder layer as an HF Llama config: what every layout shares."""
    rope = dict(cfg.rope_parameters)
    return {
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "num_hidden_layers": cfg.num_hidden_layers,
        "hidden_act": cfg.hidden_act,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": rope.get("rope_theta", 10000.0),
        "rope_scaling": None if rope.get("rope_type", "default") == "default" else {
            k: v for k, v in rope.items() if k != "rope_theta"},
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "num_aux_hidden_states": len(cfg.aux_layer_ids),  # vLLM sizes fc from this, not from the ids
    }


def eagle3(cfg: DraftConfig) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        **layer_fields(cfg),
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.hidden_size,
        "norm_before_residual": cfg.norm_before_residual,
        **{option: getattr(cfg, option) for option in EAGLE31_OPTIONS},
        "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
        **(mla.hf_fields(cfg) if cfg.attention == "mla" else {}),
    }


def peagle(cfg: DraftConfig) -> dict[str, Any]:
    return {**eagle3(cfg), "mask_token_id": cfg.mask_token_id}


def dflash(cfg: DraftConfig) -> dict[str, Any]:
    layer = {k: v for k, v in layer_fields(cfg).items() if k != "num_aux_hidden_states"}
    return {
        **layer,
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "num_hidden_layers": cfg.num_hidden_layers,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
        "block_size": cfg.ttt_steps + 1,
        "dflash_config": {"mask_token_id": cfg.mask_token_id, "target_layer_ids": [k - 1 for k in cfg.aux_layer_ids]},
    }
