"""Read EAGLE-3 drafters trained elsewhere into an eyas checkpoint, so `eyas eval` can score them.

Understood layouts; anything else is refused with the field that is missing or unsupported:
- official EAGLE-3 (SafeAILab/EAGLE): a Llama config (`LlamaForCausalLM` or
  `LlamaForCausalLMEagle3`) with `draft_vocab_size`; `pytorch_model.bin` or `model.safetensors`
  holding `midlayer.*`, `fc`, `norm`, `lm_head`, `d2t`, `t2d`, sometimes a copy of the target's
  `embed_tokens`; no layer ids, so both engines use input-of-layer ids (2, N/2, N-3).
- SpecForge / SGLang: the same, with ids in `eagle_config.eagle_aux_hidden_state_layer_ids`
  counted as outputs of layers (eyas adds 1).
- vLLM: ids at top level, already eyas's convention (input of layer k).
- speculators: `speculators_model_type: eagle3`, the layer in `transformer_layer_config`,
  weights under `layers.0.*`; the `speculative_tokens` it is served with becomes its depth.
- eyas's own exports (an `eyas` block): restored exactly, the engine-visible fields checked
  against it.
- MLA heads (vLLM's `Eagle3DeepseekV3ForCausalLM`, SGLang's `Eagle3DeepseekV2ForCausalLM`,
  e.g. Kimi-K2.5 EAGLE-3 MLA drafters): the same, with a DeepSeek layer whose sizes are
  read from `q_lora_rank`, `kv_lora_rank`, `qk_nope_head_dim`, `qk_rope_head_dim`, `v_head_dim`.
In every layout the options `fc_norm` (weights `fc_norm.{i}.weight`), `norm_output` and
`norm_before_fc` (weight `input_norm.weight`; speculators' default) are read where vLLM reads
them: at the top level of config.json. A speculators layer's sliding window (its default, 2048)
is reported, not applied: eyas's drafter attends to the whole context, the same at any context
up to the window.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig

from eyas.draft import mla_config as mla
from eyas.draft.checkpoint import CONFIG, save_drafter
from eyas.draft.config import DraftConfig
from eyas.errors import EyasError
from eyas.export.layouts import EAGLE31_OPTIONS, EYAS_PREFIX
from eyas.export.weights import build_drafter, owned_out, read_tensors
from eyas.models import load_tokenizer, model_identity
from eyas.models.identity import ModelIdentity
from eyas.models.layers import default_aux_ids
from eyas.models.resolve import resolve_model
from eyas.models.target_head import load_target_head
from eyas.paths import check_confined
from eyas.validate import COUNT

LLAMA_EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "LlamaForCausalLM")
MLA_MODEL_TYPES = ("deepseek_v3", "deepseek_v2", "kimi_k2")
SPECULATORS_PREFIX = "layers.0."
# speculators keeps frozen copies of the target's final norm and lm_head for training; never served.
IGNORED_PREFIXES = ("verifier_norm.", "verifier_lm_head.")
# Variants eyas's drafter does not implement: flag -> what it means.
UNSUPPORTED = {
    "attention_bias": "attention biases",
    "mlp_bias": "MLP biases",
    "tie_word_embeddings": "an lm_head tied to the embeddings",
}


# The size fields of a drafter config, each a positive integer where it is present.
SIZES = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
         "draft_vocab_size", "target_hidden_size", "num_hidden_layers")


@dataclass
class Foreign:
    """What a drafter folder's config.json says, in eyas's terms."""
    layout: str
    raw: dict[str, Any]  # the whole config.json
    layer: dict[str, Any]  # the decoder layer's Llama fields
    aux_layer_ids: tuple[int, ...] | None  # eyas's convention (input of layer k); None = engine default
    norm_before_residual: bool
    verifier: str | None  # the target named by the folder itself
    depth: int | None = None  # the draft tokens a step it is served with (speculators), its trained depth

    @property
    def attention(self) -> str:
        return "mla" if set(self.raw.get("architectures") or []) & set(mla.ARCHITECTURES) else "gqa"

    @property
    def options(self) -> dict[str, bool]:
        """fc_norm / norm_output, read at the top level as vLLM reads them in both formats."""
        return {option: bool(self.raw.get(option, False)) for option in EAGLE31_OPTIONS}


def import_drafter(src: str | Path, out: str | Path, *, target: str | None = None, force: bool = False) -> dict[str, Any]:
    """Convert the drafter in `src` to an eyas checkpoint in `out`; return a summary."""
    src, out = Path(src), Path(out)
    check_confined(out, {"the drafter folder": src, "--target": target})
    raw = read_config(src)
    foreign = parse_config(raw, src)
    own = DraftConfig.from_hf_dict(raw, f"{src}/{CONFIG}") if "eyas" in raw else None
    identity = target_identity(target, own, foreign, src)
    state = {_eyas_name(k): v for k, v in read_tensors(src).items() if not k.startswith(IGNORED_PREFIXES)}
    cfg = own or draft_config(foreign, identity, state, src)
    if own is not None:
        check_agrees(own, foreign, src)
    embed = state.pop("embed_tokens.weight", None)
    if embed is not None:
        check_embeddings(embed, target or foreign.verifier or cfg.identity.model, src)
    state.update(vocab_tables(state, cfg, src))
    model = build_drafter(cfg, state, str(src))
    with owned_out(out, force, src, "import"):
        save_drafter(model, out)
    summary = {
        "layout": foreign.layout, "out": str(out), "target": cfg.identity.model,
        "aux_layer_ids": list(cfg.aux_layer_ids), "draft_vocab_size": cfg.draft_vocab_size, "depth": cfg.depth,
        "embed_tokens": "equal to the target's, dropped" if embed is not None else "absent (the target's are used)",
    }
    window = foreign.layer.get("sliding_window")
    if window and "sliding_attention" in (foreign.layer.get("layer_types") or ["sliding_attention"]):
        summary["sliding_window"] = (f"{window} tokens in training, not applied: eyas attends to the whole context "
                                     f"(the same drafts while the context is at most {window} tokens)")
    return summary


def read_config(folder: Path) -> dict[str, Any]:
    try:
        raw = json.loads((folder / CONFIG).read_bytes())
    except (FileNotFoundError, NotADirectoryError):
        raise EyasError(f"{folder} has no {CONFIG}: not a drafter folder.") from None
    except (ValueError, RecursionError) as e:
        raise EyasError(f"{folder}/{CONFIG} is cut off or not valid JSON ({e}).") from None
    if not isinstance(raw, dict):
        raise EyasError(f"{folder}/{CONFIG} is not a JSON object; not a drafter config.")
    return raw


def _field(d: dict[str, Any], key: str, where: str, why: str = "") -> Any:
    if d.get(key) is None:
        raise EyasError(f"{where} has no `{key}`{why}; eyas cannot tell how to read this drafter.")
    return d[key]


def parse_config(raw: dict[str, Any], src: Path) -> Foreign:
    where = f"{src}/{CONFIG}"
    if "speculators_model_type" in raw:
        if raw["speculators_model_type"] != "eagle3":
            raise EyasError(f"{where}: speculators_model_type is {raw['speculators_model_type']!r}; "
                            "eyas imports only 'eagle3' speculators.")
        layer = _field(raw, "transformer_layer_config", where)
        nbr = _field(raw, "norm_before_residual", where,
                     " (vLLM assumes true when it is absent, the speculators library false)")
        ids = raw.get("eagle_aux_hidden_state_layer_ids")
        verifier = ((raw.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
        foreign = Foreign("speculators", raw, layer, tuple(ids) if ids else None, bool(nbr), verifier,
                          _speculative_tokens(raw, where))
    else:
        architectures = _field(raw, "architectures", where)
        if not set(architectures) & {*LLAMA_EAGLE3_ARCHITECTURES, *mla.ARCHITECTURES}:
            raise EyasError(f"{where}: architectures {architectures} is no EAGLE-3 head eyas reads; it imports "
                            f"{', '.join((*LLAMA_EAGLE3_ARCHITECTURES, *mla.ARCHITECTURES))} and speculators' "
                            "Eagle3Speculator.")
        layout, ids = _hf_layer_ids(raw, where)
        foreign = Foreign(layout, raw, raw, ids, bool(raw.get("norm_before_residual", False)), None)
    if not isinstance(foreign.layer, dict):
        raise EyasError(f"{where}: the decoder layer's config is not a JSON object.")
    for d in (foreign.raw, foreign.layer):  # numbers as numbers: "576" is not 576
        for key in SIZES:
            if d.get(key) is not None:
                COUNT.check(f"{where}: `{key}`", d[key])
    _check_supported(foreign, where)
    return foreign


def _speculative_tokens(raw: dict[str, Any], where: str) -> int | None:
    """speculators' `speculators_config.proposal_methods[0].speculative_tokens`: the tokens a step
    vLLM serves the drafter with, which eyas keeps as its depth (`ttt_steps`), so that eval and
    a re-export draft as many; None where the config does not say."""
    methods = (raw.get("speculators_config") or {}).get("proposal_methods")
    first = methods[0] if isinstance(methods, list) and methods else None
    k = first.get("speculative_tokens") if isinstance(first, dict) else None
    if k is not None:
        COUNT.check(f"{where}: `speculative_tokens`", k)
    return k


def _hf_layer_ids(raw: dict[str, Any], where: str) -> tuple[str, tuple[int, ...] | None]:
    """vLLM reads top-level ids (inputs of layers), SGLang only `eagle_config` ids (outputs of layers)."""
    top = raw.get("eagle_aux_hidden_state_layer_ids")
    eagle = raw.get("eagle_config") or {}
    if not isinstance(eagle, dict):
        raise EyasError(f"{where}: eagle_config is not a JSON object.")
    if eagle.get("use_aux_hidden_state") is False:
        raise EyasError(f"{where}: eagle_config.use_aux_hidden_state is false (an EAGLE-1/2 style head); "
                        "eyas drafters read the target's aux layers.")
    sglang = eagle.get("eagle_aux_hidden_state_layer_ids")
    for ids in (top, sglang):
        if ids is not None and (not isinstance(ids, list)
                                or not all(isinstance(k, int) and not isinstance(k, bool) and k >= 0 for k in ids)):
            raise EyasError(f"{where}: eagle_aux_hidden_state_layer_ids {ids!r} is not a list of layer ids "
                            f"(integers >= 0).")
    if sglang:
        shifted = tuple(int(k) + 1 for k in sglang)
        if top and tuple(top) != shifted:
            raise EyasError(f"{where}: top-level eagle_aux_hidden_state_layer_ids {list(top)} (vLLM: inputs of layers) "
                            f"and eagle_config's {list(sglang)} (SGLang: outputs of layers) name different layers.")
        return "EAGLE-3, SGLang layer ids", shifted
    if top:
        return "EAGLE-3, vLLM layer ids", tuple(int(k) for k in top)
    return "EAGLE-3, no layer ids (engine default)", None


def _check_supported(foreign: Foreign, where: str) -> None:
    for d in (foreign.raw, foreign.layer):
        for key, what in UNSUPPORTED.items():
            if d.get(key):
                raise EyasError(f"{where}: {key} is set ({what}); eyas's EAGLE-3 drafter does not implement it.")
    kinds = MLA_MODEL_TYPES if foreign.attention == "mla" else ("llama",)
    if foreign.layer.get("model_type", kinds[0]) not in kinds:
        raise EyasError(f"{where}: the decoder layer's model_type is {foreign.layer['model_type']!r}; "
                        f"eyas imports {' or '.join(kinds)} layers for {foreign.raw.get('architectures')}.")
    if foreign.layer.get("num_hidden_layers", 1) != 1:
        raise EyasError(f"{where}: num_hidden_layers is {foreign.layer['num_hidden_layers']}; "
                        "eyas imports one-layer EAGLE-3 heads (it trains deeper ones with --draft-layers, but "
                        "does not read them back).")
    hidden, target_hidden = foreign.layer.get("hidden_size"), foreign.raw.get("target_hidden_size")
    if target_hidden is not None and hidden is not None and target_hidden != hidden:
        raise EyasError(f"{where}: target_hidden_size {target_hidden} differs from hidden_size {hidden}; "
                        "eyas drafters have the target's width.")


def target_identity(target: str | None, own: DraftConfig | None, foreign: Foreign, src: Path) -> ModelIdentity:
    """The target the imported drafter is for: `--target`, else the folder's own record."""
    if target is None and own is not None:
        return own.identity
    spec = target or foreign.verifier
    if spec is None:
        raise EyasError(f"{src} does not say which model it drafts for; pass --target MODEL (the model it was "
                        "trained with).")

    try:
        folder = resolve_model(spec)
        config = AutoConfig.from_pretrained(folder)
    except (OSError, ValueError) as e:
        raise EyasError(f"Cannot load the target {spec!r}: {e}. Pass --target with a local model folder.") from e
    identity = model_identity(spec, config, load_tokenizer(spec), folder)
    if own is not None:
        identity.check_same(own.identity, f"The drafter in {src}")
    return identity


def draft_config(foreign: Foreign, identity: ModelIdentity, state: dict[str, torch.Tensor], src: Path) -> DraftConfig:
    """An eyas config for a foreign drafter, checked against the target it is imported for."""
    where = f"{src}/{CONFIG}" + (" (transformer_layer_config)" if foreign.layer is not foreign.raw else "")
    layer = foreign.layer
    hidden, heads, vocab = (_field(layer, k, where) for k in ("hidden_size", "num_attention_heads", "vocab_size"))
    if (vocab, hidden) != (identity.vocab_size, identity.hidden_size):
        raise EyasError(f"{where}: the drafter is for a model with vocabulary {vocab} and width {hidden}, but "
                        f"{identity.model} has {identity.vocab_size} and {identity.hidden_size}.")
    n = identity.num_layers
    aux = tuple(sorted(foreign.aux_layer_ids)) if foreign.aux_layer_ids else default_aux_ids(n)
    if any(not 0 <= k < n for k in aux):
        raise EyasError(f"{where}: aux layer ids {list(aux)} (inputs of layers) do not exist in the {n}-layer "
                        f"{identity.model}.")
    lm_head = state.get("lm_head.weight")
    draft_vocab = foreign.raw.get("draft_vocab_size") or layer.get("draft_vocab_size")
    draft_vocab = draft_vocab or (lm_head.shape[0] if lm_head is not None else vocab)
    if foreign.attention == "mla":  # the DeepSeek layer: its sizes, all heads keyed by one latent
        sizes = {k: layer.get(k) for k in mla.MLA_FIELDS}
        attention = {"attention": "mla", "mla": sizes, "num_key_value_heads": heads,
                     "head_dim": _field(layer, "qk_rope_head_dim", where)}
    else:
        attention = {"num_key_value_heads": layer.get("num_key_value_heads") or heads,
                     "head_dim": layer.get("head_dim") or hidden // heads}
    return DraftConfig(
        hidden_size=hidden, intermediate_size=_field(layer, "intermediate_size", where),
        num_attention_heads=heads, **attention, vocab_size=vocab, draft_vocab_size=draft_vocab,
        aux_layer_ids=aux, label_layer_id=n, target=identity.to_dict(),
        rms_norm_eps=layer.get("rms_norm_eps", 1e-6), rope_parameters=rope_parameters(layer),
        max_position_embeddings=layer.get("max_position_embeddings", 8192), hidden_act=layer.get("hidden_act", "silu"),
        norm_before_residual=foreign.norm_before_residual, **foreign.options,
        **({"ttt_steps": foreign.depth} if foreign.depth else {}),
    )


def rope_parameters(layer: dict[str, Any]) -> dict[str, Any]:
    """transformers 5's `rope_parameters`, or the legacy `rope_theta` + `rope_scaling` pair."""
    if layer.get("rope_parameters"):
        return {"rope_type": "default", **layer["rope_parameters"]}
    scaling = dict(layer.get("rope_scaling") or {})
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    return {**scaling, "rope_type": rope_type, "rope_theta": float(layer.get("rope_theta", 10000.0))}


def check_agrees(own: DraftConfig, foreign: Foreign, src: Path) -> None:
    """An eyas export's engine-visible fields must say what its `eyas` block says."""
    seen = {
        "aux layer ids": (foreign.aux_layer_ids, own.aux_layer_ids),
        "norm_before_residual": (foreign.norm_before_residual, own.norm_before_residual),
        **{option: (value, getattr(own, option)) for option, value in foreign.options.items()},
        "draft_vocab_size": (foreign.raw.get("draft_vocab_size"), own.draft_vocab_size),
        "hidden_size": (foreign.layer.get("hidden_size"), own.hidden_size),
    }
    for name, (engine, recorded) in seen.items():
        if engine is not None and engine != recorded:
            raise EyasError(f"{src}/{CONFIG}: {name} {engine} disagrees with its eyas block ({recorded}); "
                            "the file was edited after export.")


def _eyas_name(name: str) -> str:
    return EYAS_PREFIX + name.removeprefix(SPECULATORS_PREFIX) if name.startswith(SPECULATORS_PREFIX) else name


def vocab_tables(state: dict[str, torch.Tensor], cfg: DraftConfig, src: Path) -> dict[str, torch.Tensor]:
    """`d2t` (offsets) and `t2d` (mask) as eyas stores them, checked against each other."""
    vd, v = cfg.draft_vocab_size, cfg.vocab_size
    d2t = state.get("d2t")
    if d2t is None:
        if vd != v:
            raise EyasError(f"{src}: the draft vocabulary has {vd} of the target's {v} tokens but the weights have "
                            "no d2t (the draft-to-target table).")
        d2t = torch.zeros(vd, dtype=torch.int64)
    if d2t.shape != (vd,):
        raise EyasError(f"{src}: d2t has shape {list(d2t.shape)}, not [{vd}] (draft_vocab_size).")
    target_ids = torch.arange(vd) + d2t.long()
    if target_ids.min() < 0 or target_ids.max() >= v or len(target_ids.unique()) != vd:
        raise EyasError(f"{src}: d2t maps draft ids outside the target vocabulary or onto the same token twice.")
    t2d = torch.zeros(v, dtype=torch.bool)
    t2d[target_ids] = True
    given = state.get("t2d")
    if given is not None and (given.shape != t2d.shape or not torch.equal(given.bool(), t2d)):
        raise EyasError(f"{src}: t2d does not mark exactly the target tokens that d2t maps to.")
    return {"d2t": d2t.long(), "t2d": t2d}


def check_embeddings(embed: torch.Tensor, target: str, src: Path) -> None:
    """A drafter may ship a copy of the target's input embeddings (vLLM then shares the target's);
    eyas always uses the target's, so a different table would make every score untrue."""
    reference = load_target_head(resolve_model(target)).embed_weight  # [V, H] float32
    # Equal up to one bfloat16 rounding (relative 2^-7): a copy of the table in any dtype passes,
    # a different (e.g. trained) table does not.
    if embed.shape != reference.shape or not torch.allclose(embed.float(), reference, rtol=2**-7, atol=0):
        raise EyasError(f"{src}: the drafter's embed_tokens differ from {target}'s input embeddings; eyas drafters "
                        "use the target's embeddings, so this drafter cannot be imported faithfully.")
