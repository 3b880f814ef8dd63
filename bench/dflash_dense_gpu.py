"""DFlash training against anchor density, its loss chunked or held whole, on one GPU (issue 41).

A DFlash step scores K = block - 1 slots of every anchored block. With the loss held whole,
every scored slot's draft-vocab logits and their float32 softmax, log-softmax and gradient
stay in memory at once (what stopped eyas at one anchor per 512 tokens); draft/loss.py runs
the head and the loss a chunk of pairs at a time instead (`LOSS_CHUNK` logits). For each
target shape and anchor density this runs `eyas train`'s own step (loop.train_step, bf16
autocast, compiled flex block attention, AdamW) on in-memory random batches of --samples x
--length tokens, block --block and --layers layers, once with the loss chunked (eyas's
default) and once held whole (one chunk), and reports peak memory above what was resident,
tokens/s and the anchors a step trains. Random weights and states: memory and speed do not
depend on their values.

Top-level keys: `anchors_per_step`, `peak_gib_dflash` (the densest chunked setting that ran on
the first shape, with its anchors), and a table per shape.

  PYTHONPATH=src python3 -u bench/dflash_dense_gpu.py --out $OUT/dense.json         # H200, ~3 min
  PYTHONPATH=src python3 -u bench/dflash_dense_gpu.py --smoke --out /tmp/dense.json  # CPU, tiny shapes
"""

from __future__ import annotations

import time

STARTED = time.monotonic()

import argparse
import sys
import traceback
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Peak, device_name, dump, free_memory, git, say, sync  # noqa: E402
from speed_gpu import InMemorySource, in_memory_run  # noqa: E402

SHAPES = {  # the target's text config (Llama fields)
    "smollm2": dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                    vocab_size=49152, num_hidden_layers=30),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
               vocab_size=128256, num_hidden_layers=32),
    "smoke": dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=2048, num_hidden_layers=8),
}
WHOLE = 1 << 62  # LOSS_CHUNK that makes every micro-batch's loss one chunk: all logits held


def draft_config(shape: str, block: int, layers: int, draft_vocab: int):
    from transformers import LlamaConfig

    from eyas.draft.config import DraftConfig
    from eyas.models.identity import ModelIdentity

    s = SHAPES[shape]
    config = LlamaConfig(**s, max_position_embeddings=8192)
    N = s["num_hidden_layers"]
    identity = ModelIdentity(model=f"llama-{shape}-shape", config_hash="random", tokenizer_hash="random",
                             num_layers=N, hidden_size=s["hidden_size"], vocab_size=s["vocab_size"])
    return DraftConfig.for_target(config, identity, (2, N // 2, N - 3, N), min(draft_vocab, s["vocab_size"]),
                                  drafter="dflash", ttt_steps=block - 1, num_hidden_layers=layers,
                                  mask_token_id=s["vocab_size"] - 1)


def make_run(draft, args, anchors: int, device: torch.device):
    """`eyas train`'s run over in-memory random samples of --length tokens."""
    from eyas.models.target_head import TargetHead
    from eyas.train.config import TrainConfig

    H, V = draft.hidden_size, draft.vocab_size
    cfg = TrainConfig(out="(in memory)", store="(in memory)", drafter="dflash", block_size=draft.ttt_steps + 1,
                      draft_layers=draft.num_hidden_layers, anchors=anchors, draft_vocab=draft.draft_vocab_size,
                      steps=1_000_000, batch_tokens=args.samples * args.length, max_len=args.length,
                      device=str(device), progress=False)
    norm = torch.nn.RMSNorm(H, eps=1e-6).to(device)
    with torch.device(device):
        embed, lm_head = torch.randn(V, H) * 0.02, torch.randn(V, H) * 0.02
    source = InMemorySource([args.length] * (4 * args.samples), draft, device)
    run = in_memory_run(cfg, draft, TargetHead(embed, norm, lm_head), source, device)
    run.head = TargetHead(None, norm, lm_head)  # the drafter holds its own copy of the embeddings
    return run


def anchors_per_step(run) -> int:
    """The anchor rows of the run's next step (train/anchors.py draws them as training does)."""
    from eyas.train.anchors import batch_rows

    micro = run.train_stream.for_step(run.step, run.group, run.d.rank, run.d.world)
    return sum(int(batch_rows(run.source, b, run.draft.ttt_steps, run.cfg.anchors, run.cfg.seed, run.step).sum())
               for b in micro)


def measure(shape: str, anchors: int, whole: bool, args, device: torch.device) -> dict[str, Any]:
    import eyas.draft.loss as loss
    from eyas.train.loop import train_step

    default = loss.LOSS_CHUNK
    loss.LOSS_CHUNK = WHOLE if whole else default
    out: dict[str, Any] = {"shape": shape, "anchors_per_sample": anchors, "loss": "whole" if whole else "chunked"}
    try:
        with Peak(device) as peak:
            run = make_run(draft_config(shape, args.block, args.layers, args.draft_vocab), args, anchors, device)
            out["anchors_per_step"] = anchors_per_step(run)
            for _ in range(args.warm_steps):
                train_step(run)
            sync(device)
            start, steps = time.perf_counter(), 0
            while steps < 2 or (time.perf_counter() - start < args.seconds and steps < 50):
                train_step(run)
                steps += 1
            sync(device)
            wall = time.perf_counter() - start
        out.update(peak.report(), steps=steps, tok_s=round(steps * args.samples * args.length / wall, 1))
    except torch.OutOfMemoryError as e:
        out["error"] = f"out of memory: {str(e).splitlines()[0][:200]}"
    except Exception as e:  # noqa: BLE001 -- a refused or failed setting is a result; the sweep goes on
        traceback.print_exc()
        out["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    finally:
        loss.LOSS_CHUNK = default
        run = None
        free_memory()
    say(f"{shape} anchors/sample {anchors:>5} ({out.get('anchors_per_step', '?')}/step) loss {out['loss']:<7}: "
        + (out["error"] if "error" in out else f"peak {out.get('peak_gib')} GiB, {out['tok_s']:,.0f} tok/s"))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="the JSON result")
    p.add_argument("--shapes", default="smollm2,8b")
    p.add_argument("--anchors", default="16,64,256,1024", help="anchors per sample, comma-separated")
    p.add_argument("--block", type=int, default=16)
    p.add_argument("--layers", type=int, default=5)
    p.add_argument("--draft-vocab", type=int, default=32000)
    p.add_argument("--samples", type=int, default=64, help="samples per step")
    p.add_argument("--length", type=int, default=1024, help="tokens per sample")
    p.add_argument("--warm-steps", type=int, default=2)
    p.add_argument("--seconds", type=float, default=6.0, help="timed seconds per setting")
    p.add_argument("--minutes", type=float, default=6.0, help="stop starting settings after this")
    p.add_argument("--device", default="cuda")
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args()
    if args.smoke:
        args.shapes, args.anchors, args.device, args.samples, args.length = "smoke", "4,16", "cpu", 2, 64
        args.block, args.layers, args.draft_vocab, args.seconds, args.warm_steps = 4, 2, 500, 1.0, 1
    device = torch.device(args.device)
    report: dict[str, Any] = {"command": " ".join(sys.argv), "commit": git("rev-parse", "HEAD"),
                              "device": device_name(args.device), "settings": vars(args), "runs": []}
    for shape in args.shapes.split(","):
        for anchors in (int(a) for a in args.anchors.split(",")):
            for whole in (False, True):
                if time.monotonic() - STARTED > 60 * args.minutes:
                    report.setdefault("skipped", []).append(f"{shape} {anchors} {'whole' if whole else 'chunked'}")
                    continue
                report["runs"].append(measure(shape, anchors, whole, args, device))
                dump(Path(args.out), report)
    first = args.shapes.split(",")[0]
    ran = [r for r in report["runs"] if r["shape"] == first and r["loss"] == "chunked" and "error" not in r]
    if ran:
        densest = max(ran, key=lambda r: r["anchors_per_step"])
        report["anchors_per_step"], report["peak_gib_dflash"] = densest["anchors_per_step"], densest.get("peak_gib")
    report["seconds"] = round(time.monotonic() - STARTED, 1)
    dump(Path(args.out), report)
    say(f"{'shape':<8} {'anchors/step':>12} {'loss':<8} {'peak GiB':>9} {'tok/s':>10}")
    for r in report["runs"]:
        say(f"{r['shape']:<8} {r.get('anchors_per_step', 0):>12} {r['loss']:<8} {r.get('peak_gib', '-')!s:>9} "
            f"{r.get('tok_s', r.get('error', ''))!s:>10}")


if __name__ == "__main__":
    main()
