"""Every option of `eyas export` and of `eyas import`, as typed configs: their CLIs are
generated from them and the recipe's `export:` keys are checked against ExportConfig."""

from __future__ import annotations

from dataclasses import dataclass

from eyas.export.layouts import LAYOUTS
from eyas.options import check_rules, option
from eyas.validate import COUNT


@dataclass(kw_only=True)
class ExportConfig:
    ckpt: str = option("the eyas drafter checkpoint folder (from eyas train or eyas import)", positional=True)
    to: str = option("the serving layout to write", choices=tuple(sorted(LAYOUTS)))
    out: str = option("output folder (created; must be empty unless --force)")
    dtype: str = option("cast the weights (keep: the checkpoint's dtype; engines cast at load anyway)", "keep",
                        choices=("keep", "bf16", "fp16", "fp32"))
    target: str | None = option("the target to serve, if not the one recorded in the drafter (checked to be the "
                                "same model and tokenizer)", None)
    num_speculative_tokens: int | None = option(
        "draft tokens per step in the serve command and the speculators config (default: the depth the drafter "
        "was trained to draft, its --ttt-steps, a DFlash drafter's block size - 1; the depth `eyas eval` measures "
        "by default)", None, rule=COUNT, metavar="K")
    serve_command: bool = option("only print the command that serves the target with the drafter at --out; write "
                                 "nothing", False)
    force: bool = option("replace the drafter files in a non-empty --out", False)

    def __post_init__(self) -> None:
        check_rules(self)


@dataclass(kw_only=True)
class ImportConfig:
    dir: str = option("the drafter folder (config.json + model.safetensors or pytorch_model.bin)", positional=True)
    out: str = option("the eyas checkpoint folder to write")
    target: str | None = option("the model the drafter was trained for (needed unless the folder names it)", None)
    force: bool = option("replace the drafter files in a non-empty --out", False)
