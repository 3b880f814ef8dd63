"""Live decoding's acceptance beside the walk along the very answers it decoded.

The held-out walk (tau_walk) drafts greedily along stored answers and verifies as decoding
does; on the CPU it equals the decoding loop's tau on the same text exactly
(tests/test_on_policy.py). On one H100 (bench/results/peers_quality_dflash_frozen_h100.json)
decoding accepted far less than the walk promised: DFlash walked 3.03 on held-out samples and
decoded 1.68 on held-out prompts; the EAGLE-3 chain's tau_sim was 3.27 and its tau 2.04. Two
things differ between them: the text (the first turn of a conversation, or all of its turns),
and the target's numbers (`eyas eval` runs the target in --dtype, float32 by default; training
and the walk read states the target computed in bf16 on a GPU). This script removes the first:
it decodes the prompts with `eyas eval` at each --dtypes, then walks the drafter along exactly
the answers each decode produced (the target's states computed again, as online training
does) and prints both. Equal at a dtype (but for each answer's last step, where decoding stops at
--max-new-tokens: on the CPU, 1.725 live against 1.748 walked over the same 218 steps): decoding
drafts what the walk scores there.

  PYTHONPATH=src python3 bench/walk_live.py --model M --draft D --out OUT.json [--prompts P] [--limit N]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--draft", required=True, help="a drafter folder `eyas train` wrote")
    p.add_argument("--prompts", default="mt-bench", help="as `eyas eval --prompts`")
    p.add_argument("--limit", type=int, default=10)
    p.add_argument("--max-new-tokens", type=int, default=192)
    p.add_argument("--dtypes", default="float32,bfloat16", help="the target's dtypes to decode in, comma-separated")
    p.add_argument("--device", default=None)
    p.add_argument("--work", default="/tmp/walk-live")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    result = {"model": args.model, "draft": args.draft, "prompts": args.prompts, "limit": args.limit,
              "max_new_tokens": args.max_new_tokens, "device": _device_name(args.device), "by_dtype": {}}
    for dtype in args.dtypes.split(","):
        live, plain = decode(args, dtype, work / f"results-{dtype}.json")
        answers = work / f"answers-{dtype}"
        write_answers(args.model, plain, answers)
        walk = walk_along(args, answers)
        result["by_dtype"][dtype] = {**live, "walk": walk,
                                     "walk_minus_live": round(walk["tau_walk"] - live["tau"], 4)}
        print(f"{dtype}: live tau {live['tau']:.3f} (first draft accepted at {live['accept_first']:.3f} of steps), "
              f"walk along the same answers {walk['tau_walk']:.3f} ({walk['accept_walk_per_step'][0]:.3f}); "
              f"answers equal to plain {live['identical']}", flush=True)
    result["seconds"] = round(time.monotonic() - t0, 1)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


def decode(args, dtype: str, output: Path) -> tuple[dict, list[dict]]:
    """`eyas eval` with the drafter at the depth it trained: its tau and first-draft acceptance
    over every verification step, and plain decoding's records (the answers to walk)."""
    from eyas.evaluate.config import EvalConfig
    from eyas.evaluate.run import evaluate

    results = evaluate(EvalConfig(model=args.model, draft=args.draft, prompts=args.prompts, limit=args.limit,
                                  max_new_tokens=args.max_new_tokens, baselines=(), dtype=dtype,
                                  device=args.device or EvalConfig.device, output=str(output), plot=str(output) + ".png"))
    plain = [r for r in results["records"] if r["method"] == "plain"]
    (method, summary), = ((m, v) for m, v in results["summary"].items() if m != "plain")
    return ({"method": method, "tau": round(summary["tau"], 4), "steps": summary["steps"],
             "accept_first": round(summary["acceptance"][0], 4),
             "identical": f"{summary['identical']}/{summary['answers']}"}, plain)

def write_answers(model: str, plain: list[dict], out: Path) -> None:
    """Plain decoding's answers as prepared samples, token for token: the prompt untrained, the
    answer scored (no re-tokenisation, so the walk follows exactly the decoded text)."""
    from transformers import AutoConfig

    from eyas.data.prepared import PreparedSample, write_prepared
    from eyas.models import load_tokenizer, model_identity, resolve_model

    folder = resolve_model(model)
    identity = model_identity(model, AutoConfig.from_pretrained(folder), load_tokenizer(model), folder)
    samples = []
    for i, r in enumerate(plain):
        ids = torch.tensor(r["prompt_ids"] + r["generated_ids"])
        mask = torch.zeros(len(ids), dtype=torch.bool)
        mask[len(r["prompt_ids"]):] = True
        samples.append(PreparedSample(ids, mask, i))
    out.mkdir(parents=True, exist_ok=True)
    write_prepared(out, samples, [[] for _ in samples], identity, None, "walk_live", max(len(s.input_ids) for s in samples),
                   {"kept": len(samples), "tokens": sum(len(s.input_ids) for s in samples)})


def walk_along(args, answers: Path) -> dict:
    """`eyas eval --teacher-forced` on the answers: the walk at the drafter's depth."""
    from eyas.evaluate.teacher_forced import teacher_forced

    out = teacher_forced(args.model, args.draft, answers, device=args.device)
    return {k: out.get(k) for k in ("tau_walk", "accept_walk_per_step", "chains", "greedy_path", "tau_sim",
                                    "acc_per_step")}


def _device_name(device: str | None) -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() and device != "cpu" else "cpu"


if __name__ == "__main__":
    main()
