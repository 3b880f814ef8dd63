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

import argparse
import importlib

HELP = "the whole pipeline from a recipe file, resumable, ending with a report"
ON_INTERRUPT = "interrupted; run the same command again to continue where it stopped."


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipe", help="the recipe (YAML)")
    p.add_argument("--work", help="folder for every stage's output (default: the recipe's `work`, else the "
                   "recipe's path without .yaml)")
    p.add_argument("--dry-run", action="store_true", help="print the stages, their estimates and what is done; "
                   "run nothing")
    p.add_argument("--stop-after", metavar="STAGE", help="stop once this stage is done (e.g. regenerate, train): "
                   "to split a run over several sessions")


def run(args: argparse.Namespace) -> int:
    run_recipe = importlib.import_module("eyas.recipe.run").run_recipe  # loaded to run, never for --help
    run_recipe(args.recipe, args.work, dry_run=args.dry_run, stop_after=args.stop_after)
    return 0
