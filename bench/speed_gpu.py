"""Issue 12's speed benchmark: capture and drafter training at real shapes, on one GPU, in one run.

A random-weight Llama target of `--shape` (8b: Llama-3.1-8B's shape, bf16 on the GPU) and
random prepared samples of 256-2048 tokens are built in this process and the target is saved
to a model folder (16 GB at 8b), which `eyas capture` and online training load as any model;
the pure forward and the batch-1 loop use the copy that built it (loading is outside every
figure). Parts, in order, each timed on its own:

  forward         pure forward over capture's own token-budget batches; padding share
  capture_fp8     `eyas capture --dtype fp8` end to end (capture's own summary line)
  capture_bf16    the same into a bf16 store (deleted afterwards: it is large)
  disk            the disk's fsync'd write rate, 1 and 3 writer threads (capture uses 3)
  batch1_loop     the peers' way: batch 1, output_hidden_states, torch.save per sample
  train           `eyas train`'s own step (loop.train_step) from the fp8 store: tok/s,
                  TFLOP/s by FLOP_FORMULA, peak memory, compile/recompile counters
  train_parts     the trainer's step with its per-part timer (eyas.timing.StepTimer), synchronised
                  around each part: data loading + dequantisation, labels, forward, backward,
                  clip, checks, optimizer
  train_preloaded the same step over batches already on the GPU (loading taken out)
  profile         torch.profiler over a few train steps: top CUDA kernels, GPU busy share
  fixed_4x2048    the trainer's step on in-memory 4 x 2048-token batches (the shape of the
                  23.4k tok/s flex-attention figure in docs/train.md)
  plain_step      the plain peer-style head step: SDPA over concatenated per-step keys with a
                  boolean mask, fp32 full-vocabulary logits per step, AdamW; 2048 tokens
  online          `eyas train --online` (the target's forward in the loop) vs the rate
                  predicted from the target's forward alone and the head's training alone
  seed            the seed's shape: the drafter eyas builds for Kimi-K2 (hidden 7168, draft
                  vocab 32000, target vocab 163840), trainer's step on in-memory batches

Every part is wrapped: a failure is recorded (with its traceback) and the others still
run. The JSON is rewritten (atomically) after every part; parts that would not fit in what
is left of `--minutes` are skipped and say so.

  PYTHONPATH=src python3 -u bench/speed_gpu.py --shape 8b --out $OUT --minutes 4.5
  PYTHONPATH=src python3 -u bench/speed_gpu.py --shape tiny --device cpu --out /tmp/speed --minutes 1   # smoke run
"""

from __future__ import annotations

import time

STARTED = time.monotonic()  # the budget counts the imports too

import argparse
import contextlib
import io
import json
import logging
import os
import random
import re
import shutil
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Peak, capture_rate, disk_write_rate, forward_rate, free_memory, git, say, sync  # noqa: E402
from random_target import SEED_SHAPES, SHAPES, build_prepared, random_target_config  # noqa: E402

LEFT: Callable[[], float] = lambda: float("inf")  # seconds left of --minutes (set in main)
PEAK_TFLOPS = 790.0  # H200 dense bf16 matrix-unit ceiling, the issue's denominator
TRAIN_BATCH_TOKENS = 8192
TTT_STEPS = 7

FLOP_FORMULA = (
    "Matrix FLOPs per training pass over real (unpadded) tokens, n tokens in samples of lengths T_s; "
    "H hidden, I intermediate, q = heads x head_dim, kv = kv_heads x head_dim, L aux layers, Vd draft vocab, "
    "V target vocab, K TTT steps. Forward per token per step: 2(2H.q + 2.2H.kv + q.H + 3H.I + H.Vd); "
    "attention per step k: 4q x (sum_s T_s(T_s+1)/2 + k.n) (QK^T and PV over the keys each query sees: causal "
    "step-0 keys and one same-position key per earlier step). fc: 2L.H.H per token. "
    "Training = 3 x (K steps' forward incl. attention) + 2 x fc (its input needs no gradient) "
    "+ labels 2H.V per token (the target's lm_head, forward only). Norms, softmax, loss and optimizer not counted."
)


def train_flops(draft, target_vocab: int, lengths: list[int], steps: int = TTT_STEPS) -> dict[str, float]:
    """FLOP_FORMULA for samples of `lengths`: {'labels', 'forward', 'backward', 'total'}."""
    H, I, Vd = draft.hidden_size, draft.intermediate_size, draft.draft_vocab_size
    q, kv = draft.num_attention_heads * draft.head_dim, draft.num_key_value_heads * draft.head_dim
    L, n = len(draft.aux_layer_ids), sum(lengths)
    per_token_step = 2 * (2 * H * q + 2 * 2 * H * kv + q * H + 3 * H * I + H * Vd)
    causal_pairs = sum(T * (T + 1) / 2 for T in lengths)
    attention = sum(4 * q * (causal_pairs + k * n) for k in range(steps))
    fc = 2 * L * H * H * n
    body = steps * n * per_token_step + attention
    labels = 2 * H * target_vocab * n
    return {"labels": labels, "forward": fc + body, "backward": fc + 2 * body, "total": labels + 3 * body + 2 * fc}


# ---------------------------------------------------------------- the run's record


class Record:
    """The results JSON: parts as they finish, the issue's headline ratios, rewritten atomically."""

    HEADLINE = ("capture_fp8_over_forward", "capture_bf16_over_forward", "capture_over_batch1_loop",
                "real_token_share", "train_fraction_of_790", "train_over_plain_step", "train_peak_gib",
                "online_over_predicted")

    def __init__(self, path: Path, minutes: float, meta: dict[str, Any]):
        self.path = path
        self.budget = 60 * minutes
        self.started = STARTED
        self.data: dict[str, Any] = {k: None for k in self.HEADLINE}
        self.data.update(meta)
        self.data["parts"] = {}

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def left(self) -> float:
        return self.budget - self.elapsed()

    def run(self, name: str, need_s: float, fn: Callable[[], dict[str, Any]]) -> dict[str, Any] | None:
        """Run part `name` unless less than `need_s` of the budget is left; record it either way."""
        if self.left() < need_s:
            why = f"{self.left():.0f} s left of the budget, needs ~{need_s:.0f} s"
            self.data["parts"][name] = {"ok": False, "skipped": why}
            say(f"[{self.elapsed():6.1f} s] {name}: SKIPPED ({self.left():.0f} s left, needs ~{need_s:.0f} s)")
            self.save()
            return None
        say(f"[{self.elapsed():6.1f} s] {name}: start")
        start = time.monotonic()
        try:
            out = fn()
            self.data["parts"][name] = {"ok": True, "seconds": round(time.monotonic() - start, 2), **out}
            say(f"[{self.elapsed():6.1f} s] {name}: done in {time.monotonic() - start:.1f} s: {_brief(out)}")
        except Exception as e:  # recorded; the other parts still run
            out = None
            self.data["parts"][name] = {"ok": False, "seconds": round(time.monotonic() - start, 2),
                                        "error": f"{type(e).__name__}: {e}"[:2000], "traceback": traceback.format_exc()}
            say(f"[{self.elapsed():6.1f} s] {name}: FAILED: {type(e).__name__}: {str(e)[:300]}")
        finally:
            free_memory()
        self.save()
        return out

    def save(self) -> None:
        self.data["elapsed_s"] = round(self.elapsed(), 1)
        self.data["dynamo_warnings"] = DYNAMO_WARNINGS.report()  # so far in the run
        self.data["compile_counters"] = _compile_counters()
        self.data.update(headline(self.data["parts"]))
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.data, indent=2, default=str))
        os.replace(tmp, self.path)


def _brief(out: dict[str, Any]) -> str:
    keys = [k for k in out if k.endswith(("tok_s", "tflops", "gib", "share", "gb_s", "over_predicted"))]
    return ", ".join(f"{k}={out[k]:,.3f}" if isinstance(out[k], float) else f"{k}={out[k]}" for k in keys[:8]) or "ok"


def headline(parts: dict[str, Any]) -> dict[str, Any]:
    """The issue's mechanically checked keys, from whichever parts succeeded."""
    def get(part: str, key: str):
        p = parts.get(part) or {}
        return p.get(key) if p.get("ok") else None

    def ratio(a, b):
        return a / b if a is not None and b else None

    fwd = get("forward", "tok_s")
    return {
        "capture_fp8_over_forward": ratio(get("capture_fp8", "tok_s"), fwd),
        "capture_bf16_over_forward": ratio(get("capture_bf16", "tok_s"), fwd),
        "capture_over_batch1_loop": ratio(get("capture_fp8", "tok_s"), get("batch1_loop", "tok_s")),
        "real_token_share": get("forward", "real_token_share"),
        "train_fraction_of_790": ratio(get("train", "tflops"), PEAK_TFLOPS),
        "train_over_plain_step": ratio(get("train", "tok_s"), get("plain_step", "tok_s")),
        "train_peak_gib": get("train", "peak_gib"),
        "online_over_predicted": get("online", "over_predicted"),
        "capture_bf16_over_disk": ratio(get("capture_bf16", "store_gb_s"), (get("disk", "gb_s") or {}).get("3")),
    }


class _Tee(io.TextIOBase):
    def __init__(self, *streams):
        self.streams = streams

    def write(self, s: str) -> int:
        for stream in self.streams:
            stream.write(s)
        return len(s)

    def flush(self) -> None:
        for stream in self.streams:
            stream.flush()


# ---------------------------------------------------------------- the shared target


@dataclass
class Context:
    args: argparse.Namespace
    device: torch.device
    work: Path
    folder: Path  # config, tokenizer, head tensors
    prepared: Path
    model: Any = None  # the resident target
    tokenizer: Any = None
    lengths: list[int] | None = None
    run: Any = None  # the offline training run, shared by the train_* parts
    fp8_store: Path | None = None
    record: Any = None

    @property
    def tiny(self) -> bool:
        return self.args.shape == "tiny"

    @property
    def train_batch_tokens(self) -> int:
        return 1024 if self.tiny else TRAIN_BATCH_TOKENS  # dense attention on a CPU: keep [T, T] small


def build(ctx: Context) -> dict[str, Any]:
    """The random target on the device, saved as a model folder; the prepared samples."""
    from transformers import AutoModelForCausalLM

    config, tokenizer = random_target_config(ctx.args.shape)
    dtype = torch.bfloat16 if ctx.device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    with torch.device(ctx.device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.eval().requires_grad_(False)
    ctx.folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(ctx.folder)
    tokenizer.save_pretrained(ctx.folder)
    ctx.model, ctx.tokenizer = model, tokenizer
    ctx.lengths = build_prepared(ctx.prepared, ctx.folder, model.config, tokenizer, ctx.args.tokens)
    return {"samples": len(ctx.lengths), "tokens": sum(ctx.lengths), "model_dtype": str(dtype),
            "target_params": sum(p.numel() for p in model.parameters())}


def _batches_share(lengths: list[int], batch_tokens: int) -> tuple[int, int, int]:
    """(batches, real tokens, computed tokens) of token-budget batches over `lengths`."""
    from eyas.data.batching import token_budget_batches

    batches = token_budget_batches(list(range(len(lengths))), lengths, batch_tokens)
    return len(batches), sum(lengths), sum(len(b) * max(lengths[i] for i in b) for b in batches)


# ---------------------------------------------------------------- capture parts


def part_forward(ctx: Context) -> dict[str, Any]:
    rate = forward_rate(ctx.model, ctx.prepared, str(ctx.device), ctx.args.batch_tokens)
    n, real, computed = _batches_share(ctx.lengths, ctx.args.batch_tokens)
    _, treal, tcomputed = _batches_share(ctx.lengths, ctx.train_batch_tokens)
    return {"tok_s": rate, "batch_tokens": ctx.args.batch_tokens, "batches": n, "real_tokens": real,
            "computed_tokens": computed, "real_token_share": real / computed,
            "padding_share": 1 - real / computed, "train_batches_real_token_share": treal / tcomputed}


def part_capture(ctx: Context, dtype: str) -> dict[str, Any]:
    from eyas.capture.config import CaptureConfig
    from eyas.capture.run import capture
    from eyas.store import Store

    store = ctx.work / f"store-{dtype}"
    shutil.rmtree(store, ignore_errors=True)
    out, err = io.StringIO(), io.StringIO()
    start = time.monotonic()
    with contextlib.redirect_stdout(_Tee(sys.stdout, out)), contextlib.redirect_stderr(err):
        capture(CaptureConfig(model=str(ctx.folder), data=str(ctx.prepared), out=str(store), dtype=dtype,
                              device=str(ctx.device), batch_tokens=ctx.args.batch_tokens))
    wall = time.monotonic() - start
    rate, waited = capture_rate(out.getvalue())
    per_token = Store(store).bytes_per_token()
    if dtype == "fp8":
        ctx.fp8_store = store
    else:
        shutil.rmtree(store, ignore_errors=True)  # 32 KiB a token at 8b: keep the disk for the rest
    return {"tok_s": rate, "waited_on_store_s": waited, "wall_s_incl_setup_and_close": wall,
            "store_bytes_per_token": per_token, "store_gb_s": rate * per_token / 1e9,
            "summary_line": out.getvalue().strip().splitlines()[-1:]}


def part_disk(ctx: Context) -> dict[str, Any]:
    gib = 1.0 if ctx.device.type == "cuda" else 0.05
    rates = {str(w): disk_write_rate(ctx.work, w, gib) for w in (1, 3)}
    return {"gb_s": rates, "gib_per_writer": gib, "folder": str(ctx.work)}


@torch.inference_mode()
def part_batch1(ctx: Context) -> dict[str, Any]:
    """Batch 1, the whole model with output_hidden_states (logits included, as a plain
    `model(...)` call computes them), the aux states and the last one to the host, one
    torch.save per sample; then one sync so the files are on the disk, as capture's are."""
    from eyas.data.prepared import PreparedData
    from eyas.models.layers import default_aux_ids

    data = PreparedData(ctx.prepared)
    layers = [*default_aux_ids(ctx.model.config.num_hidden_layers), ctx.model.config.num_hidden_layers]
    folder = ctx.work / "batch1"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    budget = min(ctx.args.batch1_tokens, sum(ctx.lengths))
    order = list(range(len(data)))

    def one(i: int) -> int:
        s = data[i]
        out = ctx.model(input_ids=s.input_ids[None].to(ctx.device), output_hidden_states=True, use_cache=False)
        hidden = torch.stack([out.hidden_states[k][0] for k in layers], dim=-2).cpu()  # [T, L, H]
        torch.save({"input_ids": s.input_ids, "loss_mask": s.loss_mask, "hidden_states": hidden}, folder / f"{i}.pt")
        return len(s.input_ids)

    one(order[-1])  # warm-up
    os.sync()
    start, tokens, samples = time.perf_counter(), 0, 0
    for i in order:
        if tokens >= budget:
            break
        tokens += one(i)
        samples += 1
    loop = time.perf_counter() - start
    os.sync()
    total = time.perf_counter() - start
    shutil.rmtree(folder, ignore_errors=True)
    return {"tok_s": tokens / total, "tok_s_before_sync": tokens / loop, "tokens": tokens, "samples": samples,
            "layers": layers, "sync_s": total - loop}


# ---------------------------------------------------------------- training parts


def _train_config(ctx: Context, **kw):
    from eyas.train.config import TrainConfig

    V = ctx.model.config.vocab_size if ctx.model is not None else SHAPES[ctx.args.shape][-1]
    return TrainConfig(out=str(ctx.work / "train-out"), draft_vocab=min(32000, V), steps=1_000_000,
                       batch_tokens=ctx.train_batch_tokens, ttt_steps=TTT_STEPS, device=str(ctx.device), progress=False,
                       eval_fraction=0.05, max_len=256 if ctx.tiny else None, **kw)


def _step_lengths(run) -> list[int]:
    return [run.source.lengths[p] for b in run.train_stream.for_step(run.step, run.group, 0, 1) for p in b]


def timed_steps(run, seconds: float, max_steps: int, step_fn=None) -> dict[str, Any]:
    """Train steps for about `seconds` (at least 2, at most `max_steps`): real tok/s, TFLOP/s."""
    from eyas.train.loop import train_step

    step_fn = step_fn or train_step
    V = run.head.lm_head_weight.shape[0]
    seconds = min(seconds, max(LEFT() - 10, 0))  # leave the rest of the budget its chance
    tokens = flops = steps = 0
    sync(run.device)
    start = time.perf_counter()
    while steps < max_steps and (steps < 2 or time.perf_counter() - start < seconds):
        lengths = _step_lengths(run)
        tokens += sum(lengths)
        flops += train_flops(run.draft, V, lengths)["total"]
        step_fn(run)
        steps += 1
    sync(run.device)
    wall = time.perf_counter() - start
    return {"tok_s": tokens / wall, "tflops": flops / wall / 1e12, "steps": steps, "tokens": tokens, "wall_s": wall,
            "tflop_per_token": flops / tokens / 1e12, "fraction_of_790": flops / wall / 1e12 / PEAK_TFLOPS}


def _compile_counters() -> dict[str, Any]:
    try:
        from torch._dynamo.utils import counters

        return {k: dict(v) for k, v in counters.items() if k in ("stats", "recompiles", "graph_break", "frames")}
    except Exception as e:  # private API: record why not
        return {"error": repr(e)}


class DynamoWarnings(logging.Handler):
    """torch._dynamo's warnings (a recompile limit hit, say), counted, the first few kept."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.count, self.first = 0, []

    def emit(self, record: logging.LogRecord) -> None:
        self.count += 1
        if len(self.first) < 10:
            self.first.append(record.getMessage()[:1000])

    def report(self) -> dict[str, Any]:
        return {"count": self.count, "first": self.first}


DYNAMO_WARNINGS = DynamoWarnings()


def _mask_cache() -> dict[str, int]:
    from eyas.draft.model import causal_block_mask

    info = causal_block_mask.cache_info()
    return {"hits": info.hits, "misses": info.misses, "currsize": info.currsize, "maxsize": info.maxsize}


def part_train(ctx: Context) -> dict[str, Any]:
    from eyas import distributed
    from eyas.train.loop import setup, train_step

    cfg = _train_config(ctx, store=str(ctx.fp8_store), model=str(ctx.folder))
    d, device = distributed.init(cfg.device, False)
    with Peak(device) as peak:
        start = time.monotonic()
        run = setup(cfg, d, device)
        setup_s = time.monotonic() - start
        start = time.monotonic()
        for _ in range(ctx.args.warm_steps):
            train_step(run)
        sync(device)
        warm_s = time.monotonic() - start
        masks_before = _mask_cache()
        timed = timed_steps(run, ctx.args.train_seconds, 200)
        masks_after = _mask_cache()
    ctx.run = run
    return {**timed, **peak.report(), "setup_s": setup_s, "warm_steps": ctx.args.warm_steps, "warm_s_incl_compile": warm_s,
            "store": str(ctx.fp8_store), "batch_tokens": cfg.batch_tokens, "draft_vocab": run.draft.draft_vocab_size,
            "ttt_steps": run.draft.ttt_steps, "batches_per_epoch": len(run.train_stream),
            "block_mask_cache": {"before_timed": masks_before, "after_timed": masks_after},
            "compile_counters": _compile_counters(), "dynamo_warnings": DYNAMO_WARNINGS.report(),
            "note": "peak_gib is above the memory resident before setup (the bench's own target model)"}


def part_train_parts(ctx: Context) -> dict[str, Any]:
    from eyas.timing import StepTimer
    from eyas.train.loop import train_step

    run = ctx.run
    timer = StepTimer(run.device)
    V = run.head.lm_head_weight.shape[0]
    lengths: list[int] = []
    start = time.perf_counter()
    steps = 0
    while steps < ctx.args.parts_steps:
        lengths += _step_lengths(run)
        train_step(run, timer)
        steps += 1
    wall = time.perf_counter() - start
    f = train_flops(run.draft, V, lengths)
    n = sum(lengths)
    flops_of = {"labels": f["labels"], "forward": f["forward"], "backward": f["backward"]}
    pieces = {name: {"s_per_step": s / steps, "share": s / wall, "tok_s": n / s,
                     **({"tflops": flops_of[name] / s / 1e12} if name in flops_of else {})}
              for name, s in sorted(timer.seconds.items(), key=lambda kv: -kv[1])}
    bytes_loaded = n * run.source.store.bytes_per_token() if hasattr(run.source, "store") else None
    if bytes_loaded:
        pieces["load"]["store_gb_s"] = bytes_loaded / timer.seconds["load"] / 1e9
    return {"steps": steps, "tokens": n, "tok_s": n / wall, "tflops": f["total"] / wall / 1e12, "pieces": pieces,
            "unaccounted_share": 1 - sum(timer.seconds.values()) / wall,
            "block_mask_creation": _time_block_masks(run.device),
            "note": "each piece is synchronised before and after, so nothing overlaps: the sum exceeds a plain step"}


def _time_block_masks(device: torch.device) -> dict[str, Any]:
    """Seconds to build one TTT block mask (what an lru_cache miss costs), for 2047 tokens."""
    if device.type != "cuda":
        return {"skipped": "flex attention is used on CUDA only"}
    from eyas.draft.model import causal_block_mask

    sync(device)
    start = time.perf_counter()
    causal_block_mask.__wrapped__(2048, device)
    sync(device)
    return {"causal_s": time.perf_counter() - start}


class OnDevice:
    """A source whose batches already sit on the device: nothing to read ahead, nothing started
    in the background (the rest of eyas.train.data.SampleSource)."""

    def read_ahead(self, items, device: torch.device, rows_of=None) -> None:
        pass

    def close(self) -> None:
        pass


class PreloadedSource(OnDevice):
    """A training source answering `load` from the batches of the next `steps` steps of
    `run`, loaded (onto the device) by its own source beforehand."""

    def __init__(self, run, steps: int):
        source = run.source
        self.lengths, self.sample_index, self.tokens = source.lengths, source.sample_index, source.tokens
        self.batches = {tuple(positions): source.load(positions, run.device) for s in range(run.step, run.step + steps)
                        for positions in run.train_stream.for_step(s, run.group, 0, 1)}

    def load(self, positions: list[int], device: torch.device, rows=None):
        return self.batches[tuple(positions)]


@contextlib.contextmanager
def _preloaded(run, steps: int):
    """run's source swapped for a PreloadedSource of its next `steps` steps."""
    saved = run.source
    run.source = PreloadedSource(run, steps)
    try:
        yield
    finally:
        run.source = saved


def part_train_preloaded(ctx: Context) -> dict[str, Any]:
    run = ctx.run
    steps = ctx.args.preload_steps
    with _preloaded(run, steps):
        timed = timed_steps(run, 1e9, steps)
    return {**timed, "note": "loop.train_step over the same kind of batches, loaded onto the device beforehand"}


def part_profile(ctx: Context) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    from eyas.train.loop import train_step

    run = ctx.run
    cuda = run.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    lengths = []
    with profile(activities=activities) as prof:
        sync(run.device)
        start = time.perf_counter()
        for _ in range(ctx.args.profile_steps):
            lengths += _step_lengths(run)
            train_step(run)
        sync(run.device)
        wall = time.perf_counter() - start
    start = time.perf_counter()
    events = prof.key_averages()
    kernels = [e for e in events if _is_kernel(e)] if cuda else []
    total = sum(_self_device_us(e) for e in kernels)
    top = sorted(kernels, key=_self_device_us, reverse=True)[: ctx.args.top]
    cpu_top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[: ctx.args.top]
    ops = [e for e in events if not _is_kernel(e)]
    op_top = sorted(ops, key=_self_device_us, reverse=True)[: ctx.args.top] if cuda else []
    return {
        "steps": ctx.args.profile_steps, "tokens": sum(lengths), "wall_s": wall, "tok_s_under_profiler": sum(lengths) / wall,
        "kernel_total_ms": total / 1e3, "gpu_busy_share": total / 1e6 / wall if cuda else None,
        "top_cuda_kernels": [{"name": e.key[:200], "total_ms": round(_self_device_us(e) / 1e3, 3), "calls": e.count,
                              "share": round(_self_device_us(e) / total, 4) if total else None} for e in top],
        "kernel_classes": _kernel_classes(kernels, total),
        "top_ops_by_kernel_time": [{"name": e.key[:200], "kernel_ms": round(_self_device_us(e) / 1e3, 3), "calls": e.count}
                                   for e in op_top],
        "top_cpu_ops_self": [{"name": e.key[:200], "self_cpu_ms": round(e.self_cpu_time_total / 1e3, 3), "calls": e.count}
                             for e in cpu_top],
        "analysis_s": time.perf_counter() - start,
    }


def _self_device_us(e) -> float:
    return float(getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0) or 0.0)


def _is_kernel(e) -> bool:
    """A GPU kernel (or memcpy/memset) row of key_averages, not a CPU-side op."""
    kind = getattr(e, "device_type", None)
    if kind is not None and str(kind).endswith("CUDA"):
        return True
    return e.self_cpu_time_total == 0 and _self_device_us(e) > 0


KERNEL_CLASSES = [  # first match wins; names as CUDA/Triton report them
    ("flex attention", re.compile(r"flex|triton_tem", re.I)),
    ("sdpa/flash attention", re.compile(r"flash|fmha|attention|efficient", re.I)),
    ("matmul (cuBLAS/CUTLASS)", re.compile(r"gemm|xmma|cutlass|nvjet|sm90_|sm80_|cublas", re.I)),
    ("triton fused (compiled)", re.compile(r"^triton_", re.I)),
    ("memcpy/memset", re.compile(r"memcpy|memset", re.I)),
    ("reduce/softmax/argmax", re.compile(r"reduce|softmax|argmax|norm", re.I)),
    ("elementwise/copy/index", re.compile(r"elementwise|vectorized|copy|index|gather|scatter|cat", re.I)),
]


def _kernel_classes(kernels, total: float) -> dict[str, float]:
    out: dict[str, float] = {}
    for e in kernels:
        name = next((label for label, rx in KERNEL_CLASSES if rx.search(e.key)), "other")
        out[name] = out.get(name, 0.0) + _self_device_us(e)
    return {k: round(v / total, 4) for k, v in sorted(out.items(), key=lambda kv: -kv[1])} if total else {}


class InMemorySource(OnDevice):
    """A training source of random samples whose states already sit on the device: every
    sample's hidden is a view of one random [max_len, L+1, H] tensor (speed does not depend
    on values); `load` pads on the device as StoreSource pads on the host."""

    def __init__(self, lengths: list[int], draft, device: torch.device, dtype=torch.float32, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        layers, hidden_size, vocab = len(draft.layer_ids), draft.hidden_size, draft.vocab_size
        self.identity, self.layer_ids, self.hidden_size = draft.identity, draft.layer_ids, hidden_size
        self.chat_template, self.cropped = None, 0
        self.lengths = list(lengths)
        self.sample_index = list(range(len(lengths)))
        self._ids = [torch.randint(2, vocab, (n,), generator=g) for n in lengths]
        self._masks = []
        for n in lengths:
            mask = torch.ones(n, dtype=torch.bool)
            mask[: n // 5] = False
            self._masks.append(mask)
        self._hidden = torch.randn(max(lengths), layers, hidden_size, device=device, dtype=dtype)

    def tokens(self, pos: int):
        return self._ids[pos], self._masks[pos]

    def load(self, positions: list[int], device: torch.device, rows=None):
        from eyas.train.data import Batch

        T = max(self.lengths[p] for p in positions)
        ids = torch.zeros(len(positions), T, dtype=torch.long)
        mask = torch.zeros(len(positions), T, dtype=torch.bool)
        hidden = self._hidden.new_zeros(len(positions), T, *self._hidden.shape[1:])
        for b, p in enumerate(positions):
            n = self.lengths[p]
            ids[b, :n], mask[b, :n] = self._ids[p], self._masks[p]
            hidden[b, :n] = self._hidden[:n]
        return Batch(ids.to(device), mask.to(device), hidden, [self.sample_index[p] for p in positions])


def in_memory_run(cfg, draft, head, source, device: torch.device):
    """`eyas train`'s own run (loop.setup) over `source`, with the target's `head` and `draft` given in memory."""
    from eyas import distributed
    from eyas.train.loop import InMemory, setup

    d, device = distributed.init(str(device), False)
    return setup(cfg, d, device, InMemory(source, head, draft))


def part_fixed(ctx: Context) -> dict[str, Any]:
    """The offline run's drafter and optimizer, fed 4 x 2048-token in-memory batches."""
    from eyas.train.data import BatchStream

    run = ctx.run
    saved = run.source, run.train_stream
    T = 256 if ctx.tiny else 2048
    run.source = InMemorySource([T] * 8, run.draft, run.device)
    run.train_stream = BatchStream(list(range(8)), run.source.lengths, run.source.sample_index, 4 * T, 0)
    try:
        from eyas.train.loop import train_step

        train_step(run)  # a new T: its block masks
        timed = timed_steps(run, ctx.args.train_seconds / 2, 100)
    finally:
        run.source, run.train_stream = saved
    return {**timed, "batch": f"4 x {T}", "compare": "docs/train.md: 23.4k tok/s (flex attention, 4 x 2048, H200)"}


def plain_step(drafter, head, optimizer, draft_ids: torch.Tensor, input_ids, aux, last, loss_mask, steps: int,
               decay: float = 0.8) -> torch.Tensor:
    """The plain peer-style step on one sample (input_ids [1, T], aux [1, T, L, H], last [1, T, H]):
    full fp32 target logits for the labels, every step's keys concatenated and attended with
    SDPA under a dense boolean mask, fp32 full logits and log-softmax per step, AdamW."""
    import torch.nn.functional as F

    T = input_ids.shape[1]
    device = input_ids.device
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda"):
        with torch.no_grad():
            target = head.logits(last).float()  # [1, T, V]
            probs = target[..., draft_ids].softmax(-1)  # [1, T, Vd]
            valid = (target.argmax(-1)[..., None] == draft_ids).any(-1)  # [1, T]
        hidden = drafter.combine(aux)  # [1, T, H]
        padded = F.pad(input_ids, (0, steps))
        pos = torch.arange(T, device=device)[None]
        causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()
        eye = torch.eye(T, dtype=torch.bool, device=device)
        trained = torch.zeros_like(loss_mask)
        trained[:, :-1] = loss_mask[:, 1:]  # position j is trained iff token j+1 is an answer token
        keys, values = [], []
        loss = torch.zeros((), device=device)
        layer = drafter.midlayer
        for k in range(steps):
            x, residual = layer.pre_attention(drafter.embed_tokens(padded[:, 1 + k : 1 + k + T]), hidden)
            cos, sin = drafter.rope(x, pos + k)
            q, kk, vv = layer.self_attn.qkv(x, cos, sin)
            keys.append(kk)
            values.append(vv)
            mask = torch.cat([causal, *([eye] * k)], dim=1)  # [T, (k+1)T]
            out = F.scaled_dot_product_attention(q, torch.cat(keys, 2), torch.cat(values, 2), attn_mask=mask,
                                                 enable_gqa=True)
            logits, hidden = drafter.outputs(layer.post_attention(out.transpose(1, 2).flatten(2), residual))
            n = T - 1 - k
            logp = logits[:, :n].float().log_softmax(-1)
            m = (trained[:, 1 + k :] & valid[:, 1 + k :]).float()  # [1, n]
            ce = -(probs[:, 1 + k :] * logp).sum(-1)
            loss = loss + decay ** k * (ce * m).sum() / m.sum().clamp_min(1)
    loss.backward()
    torch.nn.utils.clip_grad_norm_([p for p in drafter.parameters() if p.requires_grad], 0.5)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def _eight_b_draft(ctx: Context):
    """The DraftConfig eyas builds for the bench's target (as loop.setup would)."""
    from transformers import AutoConfig

    from eyas.draft.config import DraftConfig
    from eyas.models import load_tokenizer, model_identity
    from eyas.models.layers import resolve_layer_ids

    config = AutoConfig.from_pretrained(ctx.folder)
    identity = model_identity(str(ctx.folder), config, load_tokenizer(str(ctx.folder)))
    layer_ids = resolve_layer_ids("auto", config.num_hidden_layers)
    return DraftConfig.for_target(config, identity, layer_ids, min(32000, config.vocab_size), ttt_steps=TTT_STEPS)


def part_plain(ctx: Context) -> dict[str, Any]:
    from eyas.draft.model import Eagle3Drafter
    from eyas.models.target_head import load_target_head

    device = ctx.device
    draft = _eight_b_draft(ctx)
    T = 256 if ctx.tiny else 2048
    with Peak(device) as peak:
        head = load_target_head(ctx.folder).to(device)
        torch.manual_seed(0)
        with torch.device(device):
            drafter = Eagle3Drafter(draft, head.embed_weight)
        draft_ids = torch.randperm(draft.vocab_size)[: draft.draft_vocab_size].sort().values.to(device)
        drafter.set_vocab(draft_ids)
        optimizer = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=1e-4, betas=(0.9, 0.95))
        L, H = len(draft.aux_layer_ids), draft.hidden_size
        ids = torch.randint(2, draft.vocab_size, (1, T), device=device)
        aux, last = torch.randn(1, T, L, H, device=device), torch.randn(1, T, H, device=device)
        mask = torch.ones(1, T, dtype=torch.bool, device=device)
        mask[:, : T // 5] = False
        args = (drafter, head, optimizer, draft_ids, ids, aux, last, mask, TTT_STEPS)
        plain_step(*args)  # warm-up
        sync(device)
        start, steps = time.perf_counter(), 0
        while steps < 2 or (time.perf_counter() - start < ctx.args.train_seconds / 2 and steps < 50):
            plain_step(*args)
            steps += 1
        sync(device)
        wall = time.perf_counter() - start
    flops = train_flops(draft, draft.vocab_size, [T] * steps)["total"]
    return {"tok_s": T * steps / wall, "tflops": flops / wall / 1e12, "steps": steps, "tokens_per_step": T,
            **peak.report(), "fraction_of_790": flops / wall / 1e12 / PEAK_TFLOPS}


def part_online(ctx: Context) -> dict[str, Any]:
    from eyas import distributed
    from eyas.train.loop import setup, train_step

    cfg = _train_config(ctx, online=True, model=str(ctx.folder), data=str(ctx.prepared))
    d, device = distributed.init(cfg.device, False)
    with Peak(device) as peak:
        run = setup(cfg, d, device)
        for _ in range(ctx.args.warm_steps):
            train_step(run)
        # The target's forward alone, as the loop runs it (OnlineSource.load), over the next steps' batches.
        n = ctx.args.online_steps
        batches = [b for s in range(run.step, run.step + n) for b in run.train_stream.for_step(s, run.group, 0, 1)]
        sync(device)
        start = time.perf_counter()
        for positions in batches:
            run.source.load(positions, device)
        sync(device)
        forward_s = time.perf_counter() - start
        tokens = sum(run.source.lengths[p] for b in batches for p in b)
        timed = timed_steps(run, 1e9, n)
    forward = tokens / forward_s
    parts = ctx_parts(ctx)
    head_part = "train_preloaded" if parts.get("train_preloaded", {}).get("ok") else "train"
    head = parts.get(head_part, {}).get("tok_s") if parts.get(head_part, {}).get("ok") else None
    predicted = 1 / (1 / forward + 1 / head) if head else None
    return {**timed, **peak.report(), "forward_alone_tok_s": forward, "head_alone_tok_s": head, "head_alone_from": head_part,
            "predicted_tok_s": predicted, "over_predicted": timed["tok_s"] / predicted if predicted else None,
            "prediction": "1 / (1/forward_alone + 1/head_alone): the two run one after the other"}


def ctx_parts(ctx: Context) -> dict[str, Any]:
    return ctx.record.data["parts"]


def part_seed(ctx: Context) -> dict[str, Any]:
    """The trainer's step for the drafter eyas builds for Kimi-K2, on in-memory batches."""
    from transformers import DeepseekV3Config

    from eyas.draft.config import DraftConfig
    from eyas.models.identity import ModelIdentity
    from eyas.models.target_head import TargetHead

    shape = SEED_SHAPES[ctx.args.shape]
    config = DeepseekV3Config(**shape, rope_parameters={"rope_type": "default", "rope_theta": 50000.0})
    N = shape["num_hidden_layers"]
    layer_ids = (2, N // 2, N - 3, N)
    identity = ModelIdentity(model="kimi-k2-shape", config_hash="random", tokenizer_hash="random", num_layers=N,
                             hidden_size=shape["hidden_size"], vocab_size=shape["vocab_size"])
    V, H = shape["vocab_size"], shape["hidden_size"]
    draft = DraftConfig.for_target(config, identity, layer_ids, min(32000, V // 2), ttt_steps=TTT_STEPS)
    device = ctx.device
    cfg = _train_config(ctx, store="(in memory)")
    with Peak(device) as peak:
        norm = torch.nn.RMSNorm(H, eps=1e-6).to(device)
        with torch.device(device):
            embed = torch.randn(V, H) * 0.02
            lm_head = torch.randn(V, H) * 0.02
        rng = random.Random(1)
        lengths = [rng.randint(32, 256) if ctx.tiny else rng.randint(256, 2048) for _ in range(96)]
        source = InMemorySource(lengths, draft, device)
        run = in_memory_run(cfg, draft, TargetHead(embed, norm, lm_head), source, device)
        del embed
        run.head = TargetHead(None, norm, lm_head)  # the drafter holds its own copy of the embeddings
        from eyas.train.loop import train_step

        start = time.monotonic()
        for _ in range(ctx.args.warm_steps):
            train_step(run)
        sync(device)
        warm = time.monotonic() - start
        timed = timed_steps(run, ctx.args.train_seconds, 100)
    trainable = sum(p.numel() for p in run.model.parameters() if p.requires_grad)
    return {**timed, **peak.report(), "warm_s_incl_compile": warm, "trainable_params": trainable,
            "draft": {k: getattr(draft, k) for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                                     "num_key_value_heads", "head_dim", "vocab_size", "draft_vocab_size")},
            "note": "DraftConfig.for_target of a DeepseekV3Config at Kimi-K2's sizes; random head and in-memory "
                    "batches of 256-2048-token samples; peak above what was resident before"}


# ---------------------------------------------------------------- main

# name, seconds it needs at least (8b on an H200), function
PARTS: list[tuple[str, float, Callable[[Context], dict[str, Any]]]] = [
    ("forward", 15, part_forward),
    ("capture_fp8", 20, lambda c: part_capture(c, "fp8")),
    ("capture_bf16", 20, lambda c: part_capture(c, "bf16")),
    ("disk", 6, part_disk),
    ("batch1_loop", 6, part_batch1),
    ("train", 45, part_train),
    ("train_parts", 10, part_train_parts),
    ("train_preloaded", 10, part_train_preloaded),
    ("profile", 12, part_profile),
    ("plain_step", 8, part_plain),
    ("online", 20, part_online),
    ("seed", 40, part_seed),
    ("fixed_4x2048", 8, part_fixed),  # a diagnostic: last
]
NEEDS = {"train": "capture_fp8", "train_parts": "train", "train_preloaded": "train",
         "profile": "train", "fixed_4x2048": "train"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="8b", choices=["8b", "tiny"])
    p.add_argument("--device", default="cuda")
    p.add_argument("--tokens", type=int, default=None, help="prepared tokens (default 262144 at 8b, 6000 at tiny)")
    p.add_argument("--batch-tokens", type=int, default=None, help="capture's --batch-tokens (default 16384; 4096 at tiny)")
    p.add_argument("--batch1-tokens", type=int, default=None,
                   help="tokens through the batch-1 loop (default 32768; 2048 at tiny)")
    p.add_argument("--minutes", type=float, default=4.5, help="the whole run's budget; parts that would not fit are skipped")
    p.add_argument("--train-seconds", type=float, default=10.0, help="timed seconds of the main training measurement")
    p.add_argument("--warm-steps", type=int, default=3)
    p.add_argument("--parts-steps", type=int, default=4)
    p.add_argument("--preload-steps", type=int, default=8)
    p.add_argument("--profile-steps", type=int, default=3)
    p.add_argument("--online-steps", type=int, default=8)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--parts", default=None, help="comma-separated subset of: " + ",".join(n for n, _, _ in PARTS))
    p.add_argument("--work", default="/tmp/eyas-speed", help="model folder, prepared data and stores (on the disk measured)")
    p.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for speed_gpu.json (default $OUT)")
    p.add_argument("--commit", default=None, help="recorded if git is not available where this runs")
    args = p.parse_args()
    tiny = args.shape == "tiny"
    args.tokens = args.tokens or (6000 if tiny else 262_144)
    args.batch_tokens = args.batch_tokens or (4096 if tiny else 16384)
    args.batch1_tokens = args.batch1_tokens or (2048 if tiny else 32_768)
    if tiny:
        args.train_seconds = min(args.train_seconds, 2.0)
        args.warm_steps = min(args.warm_steps, 1)
        args.parts_steps, args.preload_steps = min(args.parts_steps, 2), min(args.preload_steps, 2)
        args.profile_steps, args.online_steps = min(args.profile_steps, 1), min(args.online_steps, 2)

    device = torch.device(args.device)
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)  # an earlier run's stores would be resumed
    work.mkdir(parents=True)
    machine = torch.cuda.get_device_name(0) if device.type == "cuda" else f"cpu x{os.cpu_count()}"
    global LEFT
    record = Record(Path(args.out) / "speed_gpu.json", args.minutes, {
        "command": "python3 " + " ".join([sys.argv[0], *sys.argv[1:]]),
        "commit": git("rev-parse", "HEAD") or args.commit, "dirty": bool(git("status", "--porcelain")),
        "machine": machine, "torch": torch.__version__, "shape": args.shape, "tokens": args.tokens,
        "tokens_note": "fewer than the issue's 1M tokens, to fit one call; rates, not totals, are compared",
        "peak_tflops": PEAK_TFLOPS, "flop_formula": FLOP_FORMULA,
    })
    LEFT = record.left
    logging.getLogger("torch._dynamo").addHandler(DYNAMO_WARNINGS)
    ctx = Context(args=args, device=device, work=work, folder=work / "model", prepared=work / "prepared", record=record)
    say(f"speed_gpu: {machine}, shape {args.shape}, {args.tokens:,} tokens, budget {args.minutes} min -> {record.path}")
    if record.run("build", 10, lambda: build(ctx)) is None:
        say("build failed: nothing else can run")
        return
    wanted = set(args.parts.split(",")) if args.parts else None
    scale = 0.1 if tiny else 1.0
    for name, need, fn in PARTS:
        if wanted is not None and name not in wanted:
            continue
        if name == "seed":
            ctx.model = None  # the target is not needed any more: give its memory to the seed's head
            free_memory()
        dependency = NEEDS.get(name)
        if dependency and not record.data["parts"].get(dependency, {}).get("ok"):
            record.data["parts"][name] = {"ok": False, "skipped": f"needs {dependency}, which did not succeed"}
            record.save()
            say(f"[{record.elapsed():6.1f} s] {name}: SKIPPED (needs {dependency})")
            continue
        record.run(name, need * scale, lambda: fn(ctx))
    heads = {k: record.data[k] for k in Record.HEADLINE}
    say(f"[{record.elapsed():6.1f} s] finished; headline: " + json.dumps(heads, default=str))


if __name__ == "__main__":
    main()
