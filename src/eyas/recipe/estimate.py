"""`eyas recipe --dry-run`: the plan, with what each stage is bounded to and what is done.

Only figures the recipe fixes, or the finished stages show, are given: sizes from the
prepared (or regenerated) data once that stage is done, else upper bounds from `limit` and
`max_len`; time where a stage has `minutes`; the store's disk from its tokens, dtype and the
target's hidden size. The rest depends on the data and the machine, and says so.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eyas.data.prepared import PreparedData
from eyas.errors import EyasError
from eyas.options import AUTO_LAYERS, aux_layer_count, snake_keys

MIB = 2**20
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8": 1}


@dataclass
class Data:
    """What the linked data holds: measured (a finished stage's output) or an upper bound."""
    samples: int | None
    tokens: int | None
    measured: bool
    hidden_size: int | None = None

    def __str__(self) -> str:
        if self.samples is None:
            return "every record (no `limit`: sizes follow the data)"
        bound = "" if self.measured else "<= "
        return f"{bound}{self.samples:,} samples, {bound}{self.tokens:,} tokens"


def _done(stage, state) -> bool:
    """Done with this command and its output still there: a lost output is redone by the run."""
    return state.done.get(stage.name) == stage.line and stage.output.exists()


def _status(stage, state, lost_from: str | None) -> str:
    """`lost_from`: the lost stage this one was built from, if any (see run.built_from_lost)."""
    if state.lost(stage):
        return f"to do again: it was done, but its output {stage.output} is gone"
    if lost_from is not None and stage.output.exists():
        return (f"STOPS: made from the {lost_from} stage's lost output; the run asks to remove {stage.output} "
                f"first")
    try:
        if state.check(stage):
            return "done"
    except EyasError:
        return "DONE WITH OTHER OPTIONS (the run will stop there: see the message it gives)"
    return "partial: continues from its output" if stage.output.exists() else "to do"


def _options(recipe: dict[str, Any], key: str) -> dict[str, Any]:
    return snake_keys(recipe.get(key) or {})


def _data(stages, state, recipe: dict[str, Any], names: tuple[str, ...], lost: dict[str, str]) -> Data:
    """The output of the first of the stages `names` that is done (and not built from a lost
    output, which the run redoes), else bounds from the recipe."""
    for name in names:
        stage = next((s for s in stages if s.name == name), None)
        if stage is not None and _done(stage, state) and name not in lost:
            data = PreparedData(stage.output)
            return Data(len(data), int(data.offsets[-1]), True, data.identity.hidden_size)
    prep = _options(recipe, "prepare")
    limit = prep.get("limit")
    return Data(limit, limit * prep.get("max_len", 2048) if limit else None, False, _hidden_size(recipe["model"]))


def _hidden_size(model: str) -> int | None:
    """The target's hidden size when `model` is a folder with a config.json (read as JSON: a
    plan loads nothing), else None."""
    try:
        config = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    text = config.get("text_config") or config  # vision-language wrappers nest the text model's config
    return text.get("hidden_size") if isinstance(text, dict) else None


def _store(recipe: dict[str, Any], data: Data) -> str:
    capture = _options(recipe, "capture")
    dtype = capture.get("dtype", "bf16")
    layers = capture.get("layers", AUTO_LAYERS)
    states = (aux_layer_count(layers) or 3) + 1  # the aux ids and the label state
    per_value = DTYPE_BYTES.get(dtype, 2)
    fixed = 5 + (4 * states if dtype == "fp8" else 0)  # token id and mask; fp8's float32 scale per state
    if data.hidden_size is None:
        return (f"{dtype} store: {states} states x hidden size x {per_value} B + {fixed} B per token "
                f"({data})")
    per_token = states * data.hidden_size * per_value + fixed
    size = f", {'' if data.measured else '<= '}{data.tokens * per_token / MIB:,.0f} MiB" if data.tokens else ""
    return f"{dtype} store: {per_token:,} B per token{size} ({data})"


def _estimate(stage, recipe: dict[str, Any], prepared: Data, data: Data) -> str:
    """`prepared`: what prepare made (or bounds); `data`: what training reads (regenerated or prepared)."""
    opts = snake_keys(stage.options)  # the stage's own: the onpolicy stage runs train with other minutes
    minutes = f"<= {opts['minutes']} min" if opts.get("minutes") else "grows with the data (no `minutes` bound)"
    if stage.name == "prepare":
        disk = f"{'' if prepared.measured else '<= '}{prepared.tokens * 5 / MIB:,.1f} MiB" if prepared.tokens else \
            "~5 B per token"
        return f"{prepared}; disk {disk}; ~1 ms per rendered turn per worker"
    if stage.name == "regenerate":
        return f"{prepared} in, answers up to max_new_tokens each; {minutes}"
    if stage.name == "capture":
        return _store(recipe, data)
    if stage.name in ("train", "onpolicy"):
        if opts.get("minutes"):
            return f"{opts['minutes']} min (the schedule is sized to it); drafter + checkpoints ~3x its size"
        return "steps or epochs as given (no `minutes` bound); drafter + checkpoints ~3x its size"
    if stage.name == "heldout":
        if _options(recipe, "train").get("online"):
            return "one forward pass of target and drafter over the held-out samples"
        return "one forward pass of the drafter over the held-out samples, their states read from the store"
    if stage.name.startswith("eval"):
        n = opts.get("limit") or "every"
        return f"{n} prompt(s) x methods x turns, decoding up to max_new_tokens each"
    return "seconds; one drafter's size"


def describe(recipe: dict[str, Any], stages, state, lost: dict[str, str] | None = None) -> str:
    """The plan; `lost` maps each stage built from a lost stage's output to that stage's name."""
    lost = lost or {}
    prepared = _data(stages, state, recipe, ("prepare",), lost)
    data = _data(stages, state, recipe, ("regenerate", "prepare"), lost)
    lines = [f"recipe for {recipe['model']}: {len(stages)} stages, state in {state.path}"]
    for k, stage in enumerate(stages, 1):
        lines += [f"{k:>2}. {stage.name:<14} {_status(stage, state, lost.get(stage.name))}",
                  f"      {stage.line}",
                  f"      estimate: {_estimate(stage, recipe, prepared, data)}"]
    return "\n".join(lines)
