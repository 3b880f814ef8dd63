"""Long samples at the Llama-3.1-8B shape on one GPU (issue 42): the longest single sample whose
training step fits, and the peak memory at each length, for each setting side by side (the
plain step, and `--checkpoint-steps`, which recomputes each TTT step in backward); then, for
each setting that fits a 65,536-token sample, tok/s on one such sample against eight of 8,192
at the same tokens per step (the faster setting at 64k is the headline).

The trainer's own step (loop.train_step, flex TTT attention, 7 steps, bf16 autocast, the
chunked loss) on in-memory random samples and states, as bench/mla_gpu.py does at the seed's
shape: no model folder. The drafter is the one eyas builds for Llama-3.1-8B (hidden 4096, 32
heads, 8 KV heads, MLP 14336, target vocabulary 128256, draft vocabulary 32000, `auto` layers).

Top-level keys: `max_seq_len_8b_1gpu` (the longest of any setting), `setting` (the headline's),
`peak_gib_16k`, `peak_gib_32k`, `peak_gib_64k` (that setting's; None where it did not fit),
`tok_s_64k_over_8k`.

  PYTHONPATH=src python3 -u bench/long_context_gpu.py --out $OUT --commit SHA   # H200, ~5 min
  PYTHONPATH=src python3 -u bench/long_context_gpu.py --smoke --out /tmp/long    # CPU, tiny shapes
"""

from __future__ import annotations

import time

STARTED = time.monotonic()

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import speed_gpu  # noqa: E402
from common import Peak, free_memory, git, say, sync  # noqa: E402
from mla_gpu import fits, make_run  # noqa: E402
from random_target import random_target_config  # noqa: E402

SETTINGS = {"plain": {}, "checkpoint-steps": {"checkpoint_steps": True}}
TTT_STEPS = 7


def left(budget_s: float) -> float:
    return budget_s - (time.monotonic() - STARTED)


def drafter_config(shape: str):
    """The DraftConfig eyas builds for a Llama of `shape` (positions enough for any probe)."""
    from eyas.draft.config import DraftConfig
    from eyas.models.identity import ModelIdentity
    from eyas.models.layers import resolve_layer_ids

    config, _ = random_target_config(shape)
    config.max_position_embeddings = 262144
    N = config.num_hidden_layers
    identity = ModelIdentity(model=f"llama-{shape}-shape", config_hash="random", tokenizer_hash="random",
                             num_layers=N, hidden_size=config.hidden_size, vocab_size=config.vocab_size)
    return DraftConfig.for_target(config, identity, resolve_layer_ids("auto", N), min(32000, config.vocab_size),
                                  ttt_steps=TTT_STEPS)


def probe(draft, lengths: list[int], device: torch.device, options: dict, name: str, budget_s: float,
          reserve_s: float) -> dict[str, Any]:
    """One step on one sample of each length, shortest first, until one does not fit."""
    tried, best = {}, None
    for length in lengths:
        if left(budget_s) < reserve_s:
            tried["stopped"] = "budget"
            break
        start = time.monotonic()
        result = fits(draft, length, device, **options)
        tried[str(length)] = {**result, "s": round(time.monotonic() - start, 1)}
        say(f"  {name} {length} tokens: {'fits' if result['fits'] else 'out of memory'} {result.get('peak_gib', '')}")
        if not result["fits"]:
            break
        best = length
    return {"largest_fitting_tokens": best, "tried": tried}


def rate(draft, lengths: list[int], batch_tokens: int, device: torch.device, options: dict, seconds: float,
         warm_steps: int) -> dict[str, Any]:
    """tok/s of the trainer's step over samples of `lengths`, `batch_tokens` a step, after warm-up."""
    from eyas.train.loop import train_step

    with Peak(device) as peak:
        run = make_run(draft, lengths, batch_tokens, device, **options)
        for _ in range(warm_steps):
            train_step(run)
        sync(device)
        timed = speed_gpu.timed_steps(run, seconds, 50)
    del run
    free_memory()
    return {**{k: timed[k] for k in ("tok_s", "steps", "tokens", "wall_s")}, **peak.report()}


def kept_for_backward(draft, lengths: list[int], device: torch.device, options: dict) -> dict[str, Any]:
    """What one training step keeps for backward, by the drafter module that saved it, at each
    of `lengths` (one sample each): the trainer's own step under saved-tensor hooks, each
    storage counted once, the drafter's weights not at all. With three lengths or more, each
    module's bytes are fit to c + a*T + b*T^2, so the bytes per token (a) can be told from what
    does not grow (c: e.g. the head's gradient, computed in the forward) and a quadratic term
    (b: off CUDA, the dense TTT attention's scores; the flex attention used on CUDA keeps
    none). Device-free: it runs on the CPU at the 8B shape, where no GPU is at hand."""
    from eyas.train.loop import accumulate

    by_length: dict[int, dict[str, int]] = {}
    for length in lengths:
        run = make_run(draft, [length], length, device, **options)
        names, stack, kept = {m: n or "drafter" for n, m in run.model.named_modules()}, [], {}
        # Weights are resident whatever the length: only activations are counted.
        seen = {t.untyped_storage().data_ptr() for t in [*run.model.parameters(), *run.model.buffers()]}

        def enter(module, *_) -> None:
            stack.append(names[module])

        def leave(module, *_) -> None:  # returns None: a forward hook's result would replace the output
            stack.pop()

        handles = [m.register_forward_pre_hook(enter) for m in names] + [m.register_forward_hook(leave) for m in names]

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                where = stack[-1] if stack else "loss"
                kept[where] = kept.get(where, 0) + storage.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            accumulate(run)
        for h in handles:
            h.remove()
        by_length[length] = kept
        del run
        free_memory()
    out: dict[str, Any] = {"bytes": {str(n): dict(sorted(k.items(), key=lambda kv: -kv[1])) for n, k in by_length.items()}}
    if len(lengths) >= 3:  # y = c + a*T + b*T^2 per module, least squares
        import numpy as np

        T = np.array(sorted(by_length), dtype=float)
        basis = np.stack([np.ones_like(T), T, T * T], axis=1)
        fit = {}
        for where in {w for k in by_length.values() for w in k}:
            y = np.array([by_length[int(t)].get(where, 0) for t in T], dtype=float)
            c, a, b = np.linalg.lstsq(basis, y, rcond=None)[0]
            fit[where] = {"bytes_per_token": round(a), "bytes_per_token_squared": round(b, 3), "bytes_fixed": round(c)}
        out["fit"] = dict(sorted(fit.items(), key=lambda kv: -kv[1]["bytes_per_token"]))
        out["bytes_per_token"] = sum(f["bytes_per_token"] for f in fit.values())
        out["bytes_fixed"] = sum(f["bytes_fixed"] for f in fit.values())
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: proves the script runs")
    p.add_argument("--device", default=None, help="default cuda (cpu with --smoke)")
    p.add_argument("--lengths", default=None, help="comma-separated probe lengths, until one does not fit "
                   "(default 8k, 16k, 32k, 64k, 96k, 128k)")
    p.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated, of: " + ", ".join(SETTINGS))
    p.add_argument("--short", type=int, default=None, help="the short samples of the rate comparison (default 8192)")
    p.add_argument("--long", type=int, default=None, help="the long sample of the rate comparison (default 65536)")
    p.add_argument("--seconds", type=float, default=None, help="timed seconds per rate (default 20)")
    p.add_argument("--warm-steps", type=int, default=2)
    p.add_argument("--probe-reserve", type=float, default=30.0, help="seconds a probe needs at least")
    p.add_argument("--minutes", type=float, default=8.0, help="budget: probes and rates stop when it runs out")
    p.add_argument("--kept", default=None, metavar="T1,T2,T3",
                   help="only what a step keeps for backward, by module, at these lengths (three or more: fit per "
                        "token), on any device (the CPU takes the 8B shape at a few hundred tokens), for each setting")
    p.add_argument("--out", default=".", help="folder for long_context_gpu.json")
    p.add_argument("--commit", default=None, help="recorded if git is not available where this runs")
    args = p.parse_args()
    shape = "tiny" if args.smoke else "8b"  # --kept on the CPU keeps the 8B shape
    device = torch.device(args.device or ("cpu" if args.smoke else "cuda"))
    default_lengths = [128, 256, 512] if args.smoke else [8192, 16384, 32768, 65536, 98304, 131072]
    lengths = [int(n) for n in args.lengths.split(",")] if args.lengths else default_lengths
    short, long_ = args.short or (128 if args.smoke else 8192), args.long or (512 if args.smoke else 65536)
    seconds = args.seconds or (2.0 if args.smoke else 20.0)
    budget = 60 * args.minutes
    draft = drafter_config(shape)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record: dict[str, Any] = {"command": " ".join(sys.argv), "commit": args.commit or git("rev-parse", "HEAD"),
                              "machine": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                              "shape": shape, "ttt_steps": TTT_STEPS, "draft_vocab": draft.draft_vocab_size,
                              "settings": {}}

    def save() -> None:
        record["elapsed_s"] = round(time.monotonic() - STARTED, 1)
        (out / "long_context_gpu.json").write_text(json.dumps(record, indent=1))

    if args.kept:
        record["kept_for_backward"] = {}
        for name in args.settings.split(","):
            say(f"kept for backward: {name}")
            record["kept_for_backward"][name] = kept_for_backward(draft, [int(n) for n in args.kept.split(",")],
                                                                 device, SETTINGS[name])
            save()
        say({n: k.get("bytes_per_token") for n, k in record["kept_for_backward"].items()})
        return
    for name in args.settings.split(","):
        say(f"probing {name}")
        record["settings"][name] = probe(draft, lengths, device, SETTINGS[name], name, budget, args.probe_reserve)
        save()
    best = max(record["settings"], key=lambda n: (record["settings"][n]["largest_fitting_tokens"] or 0,
                                                  n == "plain"))  # the plain step where both reach as far
    record.update({"max_seq_len_8b_1gpu": record["settings"][best]["largest_fitting_tokens"]})
    reach = [n for n in record["settings"] if (record["settings"][n]["largest_fitting_tokens"] or 0) >= long_]
    record["rate"] = {}
    for name in reach:  # each setting that fits the long sample: the faster one is the headline
        if left(budget) < 2 * seconds + 60:
            record["rate"][name] = "budget"
            break
        say(f"rates with {name}: {long_ // short} x {short} against 1 x {long_}")
        try:
            r = {f"{long_ // short}x{short}": rate(draft, [short] * (long_ // short), long_, device, SETTINGS[name],
                                                   seconds, args.warm_steps),
                 f"1x{long_}": rate(draft, [long_] * 2, long_, device, SETTINGS[name], seconds, args.warm_steps)}
            r["long_over_short"] = round(r[f"1x{long_}"]["tok_s"] / r[f"{long_ // short}x{short}"]["tok_s"], 3)
        except torch.OutOfMemoryError as e:  # steps in a row can fragment what one step fitted
            r = {"error": str(e).splitlines()[0][:200]}
            free_memory()
        record["rate"][name] = r
        save()
    rated = [n for n in reach if isinstance(record["rate"].get(n), dict) and "long_over_short" in record["rate"][n]]
    if rated:
        best = max(rated, key=lambda n: record["rate"][n][f"1x{long_}"]["tok_s"])
        record["tok_s_64k_over_8k"] = record["rate"][best]["long_over_short"]
    tried = record["settings"][best]["tried"]
    record.update({"setting": best,
                   **{f"peak_gib_{n // 1024}k": tried.get(str(n), {}).get("peak_gib") for n in (16384, 32768, 65536)}})
    save()
    say({k: record.get(k) for k in ("setting", "max_seq_len_8b_1gpu", "peak_gib_16k", "peak_gib_32k", "peak_gib_64k",
                                    "tok_s_64k_over_8k")})


if __name__ == "__main__":
    main()
