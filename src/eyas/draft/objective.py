"""What the training loss is made of, without torch (the CLI's options read it; draft/loss.py
computes it): the per-pair losses by name, and the record the drafter's forward takes."""

from __future__ import annotations

from dataclasses import dataclass

LOSSES = ("soft-ce", "hard-ce", "lk-hybrid", "lk-alpha")  # draft/loss.py's module docstring defines them


@dataclass(frozen=True)
class Objective:
    """What a scored pair's loss is (`LOSSES`, eta for lk-hybrid) and, with `dpace_alpha`, that
    each pair is further weighted by its D-PACE weight (draft/loss.py `dpace_weights`); with
    `on_policy`, that only the pairs greedy decoding with the drafter reaches count
    (draft/reach.py)."""
    loss: str = "soft-ce"
    lk_eta: float = 3.0
    dpace_alpha: float | None = None
    on_policy: bool = False

    def __post_init__(self) -> None:
        if self.loss not in LOSSES:
            raise ValueError(f"unknown loss {self.loss!r}: one of {', '.join(LOSSES)}")
