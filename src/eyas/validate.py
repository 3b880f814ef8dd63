"""Option rules: the accepted range of a number option, checked before any work starts.

argparse turns `--lr inf` or `--shard-mb nan` into floats without a word, and a 0 or a
negative size would be taken as something else further down. A rule names the accepted
range; `check_options` raises one line naming the option, that range and the value given.
Each stage's options carry their rules in its typed config (eyas.options); a function that
takes options as keywords checks them with `check_options(values, options.rules(Config))`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from eyas.errors import EyasError


@dataclass(frozen=True)
class Number:
    """A number option's accepted values: an integer or a finite float, within [lo, hi]
    (either end open, or absent). None (the option not given) is accepted unless `required`."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    integer: bool = False
    required: bool = False

    def describe(self) -> str:
        kind = "an integer" if self.integer else "a finite number"
        if self.lo is not None and self.hi is not None:
            left, right = "(" if self.lo_open else "[", ")" if self.hi_open else "]"
            return f"{kind} in {left}{_fmt(self.lo)}, {_fmt(self.hi)}{right}"
        if self.lo is not None:
            return f"{kind} {'>' if self.lo_open else '>='} {_fmt(self.lo)}"
        if self.hi is not None:
            return f"{kind} {'<' if self.hi_open else '<='} {_fmt(self.hi)}"
        return kind

    def accepts(self, value: Any) -> bool:
        if value is None:
            return not self.required
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        if self.integer and not (isinstance(value, int) or (math.isfinite(value) and value == int(value))):
            return False
        if not math.isfinite(value):
            return False
        if self.lo is not None and (value <= self.lo if self.lo_open else value < self.lo):
            return False
        return not (self.hi is not None and (value >= self.hi if self.hi_open else value > self.hi))

    def check(self, option: str, value: Any) -> None:
        if not self.accepts(value):
            raise EyasError(f"{option} must be {self.describe()} (got {value!r}).")


def _fmt(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


# The shapes most options take.
COUNT = Number(lo=1, integer=True)  # sizes, steps, counts: at least 1
POSITIVE = Number(lo=0, lo_open=True)  # rates, budgets in minutes or MiB
NON_NEGATIVE = Number(lo=0)  # temperatures, decays of zero
SHARE = Number(lo=0, hi=1, hi_open=True)  # a fraction that leaves something over


def option_name(name: str) -> str:
    """`batch_tokens` -> `--batch-tokens`."""
    return "--" + name.replace("_", "-")


def check_options(values: Mapping[str, Any] | Any, rules: Mapping[str, Number]) -> None:
    """Check every option named in `rules` (a dict, a dataclass or an argparse namespace)."""
    for name, rule in rules.items():
        value = values.get(name) if isinstance(values, Mapping) else getattr(values, name, None)
        rule.check(option_name(name), value)
