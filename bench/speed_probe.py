"""Where the time goes in regeneration and online training on a small target, on a GPU,
without the real weights: a random-weight model with --model's exact config and tokenizer
(default SmolLM2-135M) runs eyas's own code paths, which cost the same whatever the weights are.

  PYTHONPATH=src python3 bench/speed_probe.py --model MODEL --data packaged:sharegpt --out OUT

It writes OUT/speed_probe.json: the regeneration loop's decode step (prefill time, ms per
step), and online training's tokens/s
with a synchronised breakdown of a step; each with the top CUDA kernels and host-side ops
from torch.profiler, so that launch-bound and compute-bound work can be told apart.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from common import profile_table  # noqa: E402

FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def random_model(model: str, folder: Path) -> None:
    """An HF folder with `model`'s config and tokenizer (any model eyas loads) and random bf16
    weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from eyas.models import resolve_model

    source = Path(resolve_model(model))
    folder.mkdir(parents=True, exist_ok=True)
    for name in FILES:
        if (source / name).exists():
            shutil.copy(source / name, folder / name)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=torch.bfloat16)
    model.save_pretrained(folder)


def prepare_sample(model_dir: Path, data: list[str], work: Path, n: int) -> dict:
    """The first `n` conversations of `data` with their original answers (training's sample
    lengths as they are), prepared for the random model."""
    from eyas.data.config import PrepareConfig
    from eyas.data.prepare import prepare

    shutil.rmtree(work / "prepared", ignore_errors=True)
    return prepare(PrepareConfig(model=str(model_dir), data=data, out=str(work / "prepared"), max_len=1024,
                                 limit=n), progress=False)


def profile_decode(model_dir: Path, rows: int = 2048, prompt: int = 256, steps: int = 256) -> dict:
    """One batch of the static-cache loop: prefill time, ms per decode step, and a profile
    of the prefill and a few steps; the same batch read three ways side by side: the written
    slots rounded up to KV_ALIGN (the default), the exact written slots, and the whole cache;
    and the default loop (a CUDA graph per decode step) against the eager one."""
    from torch.profiler import ProfilerActivity, profile

    import eyas.regenerate.static as static
    from eyas.models import load_target

    model, _ = load_target(str(model_dir), dtype="bf16", device=DEVICE)
    prompts = [[1 + (i * 7 + j) % 4000 for j in range(prompt - i % 64)] for i in range(rows)]
    # One batch of all rows (the cache holds them): generate's length sort only reorders them.
    greedy = static.StaticGreedy(model, pad_id=0, stops=[], cache_tokens=1 << 21)
    greedy.generate(prompts[:64], [4] * len(prompts[:64]))  # warm-up

    def timed(new_tokens: int, g=greedy) -> float:
        _sync()
        t0 = time.monotonic()
        g.generate(prompts, [new_tokens] * rows)
        _sync()
        return time.monotonic() - t0

    def step_ms(g=greedy) -> float:
        return 1e3 * (timed(steps, g) - timed(1, g)) / (steps - 1)

    prefill, aligned = timed(1), step_ms()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        greedy.generate(prompts, [8] * rows)
        _sync()
    align = greedy.kv_align
    exact = step_ms(static.StaticGreedy(model, pad_id=0, stops=[], cache_tokens=1 << 21, kv_align=1))
    whole = step_ms(static.StaticGreedy(model, pad_id=0, stops=[], cache_tokens=1 << 21, kv_align=1 << 30))
    # The same loop launching every kernel from Python (no CUDA graphs), as before they were
    # recorded: the graphs' gain, and the answers compared token for token.
    eager = static.StaticGreedy(model, pad_id=0, stops=[], cache_tokens=1 << 21, graphs=False)
    eager_ms = step_ms(eager)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as eager_prof:
        eager.generate(prompts, [8] * rows)
        _sync()
    same = eager.generate(prompts, [64] * rows) == greedy.generate(prompts, [64] * rows)
    return {"rows": rows, "prompt": prompt, "steps": steps, "prefill_s": round(prefill, 3), "kv_align": align,
            "decode_step_ms": round(aligned, 2), "decode_tokens_per_s": round(rows / aligned * 1e3, 1),
            "decode_step_ms_exact_slots": round(exact, 2), "decode_step_ms_reading_whole_cache": round(whole, 2),
            "whole_over_aligned": round(whole / aligned, 3), "exact_over_aligned": round(exact / aligned, 3),
            "decode_step_ms_eager": round(eager_ms, 2), "eager_over_graphs": round(eager_ms / aligned, 3),
            "graph_answers_equal_eager": same, "graphs_recorded": greedy.graphs.enabled,
            "profile_prefill_and_7_steps": profile_table(prof),
            "profile_eager_prefill_and_7_steps": profile_table(eager_prof)}


def probe_train(model_dir: Path, prepared: Path, work: Path, batch_tokens: int, steps: int, profile_steps: int,
                options: dict) -> dict:
    """eyas's own online training set-up and steps; tokens/s over the timed steps, then a
    profile of a few more."""
    from torch.profiler import ProfilerActivity, profile

    from eyas import distributed
    from eyas.train import TrainConfig
    from eyas.train.loop import setup, train_step

    out = work / f"train-{batch_tokens}"
    shutil.rmtree(out, ignore_errors=True)
    cfg = TrainConfig(online=True, model=str(model_dir), data=str(prepared), out=str(out), batch_tokens=batch_tokens,
                      max_len=1024, lr=1e-3, steps=steps + profile_steps + 4, device=DEVICE, progress=False,
                      eval_fraction=0, **options)
    d, device = distributed.init(DEVICE, False)
    run = setup(cfg, d, device)
    for _ in range(3):  # compile and warm up
        train_step(run)
    _sync()
    tokens, t0 = 0, time.monotonic()
    for _ in range(steps):
        tokens += sum(run.source.lengths[p] for b in run.train_stream.for_step(run.step, run.group, 0, 1) for p in b)
        train_step(run)
    _sync()
    seconds = time.monotonic() - t0
    # The target's forward alone over the same kind of batches, for the online ratio.
    t1, fwd_tokens = time.monotonic(), 0
    for s in range(steps):
        positions = run.train_stream.for_step(s, run.group, 0, 1)[0]
        fwd_tokens += sum(run.source.lengths[p] for p in positions)
        run.source.load(positions, device)
    _sync()
    load_s = time.monotonic() - t1
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(profile_steps):
            train_step(run)
        _sync()
    phases = phase_times(run, steps)
    return {"phases_ms_per_step": phases, "batch_tokens": batch_tokens, "options": options, "steps": steps, "seconds": round(seconds, 2),
            "tokens_per_s": round(tokens / seconds, 1), "target_forward_tokens_per_s": round(fwd_tokens / load_s, 1),
            "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1) if DEVICE == "cuda" else None,
            f"profile_{profile_steps}_steps": profile_table(prof)}


def phase_times(run, steps: int) -> dict:
    """The parts of a training step, each synchronised (the trainer's own eyas.timing.StepTimer):
    their sum against an unsynchronised step shows how much overlaps."""
    from eyas.timing import StepTimer
    from eyas.train.loop import train_step

    timer = StepTimer(run.device)
    for _ in range(steps):
        train_step(run, timer)
    return {k: round(1e3 * v / steps, 1) for k, v in timer.seconds.items()}


def run(args) -> None:
    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + 60 * args.minutes
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result: dict = {"command": " ".join(sys.argv), "commit": commit, "device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu",
                    "torch": torch.__version__}
    model_dir = work / "random-model"

    def part(name: str, fn) -> None:
        if time.monotonic() > deadline:
            result[name] = {"skipped": "out of time"}
            return
        t0 = time.monotonic()
        try:
            result[name] = fn()
        except Exception:  # a failed part is recorded; the others still run
            result[name] = {"error": traceback.format_exc()[-3000:]}
        result[name + "_wall_s"] = round(time.monotonic() - t0, 1)
        (out / "speed_probe.json").write_text(json.dumps(result, indent=1, default=str))
        print(f"{name}: {json.dumps(result[name], default=str)[:1500]}", flush=True)

    parts = set(args.parts.split(","))
    part("random_model", lambda: random_model(args.model, model_dir) or {"folder": str(model_dir)})
    if "decode" in parts:
        part("decode", lambda: profile_decode(model_dir) if DEVICE == "cuda" else profile_decode(model_dir, 8, 80, 6))
    if "train" not in parts:
        return
    part("prepare", lambda: prepare_sample(model_dir, args.data, work, args.conversations))
    prepared = work / "prepared"
    for bt in args.batch_tokens:
        part(f"train_{bt}", lambda bt=bt: probe_train(model_dir, prepared, work, bt, args.train_steps, 3,
                                                      {"fc_norm": True, "norm_output": True}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="packaged:smollm2-135m",
                   help="whose config and tokenizer the random model takes: any model eyas loads")
    p.add_argument("--data", nargs="+", default=["packaged:sharegpt"], help="any source(s) eyas prepare reads")
    p.add_argument("--work", default="/tmp/probe")
    p.add_argument("--out", required=True)
    p.add_argument("--minutes", type=float, default=4.0)
    p.add_argument("--conversations", type=int, default=3000, help="conversations of --data to train on")
    p.add_argument("--train-steps", type=int, default=8)
    p.add_argument("--batch-tokens", type=int, nargs="+", default=[65536])
    p.add_argument("--parts", default="decode,train", help="decode, train, or both (default)")
    run(p.parse_args())


if __name__ == "__main__":
    main()
