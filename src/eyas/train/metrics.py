"""Per-step training metrics: summed statistics turned into loss, accuracy and the simulated
acceptance length, written as JSONL (and to TensorBoard when it is installed)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from eyas.errors import EyasError
from eyas.paths import atomic_write_bytes
from eyas.draft.loss import (ACCEPT, CHAINS_ACCEPTING, CHAINS_REACHING, CORRECT, COUNT, GREEDY_PATH, IN_VOCAB,
                             LOSS, simulated_acceptance)

METRICS_FILE = "metrics.jsonl"
TAU_DEFINITION = "tau_sim = 1 + sum_k prod_{j<=k} acc_j (acceptance length if step k is accepted with prob. acc_k)"
ACCEPT_DEFINITION = ("accept_t1 = sum_v min(p_v, q_v): the chance speculative sampling at temperature 1 accepts the "
                     "drafter's token (p the target's full distribution, q the drafter's); tau_sim_t1 the same "
                     "product over steps")
WALK_DEFINITION = ("tau_walk = 1 + accepted drafts per chain, chains of K drafted greedily along the samples and "
                   "verified against the target's greedy token as decoding does (eval's tau, exact on the target's "
                   "own greedy answers: a chain ends where an answer leaves that path); walk = the share of chains "
                   "accepting step k")


def summarize(stats: torch.Tensor) -> dict[str, Any]:
    """stats [K, STATS] summed over positions (and processes) -> per-step loss, accuracy and
    acceptance at T=1, and the simulated acceptance lengths."""
    s = stats.double().cpu()
    count = s[:, COUNT].clamp_min(1)
    loss = (s[:, LOSS] / count).tolist()
    acc = (s[:, CORRECT] / count).tolist()
    accept = (s[:, ACCEPT] / count).tolist()
    return {
        "loss": sum(loss) / len(loss),
        "loss_per_step": [round(x, 5) for x in loss],
        "acc_per_step": [round(x, 5) for x in acc],
        "tau_sim": round(simulated_acceptance(acc), 4),
        "accept_t1_per_step": [round(x, 5) for x in accept],
        "tau_sim_t1": round(simulated_acceptance(accept), 4),
        "vocab_coverage": round(float(s[0, IN_VOCAB] / count[0]), 5),
        "positions": int(s[0, COUNT]),
        **_walk(s),
    }


def _walk(s: torch.Tensor) -> dict[str, Any]:
    """The chains greedy decoding drafts along the samples (where they were walked): the share
    accepting each step, which is eval's acceptance at position k + 1, and tau_walk."""
    chains = float(s[0, CHAINS_REACHING])
    if not chains:
        return {}
    accepting = (s[:, CHAINS_ACCEPTING] / chains).tolist()
    return {"accept_walk_per_step": [round(x, 5) for x in accepting], "tau_walk": round(1 + sum(accepting), 4),
            "chains": int(chains), "greedy_path": round(float(s[0, GREEDY_PATH] / s[0, COUNT].clamp_min(1)), 5)}


class MetricsLog:
    """Appends one JSON row per logged step to `out/metrics.jsonl`; on resume, rows written
    after the checkpoint being resumed (by the interrupted run) are dropped first."""

    def __init__(self, out: Path, resume_step: int | None):
        out.mkdir(parents=True, exist_ok=True)
        self.path = out / METRICS_FILE
        if resume_step is None:
            self.path.unlink(missing_ok=True)
        elif self.path.is_file():
            rows = [line for line in read_rows(self.path) if json.loads(line)["step"] <= resume_step]
            atomic_write_bytes(self.path, "".join(r + "\n" for r in rows).encode())
        self.tb = _tensorboard(out)

    def write(self, row: dict[str, Any]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if self.tb is not None:
            prefix = row["split"]
            for key, value in row.items():
                if isinstance(value, (int, float)) and key != "step":
                    self.tb.add_scalar(f"{prefix}/{key}", value, row["step"])
            for k, a in enumerate(row.get("acc_per_step", [])):
                self.tb.add_scalar(f"{prefix}/acc_step{k}", a, row["step"])

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def read_rows(path: Path) -> list[str]:
    """The complete rows of a metrics file. A last line cut off (a run killed mid-write, a full
    disk) is dropped; damage anywhere else is the user's to look at."""
    lines = path.read_bytes().decode("utf-8", errors="replace").split("\n")
    rows = []
    for n, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            ok = isinstance(json.loads(line).get("step"), int)
        except (ValueError, AttributeError, RecursionError):
            ok = False
        if not ok:
            if n >= len(lines) - 2 and not any(x.strip() for x in lines[n + 1:]):  # the last line: torn
                break
            raise EyasError(f"{path} line {n + 1} is not a metrics row; move the file away to resume without it.")
        rows.append(line)
    return rows


def _tensorboard(out: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # tensorboard is optional
        return None
    return SummaryWriter(str(out / "tensorboard"))


def format_table(rows: dict[str, dict[str, Any]]) -> str:
    """Per-step accuracies of each split, one line per split, plus tau_sim and its definition."""
    steps = max(len(r["acc_per_step"]) for r in rows.values())
    lines = [f"{'':10}" + "".join(f"{'step ' + str(k):>9}" for k in range(steps)) + f"{'tau_sim':>10}{'loss':>9}"]
    for split, r in rows.items():
        lines.append(f"{split + ' acc':10}" + "".join(f"{a:9.3f}" for a in r["acc_per_step"])
                     + f"{r['tau_sim']:10.3f}{r['loss']:9.3f}")
        if "accept_t1_per_step" in r:  # rows written before it was measured have none
            lines.append(f"{split + ' T=1':10}" + "".join(f"{a:9.3f}" for a in r["accept_t1_per_step"])
                         + f"{r['tau_sim_t1']:10.3f}")
        if "tau_walk" in r:
            lines.append(f"{split + ' walk':10}" + "".join(f"{a:9.3f}" for a in r["accept_walk_per_step"])
                         + f"{r['tau_walk']:10.3f}   ({r['chains']} chains; {100 * r['greedy_path']:.1f}% of "
                           f"the answer tokens are the target's greedy tokens)")
    coverage = ", ".join(f"{split} {r['vocab_coverage']:.3f}" for split, r in rows.items())
    lines += [f"acc = top-1 agreement with the target's greedy token on trained positions (at most the share of "
              f"those tokens inside the draft vocab: {coverage})", TAU_DEFINITION, ACCEPT_DEFINITION,
              *([WALK_DEFINITION] if any("tau_walk" in r for r in rows.values()) else []),
              "train = the batches of the last logged steps, as they were trained; eval = the held-out samples"]
    return "\n".join(lines)
