"""WORK/report.md (and report.json): what the recipe made, from the stages' own outputs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from eyas.evaluate.report import SAME_DEFINITION, by_number
from eyas.export.exporter import planned_serve_command
from eyas.paths import atomic_write_bytes, atomic_write_json


REPORTS = ("report.md", "report.json")


def _read(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _table(rows: dict[str, dict[str, float]], columns: list[str]) -> list[str]:
    out = ["| method | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    out += [f"| {m} | " + " | ".join(f"{by[c]:.2f}" if c in by else "-" for c in columns) + " |" for m, by in rows.items()]
    return out


def write_report(recipe: dict[str, Any], work: Path, stages, where: str) -> Path:
    """The report from the outputs of the planned `stages` only: an eval file an earlier plan
    left (a tree.json before the drafter became DFlash) is no result of this one."""
    planned = {s.name: s.output for s in stages}

    def output(name: str) -> dict[str, Any]:
        return _read(planned[name]) if name in planned else {}

    heldout = output("heldout").get("teacher_forced", {})
    chain, tree = output("eval-chain"), output("eval-tree")
    # The tree run has no baseline of its own but plain decoding: its drafter row joins the chain run's table.
    found = {**{m: v for m, v in tree.get("summary", {}).items() if m != "plain"}, **chain.get("summary", {})}
    summary = {m: found[m] for m in sorted(found, key=lambda m: (m != "plain", m.startswith("eagle3"), m))}
    by = {key: {m: v for r in (chain, tree) for m, v in r.get("tau_by", {}).get(key, {}).items() if m != "plain"}
          for key in ("category", "turn")}
    exports = {s.output.name: {"folder": str(s.output), "serve": planned_serve_command(s.config(where), check=False)}
               for s in stages if s.command == "export"}
    plots = [planned[n].with_suffix(".png") for n in ("eval-chain", "eval-tree") if n in planned]
    result = {"model": recipe["model"], "heldout": heldout, "summary": summary, "tau_by": by, "exports": exports,
              "plots": [str(p) for p in plots if p.is_file()]}
    atomic_write_json(work / REPORTS[1], result)
    lines = [f"# eyas recipe report: {recipe['model']}", ""]
    if heldout:
        lines += ["## Held-out accuracy per TTT step (teacher-forced)", "",
                  f"{heldout['samples']} held-out samples, {heldout['positions']} positions: "
                  + ", ".join(f"step {k} {a:.3f}" for k, a in enumerate(heldout["acc_per_step"]))
                  + f"; tau_sim {heldout['tau_sim']:.3f}"
                  + (f"; tau_walk {heldout['tau_walk']:.3f} (greedy chains walked along the held-out answers, as "
                     f"decoding drafts them)" if "tau_walk" in heldout else ""), ""]
    if summary:
        settings = chain.get("settings") or tree.get("settings") or {}
        depth = chain.get("draft_depth") or tree.get("draft_depth")
        lines += [f"## Acceptance length on {settings.get('prompts', '?')}", "",
                  "tau = 1 + accepted draft tokens per verification step", "", SAME_DEFINITION, "",
                  *([f"Drafted {depth['tokens']} tokens a step ({depth['rule']}).", ""] if depth else []),
                  "| method | tau | speed-up | answers | = plain |", "|---|---|---|---|---|"]
        for m, s in summary.items():
            speed = f"{s['speedup']:.2f}x" if s.get("speedup") else "-"
            same = f"{s['identical']}/{s['answers']}" if s.get("identical") is not None else "-"
            lines.append(f"| {m} | {s['tau']:.2f} | {speed} | {s['answers']} | {same} |")
        if settings.get("workers", 1) > 1:
            lines += ["", f"No speed-ups: {settings['workers']} worker processes shared the machine, so their timings "
                          "are contended; `workers: 1` measures them in one process."]
        for key, rows in by.items():
            columns = sorted({c for r in rows.values() for c in r}, key=by_number)
            if len(columns) > 1:
                lines += ["", f"tau by {key}:", "", *_table(rows, columns)]
        lines += [""] + [f"![per-position acceptance]({Path(p).relative_to(work)})" for p in result["plots"]] + [""]
    if exports:
        lines += ["## Serving", ""]
        for fmt, e in exports.items():
            lines += [f"{fmt}: `{e['folder']}`", "", "```", e["serve"], "```", ""]
    path = work / REPORTS[0]
    atomic_write_bytes(path, "\n".join(lines).encode("utf-8"))
    return path
