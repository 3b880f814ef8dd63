"""The layouts serving engines load an EAGLE-3 drafter from, one definition each.

Every field here was read from the engine's own loader, not from memory:

vllm         vLLM 0.32 `model_executor/models/llama_eagle3.py` + `v1/worker/gpu_model_runner.py`:
             architecture `LlamaForCausalLMEagle3`; aux ids from top-level
             `eagle_aux_hidden_state_layer_ids` (input-of-layer ids, eyas's own convention);
             `fc` width from `num_aux_hidden_states` (else 3); weights `midlayer.*` (renamed to
             `layers.0.*` by vLLM), `fc`, `norm`, `lm_head`, `d2t` (offsets; no `d2t` when the draft
             vocabulary is the whole target vocabulary); `t2d` ignored; the target's embeddings shared.
             EAGLE 3.1 options from top-level `fc_norm` (one RMSNorm per aux state before `fc`,
             weights `fc_norm.{i}.weight`: the loader prefixes every name but `lm_head` with
             `model.`, so they are written unprefixed), `norm_output` (no weights) and
             `norm_before_fc` (one RMSNorm over all aux states, weight `input_norm.weight`).
speculators  vLLM's `transformers_utils/configs/speculators/`: `speculators_model_type: eagle3`,
             `architectures: [Eagle3Speculator]`, the decoder layer in `transformer_layer_config`,
             `norm_before_residual` defaulting to True when absent (so it is always written),
             top-level `fc_norm` / `norm_output` / `norm_before_fc` (the same model class loads
             it, so the same weight names), weights under `layers.0.*`;
             `speculators_config.verifier` names the target.
sglang       SGLang `srt/models/llama_eagle3.py` + `llama.py` + `model_executor/model_runner.py`:
             architecture `LlamaForCausalLMEagle3`; aux ids only from
             `eagle_config.eagle_aux_hidden_state_layer_ids`, counted as *outputs* of layers (it
             captures at id + 1), so eyas's ids are shifted by -1; `fc` is hard-wired to three aux
             states; the residual is always the un-normed hidden state (no `norm_before_residual`);
             weights `midlayer.*`, `fc`, `norm`, `lm_head`, `d2t` (read as offsets), `t2d`;
             no `fc_norm` and no `norm_output` (neither field is read, the weights would be dropped).
             The top-level vLLM ids are written too, so the folder also serves correctly in vLLM
             (which reads top level first) instead of silently off by one layer.

An MLA drafter (draft/mla.py) is the same folder with a DeepSeek layer: vLLM 0.32
`model_executor/models/deepseek_eagle3.py` loads `Eagle3DeepseekV3ForCausalLM` (model_type
deepseek_v2, since vLLM reads a deepseek_v3 draft config as its MTP model; `q_lora_rank`, `kv_lora_rank`, `qk_nope_head_dim`, `qk_rope_head_dim`,
`v_head_dim`, `fc_norm`, `norm_output`; weights `midlayer.self_attn.{q_a_proj, q_a_layernorm,
q_b_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj}` beside the Llama ones);
SGLang `srt/models/kimi_k25_eagle3.py` loads the same weights (`midlayer.*` or `layers.0.*`)
as `Eagle3DeepseekV2ForCausalLM`, reads `fc_norm` and `norm_output`, ids from `eagle_config`,
and keeps the un-normed residual. speculators has no MLA layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from eyas.draft import mla_config as mla
from eyas.draft.vllm_config import EAGLE31_OPTIONS, layer_fields
from eyas.errors import EyasError

if TYPE_CHECKING:  # annotations only: `eyas export --help` lists the layouts without torch
    from eyas.draft.config import DraftConfig

EYAS_PREFIX = "midlayer."  # eyas's (and vLLM's, SGLang's, EAGLE's) name for the EAGLE-3 decoder layer
STACK_PREFIX = "stack."  # eyas's layers after it (--draft-layers): stack.i is vLLM's layers.{i+1}


@dataclass(frozen=True)
class Layout:
    name: str
    engine: str
    layer_prefix: str  # what the decoder layer's weights are called in this layout
    full_vocab_mapping: bool  # write d2t/t2d even when the draft vocabulary is the whole target vocabulary
    config: Callable[[DraftConfig, dict[str, Any]], dict[str, Any]]  # (cfg, serving info) -> config.json
    check: Callable[[DraftConfig], None]

    def export_name(self, name: str) -> str:
        if name.startswith(EYAS_PREFIX):
            return self.layer_prefix + name.removeprefix(EYAS_PREFIX)
        if name.startswith(STACK_PREFIX):
            index, _, rest = name.removeprefix(STACK_PREFIX).partition(".")
            return f"layers.{int(index) + 1}.{rest}"
        return name


def _needs_silu(cfg: DraftConfig) -> None:
    # Both engines' LlamaMLP raise on anything else.
    if cfg.hidden_act != "silu":
        raise EyasError(f"hidden_act is {cfg.hidden_act!r}; vLLM and SGLang serve EAGLE-3 heads only with 'silu'.")


def _one_layer(cfg: DraftConfig, engine: str) -> None:
    if cfg.num_hidden_layers > 1:
        raise EyasError(f"{engine} reads one EAGLE-3 layer; this drafter has {cfg.num_hidden_layers} "
                        f"(--draft-layers). Export it --to vllm, whose llama_eagle3 builds them all.")


def _sglang_check(cfg: DraftConfig) -> None:
    _needs_silu(cfg)
    _one_layer(cfg, "SGLang's EAGLE-3 head")
    if len(cfg.aux_layer_ids) != 3:
        raise EyasError(f"SGLang's EAGLE-3 head fuses exactly three aux layers (fc is 3H wide); this drafter uses "
                        f"{len(cfg.aux_layer_ids)} ({list(cfg.aux_layer_ids)}). Export it --to vllm instead.")
    if cfg.norm_before_residual:
        raise EyasError("This drafter was trained with norm_before_residual=true, which SGLang's EAGLE-3 layer does "
                        "not implement (its residual is always the un-normed hidden state). Export it --to vllm.")
    for option, what in EAGLE31_OPTIONS.items():
        if getattr(cfg, option) and cfg.attention != "mla":  # its MLA head (kimi_k25_eagle3) reads both
            raise EyasError(f"This drafter was trained with {option}=true ({what}), which SGLang's EAGLE-3 head does "
                            "not implement; export it --to vllm.")
    if cfg.attention == "mla" and not cfg.mla["q_lora_rank"]:
        raise EyasError("SGLang's MLA EAGLE-3 head (kimi_k25_eagle3) needs a q_lora_rank; this drafter has none. "
                        "Export it --to vllm.")
    if min(cfg.aux_layer_ids) < 1:
        raise EyasError("Aux layer id 0 (the embeddings) has no output-of-layer id in SGLang's convention.")


def vllm_config(cfg: DraftConfig, serving: dict[str, Any]) -> dict[str, Any]:
    """The config.json the drafter's checkpoint holds: one writer for both (draft/vllm_config.py)."""
    return cfg.to_hf_dict()


def sglang_config(cfg: DraftConfig, serving: dict[str, Any]) -> dict[str, Any]:
    return {
        **vllm_config(cfg, serving),
        **({"architectures": [mla.SGLANG_ARCHITECTURE]} if cfg.attention == "mla" else {}),
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": [k - 1 for k in cfg.aux_layer_ids],
            "use_aux_hidden_state": True,
        },
    }


def speculators_config(cfg: DraftConfig, serving: dict[str, Any]) -> dict[str, Any]:
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{
                "proposal_type": "greedy", "speculative_tokens": serving["num_speculative_tokens"],
                "verifier_accept_k": 1, "accept_tolerance": 0.0,
            }],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": serving["target"], "architectures": serving["target_architectures"]},
        },
        "transformer_layer_config": layer_fields(cfg),
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.hidden_size,
        "norm_before_residual": cfg.norm_before_residual,
        **{option: getattr(cfg, option) for option in EAGLE31_OPTIONS},
        "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
        "eyas": cfg.to_hf_dict()["eyas"],  # eyas's own record (target, ids in eyas's convention); engines ignore it
    }


def _speculators_check(cfg: DraftConfig) -> None:
    _needs_silu(cfg)
    _one_layer(cfg, "The speculators format as eyas writes it")
    if cfg.attention == "mla":
        raise EyasError("vLLM's speculators format describes a Llama layer; export this MLA drafter --to vllm "
                        "(Eagle3DeepseekV3ForCausalLM).")


LAYOUTS: dict[str, Layout] = {
    "vllm": Layout("vllm", "vllm", EYAS_PREFIX, False, vllm_config, _needs_silu),
    "speculators": Layout("speculators", "vllm", "layers.0.", False, speculators_config, _speculators_check),
    "sglang": Layout("sglang", "sglang", EYAS_PREFIX, True, sglang_config, _sglang_check),
}


def layout_for(cfg: DraftConfig, name: str) -> Layout:
    """The layout `name`, if the drafter's kind is written in it and an engine serves this drafter."""
    layout = get_layout(name)
    cfg.kind.check_format(name)
    cfg.kind.check_served(cfg)
    return layout


def get_layout(name: str) -> Layout:
    try:
        return LAYOUTS[name]
    except KeyError:
        raise EyasError(f"Unknown export format {name!r}; choose one of {', '.join(LAYOUTS)}.") from None
