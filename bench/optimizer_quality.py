"""AdamW against Muon (`eyas train --optimizer`) on one store: the same steps, batches, seed
and schedule, each optimizer at each learning rate of --lrs; reported per run: held-out top-1
accuracy per TTT step and tau_sim (training's own held-out pass on the same samples) and
seconds per step; then each optimizer at its best learning rate, and Muon's accuracy minus
AdamW's there. Any device; a store of any target (`eyas capture`). An --out that holds runs
with the same settings keeps them, so a sweep can grow over several calls.

  PYTHONPATH=src python3 bench/optimizer_quality.py --store STORE --out OUT.json \
      [--steps 200] [--batch-tokens 8192] [--ttt-steps 3] [--lrs 1e-3,3e-3] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import device_name, dump, git  # noqa: E402

OPTIMIZERS = ("adamw", "muon")


def run(args, optimizer: str, lr: float, work: Path) -> dict:
    """One training run; its final held-out pass scores it."""
    from eyas.train import TrainConfig, train

    out = work / f"{optimizer}-{lr}"
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.monotonic()
    final = train(TrainConfig(out=str(out), store=args.store, steps=args.steps, optimizer=optimizer, lr=lr,
                              batch_tokens=args.batch_tokens, max_len=args.max_len, ttt_steps=args.ttt_steps,
                              draft_vocab=args.draft_vocab, fc_norm=True, norm_output=True, device=args.device,
                              eval_fraction=args.eval_fraction, eval_every=args.steps, save_every=10**6,
                              log_every=max(args.steps // 10, 1), seed=args.seed, progress=False))
    seconds = time.monotonic() - t0
    held = final["eval"]
    return {"optimizer": optimizer, "lr": lr, "acc_per_step": held["acc_per_step"], "tau_sim": round(held["tau_sim"], 4),
            "loss": round(held["loss"], 5), "positions": held["positions"], "seconds": round(seconds, 1),
            "s_per_step": round(seconds / args.steps, 3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--store", required=True, help="a hidden-state store (eyas capture)")
    p.add_argument("--out", required=True, help="the result JSON")
    p.add_argument("--work", default=None, help="training folders (default: beside --out, removed at the end)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--lrs", default="1e-3", help="comma-separated learning rates, each run with each optimizer")
    p.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    p.add_argument("--batch-tokens", type=int, default=8192)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--ttt-steps", type=int, default=3)
    p.add_argument("--draft-vocab", type=int, default=32000)
    p.add_argument("--eval-fraction", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None)
    args = p.parse_args()
    out = Path(args.out)
    work = Path(args.work) if args.work else out.with_name(out.stem + "-work")
    settings = {k: v for k, v in vars(args).items() if k not in ("out", "work", "lrs", "optimizers")}
    result = {"settings": settings, "runs": {}, "commands": []}
    if out.exists():
        earlier = json.loads(out.read_text())
        if earlier.get("settings") != settings:
            raise SystemExit(f"{out} holds runs with other settings: {earlier.get('settings')}")
        result = earlier
    result.update(device=device_name(args.device or "cpu"), commit=git("rev-parse", "--short", "HEAD"))
    result["commands"].append("bench/optimizer_quality.py " + " ".join(sys.argv[1:]))
    for lr in map(float, args.lrs.split(",")):
        for optimizer in args.optimizers.split(","):
            key = f"{optimizer}@{lr:g}"
            if key not in result["runs"]:
                result["runs"][key] = run(args, optimizer, lr, work)
                print(key, json.dumps(result["runs"][key]), flush=True)
                dump(out, result)
    best = {name: max((r for r in result["runs"].values() if r["optimizer"] == name), key=lambda r: r["tau_sim"],
                      default=None) for name in OPTIMIZERS}
    result["best"] = {name: r and {"lr": r["lr"], "acc_per_step": r["acc_per_step"], "tau_sim": r["tau_sim"]}
                      for name, r in best.items()}
    if best["adamw"] and best["muon"]:
        result["muon_minus_adamw_acc_per_step_at_best_lr"] = [
            round(m - a, 4) for m, a in zip(best["muon"]["acc_per_step"], best["adamw"]["acc_per_step"])]
    dump(out, result)
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps({k: result[k] for k in result if k.startswith(("best", "muon_"))}))


if __name__ == "__main__":
    main()
