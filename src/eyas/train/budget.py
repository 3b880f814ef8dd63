"""Sizing a training run to a time budget (`eyas train --minutes`).

A probe measured before the run is the wrong clock: the first steps of a run pay for
compilation, cold caches and allocator warm-up, so on a cold compile cache a probe once
measured 1.79 s/step instead of ~0.55 and planned 205 steps instead of ~740. Instead, the
run plans from its own steady-state rate: the median duration of its recent steps, the first
`SETTLE` steps left out, plus the held-out passes and checkpoints still to come, as measured.
The plan is revised as the rate changes, so the learning-rate schedule (which depends on the
total) reaches its end inside the budget. Until the steady state shows, the schedule keeps
the length it started with: a plan made from a compiling step would cut the warm-up short and
run those steps near the peak learning rate. So the steps of a cold start see the same
learning rates as a warm start's, and the cold start costs only the seconds it spent.

Compilation does not end with the first steps. On a cold cache a batch of a shape not seen
yet recompiles, and the first held-out pass compiles its own graph: on one H200, a 1-minute
run planned 52 steps at 0.37 s/step, met such stalls, and reached its deadline at step 18 of
28 with the schedule unfinished and the final held-out pass 12 s late. So the plan keeps in
reserve the seconds that recent steps ran over the steady rate: stalls that have just
happened predict more (as many again, or as often again, whichever leaves more steps), and a
run whose stalls have stopped sheds the reserve within `RECENT` steps. The trainer runs the
first held-out pass as soon as the steady state shows, when the plan can still absorb its
compilation.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque

clock = time.monotonic  # the budget's clock (tests drive it)

SETTLE = 2  # steps left out of the rate: compilation and warm-up
STEADY = 3  # steady steps measured before the first plan
WINDOW = 9  # recent steps whose median is the rate: long enough to ignore a stray slow step,
            # short enough to follow a lasting change within a few steps
RECENT = 3 * WINDOW  # steps whose time over the steady rate is kept in reserve
MARGIN = 0.03  # share of the budget kept free: the final save and the jitter of the last steps


class Budget:
    """The step count that fits the time left, from steady-state step times."""

    def __init__(self, minutes: float, started: float, cap: int | None):
        self.deadline = started + 60 * minutes
        self.margin = 60 * minutes * MARGIN
        self.cap = cap  # --steps / --epochs, when given, bound the plan
        self.early: list[float] = []  # the first SETTLE steps
        self.steps: deque[float] = deque(maxlen=WINDOW)  # the steady state's recent steps
        self.recent: deque[float] = deque(maxlen=RECENT)  # a longer view, for the stalls among them
        self.eval_s: float | None = None  # the last held-out pass after the first (which compiles)
        self.evaluated = False  # the first held-out pass has run
        self.save_s = 0.0  # the last intermediate checkpoint
        self.logged = False  # a steady-state plan was announced

    def step_took(self, seconds: float) -> None:
        if len(self.early) < SETTLE:
            self.early.append(seconds)
        else:
            self.steps.append(seconds)
            self.recent.append(seconds)

    def restart(self) -> None:
        """Measure the rate afresh (the steps changed their cost), keeping the held-out and save costs."""
        self.early.clear()
        self.steps.clear()
        self.recent.clear()

    @property
    def steady(self) -> bool:
        return len(self.steps) >= STEADY

    @property
    def step_s(self) -> float:
        """Seconds per step in the steady state (once `steady`)."""
        return statistics.median(self.steps)

    @property
    def reserve(self) -> float:
        """Seconds that the recent steady-state steps took over the rate (recompiles and other
        stalls), kept free in case as many come again."""
        rate = self.step_s
        return sum(t - rate for t in self.recent if t > rate)

    def plan(self, step: int, step_s: float, eval_every: int, save_every: int, eval_guess: float) -> int | None:
        """The total step count that ends the schedule before the deadline, from `step` on
        (None when not one more step fits).

        `step_s` is the (all-process) steady-state rate; held-out passes cost their measured
        time (`eval_guess` until one has run) every `eval_every` steps and once at the end."""
        eval_s = self.eval_s if self.eval_s is not None else eval_guess
        per_step = step_s + eval_s / eval_every + self.save_s / save_every
        left = self.deadline - clock() - self.margin - eval_s
        if left < per_step:  # spent: the run stops at the deadline, and --resume finishes the plan as it stands
            return None
        # Recent stalls come again: once more at most (a long run), or at their recent rate (a run
        # whose rest is shorter than the recent steps); the smaller of the two reserves.
        stalls = self.reserve
        fit = max(math.floor((left - stalls) / per_step),
                  math.floor(left / (per_step + stalls / max(len(self.recent), 1))))
        if fit < 1:
            return None
        total = step + fit
        return min(total, self.cap) if self.cap else total


# The budget rule: the TTT depth an EAGLE-3 run trains at when --ttt-steps leaves it open. A step's
# cost follows its depth, so on a short budget a shallower drafter takes more updates, and early in
# training the number of updates matters more than the depth trained. Measured with SmolLM2-135M on
# one H200 (docs/train.md; padded tokens, about 0.87 of them real):
#   1.5 min, 1.94 M tokens of data (bench/results/peers_quality_h200.json), held-out step 0 / 6:
#     65,536-token steps, depth 7:   193 steps = 12.6 M tokens: 0.470 / 0.415
#      8,192-token steps, depth 7:   839 steps =  6.9 M tokens: 0.619 / 0.570
#      8,192-token steps, depth 3: 1,887 steps = 15.5 M tokens: 0.791 / 0.725 (drafting past its depth)
#   7.5 min, the recipe's 40,903 conversations (recipe_smollm2_h200.json, issue 38's re-run):
#     65,536-token steps, depth 7: 619-691 steps = 40.6-45.3 M tokens: 0.760-0.772 / 0.731-0.746,
#       MT-bench chain tau 3.13; 8,192-token steps at depth 3: 0.780 / 0.720, chain 3.12: no gain.
# So a run that fits fewer tokens at depth 7 than about halfway (on a log scale) between the short
# runs' 12.6 M and the recipe's 40.6 M trains at depth 3; a longer one keeps its depth, where the
# deep steps' accuracy is what depth buys. Tokens per step are not the rule's: its default (8,192)
# is already the short budgets' best, and at 7.5 minutes 65,536 did no better.
SHORT_RUN_TOKENS = 20_000_000  # real tokens the run trains at its starting depth
SHORT_RUN_DEPTH = 3  # speculators' default depth, and the 1.5-minute winner above


def rule_depth(tokens: float, depth: int) -> int:
    """The depth a --minutes run trains at, from the real `tokens` it fits at `depth` (its starting one)."""
    return depth if depth <= SHORT_RUN_DEPTH or tokens >= SHORT_RUN_TOKENS else SHORT_RUN_DEPTH


def depth_choice(steps: int, tokens_per_step: float, depth: int, step_s: float, minutes: float,
                 capped: bool) -> tuple[int, str]:
    """(depth, why): the budget rule applied to a run whose steady state fits `steps` steps of
    `tokens_per_step` real tokens at `depth`, `step_s` seconds each, in --minutes `minutes`;
    `capped` when --steps/--epochs end it first (faster steps then buy no updates)."""
    tokens = steps * tokens_per_step
    fits = (f"at {step_s:.3g} s/step, {steps:,} steps of ~{tokens_per_step:,.0f} tokens = {tokens / 1e6:.1f} M "
            f"tokens at {depth} TTT steps")
    if capped:
        return depth, f"{fits}, as many as --steps/--epochs allow: keeping {depth} TTT steps"
    picked = rule_depth(tokens, depth)
    if picked == depth:
        return depth, (f"{fits} fit --minutes {minutes:g}, at least the {SHORT_RUN_TOKENS / 1e6:.0f} M below "
                       f"which a shallower drafter trained better: keeping {depth} TTT steps")
    return picked, (f"{fits} fit --minutes {minutes:g}, fewer than {SHORT_RUN_TOKENS / 1e6:.0f} M: training "
                    f"{picked} TTT steps instead, each step cheaper, so more of them (on a 1.5-minute budget "
                    f"this took held-out step-0 accuracy from 0.62 to 0.79; docs/train.md). The drafter is "
                    f"served drafting {picked} tokens; --ttt-steps N chooses the depth yourself")
