"""eval's two decoding paths side by side in one process: `--decode eager` (transformers'
growing cache, every kernel launched from Python) against `--decode static` (preallocated
caches, each verification pass and each greedy draft one CUDA graph replay).

Per MT-bench question (stratified by category, both turns, T=0, batch 1), interleaved so
load changes hit both alike: plain decoding, prompt lookup and the drafter's chain and tree
on each path. Reports each path's tok/s and speed-ups (over its own plain decoding), the
ratios the static path gains, every answer against plain decoding and against the other
path's, and a synchronised timing pass (draft and verify milliseconds per step).

  PYTHONPATH=src:bench python3 bench/decode_gpu.py --model MODEL --drafter TRAINED_FOLDER --out OUT
  PYTHONPATH=src:bench python3 bench/decode_gpu.py --smoke --out /tmp/decode-smoke   # CPU, a minute
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from common import device_name, dump, git, say  # noqa: E402

PATHS = ("eager", "static")


def main() -> None:
    args = parse_args()
    from eyas.evaluate.config import EvalConfig
    from eyas.evaluate.prompts import stratified
    from eyas.evaluate.proposers import PromptLookup, Proposer
    from eyas.evaluate.report import summarize
    from eyas.evaluate.run import drafter_proposer, load_checked_drafter, run_methods, target_session
    from eyas.models import load_target, model_identity
    from eyas.models.eos import eos_ids
    from eyas.prompts import load_prompts

    t0 = time.monotonic()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model, tok = load_target(args.model, dtype=args.dtype, device=args.device)
    identity = model_identity(args.model, model.config, tok)
    drafter = load_checked_drafter(args.drafter, model, identity) if args.drafter else None
    depth = args.steps or (drafter.config.depth if drafter else 7)
    aux = drafter.config.aux_layer_ids if drafter else ()
    eos = set(eos_ids(model.generation_config, tok))
    sessions, methods = {}, {}
    for path in PATHS:
        cfg = EvalConfig(model=args.model, decode=path, steps=depth, max_new_tokens=args.max_new_tokens)
        sessions[path] = target_session(model, aux, cfg)
        methods[path] = [Proposer(), PromptLookup(depth)]
        if drafter is not None:
            methods[path] += [drafter_proposer(drafter, cfg, None)]
            if drafter.config.kind.drafts_trees:
                methods[path] += [drafter_proposer(drafter, replace(cfg, tree=True), None)]
    prompts = load_prompts(args.mt_bench)
    order = [prompts[i] for i in stratified(prompts)][: args.questions]
    records: dict[str, list[dict]] = {p: [] for p in PATHS}
    per_question = 0.0
    for i, prompt in enumerate(order):
        if i and time.monotonic() - t0 + per_question > 60 * args.minutes:
            break
        q0 = time.monotonic()
        for path in (PATHS if i % 2 == 0 else PATHS[::-1]):  # each path goes first on half the questions
            records[path] += run_methods(sessions[path], tok, methods[path], [prompt], args.max_new_tokens, eos,
                                         progress=False, warmup=i == 0)
        per_question = max(per_question, time.monotonic() - q0)
        say(f"question {prompt.id}: {time.monotonic() - q0:.1f} s")
    positions = {m.name: depth for m in methods["static"] if m.name != "plain"}
    summaries = {p: summarize(records[p], positions) for p in PATHS}
    same = _same_answers(records)
    report = {"command": " ".join(sys.argv), "commit": git("rev-parse", "HEAD"), "device": device_name(args.device),
              "settings": vars(args), "depth": depth,
              "questions": len({r["prompt_id"] for r in records["static"]}),
              "paths": {p: {m: s.to_dict() for m, s in summaries[p].items()} for p in PATHS},
              "identical_to_plain": {p: {m: f"{s.identical}/{s.answers}" for m, s in summaries[p].items()
                                         if s.identical is not None} for p in PATHS},
              "static_answers_equal_eager": same}
    static, eager = summaries["static"], summaries["eager"]
    name = methods["static"][2].name if drafter else None  # the drafter's chain (or block)
    chain, chain_eager = static.get(name), eager.get(name)
    report.update({
        "plain_tok_s_eager": round(eager["plain"].tokens_per_s, 1),
        "plain_tok_s_static": round(static["plain"].tokens_per_s, 1),
        "plain_tok_s_over_eager": round(static["plain"].tokens_per_s / eager["plain"].tokens_per_s, 3),
        "chain_speedup_over_tau": round(chain.speedup / chain.tau, 3) if chain else None,
        "chain_speedup_over_tau_eager": round(chain_eager.speedup / chain_eager.tau, 3) if chain else None,
        "identical_to_plain": all(s.identical == s.answers for p in PATHS for s in summaries[p].values()
                                  if s.identical is not None) and all(same.values()),
    })
    dump(out / "decode_gpu.json", report)
    if args.timing_questions:
        report["ms_per_step"] = {p: timing(sessions[p], tok, methods[p], order[: args.timing_questions],
                                           args.max_new_tokens, eos) for p in PATHS}
    report["graphs"] = {"target_replays": sessions["static"].graphs.replays,
                        "target_eager_passes": sessions["static"].eager_passes,
                        "cache_slots": sessions["static"].cache.capacity}
    report["seconds"] = round(time.monotonic() - t0, 1)
    dump(out / "decode_gpu.json", report)
    for p in PATHS:
        say(f"{p}: " + ", ".join(f"{m} {s.tokens_per_s:.0f} tok/s tau {s.tau:.2f} x{s.speedup:.2f}"
                                 for m, s in summaries[p].items()))
    say({k: report[k] for k in ("plain_tok_s_over_eager", "chain_speedup_over_tau", "chain_speedup_over_tau_eager",
                                "identical_to_plain")})


def _same_answers(records: dict[str, list[dict]]) -> dict[str, bool]:
    """Per method: every answer of the static path equals the eager path's, token for token."""
    key = ("prompt_id", "turn", "method")
    eager = {tuple(r[k] for k in key): r["generated_ids"] for r in records["eager"]}
    out: dict[str, bool] = {}
    for r in records["static"]:
        m = r["method"]
        out[m] = out.get(m, True) and eager.get(tuple(r[k] for k in key)) == r["generated_ids"]
    return out


def timing(target, tok, proposers, prompts, max_new_tokens: int, eos: set[int]) -> dict:
    """Per method, the median over prompts of milliseconds per step drafting and verifying,
    each timed between device synchronisations (apart from the headline run: they cost time)."""
    from eyas.evaluate.run import run_methods
    from eyas.timing import StepTimer

    out = {}
    for p in proposers:
        draft, verify, wall = [], [], []
        for prompt in prompts:
            timer = StepTimer(target.device)
            records = run_methods(target, tok, [p], [prompt], max_new_tokens, eos, progress=False, warmup=False,
                                  timer=timer)
            steps = max(sum(len(r["accept_counts"]) for r in records), 1)
            draft.append(1e3 * timer.seconds.get("draft", 0.0) / steps)
            verify.append(1e3 * timer.seconds.get("verify", 0.0) / steps)
            wall.append(1e3 * sum(r["seconds"] for r in records) / steps)
        out[p.name] = {"draft": round(statistics.median(draft), 3), "verify": round(statistics.median(verify), 3),
                       "wall": round(statistics.median(wall), 3)}
    return out


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="packaged:smollm2-135m", help="the target: any model eyas loads")
    p.add_argument("--drafter", help="a trained drafter folder (its chain and, for EAGLE-3, tree are decoded)")
    p.add_argument("--mt-bench", default="mt-bench", help="MT-bench question.jsonl (default: the packaged one)")
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="float32", help="the target's, as eyas eval's default")
    p.add_argument("--steps", type=int, help="draft depth (default: the drafter's trained depth)")
    p.add_argument("--questions", type=int, default=80)
    p.add_argument("--minutes", type=float, default=5.0, help="stop starting questions after this long")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--timing-questions", type=int, default=2)
    p.add_argument("--smoke", action="store_true", help="CPU, 2 questions, 24 tokens: checks the script runs")
    args = p.parse_args()
    if args.smoke:
        args.device, args.questions, args.max_new_tokens, args.timing_questions = "cpu", 2, 24, 1
    return args


if __name__ == "__main__":
    main()
