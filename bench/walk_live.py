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
drafts what the walk scores there. On one H100 (bench/results/walk_live_h100.json) they agreed
within 0.007 in float32 and in bfloat16, for EAGLE-3 and DFlash, and the held-out walk sat beside
live tau: the earlier gap was the text.

  PYTHONPATH=src python3 bench/walk_live.py --model M --draft D [--draft D2] --out OUT.json [--prompts P]...
      [--limit N] [--decodes static,eager] [--held-out DATA]
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--draft", required=True, action="append",
                   help="a drafter folder `eyas train` wrote (repeat for several: each decodes and walks in turn)")
    p.add_argument("--prompts", action="append", help="as `eyas eval --prompts` (repeatable; default mt-bench)")
    p.add_argument("--limit", type=int, default=10)
    p.add_argument("--max-new-tokens", type=int, default=192)
    p.add_argument("--dtypes", default="float32,bfloat16", help="the target's dtypes to decode in, comma-separated")
    p.add_argument("--decodes", default="static", help="eval's decoding paths (static, eager), comma-separated")
    p.add_argument("--held-out", help="also walk each drafter along its training run's held-out samples of this "
                                      "prepared folder or store (the trainer's tau_walk, beside the live text's)")
    p.add_argument("--held-out-limit", type=int, default=24, help="held-out samples walked (the first N)")
    p.add_argument("--device", default=None)
    p.add_argument("--work", default="/tmp/walk-live")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    result = {"model": args.model, "limit": args.limit, "max_new_tokens": args.max_new_tokens,
              "device": _device_name(args.device), "runs": [], "held_out": {}}
    for d, draft in enumerate(args.draft):
        if args.held_out:
            result["held_out"][draft] = held_out_walk(args, draft)
            print(f"{draft}: walk along its held-out samples {result['held_out'][draft].get('tau_walk')}", flush=True)
        for p_, prompts in enumerate(args.prompts or ["mt-bench"]):
            for dtype, path in itertools.product(args.dtypes.split(","), args.decodes.split(",")):
                tag = f"{d}-{p_}-{dtype}-{path}"
                live, plain = decode(args, draft, prompts, dtype, path, work / f"results-{tag}.json")
                answers = work / f"answers-{tag}"
                write_answers(args.model, plain, answers)
                walk = walk_along(args, draft, answers)
                result["runs"].append({"draft": draft, "prompts": prompts, "dtype": dtype, "decode": path, **live,
                                       "walk": walk, "walk_minus_live": round(walk["tau_walk"] - live["tau"], 4)})
                print(f"{draft} on {prompts}, {dtype} {path}: live tau {live['tau']:.3f} (first draft accepted at "
                      f"{live['accept_first']:.3f} of steps), walk along the same answers {walk['tau_walk']:.3f} "
                      f"({walk['accept_walk_per_step'][0]:.3f}); answers equal to plain {live['identical']}",
                      flush=True)
                result["seconds"] = round(time.monotonic() - t0, 1)
                Path(args.out).write_text(json.dumps(result, indent=2) + "\n")  # each run kept as it lands


def decode(args, draft: str, prompts: str, dtype: str, path: str, output: Path) -> tuple[dict, list[dict]]:
    """`eyas eval` with the drafter at the depth it trained: its tau and first-draft acceptance
    over every verification step, and plain decoding's records (the answers to walk)."""
    from eyas.evaluate.config import EvalConfig
    from eyas.evaluate.run import evaluate

    results = evaluate(EvalConfig(model=args.model, draft=draft, prompts=prompts, limit=args.limit,
                                  max_new_tokens=args.max_new_tokens, baselines=(), dtype=dtype, decode=path,
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


WALK_KEYS = ("tau_walk", "accept_walk_per_step", "chains", "greedy_path", "tau_sim", "acc_per_step")


def walk_along(args, draft: str, answers: Path) -> dict:
    """`eyas eval --teacher-forced` on the answers: the walk at the drafter's depth."""
    from eyas.evaluate.teacher_forced import teacher_forced

    out = teacher_forced(args.model, draft, answers, device=args.device)
    return {k: out.get(k) for k in WALK_KEYS}


def held_out_walk(args, draft: str) -> dict:
    """The same walk along the samples the drafter's training run held out of --held-out (its own
    text: whole windows, every turn), or why it could not run."""
    from eyas.errors import EyasError
    from eyas.evaluate.teacher_forced import teacher_forced

    try:
        out = teacher_forced(args.model, draft, args.held_out, held_out=True, limit=args.held_out_limit,
                             device=args.device)
    except EyasError as e:
        return {"error": str(e)}
    return {"samples": out["samples"], **{k: out.get(k) for k in WALK_KEYS}}


def _device_name(device: str | None) -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() and device != "cpu" else "cpu"


if __name__ == "__main__":
    main()
