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

PATHS = ("eager", "static", "compiled")  # compiled: static, each recorded function fused by torch.compile first


def main() -> None:
    args = parse_args()
    from eyas.evaluate.config import EvalConfig
    from eyas.evaluate.prompts import stratified
    from eyas.evaluate.proposers import PromptLookup, Proposer
    from eyas.evaluate.report import summarize
    from eyas.evaluate.run import cache_slots, drafter_proposer, load_checked_drafter, run_methods, target_session
    from eyas.evaluate.static_target import StaticTargetSession
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
    paths = args.paths
    sessions, methods = {}, {}
    for path in paths:
        cfg = EvalConfig(model=args.model, decode="eager" if path == "eager" else "static", steps=depth,
                         max_new_tokens=args.max_new_tokens)
        compiled = path == "compiled"
        sessions[path] = StaticTargetSession(model, aux, cache_slots(cfg), compile=True) if compiled else \
            target_session(model, aux, cfg)
        methods[path] = [Proposer(), PromptLookup(depth)]
        if drafter is not None:
            for tree in (False, True)[: 1 + drafter.config.kind.drafts_trees]:
                proposer = drafter_proposer(drafter, replace(cfg, tree=tree), None)
                if compiled:
                    proposer.session = type(proposer.session)(drafter, cache_slots(cfg), compile=True)
                methods[path].append(proposer)
    prompts = load_prompts(args.mt_bench)
    order = [prompts[i] for i in stratified(prompts)][: args.questions]
    records: dict[str, list[dict]] = {p: [] for p in paths}
    per_question = 0.0
    for i, prompt in enumerate(order):
        if i and time.monotonic() - t0 + per_question > 60 * args.minutes:
            break
        q0 = time.monotonic()
        for path in (paths if i % 2 == 0 else paths[::-1]):  # the paths' order alternates per question
            records[path] += run_methods(sessions[path], tok, methods[path], [prompt], args.max_new_tokens, eos,
                                         progress=False, warmup=i == 0)
        per_question = max(per_question, time.monotonic() - q0)
        say(f"question {prompt.id}: {time.monotonic() - q0:.1f} s")
    positions = {m.name: depth for m in methods[paths[-1]] if m.name != "plain"}
    summaries = {p: summarize(records[p], positions) for p in paths}
    same = {p: _same_answers(records, p) for p in paths[1:]}
    report = {"command": " ".join(sys.argv), "commit": git("rev-parse", "HEAD"), "device": device_name(args.device),
              "settings": vars(args), "depth": depth,
              "questions": len({r["prompt_id"] for r in records[paths[-1]]}),
              "paths": {p: {m: s.to_dict() for m, s in summaries[p].items()} for p in paths},
              "identical_to_plain": {p: {m: f"{s.identical}/{s.answers}" for m, s in summaries[p].items()
                                         if s.identical is not None} for p in paths},
              "static_answers_equal_eager": same}
    eager = summaries["eager"]
    name = methods[paths[-1]][2].name if drafter else None  # the drafter's chain (or block)
    report["identical_to_plain"] = all(s.identical == s.answers for p in paths for s in summaries[p].values()
                                       if s.identical is not None) and all(v for d in same.values() for v in d.values())
    for p in paths:
        plain, chain = summaries[p]["plain"], summaries[p].get(name)
        report[p] = {"plain_tok_s": round(plain.tokens_per_s, 1),
                     "plain_tok_s_over_eager": round(plain.tokens_per_s / eager["plain"].tokens_per_s, 3),
                     "chain_tau": round(chain.tau, 3) if chain else None,
                     "chain_speedup": round(chain.speedup, 3) if chain else None,
                     "chain_speedup_over_tau": round(chain.speedup / chain.tau, 3) if chain else None}
    best = paths[-1]  # the keys: the last path's (the fastest variant asked for)
    report.update({"path": best, "plain_tok_s_over_eager": report[best]["plain_tok_s_over_eager"],
                   "chain_speedup_over_tau": report[best]["chain_speedup_over_tau"]})
    dump(out / "decode_gpu.json", report)
    if args.timing_questions:
        report["ms_per_step"] = {p: timing(sessions[p], tok, methods[p], order[: args.timing_questions],
                                           args.max_new_tokens, eos) for p in paths}
    report["graphs"] = {p: {"target_replays": sessions[p].graphs.replays, "target_eager_passes": sessions[p].eager_passes,
                            "recorded": len(sessions[p].graphs.graphs), "cache_slots": sessions[p].cache.capacity}
                        for p in paths[1:]}
    report["seconds"] = round(time.monotonic() - t0, 1)
    dump(out / "decode_gpu.json", report)
    for p in paths:
        say(f"{p}: " + ", ".join(f"{m} {s.tokens_per_s:.0f} tok/s tau {s.tau:.2f} x{s.speedup:.2f}"
                                 for m, s in summaries[p].items()))
    say({k: report[k] for k in ("identical_to_plain", *paths)})


def _same_answers(records: dict[str, list[dict]], path: str) -> dict[str, bool]:
    """Per method: every answer of `path` equals the eager path's, token for token."""
    key = ("prompt_id", "turn", "method")
    eager = {tuple(r[k] for k in key): r["generated_ids"] for r in records["eager"]}
    out: dict[str, bool] = {}
    for r in records[path]:
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
    p.add_argument("--paths", type=lambda t: tuple(t.split(",")), default=PATHS,
                   help="comma-separated, eager first: the paths decoded side by side (default all)")
    p.add_argument("--smoke", action="store_true", help="CPU, 2 questions, 24 tokens: checks the script runs")
    args = p.parse_args()
    if args.smoke:
        args.device, args.questions, args.max_new_tokens, args.timing_questions = "cpu", 2, 24, 1
    return args


if __name__ == "__main__":
    main()
