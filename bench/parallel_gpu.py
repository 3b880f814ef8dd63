"""A parallel drafter against the EAGLE-3 chain, from the same data for the same minutes, in
one GPU run: regenerate a small set of conversations with the target (e.g. SmolLM2-135M-Instruct),
train an EAGLE-3 drafter and a DFlash drafter online on it for equal minutes each, then on
MT-bench (both turns, T=0, one decoding process) decode plain, prompt lookup (7), the EAGLE-3
chain (7) and DFlash (a block of 7 in one pass) interleaved per question, in eyas's lossless
loop. Reports held-out accuracy per block position (training's own held-out pass), tau, the
wall-clock speed-ups, every answer against plain decoding, and in a separate synchronised
pass the draft's time per step against the target's verification pass.

The regenerate and train stages are quality_gpu.py's (regenerate, then `train_for`: a short
probe sizes each cosine schedule to its minutes); the EAGLE-3 arm is its main recipe.

  PYTHONPATH=src:bench python3 bench/parallel_gpu.py --model MODEL --out OUT
  PYTHONPATH=src:bench python3 bench/parallel_gpu.py --smoke --out /tmp/parallel-smoke   # CPU, minutes
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


sys.path.insert(0, str(Path(__file__).parent))

from quality_gpu import MIX, RECIPE, _device_name, _dump, train_for  # noqa: E402

CHAIN = 7  # the EAGLE-3 chain's depth and DFlash's block of drafted tokens (block size 8)


def main() -> None:
    args = parse_args()
    t0 = time.monotonic()
    deadline = t0 + 60 * args.minutes
    work, out = Path(args.work), Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    report: dict = {"command": " ".join(sys.argv), "commit": _commit(), "device": _device_name(args.device),
                    "settings": {k: v for k, v in vars(args).items()}, "train": {}, "errors": {}}
    # Each phase that fails is recorded and the run goes on without it: the JSON holds what was measured.
    phase(report, out, "regenerate", lambda: regenerate_set(args, work, report))
    trained = []
    for kind, options in arms(args).items():
        if "regenerate" in report["errors"]:
            break
        if phase(report, out, kind, lambda: train_arm(args, work, report, kind, options)):
            trained.append(kind)
    if trained:
        phase(report, out, "decode",
              lambda: decode(args, work, report, trained, min(60 * args.eval_minutes, deadline - time.monotonic() - 30)))
    report["seconds"] = round(time.monotonic() - t0, 1)
    _dump(out / "parallel_gpu.json", report)
    print_summary(report)


def arms(args) -> dict[str, dict]:
    """The drafters trained, in order, each for --arm-minutes on the same regenerated data."""
    dflash = {"drafter": "dflash", "block_size": CHAIN + 1, "anchors": args.dflash_anchors}
    if args.dflash_layers:
        dflash["draft_layers"] = args.dflash_layers
    return {"eagle3": RECIPE, "dflash": dflash}


def phase(report: dict, out: Path, name: str, run) -> bool:
    """Run one phase; on failure record its error (and print the traceback), then save the report."""
    try:
        run()
        return True
    except Exception as e:  # noqa: BLE001 -- a benchmark keeps the phases that ran
        traceback.print_exc()
        report["errors"][name] = f"{type(e).__name__}: {e}"[:2000]
        return False
    finally:
        _dump(out / "parallel_gpu.json", report)


def train_arm(args, work: Path, report: dict, kind: str, options: dict) -> None:
    result = train_for(args, work / "regen", work / kind, 60 * args.arm_minutes, options, evals=2)
    report["train"][kind] = {"steps": result["final"]["step"], "steps_planned": result["steps"],
                             "seconds": result["seconds"], "options": options,
                             "heldout": result["final"].get("eval"), "train": result["final"].get("train")}
    print(f"{kind}: {result['final']['step']} of {result['steps']} planned steps in {result['seconds']} s; "
          f"held-out acc per position {(result['final'].get('eval') or {}).get('acc_per_step')}", flush=True)


def regenerate_set(args, work: Path, report: dict) -> None:
    """The first --conversations-limit two-user-turn windows of --conversations (MT-bench kept
    out), prepared and regenerated greedily."""
    from eyas.data.prepare import prepare
    from eyas.regenerate.run import regenerate

    t0 = time.monotonic()
    shutil.rmtree(work / "prepared", ignore_errors=True)
    prepared = prepare(args.model, args.conversations, work / "prepared", max_len=args.max_len,
                       limit=args.conversations_limit, window=2, exclude=[args.mt_bench], progress=False)
    summary = regenerate(args.model, work / "prepared", work / "regen", max_new_tokens=args.regen_tokens,
                         group_size=args.regen_group, device=args.device, progress=False, minutes=args.regen_minutes)
    report["regenerate"] = {"prepared": prepared.get("kept"), "conversations": summary.get("kept"),
                            "tokens": summary.get("tokens"), "seconds": round(time.monotonic() - t0, 1)}
    print("regenerated:", json.dumps(report["regenerate"]), flush=True)


def proposers_for(work: Path, trained: list[str], model, identity):
    """plain, prompt lookup and each trained drafter (the EAGLE-3 chain, DFlash), all drafting CHAIN tokens."""
    from eyas.evaluate.dflash import DFlash, DFlashSession
    from eyas.evaluate.drafter import DrafterSession
    from eyas.evaluate.proposers import Eagle3, PromptLookup, Proposer
    from eyas.evaluate.run import load_checked_drafter

    drafters = {kind: load_checked_drafter(str(work / kind), model, identity) for kind in trained}
    if len({d.config.aux_layer_ids for d in drafters.values()}) > 1:
        raise SystemExit("the drafters must read the same aux layers (one target session serves them all)")
    make = {"eagle3": lambda d: Eagle3(DrafterSession(d), CHAIN), "dflash": lambda d: DFlash(DFlashSession(d), CHAIN)}
    aux = next(iter(drafters.values())).config.aux_layer_ids
    return [Proposer(), PromptLookup(CHAIN), *(make[kind](d) for kind, d in drafters.items())], aux


def decode(args, work: Path, report: dict, trained: list[str], seconds: float) -> None:
    """Every method on whole MT-bench questions (stratified by category), interleaved per
    question, until `seconds` are spent; then the timing pass."""
    from eyas.evaluate.prompts import load_prompts, stratified
    from eyas.evaluate.report import TAU_DEFINITION, summarize
    from eyas.evaluate.run import run_methods
    from eyas.models.eos import eos_ids
    from eyas.evaluate.target import TargetSession
    from eyas.models import load_target, model_identity

    t0 = time.monotonic()
    model, tok = load_target(args.model, dtype="float32", device=args.device)
    identity = model_identity(args.model, model.config, tok)
    proposers, aux_ids = proposers_for(work, trained, model, identity)
    target = TargetSession(model, aux_ids)
    eos = set(eos_ids(model.generation_config, tok))
    prompts = load_prompts(args.mt_bench)
    order = [prompts[i] for i in stratified(prompts)][: args.questions]
    records, per_question = [], 0.0
    for i, prompt in enumerate(order):
        if i and time.monotonic() - t0 + per_question + 60 > seconds:  # the timing pass needs its minute
            break
        q0 = time.monotonic()
        records += run_methods(target, tok, proposers, [prompt], args.max_new_tokens, eos, progress=False,
                               warmup=i == 0)
        per_question = max(per_question, time.monotonic() - q0)
        print(f"question {prompt.id}: {time.monotonic() - q0:.1f} s", flush=True)
    positions = {p.name: CHAIN for p in proposers[1:]}
    summaries = summarize(records, positions)
    plain = {(r["prompt_id"], r["turn"]): r["generated_ids"] for r in records if r["method"] == "plain"}
    identical = {m: f"{sum(plain.get((r['prompt_id'], r['turn'])) == r['generated_ids'] for r in records if r['method'] == m)}"
                    f"/{sum(r['method'] == m for r in records)}" for m in summaries}
    by_turn = {str(t): {m: round(s.tau, 3) for m, s in summarize([r for r in records if r["turn"] == t],
                                                                  positions).items()}
               for t in sorted({r["turn"] for r in records})}
    par, chain, lookup = summaries.get("dflash"), summaries.get("eagle3-chain"), summaries.get("prompt-lookup")
    report.update({
        "parallel_kind": "dflash",
        "speedup_parallel_over_chain": _ratio(par and par.speedup, chain and chain.speedup),
        "tau_parallel_over_chain": _ratio(par and par.tau, chain and chain.tau),
        "speedup_parallel_over_prompt_lookup": _ratio(par and par.speedup, lookup and lookup.speedup),
        "identical_to_plain": identical,
        "tau_definition": TAU_DEFINITION,
        "mt_bench": {"questions": len({r["prompt_id"] for r in records}), "answers_per_method": len(plain),
                     "max_new_tokens": args.max_new_tokens, "dtype": "float32", "decoding_processes": 1,
                     "summary": {k: s.to_dict() for k, s in summaries.items()}, "tau_by_turn": by_turn},
        "heldout_acc_per_position": {k: (v.get("heldout") or {}).get("acc_per_step") for k, v in report["train"].items()},
    })
    _dump(Path(args.out) / "parallel_gpu.json", report)
    report["draft_vs_verify"] = timing_pass(target, tok, proposers, order[: args.timing_questions],
                                            args.max_new_tokens, eos)
    target.close()


def timing_pass(target, tok, proposers, prompts, max_new_tokens: int, eos: set[int]) -> dict:
    """Per method, milliseconds per verification step spent drafting (propose + the drafter's
    context update) and in the target's verification pass, each timed between device
    synchronisations: apart from the headline run, since the synchronisations cost time."""
    from eyas.device import synchronize
    from eyas.evaluate.run import run_methods

    clock = {"verify": 0.0}
    verify = target.verify

    def timed(fn, key, into):
        def wrapper(*a, **k):
            synchronize(target.device)
            t = time.perf_counter()
            result = fn(*a, **k)
            synchronize(target.device)
            into[key] += time.perf_counter() - t
            return result
        return wrapper

    target.verify = timed(verify, "verify", clock)
    out = {}
    try:
        for p in proposers:
            spent = {"draft": 0.0}
            inner_propose, inner_update = p.propose, p.update
            p.propose, p.update = timed(inner_propose, "draft", spent), timed(inner_update, "draft", spent)
            clock["verify"] = 0.0
            records = run_methods(target, tok, [p], prompts, max_new_tokens, eos, progress=False, warmup=False)
            p.propose, p.update = inner_propose, inner_update
            steps = sum(len(r["accept_counts"]) for r in records)
            out[p.name] = {"steps": steps, "draft_ms_per_step": round(1e3 * spent["draft"] / max(steps, 1), 3),
                           "verify_ms_per_step": round(1e3 * clock["verify"] / max(steps, 1), 3),
                           "wall_ms_per_step": round(1e3 * sum(r["seconds"] for r in records) / max(steps, 1), 3)}
    finally:
        target.verify = verify
    return out


def print_summary(report: dict) -> None:
    from eyas.evaluate.report import Summary, format_table

    mt = report.get("mt_bench") or {}
    summaries = {k: Summary(**v) for k, v in mt.get("summary", {}).items()}
    print(format_table(summaries))
    print(f"\nMT-bench: {mt.get('questions')} questions, both turns, {mt.get('max_new_tokens')} new tokens, one process")
    for key in ("speedup_parallel_over_chain", "tau_parallel_over_chain", "speedup_parallel_over_prompt_lookup"):
        print(f"{key}: {report.get(key)}")
    print(f"identical to plain (answers equal / answers): {report.get('identical_to_plain')}")
    print(f"held-out accuracy per block position: {json.dumps(report.get('heldout_acc_per_position'))}")
    for m, t in (report.get("draft_vs_verify") or {}).items():
        print(f"  {m:<15} draft {t['draft_ms_per_step']:.2f} ms/step, verify {t['verify_ms_per_step']:.2f} ms/step, "
              f"wall {t['wall_ms_per_step']:.2f} ms/step")


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 4) if a is not None and b else None


def _commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="the target: any model eyas loads (folder, .gguf, packaged:...)")
    p.add_argument("--conversations", nargs="+", default=MIX,
                   help="any source(s) eyas prepare reads, mixed as SRC@WEIGHT (default: the SmolLM2 recipe's mix)")
    p.add_argument("--conversations-limit", type=int, default=6144, help="windows prepared (default 6144)")
    p.add_argument("--mt-bench", default="mt-bench", help="MT-bench question.jsonl (default: the packaged one)")
    p.add_argument("--work", default="/tmp/parallel-work")
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--minutes", type=float, default=9.0,
                   help="the whole run's budget, for one 9.5-minute call (decoding takes what is left, default 9)")
    p.add_argument("--regen-minutes", type=float, default=0.75)
    p.add_argument("--regen-tokens", type=int, default=256)
    p.add_argument("--regen-group", type=int, default=4096)
    p.add_argument("--arm-minutes", type=float, default=1.25, help="training minutes per drafter (equal for both)")
    p.add_argument("--eval-minutes", type=float, default=4.0, help="MT-bench decoding at most, timing pass included")
    p.add_argument("--questions", type=int, default=80)
    p.add_argument("--timing-questions", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--batch-tokens", type=int, default=65536)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--probe-steps", type=int, default=10)
    p.add_argument("--dflash-layers", type=int, help="DFlash decoder layers (default: eyas's, a tenth of the target's)")
    p.add_argument("--dflash-anchors", type=int, default=128,
                   help="DFlash anchors per sample and step (default 128: a sample of 1,024 tokens runs 1,024 "
                        "block tokens through the drafter instead of 8,192)")
    p.add_argument("--smoke", action="store_true",
                   help="CPU end to end in minutes: the packaged SmolLM2, 12 chitchat dialogues, 32-token answers, "
                        "tiny batches, one question")
    args = p.parse_args()
    if args.smoke:
        args.model = args.model or "packaged:smollm2-135m"
        args.conversations = ["packaged:chitchat"]
        args.device = "cpu"
        args.conversations_limit, args.regen_tokens, args.regen_group, args.max_len = 12, 24, 12, 128
        args.batch_tokens, args.probe_steps, args.arm_minutes = 512, 2, 0.4
        args.questions, args.timing_questions, args.max_new_tokens = 1, 1, 24
        args.eval_minutes, args.minutes, args.dflash_anchors = 20.0, 30.0, 8
        args.regen_minutes = None
    elif not args.model:
        p.error("--model is needed (or --smoke)")
    return args


if __name__ == "__main__":
    main()
