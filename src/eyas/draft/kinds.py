"""The drafter kinds eyas trains, one `Kind` record each, registered once (torchtitan's
TrainSpec habit): every stage asks the record, and no stage outside draft/ compares a kind's
name. A new kind is one `register(Kind(...))` with its module class; the stages follow.

- `eagle3` drafts its K tokens one forward pass each, so it can branch into a tree;
- `dflash` drafts a block of K in one pass of a few layers beside the target (trained on
  blocks anchored at sampled rows, train/anchors.py);
- `peagle` (EAGLE-3 with parallel drafting) drafts its K in one pass of the EAGLE-3 layer.

No torch here: DraftConfig checks itself with these records, and `eyas --help` lists them
without loading torch; the module class is imported on first use.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass, field
from typing import Any, Callable

from eyas.draft import vllm_config
from eyas.draft.mla_config import GQA, MLA
from eyas.errors import EyasError
from eyas.options import AUTO_LAYERS_DFLASH

# How a kind drafts during decoding, which decides eval's proposer (evaluate/run.py):
STEPS = "steps"  # one forward pass per token, so a chain or a tree
BLOCK = "block"  # a block of K in one pass over the committed context's cached states (DFlash)
PARALLEL = "parallel"  # K in one pass of the step-by-step layer, masked slots after the first (P-EAGLE)

FORMATS = ("vllm", "speculators", "sglang")  # the export layouts (export/layouts.py)
# The most layers `--draft-layers` takes before the target is known (then: at most the
# target's): no served target is deeper (Llama 3.1 405B has 126).
MAX_LAYERS = 256


def default_num_layers(target_layers: int) -> int:
    """DFlash's layers when none are asked for: its published heads use a few; a small target
    gets at least one and no more than a tenth of its own depth, rounded up."""
    return max(1, math.ceil(target_layers / 10))


def one_layer(target_layers: int) -> int:
    """EAGLE-3's layers when none are asked for: its published heads have one."""
    return 1


def _no_check(cfg) -> None:
    """A kind without rules of its own beyond its record's fields."""


@dataclass(frozen=True)
class Kind:
    name: str  # the `--drafter` value, and `drafter` in a DraftConfig
    title: str  # for messages: "EAGLE-3"
    summary: str  # what `--drafter NAME` trains, for --help
    module: str | type  # the torch module class, or "package.module:Class" imported on first use
    vllm_config: Callable[[Any], dict[str, Any]]  # its config.json (draft/vllm_config.py): checkpoint and export
    drafting: str = STEPS  # STEPS, BLOCK or PARALLEL
    attentions: tuple[str, ...] = (GQA, MLA)  # the layer attentions it may have
    # What `--draft-attention auto` means: None picks by the target (MLA for an MLA target);
    # else (attention, the note said when that differs from the target's own).
    auto_attention: tuple[str, str] | None = None
    deep: bool = False  # takes --draft-layers (default `default_layers`); else exactly one layer
    default_layers: Callable[[int], int] = one_layer  # a deep kind's layers for a target of N, unless asked
    mask_token: bool = False  # has a mask token marking the slots to fill (--mask-token-id)
    eagle_options: bool = True  # takes EAGLE 3.1's fc_norm / norm_output and norm_before_residual
    anchored: bool = False  # trained on blocks anchored at sampled rows (--block-size, --anchors)
    lm_head: str = "own"  # its `--lm-head` unless asked: what measured best for it (docs/train.md)
    auto_layers: str = ""  # why `--layers auto` suits it too where its peers read other layers (an online run says it)
    formats: tuple[str, ...] = FORMATS  # the export layouts written for it
    vllm_method: dict[str, Any] = field(default_factory=lambda: {"method": "eagle3"})  # vLLM --speculative-config
    check: Callable[[Any], None] = _no_check  # its own rules on a DraftConfig beyond the fields above
    check_served: Callable[[Any], None] = _no_check  # refuse a config of it that no engine serves (export)

    @property
    def drafts_blocks(self) -> bool:
        """Only a block's slots can attend causally within it (DraftConfig `causal_layers`,
        --causal-layers)."""
        return self.drafting == BLOCK

    @property
    def drafts_trees(self) -> bool:
        """Only step-by-step drafting can branch into a tree; a block is verified as a chain
        (eval refuses --tree, the recipe plans no tree stage)."""
        return self.drafting == STEPS

    def a_title(self, capital: bool = False) -> str:
        """ "an EAGLE-3", "a DFlash": the title after its article, for messages."""
        article = "an" if self.title[0] in "AEIOU" else "a"
        return f"{article.capitalize() if capital else article} {self.title}"

    def module_class(self) -> type:
        if isinstance(self.module, type):
            return self.module
        name, _, attr = self.module.partition(":")
        return getattr(importlib.import_module(name), attr)

    def check_config(self, cfg) -> None:
        """Refuse a DraftConfig of this kind holding what the kind cannot (called by DraftConfig itself)."""
        if cfg.num_hidden_layers < 1:
            raise EyasError("A drafter needs at least one layer.")
        if not self.deep and cfg.num_hidden_layers != 1:
            raise EyasError(f"{self.a_title(True)} drafter has exactly one layer.")
        if cfg.attention not in self.attentions:
            raise EyasError(f"{self.a_title(True)} drafter's layer has {' or '.join(self.attentions)} attention, "
                            f"not {cfg.attention}.")
        if self.mask_token and (cfg.mask_token_id is None or not 0 <= cfg.mask_token_id < cfg.vocab_size):
            raise EyasError(f"{self.a_title(True)} drafter needs a mask token id in 0..{cfg.vocab_size - 1}, not "
                            f"{cfg.mask_token_id}.")
        if cfg.causal_layers and not self.drafts_blocks:
            raise EyasError(f"causal_layers are a block drafter's; {self.a_title()} drafter has none.")
        if not self.eagle_options and (cfg.fc_norm or cfg.norm_output or cfg.norm_before_residual):
            raise EyasError(f"fc_norm, norm_output and norm_before_residual are EAGLE-3 options; {self.a_title()} "
                            f"drafter has none of them.")
        self.check(cfg)

    def check_format(self, name: str) -> None:
        """Refuse an export format this kind is not written in. The recipe asks before any stage runs."""
        if name in FORMATS and name not in self.formats:
            if not self.formats:
                raise EyasError(f"No engine serves {self.a_title()} drafter, so no export layout is written for it; "
                                f"it runs in eyas eval.")
            only = " or ".join(f"--to {f}" for f in self.formats)
            raise EyasError(f"{self.a_title(True)} drafter exports only {only} (no other layout is written for it).")


KINDS: dict[str, Kind] = {}
DEFAULT = "eagle3"  # the kind `eyas train` trains unless told


def register(kind: Kind) -> Kind:
    """Add a kind; its name must be new."""
    if kind.name in KINDS:
        raise EyasError(f"A drafter kind named {kind.name!r} is registered already.")
    KINDS[kind.name] = kind
    return kind


def get(name: str) -> Kind:
    try:
        return KINDS[name]
    except (KeyError, TypeError):
        raise EyasError(f"Unknown drafter kind {name!r}; choose from {', '.join(KINDS)}.") from None


def names(where: Callable[[Kind], bool] = lambda kind: True) -> str:
    """The names of the kinds `where` holds for, for messages: "dflash or peagle"."""
    return " or ".join(k.name for k in KINDS.values() if where(k))


def _eagle3_check(cfg) -> None:
    if cfg.num_hidden_layers > 1 and cfg.attention == MLA:
        raise EyasError("An MLA EAGLE-3 drafter has one layer (vLLM's Eagle3DeepseekV3ForCausalLM builds one); "
                        "train --draft-layers with --draft-attention gqa.")


def _dflash_served(cfg) -> None:
    if cfg.causal_layers:  # vLLM's qwen3_dflash.py: a sliding-window layer, or every layer (dflash_config.causal)
        raise EyasError(f"Layers {list(cfg.causal_layers)} of this DFlash drafter attend causally within the block "
                        "(speculators' sliding-window layers, or eyas train --causal-layers); eyas writes no vLLM "
                        "config that serves that (vLLM 0.32 reads it from sliding-window layers), so the drafter runs "
                        "in eyas eval only.")


def _peagle_served(cfg) -> None:
    if cfg.attention == MLA:  # deepseek_eagle3.py has no `mask_hidden`, which the proposer reads
        raise EyasError("vLLM 0.32 serves parallel drafting (P-EAGLE) only with its Llama EAGLE-3 head, not "
                        "Eagle3DeepseekV3ForCausalLM (no mask_hidden); this MLA P-EAGLE drafter runs in eyas eval "
                        "only: train with --draft-attention gqa to serve it.")


register(Kind(
    name="eagle3", title="EAGLE-3", summary="K tokens, one forward pass each (a chain or a tree)",
    module="eyas.draft.model:Eagle3Drafter", vllm_config=vllm_config.eagle3, deep=True, check=_eagle3_check))
register(Kind(
    name="dflash", title="DFlash", summary="a block of K in one pass of a few layers",
    module="eyas.draft.dflash:DFlashDrafter", vllm_config=vllm_config.dflash, drafting=BLOCK,
    attentions=(GQA,), deep=True, default_layers=default_num_layers, mask_token=True, eagle_options=False,
    anchored=True, lm_head="frozen", auto_layers=AUTO_LAYERS_DFLASH, formats=("vllm",),
    vllm_method={"method": "dflash"}, check_served=_dflash_served))
register(Kind(
    name="peagle", title="P-EAGLE", summary="EAGLE-3 drafting its K in one pass (vLLM's parallel_drafting)",
    module="eyas.draft.peagle:PEagleDrafter", vllm_config=vllm_config.peagle, drafting=PARALLEL,
    auto_attention=(GQA, "vLLM 0.32 serves parallel drafting only with its Llama EAGLE-3 head; --draft-attention "
                         "mla trains an MLA P-EAGLE drafter that eyas eval runs but no engine serves"),
    mask_token=True, formats=("vllm",), vllm_method={"method": "eagle3", "parallel_drafting": True},
    check_served=_peagle_served))
