"""The drafter kinds eyas trains, from the same store and the same objective: `eagle3` drafts
its K tokens one forward pass each, `dflash` drafts a block of K in one pass, `peagle`
(EAGLE-3 with parallel drafting) drafts its K in one pass of the EAGLE-3 layer. Here: what a
kind's config may hold and the config.json vLLM loads it with (no torch: DraftConfig checks
itself with these); its module class is built by `build.new_drafter`."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from eyas.errors import EyasError

DRAFTERS = ("eagle3", "dflash", "peagle")
# The most layers `--draft-layers` takes before the target is known (then: at most the
# target's): no served target is deeper (Llama 3.1 405B has 126).
MAX_DFLASH_LAYERS = 256


def drafts_trees(kind: str) -> bool:
    """Only EAGLE-3 drafts step by step, so only it can branch into a tree; DFlash and P-EAGLE
    propose one block in one pass, verified as a chain (eval refuses --tree, the recipe plans
    no tree stage)."""
    return kind == "eagle3"


def default_num_layers(target_layers: int) -> int:
    """A DFlash drafter's layers when none are asked for: DFlash's published heads use a few; a
    small target gets at least one and no more than a tenth of its own depth, rounded up."""
    return max(1, math.ceil(target_layers / 10))


def check_kind(cfg) -> None:
    """Refuse settings the kind cannot hold (called by DraftConfig itself)."""
    if cfg.drafter not in DRAFTERS:
        raise EyasError(f"Unknown drafter kind {cfg.drafter!r}; choose from {', '.join(DRAFTERS)}.")
    if cfg.num_hidden_layers < 1:
        raise EyasError("A drafter needs at least one layer.")
    if cfg.drafter != "dflash" and cfg.num_hidden_layers != 1:
        raise EyasError("An EAGLE-3 drafter has exactly one layer.")
    if cfg.drafter != "eagle3" and (cfg.mask_token_id is None or not 0 <= cfg.mask_token_id < cfg.vocab_size):
        name = {"dflash": "DFlash", "peagle": "P-EAGLE"}[cfg.drafter]
        raise EyasError(f"A {name} drafter needs a mask token id in 0..{cfg.vocab_size - 1}, not {cfg.mask_token_id}.")
    if cfg.drafter == "dflash":
        if cfg.fc_norm or cfg.norm_output or cfg.norm_before_residual:
            raise EyasError("fc_norm, norm_output and norm_before_residual are EAGLE-3 options; "
                            "a DFlash drafter has none of them.")


def peagle_hf_config(cfg) -> dict[str, Any]:
    """config.json of a P-EAGLE drafter: EAGLE-3's (vLLM's LlamaForCausalLMEagle3, which loads
    `mask_hidden` when served with `parallel_drafting`), plus the mask token vLLM's proposer
    writes into the parallel slots."""
    d = replace(cfg, drafter="eagle3", mask_token_id=None).to_hf_dict()
    d["eyas"] = {**d["eyas"], "drafter": "peagle", "mask_token_id": cfg.mask_token_id}
    return {**d, "mask_token_id": cfg.mask_token_id}


def hf_config(cfg) -> dict[str, Any]:
    """config.json of a DFlash drafter as vLLM 0.32 loads it (models/qwen3_dflash.py): the
    Qwen3 layer fields, `block_size`, the aux layer ids in vLLM's convention and
    `dflash_config` (mask token; `target_layer_ids` count one lower, as z-lab's heads do)."""
    d = replace(cfg, drafter="eagle3", num_hidden_layers=1, mask_token_id=None).to_hf_dict()
    for key in ("eyas", "fc_norm", "norm_output", "norm_before_residual", "num_aux_hidden_states"):
        d.pop(key)
    return {
        **d,
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "num_hidden_layers": cfg.num_hidden_layers,
        "attention_bias": False,
        "block_size": cfg.ttt_steps + 1,
        "dflash_config": {"mask_token_id": cfg.mask_token_id,
                          "target_layer_ids": [k - 1 for k in cfg.aux_layer_ids]},
    }
