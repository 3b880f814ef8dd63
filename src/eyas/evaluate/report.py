"""Numbers from recorded generations: acceptance length, per-position acceptance, speed.

Every figure is recomputed from the per-step accept counts and timings kept in the
results file, so anyone can check the table against `results.json`.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

TAU_DEFINITION = "tau = 1 + accepted draft tokens per verification step (mean over all steps of all prompts)"
RATE_DEFINITION = ("acceptance at position j = share of verification steps that accepted at least j drafted "
                   "tokens (so tau = 1 + the sum over j)")
SAME_DEFINITION = "= plain: answers equal, token for token, to plain decoding's answer to the same turn (T=0 only)"


@dataclass
class Summary:
    method: str
    answers: int  # generations (a prompt's turns count separately)
    steps: int  # verification steps
    tokens: int  # generated tokens
    seconds: float
    tau: float
    acceptance: list[float]  # per draft position 1..P
    tokens_per_s: float
    speedup: float | None  # over plain decoding; None without a plain run
    identical: int | None = None  # answers equal, token for token, to plain decoding's (T=0 only)

    def to_dict(self) -> dict:
        return asdict(self)


def acceptance_rates(counts: list[int], positions: int) -> list[float]:
    steps = max(len(counts), 1)
    return [sum(c >= j for c in counts) / steps for j in range(1, positions + 1)]


def summarize(records: list[dict], positions: dict[str, int], reference: str = "plain",
              greedy: bool = True) -> dict[str, Summary]:
    """records: dicts with method, generated_ids, accept_counts, seconds (as in results.json), and
    prompt_id and turn for the `identical` count, which only greedy decoding (T=0) promises."""
    by_method: dict[str, list[dict]] = {}
    for r in records:
        by_method.setdefault(r["method"], []).append(r)
    out = {}
    for method, rs in by_method.items():
        counts = [c for r in rs for c in r["accept_counts"]]
        tokens = sum(len(r["generated_ids"]) for r in rs)
        seconds = sum(r["seconds"] for r in rs)
        width = max([positions.get(method, 0), *counts], default=0)
        out[method] = Summary(
            method=method, answers=len(rs), steps=len(counts), tokens=tokens, seconds=seconds,
            tau=1 + sum(counts) / max(len(counts), 1), acceptance=acceptance_rates(counts, width),
            tokens_per_s=tokens / seconds if seconds > 0 else 0.0, speedup=None,
        )
    if reference in out and out[reference].tokens_per_s > 0:
        for s in out.values():
            s.speedup = s.tokens_per_s / out[reference].tokens_per_s
    if greedy and reference in by_method and all("prompt_id" in r for r in records):
        answer = {(r["prompt_id"], r.get("turn")): r["generated_ids"] for r in by_method[reference]}
        for method, rs in by_method.items():
            if method != reference:
                out[method].identical = sum(answer.get((r["prompt_id"], r.get("turn"))) == r["generated_ids"]
                                            for r in rs)
    return out


def differing(summaries: dict[str, Summary]) -> list[str]:
    """One line per method with answers that differ from plain decoding's: at T=0 a lossless
    method has none, so each line is a fault the user must see (or a near-tie flipped by rounding)."""
    return [f"{s.answers - s.identical} of {s.answers} {s.method} answers differ from plain decoding's"
            for s in summaries.values() if s.identical is not None and s.identical < s.answers]


def low_precision_note(dtype: str) -> str:
    """Why answers can differ below float32: a verification pass scores several rows at once, and
    its matrix products round otherwise than plain decoding's one-row pass, so a near-tie between
    two tokens can go the other way (on one H100, DFlash's 8-row passes in bfloat16 changed 4 of 10
    MT-bench answers with each of two drafters, 1,610 tokens both times; in float32 none)."""
    if dtype == "float32":
        return ""
    return (f"; in {dtype} a verification pass over several rows can round the target's logits otherwise than "
            f"plain decoding's one-row pass and turn a near-tie, so --dtype float32 (the default) is the check")


def format_table(summaries: dict[str, Summary], max_positions: int = 8) -> str:
    width = min(max([len(s.acceptance) for s in summaries.values()], default=0), max_positions)
    head = f"{'method':<15}{'tau':>6}{'tok/s':>9}{'speed-up':>10}{'steps':>8}{'tokens':>8}{'= plain':>9}  " + "".join(
        f"{'acc@' + str(j):>7}" for j in range(1, width + 1))
    lines = [TAU_DEFINITION, RATE_DEFINITION, "", head]
    for s in summaries.values():
        speed = f"{s.speedup:.2f}x" if s.speedup is not None else "-"
        same = f"{s.identical}/{s.answers}" if s.identical is not None else "-"
        rates = "".join(f"{r:>7.2f}" for r in s.acceptance[:width])
        lines.append(f"{s.method:<15}{s.tau:>6.2f}{s.tokens_per_s:>9.1f}{speed:>10}{s.steps:>8}{s.tokens:>8}{same:>9}  "
                     f"{rates}")
    if any(s.identical is not None for s in summaries.values()):
        lines.append(SAME_DEFINITION)
    return "\n".join(lines)


def tau_by(records: list[dict], key: str) -> dict[str, dict[str, float]]:
    """{method: {value of `key` (category, turn): tau over those records' steps}}."""
    counts: dict[str, dict[str, list[int]]] = {}
    for r in records:
        counts.setdefault(r["method"], {}).setdefault(str(r.get(key, "")), []).extend(r["accept_counts"])
    return {m: {k: round(1 + sum(c) / max(len(c), 1), 4) for k, c in by.items()} for m, by in counts.items()}


def by_number(value: str) -> list[str | int]:
    """A sort key that orders the numbers in a column name as numbers: "ctx 8192" before
    "ctx 32768", turn 2 before turn 10 (as text they sort the other way round)."""
    # re.split with a group alternates text (even places) and digits (odd): like compares with like
    return [int(part) if k % 2 else part for k, part in enumerate(re.split(r"(\d+)", value))]


def format_breakdown(breakdown: dict[str, dict[str, dict[str, float]]]) -> str:
    """tau per method by category and by turn, one row per method (methods that draft only)."""
    lines = []
    for key, by_method in breakdown.items():
        values = sorted({v for by in by_method.values() for v in by}, key=by_number)
        if len(values) < 2:
            continue
        lines += ["", f"tau by {key}:", f"{'method':<15}" + "".join(f"{v[:11]:>12}" for v in values)]
        lines += [f"{m:<15}" + "".join(f"{by.get(v, float('nan')):>12.2f}" for v in values)
                  for m, by in by_method.items() if m != "plain"]
    return "\n".join(lines)
