"""Drafter quality on a GPU, end to end: regenerate conversations with the target (its own
greedy answers), train an EAGLE-3 drafter online to a time budget, then measure tau and
speed-up on MT-bench at temperature 0 (7-token chain and dynamic tree) against plain decoding
and prompt lookup, all in eyas's own lossless decoding loop. `eyas recipe` is how users make
this drafter; this script is the benchmark around it (training arms, worker processes, the
held-out check, the learning curve).

Stages:
  train  (GPU)   prepare (two-user-turn windows, MT-bench kept out) -> regenerate (time-boxed)
                 -> train --online --minutes; writes the best arm's drafter whole to --out
  eval   (GPU)   MT-bench, greedy, in parallel worker processes over disjoint questions:
                 plain, prompt lookup, chain K=7, tree; tau overall, by category and by turn,
                 the speed-ups, the per-position plot; then, in the time left, short recipe
                 runs (drafter options) on the same regenerated data
  curve  (any)   the learning curve from a run's metrics.jsonl

  PYTHONPATH=src python3 bench/quality_gpu.py train --model MODEL --work /tmp/work --out OUT --minutes 9
  PYTHONPATH=src python3 bench/quality_gpu.py eval --model MODEL --work /tmp/work --out OUT --minutes 9
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from common import device_name, dump, profile_table

# The SmolLM2 recipe's mix (recipes/smollm2-1gpu.yaml): half synthetic instruction prompts.
MIX = ["packaged:synthetic:30000:0@4", "packaged:sharegpt@3", "packaged:chitchat@1"]
METHODS = {"prompt-lookup": 7, "eagle3-chain": 7, "eagle3-tree": 7}


# ---------------------------------------------------------------- train (GPU)


def train_stage(args) -> None:
    """Regenerate, then train; `--parts` runs one of them, so each can run in a process of
    its own (the regenerated data and the report stay in --work)."""
    t_start = time.monotonic()
    deadline = t_start + 60 * args.minutes
    work, out = Path(args.work), Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    parts = set(args.parts.split(","))
    report: dict = _load(work / "quality_train.json") or {}
    report.setdefault("commands", []).append(" ".join(sys.argv))
    if "regen" in parts:
        report["device"], report["tokenizer_parts"] = device_name(args.device), _tokenizer_parts(args.model)
        regen_stage(args, work, report)
        dump(out / "quality_train.json", report)
        dump(work / "quality_train.json", report)  # for the next stage, whose --out may differ
    if "train" in parts:
        arms = args.arms.split(",")
        unknown = [a for a in arms if a not in ARMS]
        if unknown:
            sys.exit(f"--arms: unknown {unknown}; known: {sorted(ARMS)}")
        report["arms"] = {}
        for i, arm in enumerate(arms):
            left = (deadline - time.monotonic() - 25 * (len(arms) - i)) / (len(arms) - i)  # held-out pass and save
            folder = work / _arm_folder(arm)
            result = train_for(args, work / "regen", folder, left, ARMS[arm], profile=i == 0 and args.profile)
            report["arms"][arm] = result
            report["train"] = report["arms"][_best_arm(report["arms"])]
            dump(out / "quality_train.json", report)
            dump(work / "quality_train.json", report)
            shutil.copy(folder / "metrics.jsonl", out / ("metrics.jsonl" if arm == "main" else f"metrics.{arm}.jsonl"))
            print(f"arm {arm}:", json.dumps(result["final"], default=str), flush=True)
        best = _best_arm(report["arms"])
        # The drafter whole (config and weights), without the resumable checkpoints.
        shutil.copytree(work / _arm_folder(best), out / "drafter", dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("checkpoints"))
        print(f"best arm by held-out tau_sim: {best} (written to {out / 'drafter'})", flush=True)


def regen_stage(args, work: Path, report: dict) -> None:
    """Prepare the conversations in two-user-turn windows (as MT-bench asks; whole long
    conversations trained a worse drafter for the same regeneration time) with MT-bench kept
    out, then regenerate as many as --regen-minutes allow."""
    from eyas.data.config import PrepareConfig
    from eyas.data.prepare import prepare
    from eyas.regenerate.config import RegenerateConfig
    from eyas.regenerate.run import regenerate

    shutil.rmtree(work / "prepared", ignore_errors=True)
    t0 = time.monotonic()
    report["prepare"] = prepare(PrepareConfig(model=args.model, data=args.conversations,
                                              out=str(work / "prepared"), max_len=args.max_len, limit=args.limit,
                                              window=args.window, exclude_prompts=["mt-bench"]), progress=False)
    report["prepare"]["seconds"] = round(time.monotonic() - t0, 1)
    print(f"prepared {report['prepare']['kept']} conversations in {report['prepare']['seconds']} s", flush=True)
    t0 = time.monotonic()
    summary = regenerate(RegenerateConfig(model=args.model, data=str(work / "prepared"), out=str(work / "regen"),
                                          max_new_tokens=args.regen_tokens, group_size=args.regen_group,
                                          device=args.device, minutes=args.regen_minutes), progress=False)
    seconds = time.monotonic() - t0
    answers = _answer_tokens(work / "regen")
    report["regenerate"] = {"seconds": round(seconds, 1), "conversations": summary.get("kept"),
                            "tokens": summary.get("tokens"), "answer_tokens": answers,
                            "answer_tokens_per_s": round(answers / seconds, 1),
                            "breakdown_s": summary.get("regenerate_seconds"), "static_decoding": summary.get("static_decoding")}
    print("regenerated:", json.dumps(report["regenerate"]), flush=True)


# The main run's drafter options; `recipe` runs in the eval call compare them. The depth is
# given, so that arms compared side by side train it (the budget rule would pick it otherwise).
RECIPE = {"fc_norm": True, "norm_output": True, "ttt_steps": 7}
# `train --arms`: drafters trained one after another on the same regenerated data, each for
# an equal share of the call. `wide` asks whether the drafter's capacity limits it: the third
# run's drafter fit its own training batches at only 0.80.
ARMS = {"main": RECIPE, "wide": {**RECIPE, "intermediate_size": 3 * 1536}}


def _arm_folder(arm: str) -> str:
    return "drafter" if arm == "main" else f"drafter-{arm}"


def _best_arm(arms: dict) -> str:
    """The arm whose final held-out pass has the highest tau_sim."""
    return max(arms, key=lambda a: arms[a]["final"].get("eval", {}).get("tau_sim", 0.0))


WARM_UP_STEPS = 4  # an untimed run that compiles the step and the held-out pass before an arm's minutes


def train_for(args, data: Path | None, folder: Path, seconds: float, options: dict, evals: int = 8,
              profile: bool = False, store: Path | None = None, warm_up: bool = False) -> dict:
    """Train online on `data` (or offline from a captured `store`) for about `seconds`: `eyas train --minutes` sizes the whole cosine schedule
    to the budget from the run's own steady-state rate (a probe on a cold compile cache once
    planned 205 steps instead of ~740). With `warm_up`, a short untimed run with the same
    options first compiles what the arm runs, so that arms compared at equal minutes all spend
    them training (the first of three arms once lost two thirds of its steps to compiling).
    With `profile`, a short run after it goes under torch.profiler (CUDA activity only) and its
    top kernels go into the result."""
    from eyas.train import TrainConfig, train

    source = dict(store=str(store)) if store else dict(online=True, model=args.model, data=str(data))
    common = {**dict(**source, batch_tokens=args.batch_tokens, lr=args.lr, max_len=args.max_len, device=args.device,
                     progress=False, save_every=10**6), **options}  # an arm's options win (its own lr)
    if warm_up:
        scratch = folder.with_name(folder.name + "-warm-up")
        shutil.rmtree(scratch, ignore_errors=True)
        train(TrainConfig(**{**common, "out": str(scratch), "steps": WARM_UP_STEPS,  # an arm's own steps= too
                             "eval_every": WARM_UP_STEPS // 2, "log_every": WARM_UP_STEPS}))
        shutil.rmtree(scratch, ignore_errors=True)
    shutil.rmtree(folder, ignore_errors=True)
    t0 = time.monotonic()
    final = train(TrainConfig(out=str(folder), minutes=seconds / 60, eval_every=max(700 // evals, 1), log_every=10,
                              **common))
    took = round(time.monotonic() - t0, 1)
    kernels: dict = {}
    if profile:
        probe = folder.with_name(folder.name + "-probe")
        shutil.rmtree(probe, ignore_errors=True)
        with _kernel_profile() as kernels:
            train(TrainConfig(**{**common, "out": str(probe), "steps": args.probe_steps, "eval_fraction": 0,
                                 "log_every": args.probe_steps // 2}))
    return {"options": options, "steps": final["step"], "seconds": took, "batch_tokens": args.batch_tokens,
            "lr": args.lr, "final": final, **({"probe_profile": kernels} if kernels else {})}


@contextlib.contextmanager
def _kernel_profile():
    """Yield a dict that, once the block ends, holds the block's top CUDA kernels by device
    time (speed_probe's table) and the device-busy share of its wall time (what bounds a
    step: GEMMs, attention, elementwise copies, or idle gaps between launches)."""
    found: dict = {}
    if not torch.cuda.is_available():
        yield found
        return
    from torch.profiler import ProfilerActivity, profile

    t0 = time.monotonic()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        yield found
        torch.cuda.synchronize()
    wall = time.monotonic() - t0
    table = profile_table(prof, limit=15)
    found.update({"wall_s": round(wall, 2), "busy_share": round(table["device_ms"] / 1e3 / wall, 3),
                  "note": "a whole short run: model load, compile and its steps", **table})


def _tokenizer_parts(model: str) -> dict:
    """What the tokenizer identity hashes, part by part, to tell which part differs between
    machines with other library versions."""
    import transformers

    from eyas.models import load_tokenizer
    from eyas.models.identity import tokenizer_hash, tokenizer_parts

    tok = load_tokenizer(model)
    return {"transformers": transformers.__version__, "hash": tokenizer_hash(tok), **tokenizer_parts(tok)}


def _answer_tokens(prepared: Path) -> int:
    from eyas.data.prepared import PreparedData

    return int(PreparedData(prepared).loss_mask.sum())


# ---------------------------------------------------------------- eval (GPU)


def eval_stage(args) -> None:
    """Spread MT-bench questions over worker processes, merge, summarise; then recipe runs."""
    from eyas.evaluate.plot import plot_acceptance
    from eyas.evaluate.report import TAU_DEFINITION, format_table, summarize

    t_start = time.monotonic()
    work, out = Path(args.work), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.mt_bench is None:
        from eyas.prompts import mt_bench_file

        args.mt_bench = str(mt_bench_file())
    categories = {str(q["question_id"]): q.get("category", "?") for q in map(json.loads, open(args.mt_bench))}
    order = _stratified(categories)[: args.questions]
    (work / "eval").mkdir(exist_ok=True)
    train_report = _load(out / "quality_train.json") or _load(work / "quality_train.json")
    drafter = args.drafter
    if drafter == "auto":
        arms = (train_report or {}).get("arms")
        drafter = _arm_folder(_best_arm(arms)) if arms else "drafter"
    print(f"evaluating {work / drafter}", flush=True)
    check = heldout_check(args, work, work / drafter, args.heldout_samples) if args.heldout_samples else None
    if check:
        trained = ((train_report or {}).get("train") or {}).get("final", {}).get("eval", {}).get("acc_per_step")
        print(f"held-out check on {check['samples']} conversations: {json.dumps(check['acc_per_step'])}; "
              f"training's own held-out pass: {trained}", flush=True)
    workers = []
    for w in range(args.workers):
        mine = order[w :: args.workers]
        cmd = [sys.executable, __file__, "eval-worker", "--model", args.model, "--mt-bench", args.mt_bench,
               "--work", args.work, "--ids", ",".join(mine), "--out", str(work / "eval" / f"worker{w}.json"),
               "--seconds", str(60 * args.eval_minutes), "--max-new-tokens", str(args.max_new_tokens),
               "--device", args.device, "--drafter", str(work / drafter)]
        workers.append(subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "2"}))
    codes = [p.wait() for p in workers]
    records = []
    for w in range(args.workers):
        path = work / "eval" / f"worker{w}.json"
        if path.exists():
            records += json.loads(path.read_text())
    used = sorted({r["prompt_id"] for r in records}, key=order.index)
    summaries = summarize(records, METHODS)
    by_category = {}
    for cat in sorted(set(categories.values())):
        rs = [r for r in records if categories[r["prompt_id"]] == cat]
        if rs:
            by_category[cat] = {m: round(s.tau, 3) for m, s in summarize(rs, METHODS).items()}
    # MT-bench's second turns often rework the first answer (rewrite, shorten, reformat): by turn,
    # since the headline tau averages both.
    by_turn = {str(t): {m: round(s.tau, 3) for m, s in summarize([r for r in records if r["turn"] == t], METHODS).items()}
               for t in sorted({r["turn"] for r in records})}
    identical = {m: s.identical for m, s in summaries.items() if s.identical is not None}
    results = {"command": " ".join(sys.argv), "tau_definition": TAU_DEFINITION, "device": device_name(args.device),
               "drafter": drafter, "workers": args.workers, "worker_exit_codes": codes, "questions": len(used), "question_ids": used,
               "answers_per_method": summaries["plain"].answers if "plain" in summaries else 0,
               "max_new_tokens": args.max_new_tokens, "dtype": "float32",
               "identical_to_plain": identical, "heldout_check": check, "summary": {k: s.to_dict() for k, s in summaries.items()},
               "tau_by_category": by_category, "tau_by_turn": by_turn, "train": train_report}
    dump(out / "quality_gpu.json", results)
    plot_acceptance(summaries, out / "quality_gpu.png", f"SmolLM2-135M drafter, MT-bench ({len(used)} questions, T=0)")
    print(format_table(summaries))
    print(f"questions: {len(used)} (both turns) over {args.workers} worker processes; identical to plain: {identical}")
    if args.workers > 1:
        print(f"speed-ups: {args.workers} processes shared the machine's cores and GPU; --workers 1 measures wall-clock "
              "speed-ups without that contention (the fifth run: chain 0.80x with six workers, 2.03x with one)")
    for name, taus in [*by_category.items(), *((f"turn {t}", v) for t, v in by_turn.items())]:
        print(f"  {name:<12}" + "  ".join(f"{m} {t:.2f}" for m, t in taus.items()))
    dump(work / "records.json", records)
    left = 60 * args.minutes - (time.monotonic() - t_start)
    if args.recipe_runs and left > 120:
        results["recipe"] = recipe_runs(args, work, left - 30)
        dump(out / "quality_gpu.json", results)
        for r in results["recipe"]:
            ev = r["final"].get("eval", {})
            print(f"recipe {r['options']}: steps {r['steps']}, held-out acc {ev.get('acc_per_step')}, "
                  f"tau_sim {ev.get('tau_sim')}")


def heldout_check(args, work: Path, drafter_dir: Path, samples: int) -> dict:
    """Training's held-out accuracy per TTT step recomputed outside the trainer, on the first
    `samples` held-out conversations, by `eyas eval --teacher-forced --held-out` (the trainer's
    own scorer, with the target's states computed anew)."""
    from eyas.evaluate.teacher_forced import teacher_forced

    return teacher_forced(args.model, drafter_dir, work / "regen", held_out=True, limit=samples, device=args.device)


def recipe_runs(args, work: Path, seconds: float) -> list[dict]:
    """Short equal-time runs of the ARMS against each other on the regenerated data (the first
    run compared the two EAGLE 3.1 options this way)."""
    variants = list(ARMS.values())
    args.batch_tokens, args.lr, args.max_len, args.probe_steps = 65536, 1e-3, 1024, 10
    return [train_for(args, work / "regen", work / f"recipe{i}", seconds / len(variants), v, evals=2)
            for i, v in enumerate(variants)]


def eval_worker(args) -> None:
    """One process: every method on each of its questions (interleaved), until its time is up."""
    from eyas.evaluate.drafter import DrafterSession
    from eyas.evaluate.proposers import Eagle3, PromptLookup, Proposer
    from eyas.evaluate.run import load_checked_drafter, run_methods
    from eyas.prompts import load_prompts
    from eyas.models.eos import eos_ids
    from eyas.evaluate.target import TargetSession
    from eyas.models import load_target, model_identity

    t0 = time.monotonic()
    model, tok = load_target(args.model, dtype="float32", device=args.device)
    drafter = load_checked_drafter(args.drafter, model, model_identity(args.model, model.config, tok))
    target = TargetSession(model, drafter.config.aux_layer_ids)
    proposers = [Proposer(), PromptLookup(7), Eagle3(DrafterSession(drafter), 7),
                 Eagle3(DrafterSession(drafter), 7, tree=True, top_k=10, max_nodes=60)]
    eos = set(eos_ids(model.generation_config, tok))
    wanted = args.ids.split(",")
    prompts = {p.id: p for p in load_prompts(args.mt_bench)}
    records, per_question = [], None
    for i, pid in enumerate(wanted):
        if per_question and time.monotonic() - t0 + per_question > args.seconds:
            break
        q0 = time.monotonic()
        records += run_methods(target, tok, proposers, [prompts[pid]], args.max_new_tokens, eos, progress=False,
                               warmup=i == 0)
        per_question = max(per_question or 0, time.monotonic() - q0)
        dump(Path(args.out), records)
        print(f"[{Path(args.out).stem}] question {pid}: {time.monotonic() - q0:.0f} s", flush=True)


def _stratified(categories: dict[str, str]) -> list[str]:
    """Question ids round-robin over categories, so any prefix covers every category."""
    by_cat: dict[str, list[str]] = {}
    for qid, cat in categories.items():
        by_cat.setdefault(cat, []).append(qid)
    out, k = [], 0
    while any(k < len(v) for v in by_cat.values()):
        out += [v[k] for v in by_cat.values() if k < len(v)]
        k += 1
    return out


# ---------------------------------------------------------------- learning curve (here)


def curve(args) -> None:
    """learning_curve.{json,png} from a run's metrics.jsonl: held-out accuracy per TTT step
    and tau_sim against training tokens (steps x the mean real tokens of a step)."""
    from PIL import Image, ImageDraw, ImageFont

    rows = [json.loads(line) for line in open(args.metrics)]
    points = [{"step": r["step"], "tokens": int(r["step"] * args.tokens_per_step), "acc_per_step": r["acc_per_step"],
               "tau_sim": r["tau_sim"]} for r in rows if r.get("split") == "eval"]
    out = Path(args.out)
    dump(out.with_suffix(".json"), {"tokens_per_step": args.tokens_per_step, "points": points})
    W, H, left, top, pw, ph = 900, 520, 70, 50, 620, 400
    img = Image.new("RGB", (W, H), "white")
    draw, font = ImageDraw.Draw(img), ImageFont.load_default()
    draw.text((left, 15), args.title, fill="black", font=font)
    xmax = max(p["tokens"] for p in points) or 1
    draw.line([(left, top), (left, top + ph), (left + pw, top + ph)], fill="black")
    for tick in range(6):
        y = top + ph - tick * ph / 5
        draw.line([(left - 5, y), (left + pw, y)], fill=(225, 225, 225))
        draw.text((left - 40, y - 6), f"{tick / 5:.1f}", fill="black", font=font)
        x = left + tick * pw / 5
        draw.text((x - 15, top + ph + 8), f"{tick * xmax / 5 / 1e6:.0f}M", fill="black", font=font)
    draw.text((left + pw / 2 - 80, H - 25), "training tokens", fill="black", font=font)
    steps = len(points[0]["acc_per_step"])
    series = [(f"acc step {k}", [p["acc_per_step"][k] for p in points], 1.0) for k in range(steps)]
    series.append(("tau_sim / 4", [p["tau_sim"] / 4 for p in points], 1.0))
    colors = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189), (140, 86, 75),
              (227, 119, 194), (0, 0, 0)]
    for i, (name, ys, _) in enumerate(series):
        xy = [(left + pw * p["tokens"] / xmax, top + ph - ph * min(y, 1.0)) for p, y in zip(points, ys)]
        draw.line(xy, fill=colors[i % len(colors)], width=2)
        draw.rectangle([left + pw + 20, top + 18 * i, left + pw + 32, top + 18 * i + 10], fill=colors[i % len(colors)])
        draw.text((left + pw + 38, top + 18 * i), name, fill="black", font=font)
    img.save(out.with_suffix(".png"))
    print(json.dumps(points[-1]))


# ---------------------------------------------------------------- helpers


def _load(path: Path):
    return json.loads(path.read_text()) if path.exists() else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="stage", required=True)
    cv = sub.add_parser("curve")
    cv.add_argument("--metrics", required=True, help="the main run's metrics.jsonl")
    cv.add_argument("--tokens-per-step", type=float, required=True)
    cv.add_argument("--out", default="bench/results/learning_curve_h200")
    cv.add_argument("--title", default="SmolLM2-135M drafter: held-out accuracy per TTT step, tau_sim / 4")
    for name in ("train", "eval", "eval-worker"):
        s = sub.add_parser(name)
        s.add_argument("--model", required=True, help="the target: any model eyas loads (folder, .gguf, packaged:...)")
        s.add_argument("--work", default="/tmp/work")
        s.add_argument("--device", default="cuda")
        s.add_argument("--out", required=True)
    tr = sub.choices["train"]
    tr.add_argument("--conversations", nargs="+", default=MIX,
                    help="any source(s) eyas prepare reads, mixed as SRC@WEIGHT (default: the SmolLM2 recipe's mix)")
    tr.add_argument("--window", type=int, default=2, help="user turns per prepared window")
    tr.add_argument("--limit", type=int, help="prepare at most this many windows")
    tr.add_argument("--minutes", type=float, default=9.0, help="the whole stage's budget")
    tr.add_argument("--parts", default="regen,train", help="regen, train, or both (default)")
    tr.add_argument("--regen-minutes", type=float, default=3.0)
    tr.add_argument("--regen-tokens", type=int, default=256)
    tr.add_argument("--regen-group", type=int, default=4096)
    tr.add_argument("--max-len", type=int, default=1024)
    tr.add_argument("--batch-tokens", type=int, default=65536)
    tr.add_argument("--lr", type=float, default=1e-3)
    tr.add_argument("--probe-steps", type=int, default=12)
    tr.add_argument("--arms", default="main",
                    help=f"drafters trained in turn on the same data, equal shares of the call: {', '.join(ARMS)}")
    tr.add_argument("--profile", action="store_true",
                    help="the first arm's top CUDA kernels, from a second probe-length run under torch.profiler")
    ev = sub.choices["eval"]
    ev.add_argument("--mt-bench", help="an MT-bench question file (default: the packaged one)")
    ev.add_argument("--minutes", type=float, default=9.0, help="the whole stage's budget")
    ev.add_argument("--eval-minutes", type=float, default=4.5, help="each worker's decoding budget")
    ev.add_argument("--questions", type=int, default=80)
    ev.add_argument("--workers", type=int, default=5)
    ev.add_argument("--max-new-tokens", type=int, default=256)
    ev.add_argument("--recipe-runs", action=argparse.BooleanOptionalAction, default=True)
    ev.add_argument("--heldout-samples", type=int, default=24,
                    help="held-out conversations for the held-out check before MT-bench (0: skip it)")
    ev.add_argument("--drafter", default="auto",
                    help="the drafter folder under --work; auto: the train call's best arm by held-out tau_sim")
    wk = sub.choices["eval-worker"]
    wk.add_argument("--mt-bench", required=True)
    wk.add_argument("--ids", required=True)
    wk.add_argument("--seconds", type=float, required=True)
    wk.add_argument("--max-new-tokens", type=int, default=256)
    wk.add_argument("--drafter", required=True, help="the drafter's folder")
    args = p.parse_args()
    {"curve": curve, "train": train_stage, "eval": eval_stage, "eval-worker": eval_worker}[args.stage](args)


if __name__ == "__main__":
    main()
