"""Read EAGLE-3 and DFlash drafters trained elsewhere into an eyas checkpoint, so `eyas eval` can score them.

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
- speculators DFlash (`speculators_model_type: dflash`, its `DFlashDraftModel`): Qwen3 (or Llama)
  layers in `transformer_layer_config` (read through transformers' config class, as the peer
  reads them), `block_size` (depth block_size - 1), `mask_token_id`, `aux_hidden_state_layer_ids`
  (eyas's convention already, ascending); weights under eyas's own names (`layers.i.*`, `fc`,
  `hidden_norm`, `norm`, `lm_head`, `d2t`, `t2d`), where a full-vocabulary drafter saves no
  `lm_head` (the target's is used). Refused: `sample_from_anchor` (slot 0 drafts too). Its
  sliding-window layers attend causally within the block unless `sliding_window_non_causal`:
  they become eyas's `causal_layers`, exactly.
- eyas's own exports (an `eyas` block): restored exactly, the engine-visible fields checked
  against it.
- MLA heads (vLLM's `Eagle3DeepseekV3ForCausalLM`, SGLang's `Eagle3DeepseekV2ForCausalLM`,
  e.g. Kimi-K2.5 EAGLE-3 MLA drafters): the same, with a DeepSeek layer whose sizes are
  read from `q_lora_rank`, `kv_lora_rank`, `qk_nope_head_dim`, `qk_rope_head_dim`, `v_head_dim`.
In every layout the options `fc_norm` (weights `fc_norm.{i}.weight`), `norm_output` and
`norm_before_fc` (weight `input_norm.weight`; speculators' default) are read where vLLM reads
them: at the top level of config.json. A speculators layer's sliding window (its default, 2048)
is reported, not applied: eyas's drafter attends to the whole context, the same at any context
up to the window (DFlash: a block drafted after at most that many tokens).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig

from eyas.draft import kinds, mla_config as mla
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
from eyas.validate import COUNT, Number

LLAMA_EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "LlamaForCausalLM")
MLA_MODEL_TYPES = ("deepseek_v3", "deepseek_v2", "kimi_k2")
DFLASH_MODEL_TYPES = ("qwen3", "llama")  # speculators' --draft-arch; its DFlash layer is Qwen3's either way
SLIDING = "sliding_attention"  # a layer type of transformers' layer_types
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
    drafter: str = kinds.DEFAULT  # the eyas kind it becomes
    kind_fields: dict[str, Any] = field(default_factory=dict)  # DraftConfig fields of that kind (DFlash's)
    layer_prefix: str | None = SPECULATORS_PREFIX  # its name for eyas's EAGLE-3 `midlayer.`; None: eyas's names
    shared_lm_head: bool = False  # saves no lm_head when its vocabulary is the target's (it uses the target's)

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
    state = {_eyas_name(k, foreign.layer_prefix): v for k, v in read_tensors(src).items()
             if not k.startswith(IGNORED_PREFIXES)}
    cfg = own or draft_config(foreign, identity, state, src)
    if own is not None:
        check_agrees(own, foreign, src)
    reference = target or foreign.verifier or cfg.identity.model
    embed = state.pop("embed_tokens.weight", None)
    if embed is not None:
        check_embeddings(embed, reference, src)
    shared_head = foreign.shared_lm_head and "lm_head.weight" not in state and cfg.draft_vocab_size == cfg.vocab_size
    if shared_head:
        state["lm_head.weight"] = load_target_head(resolve_model(reference)).lm_head_weight
    state.update(vocab_tables(state, cfg, src))
    model = build_drafter(cfg, state, str(src))
    with owned_out(out, force, src, "import"):
        save_drafter(model, out)
    summary = {
        "layout": foreign.layout, "out": str(out), "target": cfg.identity.model,
        "aux_layer_ids": list(cfg.aux_layer_ids), "draft_vocab_size": cfg.draft_vocab_size, "depth": cfg.depth,
        "embed_tokens": "equal to the target's, dropped" if embed is not None else "absent (the target's are used)",
        "drafter": cfg.drafter, **{k: list(v) if isinstance(v, tuple) else v for k, v in foreign.kind_fields.items()},
        **({"lm_head": "absent (full vocabulary): the target's"} if shared_head else {}),
    }
    window = foreign.layer.get("sliding_window")
    if window and SLIDING in (foreign.layer.get("layer_types") or [SLIDING]):
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
        foreign = _speculators(raw, where)
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


def _speculators(raw: dict[str, Any], where: str) -> Foreign:
    """A folder speculators saved: its EAGLE-3 head or its DFlash drafter."""
    model_type = raw["speculators_model_type"]
    if model_type not in SPECULATORS_READERS:
        raise EyasError(f"{where}: speculators_model_type is {model_type!r}; eyas imports only "
                        f"{' and '.join(map(repr, SPECULATORS_READERS))} speculators.")
    layer = _field(raw, "transformer_layer_config", where)
    verifier = ((raw.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
    return SPECULATORS_READERS[model_type](raw, layer, verifier, where)


def _speculators_eagle3(raw: dict[str, Any], layer: Any, verifier: str | None, where: str) -> Foreign:
    nbr = _field(raw, "norm_before_residual", where,
                 " (vLLM assumes true when it is absent, the speculators library false)")
    ids = raw.get("eagle_aux_hidden_state_layer_ids")
    return Foreign("speculators", raw, layer, tuple(ids) if ids else None, bool(nbr), verifier,
                   _speculative_tokens(raw, where))


def _speculators_dflash(raw: dict[str, Any], layer: Any, verifier: str | None, where: str) -> Foreign:
    """speculators' DFlashDraftModel as eyas's DFlash drafter (module docstring): its block,
    mask token, aux ids and layers; its sliding-window layers' causal blocks as `causal_layers`."""
    if raw.get("sample_from_anchor"):
        raise EyasError(f"{where}: sample_from_anchor is true (slot 0 drafts a token too); eyas's DFlash drafts only "
                        "the slots after the last token, so it cannot run this drafter.")
    block = _field(raw, "block_size", where)
    COUNT.check(f"{where}: `block_size`", block)
    if block < 2:
        raise EyasError(f"{where}: block_size is {block}; a DFlash block holds the last token and at least one "
                        "token to draft (block_size >= 2).")
    mask = _field(raw, "mask_token_id", where, " (the token whose embedding fills the slots to draft)")
    Number(lo=0, integer=True, required=True).check(f"{where}: `mask_token_id`", mask)
    ids = _check_ids(_field(raw, "aux_hidden_state_layer_ids", where), "aux_hidden_state_layer_ids", where)
    if not ids or ids != sorted(set(ids)):
        raise EyasError(f"{where}: aux_hidden_state_layer_ids {ids} are not distinct ascending layer ids; eyas feeds "
                        "fc the aux states in ascending layer order.")
    layer = _peer_layer(layer, where)
    sliding = [i for i, kind in enumerate(layer.get("layer_types") or []) if kind == SLIDING]
    causal = () if raw.get("sliding_window_non_causal") else tuple(sliding)
    fields = {"mask_token_id": mask, "num_hidden_layers": layer.get("num_hidden_layers", 1), "causal_layers": causal}
    return Foreign("speculators DFlash", raw, layer, tuple(ids), False, verifier, block - 1, "dflash", fields,
                   layer_prefix=None, shared_lm_head=True)


# speculators_model_type -> the reader of that layout (the peer's names, not eyas's kinds).
SPECULATORS_READERS = {"eagle3": _speculators_eagle3, "dflash": _speculators_dflash}


def _peer_layer(layer: Any, where: str) -> dict[str, Any]:
    """The DFlash layer's fields as the peer reads them: through transformers' config class of its
    model_type (Qwen3 without one), which fills in what the file leaves out (e.g. Qwen3's
    layer_types, from use_sliding_window and max_window_layers). Another model_type is left as
    it is, for `_check_supported` to refuse."""
    if not isinstance(layer, dict):
        raise EyasError(f"{where}: the decoder layer's config is not a JSON object.")
    model_type = layer.get("model_type", DFLASH_MODEL_TYPES[0])
    if model_type not in DFLASH_MODEL_TYPES:
        return layer
    try:
        return type(AutoConfig.for_model(model_type))(**layer).to_dict()
    except (TypeError, ValueError) as e:
        raise EyasError(f"{where}: transformer_layer_config is not a {model_type} config transformers reads "
                        f"({(str(e).splitlines() or [''])[0][:200]}).") from None


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
        if ids is not None:
            _check_ids(ids, "eagle_aux_hidden_state_layer_ids", where)
    if sglang:
        shifted = tuple(int(k) + 1 for k in sglang)
        if top and tuple(top) != shifted:
            raise EyasError(f"{where}: top-level eagle_aux_hidden_state_layer_ids {list(top)} (vLLM: inputs of layers) "
                            f"and eagle_config's {list(sglang)} (SGLang: outputs of layers) name different layers.")
        return "EAGLE-3, SGLang layer ids", shifted
    if top:
        return "EAGLE-3, vLLM layer ids", tuple(int(k) for k in top)
    return "EAGLE-3, no layer ids (engine default)", None


def _check_ids(ids: Any, key: str, where: str) -> list[int]:
    """`ids` if it is a list of layer ids (integers >= 0); else one line naming `key`."""
    if not isinstance(ids, list) or not all(isinstance(k, int) and not isinstance(k, bool) and k >= 0 for k in ids):
        raise EyasError(f"{where}: {key} {ids!r} is not a list of layer ids (integers >= 0).")
    return ids


def _check_supported(foreign: Foreign, where: str) -> None:
    kind = kinds.get(foreign.drafter)
    for d in (foreign.raw, foreign.layer):
        for key, what in UNSUPPORTED.items():
            if d.get(key):
                raise EyasError(f"{where}: {key} is set ({what}); eyas's {kind.title} drafter does not implement it.")
    types = DFLASH_MODEL_TYPES if kind.drafting == kinds.BLOCK else (
        MLA_MODEL_TYPES if foreign.attention == "mla" else ("llama",))
    if foreign.layer.get("model_type", types[0]) not in types:
        raise EyasError(f"{where}: the decoder layer's model_type is {foreign.layer['model_type']!r}; "
                        f"eyas imports {' or '.join(types)} layers for {foreign.raw.get('architectures')}.")
    if kind.drafting == kinds.STEPS and foreign.layer.get("num_hidden_layers", 1) != 1:
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
        **({"ttt_steps": foreign.depth} if foreign.depth else {}), drafter=foreign.drafter, **foreign.kind_fields,
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


def _eyas_name(name: str, layer_prefix: str | None) -> str:
    """eyas's name of a foreign tensor: its EAGLE-3 layer under `midlayer.`."""
    return EYAS_PREFIX + name.removeprefix(layer_prefix) if layer_prefix and name.startswith(layer_prefix) else name


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
