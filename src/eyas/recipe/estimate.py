"""`eyas recipe --dry-run`: the plan, with what each stage is bounded to and what is done.

Only figures the recipe fixes are given: time where a stage has `minutes`, disk as an upper
bound from `limit` and `max_len`; the rest depends on the data and the machine, and says so.
"""

from __future__ import annotations

from typing import Any

from eyas.errors import EyasError


def _status(stage, state) -> str:
    try:
        if state.check(stage):
            return "done"
    except EyasError:
        return "DONE WITH OTHER OPTIONS (the run will stop there: see the message it gives)"
    return "partial: continues from its output" if stage.output.exists() else "to do"


def _estimate(stage, recipe: dict[str, Any]) -> str:
    opts = {k.replace("-", "_"): v for k, v in (recipe.get(stage.command) or {}).items()}
    prep = {k.replace("-", "_"): v for k, v in (recipe.get("prepare") or {}).items()}
    limit, max_len = prep.get("limit"), prep.get("max_len", 2048)
    if stage.name in ("prepare", "regenerate"):
        size = f"<= {limit:,} samples, <= {limit * max_len * 5 / 2**20:,.1f} MiB" if limit else "every record"
        time = f"<= {opts['minutes']} min" if opts.get("minutes") else "grows with the data (no minutes bound)"
        return f"{size}; {time}" if stage.name == "regenerate" else f"{size}; ~1 ms per rendered turn per worker"
    if stage.name == "capture":
        return ("hidden states of every token: samples x tokens x (aux layers + 1) x hidden size x 2 bytes"
                + (f", <= {limit * max_len:,} tokens" if limit else ""))
    if stage.name == "train":
        if opts.get("minutes"):
            return f"{opts['minutes']} min (the schedule is sized to it); drafter + checkpoints ~3x its size"
        return "steps or epochs as given (no minutes bound); drafter + checkpoints ~3x its size"
    if stage.name == "heldout":
        return "one forward pass of target and drafter over the held-out samples"
    if stage.name.startswith("eval"):
        n = recipe.get("eval", {}).get("limit") or "every"
        return f"{n} prompt(s) x methods x turns, decoding up to max_new_tokens each"
    return "seconds; one drafter's size"


def describe(recipe: dict[str, Any], stages, state) -> str:
    lines = [f"recipe for {recipe['model']}: {len(stages)} stages, state in {state.path}"]
    for k, stage in enumerate(stages, 1):
        lines += [f"{k:>2}. {stage.name:<14} {_status(stage, state)}", f"      {stage.line}",
                  f"      estimate: {_estimate(stage, recipe)}"]
    return "\n".join(lines)
