"""Parallel drafters against the EAGLE-3 chain, from the same data for the same minutes, in
one GPU run: regenerate a small set of conversations with the target (e.g. SmolLM2-135M-Instruct),
or take an earlier run's (--data); train each of --arms online on it for equal minutes (EAGLE-3,
DFlash, P-EAGLE); then on MT-bench (both turns, T=0, one decoding process), interleaved with a
second prompt set (--second-prompts), decode plain, prompt lookup (7), the EAGLE-3 chain (7),
DFlash and P-EAGLE (a block of 7 in one pass each) per question, in eyas's lossless loop.
Reports held-out accuracy per block position (training's own held-out pass), tau, the
wall-clock speed-ups, every answer against plain decoding, and in a separate synchronised
pass the draft's time per step against the target's verification pass.

The regenerate and train stages are quality_gpu.py's (regenerate, then `train_for`: `eyas train
--minutes` sizes each cosine schedule to its minutes); the EAGLE-3 arm is its main recipe.

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

from common import device_name, dump, train_options  # noqa: E402
from quality_gpu import MIX, RECIPE, train_for  # noqa: E402

CHAIN = 7  # the EAGLE-3 chain's depth and DFlash's block of drafted tokens (block size 8)


def main() -> None:
    args = parse_args()
    t0 = time.monotonic()
    deadline = t0 + 60 * args.minutes
    work, out = Path(args.work), Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    report: dict = {"command": " ".join(sys.argv), "commit": _commit(), "device": device_name(args.device),
                    "settings": {k: v for k, v in vars(args).items()}, "train": {}, "errors": {}}
    # Each phase that fails is recorded and the run goes on without it: the JSON holds what was measured.
    if args.data or args.store:  # an earlier run's regenerated set or store: the arms train on it as it is
        report["regenerate"] = {"data": args.data, "store": args.store, "reused": True}
    elif args.arms:  # a decode-only call (--arms '' --drafter ...) needs no data
        phase(report, out, "regenerate", lambda: regenerate_set(args, work, report))
    trained = dict(args.drafter)
    for kind, folder in args.drafter.items():  # trained in an earlier call: their own last held-out pass
        report["train"][kind] = given_drafter(folder)
    for arm, options in arms(args).items():
        if "regenerate" in report["errors"]:
            break
        if phase(report, out, arm, lambda: train_arm(args, work, report, arm, options)):
            trained[arm] = arm_folder(work, arm)
    if trained and args.eval_minutes > 0:
        phase(report, out, "decode",
              lambda: decode(args, report, trained, min(60 * args.eval_minutes, deadline - time.monotonic() - 30)))
    report["seconds"] = round(time.monotonic() - t0, 1)
    dump(out / "parallel_gpu.json", report)
    print_summary(report)


KINDS = ("eagle3", "dflash", "peagle")


def arms(args) -> dict[str, dict]:
    """The drafters trained (--arms, in order), each for --arm-minutes on the same regenerated data.
    P-EAGLE is EAGLE-3's recipe drafting its CHAIN tokens in one pass (CHAIN = its TTT steps). An
    arm `KIND:OPTION=VALUE:...` is that kind with `eyas train` options changed (e.g.
    `dflash:anchors=512:position_weights=dpace`, or with commas `dflash:batch_tokens=8192,loss=hard-ce`;
    `arm_options`), trained into its own folder; `minutes=M` trains
    it for M minutes instead of --arm-minutes, `init=N` starts it from the drafter of the N-th
    arm (from 0) trained before it (`eagle3:init=0:position_weights=on-policy`), and `packed=L`
    trains it on the same regenerated conversations joined in order into samples of up to L
    tokens, as the long recipe's `regenerate --pack` does (`eagle3:packed=7680`: long contexts).
    EAGLE-3 arms train 7 TTT steps unless they say otherwise; `eagle3:ttt_steps=null` leaves the
    depth to the trainer's budget rule, as a user's run without --ttt-steps does."""
    dflash = {"drafter": "dflash", "block_size": CHAIN + 1, "anchors": args.dflash_anchors}
    if args.dflash_layers:
        dflash["draft_layers"] = args.dflash_layers
    every = {"eagle3": RECIPE, "dflash": dflash, "peagle": {**RECIPE, "drafter": "peagle", "ttt_steps": CHAIN}}
    out = {}
    for arm in args.arms:
        kind, _, changes = arm.partition(":")
        options = dict(every[kind])
        options.update(train_options(changes))
        out[arm] = options
    return out


def split_arms(text: str) -> list[str]:
    """--arms as its arms: a comma starts an arm only before a kind (`KIND` or `KIND:...`);
    elsewhere it separates an arm's options or sits in a value (`dflash:causal_layers=0,2,eagle3`
    is two arms)."""
    out: list[str] = []
    for piece in text.split(","):
        if not out or arm_kind(piece) in KINDS:
            out.append(piece)
        else:
            out[-1] += "," + piece
    return [a for a in out if a]


def arm_kind(arm: str) -> str:
    return arm.split(":")[0]


def arm_folder(work: Path, arm: str) -> Path:
    return work / "".join(c if c.isalnum() else "-" for c in arm)


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
        dump(out / "parallel_gpu.json", report)


def train_arm(args, work: Path, report: dict, arm: str, options: dict) -> None:
    data = None if args.store else Path(args.data) if args.data else work / "regen"
    options = dict(options)
    minutes = options.pop("minutes", args.arm_minutes)
    if "packed" in options:
        length = options.pop("packed")
        if data is None:
            raise SystemExit(f"{arm}: packed= joins regenerated conversations; it cannot pack a --store")
        data = packed_set(args, data, work / f"regen-packed-{length}", length)
        options.setdefault("max_len", length)
    if "init" in options:
        options["init"] = str(arm_folder(work, args.arms[options["init"]]))
    result = train_for(args, data, arm_folder(work, arm), 60 * minutes, options,
                       evals=max(700 // args.eval_every, 1), store=Path(args.store) if args.store else None,
                       warm_up=True)
    report["train"][arm] = {"steps": result["steps"], "seconds": result["seconds"], "options": options,
                             "heldout": result["final"].get("eval"), "train": result["final"].get("train")}
    print(f"{arm}: {result['steps']} steps in {result['seconds']} s; "
          f"held-out acc per position {(result['final'].get('eval') or {}).get('acc_per_step')}", flush=True)


def packed_set(args, regen: Path, folder: Path, length: int) -> Path:
    """The regenerated conversations (regenerate's conversations file) prepared again, joined in
    order into samples of up to `length` tokens: the same answers as the other arms train on,
    kept out of the same eval prompts (so recorded)."""
    from eyas.data.config import PrepareConfig
    from eyas.data.prepare import prepare
    from eyas.data.prepared import PreparedData
    from eyas.regenerate.run import CONVERSATIONS

    shutil.rmtree(folder, ignore_errors=True)
    summary = prepare(PrepareConfig(model=args.model, data=[str(regen / CONVERSATIONS)], out=str(folder),
                                    max_len=length, pack=True,
                                    exclude_prompts=PreparedData(regen).excluded_prompts or None), progress=False)
    print(f"packed into samples of up to {length} tokens: {summary.get('kept')} samples, "
          f"{summary.get('tokens')} tokens", flush=True)
    return folder


def given_drafter(folder: Path) -> dict:
    """A --drafter trained elsewhere, as `train_arm` records an arm: its steps and its trainer's
    last held-out pass (the final one) from the folder's metrics log."""
    from eyas.train.metrics import METRICS_FILE, read_rows

    rows = [json.loads(r) for r in read_rows(folder / METRICS_FILE)] if (folder / METRICS_FILE).is_file() else []
    held_out = [r for r in rows if r.get("split") == "eval"]
    last = {k: v for k, v in held_out[-1].items() if k not in ("step", "split")} if held_out else None
    return {"folder": str(folder), "steps": held_out[-1]["step"] if held_out else None, "heldout": last}


def regenerate_set(args, work: Path, report: dict) -> None:
    """The first --conversations-limit two-user-turn windows of --conversations (MT-bench kept
    out), prepared and regenerated greedily."""
    from eyas.data.config import PrepareConfig
    from eyas.data.prepare import prepare
    from eyas.regenerate.config import RegenerateConfig
    from eyas.regenerate.run import regenerate

    t0 = time.monotonic()
    folder = Path(args.prepared) if args.prepared else work / "prepared"
    if args.prepared:  # prepared elsewhere, e.g. where the conversations are (its windows, MT-bench kept out)
        prepared = {"kept": None}
    else:
        shutil.rmtree(folder, ignore_errors=True)
        prepared = prepare(PrepareConfig(model=args.model, data=args.conversations, out=str(folder),
                                         max_len=args.max_len, limit=args.conversations_limit, window=2,
                                         exclude_prompts=[args.mt_bench, *filter(None, [args.second_prompts])]),
                           progress=False)
    summary = regenerate(RegenerateConfig(model=args.model, data=str(folder), out=str(work / "regen"),
                                          max_new_tokens=args.regen_tokens, group_size=args.regen_group,
                                          device=args.device, minutes=args.regen_minutes), progress=False)
    report["regenerate"] = {"prepared": prepared.get("kept"), "conversations": summary.get("kept"),
                            "tokens": summary.get("tokens"), "seconds": round(time.monotonic() - t0, 1),
                            "stage_seconds": summary.get("regenerate_seconds"),
                            "static_decoding": summary.get("static_decoding")}
    if decoding := summary.get("static_decoding"):  # the target's greedy loop alone: prefill and decode steps
        report["regenerate"]["answer_tok_s"] = round(
            decoding["kept_tokens"] / max(decoding["prefill_s"] + decoding["decode_s"], 1e-9), 1)
    print("regenerated:", json.dumps(report["regenerate"]), flush=True)


def proposers_for(trained: dict[str, Path], model, identity, capacity: int, graphs: bool):
    """plain, prompt lookup (CHAIN tokens) and each trained drafter (the EAGLE-3 chain, DFlash, P-EAGLE), each
    drafting the depth it was trained to draft (eval's rule), with {method: depth}. The first arm of a kind keeps
    the method's own name (eagle3-chain, dflash, peagle); a further arm of that kind is named after its changes
    (eagle3-chain[loss=lk-hybrid])."""
    from eyas.evaluate.dflash import DFlash, DFlashSession
    from eyas.evaluate.drafter import DrafterSession
    from eyas.evaluate.peagle import PEagle
    from eyas.evaluate.proposers import Eagle3, PromptLookup, Proposer
    from eyas.evaluate.run import load_checked_drafter

    drafters = {arm: load_checked_drafter(str(folder), model, identity) for arm, folder in trained.items()}
    if len({d.config.aux_layer_ids for d in drafters.values()}) > 1:
        raise SystemExit("the drafters must read the same aux layers (one target session serves them all)")
    how = {"capacity": capacity, "graphs": graphs}  # eval's --decode: static caches, CUDA graphs where there are
    make = {"eagle3": lambda d: Eagle3(DrafterSession(d, **how), d.config.depth),
            "dflash": lambda d: DFlash(DFlashSession(d, **how), d.config.depth),
            "peagle": lambda d: PEagle(DrafterSession(d, **how), d.config.depth)}
    aux = next(iter(drafters.values())).config.aux_layer_ids
    proposers, kinds_seen = [Proposer(), PromptLookup(CHAIN)], set()
    depths = {proposers[1].name: CHAIN}
    for arm, drafter in drafters.items():
        proposer = make[arm_kind(arm)](drafter)
        if arm_kind(arm) in kinds_seen:
            proposer.name = f"{proposer.name}[{arm.partition(':')[2]}]"
        kinds_seen.add(arm_kind(arm))
        proposers.append(proposer)
        depths[proposer.name] = drafter.config.depth
    return proposers, aux, depths


def decode(args, report: dict, trained: dict[str, Path], seconds: float) -> None:
    """Every method on whole MT-bench questions (stratified by category), interleaved per
    question, until `seconds` are spent; then the timing pass."""
    from eyas.evaluate.prompts import stratified
    from eyas.prompts import load_prompts
    from eyas.evaluate.report import TAU_DEFINITION, summarize
    from eyas.evaluate.run import run_methods
    from eyas.models.eos import eos_ids
    from eyas.evaluate.static_target import StaticTargetSession
    from eyas.evaluate.target import TargetSession
    from eyas.data.long_prompts import load_prompt_set, parse_long
    from eyas.models import load_target, model_identity

    t0 = time.monotonic()
    model, tok = load_target(args.model, dtype="float32", device=args.device)
    identity = model_identity(args.model, model.config, tok)
    long_spec = parse_long(args.second_prompts) if args.second_prompts else None
    capacity = max([2048, *(long_spec[0] if long_spec else ())]) + args.max_new_tokens  # as eval's cache_slots
    static = args.decode == "static"
    proposers, aux_ids, positions = proposers_for(trained, model, identity, capacity, static)
    target = StaticTargetSession(model, aux_ids, capacity=capacity) if static else TargetSession(model, aux_ids)
    eos = set(eos_ids(model.generation_config, tok))
    prompts = load_prompts(args.mt_bench)
    order = [prompts[i] for i in stratified(prompts)][: args.questions]
    second = load_prompt_set(args.second_prompts, lambda: tok, args.second_questions) if args.second_prompts else []
    for p in second:
        p.id = f"second-{p.id}"  # MT-bench ids are numbers; a second file's may collide with them
    order = interleave(order, second)
    report["kept_out_of_training"] = kept_out(trained, order, tok)
    records, per_question = [], 0.0
    timing = 60 if args.timing_questions else 0  # the timing pass needs its minute
    for i, prompt in enumerate(order):
        if i and time.monotonic() - t0 + per_question + timing > seconds:
            break
        q0 = time.monotonic()
        records += run_methods(target, tok, proposers, [prompt], args.max_new_tokens, eos, progress=False,
                               warmup=i == 0)
        per_question = max(per_question, time.monotonic() - q0)
        print(f"question {prompt.id}: {time.monotonic() - q0:.1f} s", flush=True)
    mt_records = [r for r in records if not r["prompt_id"].startswith("second-")]
    summaries = summarize(mt_records, positions)
    second_records = [r for r in records if r["prompt_id"].startswith("second-")]
    identical = {m: f"{s.identical}/{s.answers}" for m, s in summarize(records, positions).items()
                 if s.identical is not None}
    by_turn = {str(t): {m: round(s.tau, 3) for m, s in summarize([r for r in mt_records if r["turn"] == t],
                                                                  positions).items()}
               for t in sorted({r["turn"] for r in mt_records})}
    chain, lookup = summaries.get("eagle3-chain"), summaries.get("prompt-lookup")
    parallel = {}
    for kind in ("dflash", "peagle"):
        if (par := summaries.get(kind)) is not None:
            parallel[kind] = {"speedup_over_chain": _ratio(par.speedup, chain and chain.speedup),
                              "tau_over_chain": _ratio(par.tau, chain and chain.tau),
                              "speedup_over_prompt_lookup": _ratio(par.speedup, lookup and lookup.speedup)}
    second_summary = summarize(second_records, positions) if second_records else {}
    drafted = [m for m in summaries if m not in ("plain", "prompt-lookup")]
    contexts = sorted({p.category for p in second if p.category.startswith("ctx ")}, key=lambda c: int(c[4:]))
    by_context = {c: summarize([r for r in second_records if r["category"] == c], positions) for c in contexts}
    if by_context:  # long prompts (issue 42): tau by context length, and over the same drafter's MT-bench tau
        report["tau_by_context"] = {m: {c[4:]: round(by_context[c][m].tau, 4) for c in contexts if m in by_context[c]}
                                    for m in summaries if m != "plain"}
        report["tau_long_over_short"] = {m: {n: _ratio(t, summaries[m].tau) for n, t in taus.items()}
                                         for m, taus in report["tau_by_context"].items() if m in drafted}
    report["arms_decoded"] = {m: {"tau_mt_bench": round(summaries[m].tau, 4),
                                  "tau_second": round(second_summary[m].tau, 4) if m in second_summary else None,
                                  "tau_both": round(summarize(records, positions)[m].tau, 4)} for m in drafted}
    if chain is not None:  # each further EAGLE-3 arm's tau gain over the first (the same run without its change)
        report["gain_over_first_eagle3_arm"] = {
            m: round(v["tau_both"] - report["arms_decoded"]["eagle3-chain"]["tau_both"], 4)
            for m, v in report["arms_decoded"].items() if m.startswith("eagle3-chain[")}
    best = max(parallel, key=lambda k: summaries[k].speedup, default=None)  # the keys: the best kind's
    report.update({
        "chain_speedup_over_tau": {m: _ratio(summaries[m].speedup, summaries[m].tau) for m in drafted
                                   if summaries[m].speedup is not None},
        "parallel_kind": best,
        "speedup_parallel_over_chain": (parallel.get(best) or {}).get("speedup_over_chain"),
        "tau_parallel_over_chain": (parallel.get(best) or {}).get("tau_over_chain"),
        "speedup_parallel_over_prompt_lookup": (parallel.get(best) or {}).get("speedup_over_prompt_lookup"),
        "parallel_over_chain": parallel,
        "identical_to_plain": identical,
        "tau_definition": TAU_DEFINITION,
        "mt_bench": {"questions": len({r["prompt_id"] for r in mt_records}),
                     "answers_per_method": summaries["plain"].answers if "plain" in summaries else 0,
                     "max_new_tokens": args.max_new_tokens, "dtype": "float32", "decoding_processes": 1,
                     "decode": args.decode, "cache_slots": capacity,
                     "summary": {k: s.to_dict() for k, s in summaries.items()}, "tau_by_turn": by_turn},
        "second_set": {"prompts": args.second_prompts, "questions": len({r["prompt_id"] for r in second_records}),
                       "summary": {k: s.to_dict() for k, s in second_summary.items()}},
        "heldout_acc_per_position": {k: (v.get("heldout") or {}).get("acc_per_step") for k, v in report["train"].items()},
    })
    dump(Path(args.out) / "parallel_gpu.json", report)
    if args.timing_questions:
        report["draft_vs_verify"] = timing_pass(target, tok, proposers, order[: args.timing_questions],
                                                args.max_new_tokens, eos)
    target.close()


def timing_pass(target, tok, proposers, prompts, max_new_tokens: int, eos: set[int]) -> dict:
    """Per method, milliseconds per verification step spent drafting (propose + the drafter's
    context update) and in the target's verification pass, each timed between device
    synchronisations (eyas's StepTimer in the decoding loop): apart from the headline run,
    since the synchronisations cost time."""
    from eyas.evaluate.run import run_methods
    from eyas.timing import StepTimer

    out = {}
    for p in proposers:
        timer = StepTimer(target.device)
        records = run_methods(target, tok, [p], prompts, max_new_tokens, eos, progress=False, warmup=False, timer=timer)
        steps = max(sum(len(r["accept_counts"]) for r in records), 1)
        out[p.name] = {"steps": steps, "draft_ms_per_step": round(1e3 * timer.seconds.get("draft", 0.0) / steps, 3),
                       "verify_ms_per_step": round(1e3 * timer.seconds.get("verify", 0.0) / steps, 3),
                       "wall_ms_per_step": round(1e3 * sum(r["seconds"] for r in records) / steps, 3)}
    return out


def print_summary(report: dict) -> None:
    from eyas.evaluate.report import Summary, format_table

    mt = report.get("mt_bench") or {}
    summaries = {k: Summary(**v) for k, v in mt.get("summary", {}).items()}
    print(format_table(summaries))
    print(f"\nMT-bench: {mt.get('questions')} questions, both turns, {mt.get('max_new_tokens')} new tokens, one process")
    for kind, ratios in (report.get("parallel_over_chain") or {}).items():
        print(f"{kind}: {json.dumps(ratios)}")
    second = report.get("second_set") or {}
    if second.get("summary"):
        print(f"\nsecond set ({second['prompts']}, {second['questions']} prompts):")
        print(format_table({k: Summary(**v) for k, v in second["summary"].items()}))
    print(f"identical to plain (answers equal / answers): {report.get('identical_to_plain')}")
    for m, taus in (report.get("tau_by_context") or {}).items():
        print(f"tau by context length, {m}: {json.dumps(taus)}; over MT-bench's: "
              f"{json.dumps((report.get('tau_long_over_short') or {}).get(m))}")
    if report.get("chain_speedup_over_tau"):
        print(f"speed-up over tau (MT-bench, one process): {json.dumps(report['chain_speedup_over_tau'])}")
    for arm, t in report.get("train", {}).items():
        held = t.get("heldout") or {}
        print(f"held-out {arm}: acc {held.get('acc_per_step')} tau_sim {held.get('tau_sim')}; "
              f"T=1 accept {held.get('accept_t1_per_step')} tau_sim_t1 {held.get('tau_sim_t1')}")
    for m, gain in (report.get("gain_over_first_eagle3_arm") or {}).items():
        print(f"{m}: tau {gain:+.3f} over eagle3-chain (MT-bench and the second set)")
    for m, t in (report.get("draft_vs_verify") or {}).items():
        print(f"  {m:<15} draft {t['draft_ms_per_step']:.2f} ms/step, verify {t['verify_ms_per_step']:.2f} ms/step, "
              f"wall {t['wall_ms_per_step']:.2f} ms/step")


def kept_out(trained: dict[str, Path], prompts: list, tok) -> dict[str, list[str] | None]:
    """Per drafter, the ids of the decoded prompts its training data's exclusion did not cover
    (eval's check, data/exclusion.py; None where its folder records none): tau on them may be
    tau on trained text, so a run says it rather than let it pass."""
    from eyas.data.exclusion import not_excluded
    from eyas.train.checkpoint import data_of

    out = {}
    for arm, folder in trained.items():
        excluded = (data_of(folder) or {}).get("excluded_prompts")
        out[arm] = not_excluded(prompts, excluded, tok) if isinstance(excluded, list) else None
        if out[arm]:
            print(f"warning: {arm}: {len(out[arm])} decoded prompts were not kept out of its training data "
                  f"({', '.join(out[arm][:4])})", flush=True)
    return out


def interleave(first: list, second: list) -> list:
    """Alternate two prompt lists (the rest of the longer at the end): a run stopped by its time
    has answered both sets about equally."""
    out = [x for pair in zip(first, second) for x in pair]
    n = min(len(first), len(second))
    return out + first[n:] + second[n:]


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
    p.add_argument("--arms", default=",".join(KINDS),
                   help=f"drafters trained, in order (default {','.join(KINDS)}); KIND:OPTION=VALUE:... changes "
                        "`eyas train` options of that kind's arm (e.g. dflash:anchors=512:position_weights=dpace; "
                        "',' separates options too, and a new arm only before a kind: "
                        "dflash:causal_layers=0,2,loss=hard-ce,eagle3)")
    p.add_argument("--prepared", help="an `eyas prepare` folder of such windows made elsewhere (e.g. where the "
                   "--conversations sources are): regenerated as it is")
    p.add_argument("--data", help="a regenerated set from an earlier run (its --work/regen): no regeneration")
    p.add_argument("--store", help="a store captured from such a set: the arms train offline from it instead")
    p.add_argument("--drafter", action="append", default=[], metavar="ARM=FOLDER",
                   help="a drafter trained elsewhere on the same data (e.g. eagle3=DIR, eagle3:loss=lk-alpha=DIR), "
                        "decoded beside the arms")
    p.add_argument("--arm-minutes", type=float, default=1.25, help="training minutes per drafter (equal for all)")
    p.add_argument("--eval-every", type=int, default=350,
                   help="an arm's held-out pass every N steps (default 350; the SmolLM2 recipe's EAGLE-3 runs one "
                        "every 100, which an arm matches with 100 when it is compared with that drafter)")
    p.add_argument("--eval-minutes", type=float, default=4.0,
                   help="MT-bench decoding at most, timing pass included; 0: train only, and decode in a later call "
                        "(--arms '' --drafter ARM=WORK/ARM ...), when training and decoding do not fit one call")
    p.add_argument("--questions", type=int, default=80)
    p.add_argument("--second-prompts", help="a second prompt set (anything `eyas eval --prompts` reads) kept out of "
                   "training, e.g. conversations past --conversations-limit, or a long spec (long:2k,7680:4): then "
                   "tau by context length and over MT-bench's (tau_long_over_short); decoded interleaved with MT-bench")
    p.add_argument("--second-questions", type=int, default=40, help="prompts taken from --second-prompts")
    p.add_argument("--timing-questions", type=int, default=2,
                   help="prompts of the draft/verify timing pass, which takes the run's last minute (0: none, and "
                        "that minute goes to decoding)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--decode", choices=("static", "eager"), default="static",
                   help="eval's --decode: static caches and CUDA graphs (default), or transformers' growing cache")
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--batch-tokens", type=int, default=65536)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--dflash-layers", type=int, help="DFlash decoder layers (default: eyas's, a tenth of the target's)")
    p.add_argument("--dflash-anchors", type=int, default=128,
                   help="DFlash anchors per sample and step (default 128: a sample of 1,024 tokens runs 1,024 "
                        "block tokens through the drafter instead of 8,192; 512, eyas train's default, ran out of "
                        "an H200's memory at 65,536-token batches)")
    p.add_argument("--smoke", action="store_true",
                   help="CPU end to end in minutes: the packaged SmolLM2, 12 chitchat dialogues, 32-token answers, "
                        "tiny batches, one question")
    args = p.parse_args()
    args.arms = split_arms(args.arms)
    drafters = {}
    for given in args.drafter:
        arm, _, folder = given.rpartition("=")
        if arm_kind(arm) not in KINDS or not folder:
            p.error(f"--drafter takes ARM=FOLDER with ARM's kind one of {','.join(KINDS)}; got {given!r}")
        drafters[arm] = Path(folder)
    args.drafter = drafters
    if unknown := {arm_kind(a) for a in args.arms} - set(KINDS):
        p.error(f"--arms: unknown {sorted(unknown)}; choose from {','.join(KINDS)}")
    if args.smoke:
        args.model = args.model or "packaged:smollm2-135m"
        args.conversations = ["packaged:chitchat"]
        args.device = "cpu"
        args.conversations_limit, args.regen_tokens, args.regen_group, args.max_len = 12, 24, 12, 128
        args.batch_tokens, args.arm_minutes = 512, 0.4
        args.questions, args.timing_questions, args.max_new_tokens = 1, 1, 24
        args.eval_minutes, args.minutes, args.dflash_anchors = 20.0, 30.0, 8
        args.regen_minutes = None
    elif not args.model:
        p.error("--model is needed (or --smoke)")
    return args


if __name__ == "__main__":
    main()
