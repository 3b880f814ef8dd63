"""What the bench scripts share, below all of them: the run's record (say, git, device_name,
dump), device helpers (sync, free_memory, Peak) and the rates measured on a target (forward,
capture, disk). Scripts import from here and from random_target.py, not from each other's
private names, so no two scripts import each other."""

from __future__ import annotations

import gc
import json
import os
import re
import subprocess
import threading
import time
from pathlib import Path

import torch

# ---------------------------------------------------------------- the run's record


def say(message: str) -> None:
    print(message, flush=True)


def git(*args: str) -> str | None:
    """`git ARGS`'s output in this checkout, or None where git or the checkout is missing."""
    try:
        done = subprocess.run(["git", *args], capture_output=True, text=True, timeout=10,
                              cwd=Path(__file__).resolve().parent)
        return done.stdout.strip() if done.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def device_name(device: str) -> str:
    return torch.cuda.get_device_name() if device.startswith("cuda") and torch.cuda.is_available() else "cpu"


def dump(path: Path, obj) -> None:
    """Write `obj` as JSON atomically: a run cut short leaves the previous whole file."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, default=str))
    tmp.replace(path)


# ---------------------------------------------------------------- device helpers

# ---------------------------------------------------------------- an arm's `eyas train` options


def train_options(text: str) -> dict:
    """`OPTION=VALUE` pieces, separated by ':' or ',', as `eyas train` options (TrainConfig
    fields): a piece without '=' belongs to the value before it, its separator kept
    (layers=spread:5, causal_layers=0,2); a number, list, mapping, null or boolean is read as JSON,
    other text (and what JSON does not read, 0,2) stays text."""
    parts = re.split(r"([:,])", text) if text else []
    changes: list[str] = []
    for sep, piece in zip([""] + parts[1::2], parts[0::2]):
        if "=" in piece or not changes:
            changes.append(piece)
        else:
            changes[-1] += sep + piece
    return {key: _json_or_text(value) for key, _, value in (c.partition("=") for c in changes)}


def _json_or_text(value: str):
    if value[:1].isdigit() or value[:1] in "-[{" or value in ("null", "true", "false"):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            pass
    return value


def profile_table(prof, limit: int = 18) -> dict:
    """Top CUDA kernels by device time, and host vs device totals of the profiled region."""
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    events.sort(key=lambda e: -e.self_device_time_total)
    device_total = sum(e.self_device_time_total for e in events)
    rows = [{"kernel": e.key[:120], "ms": round(e.self_device_time_total / 1e3, 2), "calls": e.count,
             "share": round(e.self_device_time_total / max(device_total, 1), 3)} for e in events[:limit]]
    launches = sum(e.count for e in events)
    host = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CPU]
    host.sort(key=lambda e: -e.self_cpu_time_total)
    host_rows = [{"op": e.key[:100], "ms": round(e.self_cpu_time_total / 1e3, 2), "calls": e.count} for e in host[:limit]]
    return {"device_ms": round(device_total / 1e3, 1), "kernel_launches": launches, "top": rows, "host_top": host_rows}




def sync(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _gib(n: float) -> float:
    return n / (1 << 30)


class Peak:
    """Peak CUDA memory allocated inside the block, above what was allocated when it began."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.base = self.peak = 0

    def __enter__(self):
        if self.cuda:
            free_memory()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            self.peak = torch.cuda.max_memory_allocated() - self.base

    def report(self) -> dict[str, float]:
        return {"peak_gib": round(_gib(self.peak), 2), "resident_before_gib": round(_gib(self.base), 2)} if self.cuda else {}


# ---------------------------------------------------------------- rates


def forward_rate(model, prepared: Path, device: str, batch_tokens: int, max_tokens: int | None = None) -> float:
    """tok/s of `model`'s decoder (up to its final norm) over the capture's own batches of
    `prepared` (the first batches holding `max_tokens`, if given), after two warm-up batches."""
    from eyas.data.batching import token_budget_batches
    from eyas.data.prepared import PreparedData

    data = PreparedData(prepared)
    lengths = [data.length(i) for i in range(len(data))]
    batches = token_budget_batches(list(range(len(data))), lengths, batch_tokens)
    if max_tokens is not None:
        kept, total = [], 0
        for batch in batches:
            if total >= max_tokens:
                break
            kept.append(batch)
            total += sum(lengths[i] for i in batch)
        batches = kept

    def run(batch):
        T = max(lengths[i] for i in batch)
        ids = torch.zeros(len(batch), T, dtype=torch.long)
        mask = torch.zeros(len(batch), T, dtype=torch.long)
        for b, i in enumerate(batch):
            ids[b, : lengths[i]], mask[b, : lengths[i]] = data[i].input_ids, 1
        with torch.inference_mode():
            model.model(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False)

    for batch in batches[:2]:
        run(batch)  # warm-up
    sync(device)
    start = time.perf_counter()
    for batch in batches:
        run(batch)
    sync(device)
    return sum(lengths[i] for batch in batches for i in batch) / (time.perf_counter() - start)


def disk_write_rate(folder: Path, writers: int, gib: float = 2.0) -> float:
    """GB/s that `writers` threads reach writing and fsyncing `gib` GiB each into `folder`:
    the ceiling for capture's store writes on this machine."""
    block = os.urandom(64 << 20)
    paths = [folder / f"disk-probe-{w}.bin" for w in range(writers)]

    def write(path: Path) -> None:
        with open(path, "wb") as f:
            for _ in range(int(gib * 16)):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())

    threads = [threading.Thread(target=write, args=(p,)) for p in paths]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - start
    for path in paths:
        path.unlink()
    return writers * gib * (1 << 30) / seconds / 1e9


def capture_rate(stdout: str) -> tuple[float, float]:
    """(tok/s, seconds the capture waited on its store writers) from capture's last line."""
    m = re.search(r"captured ([\d,]+) tokens in ([\d.]+) s.*; ([\d.]+) s of it waiting", stdout)
    return int(m.group(1).replace(",", "")) / float(m.group(2)), float(m.group(3))
