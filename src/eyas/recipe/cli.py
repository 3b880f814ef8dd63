"""Run the whole pipeline from a recipe: prepare -> regenerate -> train (online, or capture +
offline) -> eval (held-out accuracy per TTT step; chain and tree against prompt lookup) ->
export, ending with WORK/report.md.

A recipe is YAML: `model`, `work` (the folder for every stage's output) and one mapping per
stage whose keys are that stage command's own options (see eyas prepare --help, ...). Each
stage's output is its checkpoint: after a crash or Ctrl-C, run the same command again and it
continues where it stopped; finished stages are skipped, never silently redone.

examples:
  eyas recipe recipes/smollm2-1gpu.yaml --dry-run     # stages, estimates, what is done
  eyas recipe recipes/smollm2-1gpu.yaml
  eyas recipe recipes/tiny-cpu.yaml --work /tmp/demo
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from eyas.options import option

HELP = "the whole pipeline from a recipe file, resumable, ending with a report"
ON_INTERRUPT = "interrupted; run the same command again to continue where it stopped."


@dataclass(kw_only=True)
class RecipeConfig:
    recipe: str = option("the recipe (YAML)", positional=True)
    work: str | None = option("folder for every stage's output (default: the recipe's `work`, else the recipe's path "
                              "without .yaml)", None)
    dry_run: bool = option("print the stages, their estimates and what is done; run nothing", False)
    stop_after: str | None = option("stop once this stage is done (e.g. regenerate, train): to split a run over "
                                    "several sessions", None, metavar="STAGE")


CONFIG = RecipeConfig  # its options (eyas.options)

def run(cfg: RecipeConfig) -> int:
    run_recipe = importlib.import_module("eyas.recipe.run").run_recipe

    run_recipe(cfg.recipe, cfg.work, dry_run=cfg.dry_run, stop_after=cfg.stop_after)
    return 0
