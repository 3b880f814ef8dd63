"""eval's two decoding paths side by side in one process: `--decode eager` (transformers'
growing cache, every kernel launched from Python) against `--decode static` (preallocated
caches, each verification pass and each greedy draft one CUDA graph replay). Variants of
the static path measure one change each beside today's (`--paths static-tree-eager,static`):
`static-whole` has the target's recorded passes read the whole cache and multiply probs by
values in one product over it (before `read_width` and the split into parts of keys);
`static-tree-eager` launches a tree's levels from Python instead of replaying them as one
graph.

Per MT-bench question (stratified by category, both turns, T=0, batch 1), interleaved so
load changes hit both alike: plain decoding, prompt lookup and the drafter's chain and tree
on each path. Reports each path's tok/s and speed-ups (over its own plain decoding), the
ratios each path gains over the first, every answer against plain decoding and against the
first path's (and with `--regen-prompts`, regeneration's greedy loop with and without CUDA
graphs), a synchronised timing pass (draft and verify milliseconds per step), and where a
step's milliseconds go: the one-row graph replayed alone, the aten ops one such pass runs
(counted without a profiler), and a torch.profiler pass per path (device against wall
milliseconds per step, kernels per step, the top kernels and host ops).

  PYTHONPATH=src:bench python3 bench/decode_gpu.py --model MODEL --drafter TRAINED_FOLDER --out OUT
  PYTHONPATH=src:bench python3 bench/decode_gpu.py --smoke --out /tmp/decode-smoke   # CPU, a minute
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from common import device_name, dump, git, profile_table, say, sync  # noqa: E402

PATHS = ("eager", "static")
KNOWN_PATHS = ("eager", "static-whole", "static-tree-eager", "static")  # static variants: see variant()


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
    if args.random_shape:  # speed only: a model folder built here, no weights to carry to the machine
        from random_target import build_target

        args.model = str(Path(args.out) / "random-target")
        build_target(Path(args.model), args.random_shape, "cpu")
    if args.profile_tokens and args.device.startswith("cuda"):
        import torch.profiler._utils

        # A graph recorded before the profiler's first use can hang it on replay (pytorch#75504).
        torch.profiler._utils._init_for_cuda_graphs()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.regen_only:  # regeneration's arms alone, without eval's paths
        report = {"command": " ".join(sys.argv), "commit": git("rev-parse", "HEAD"), "device": device_name(args.device),
                  "settings": vars(args), "regen": regen(args)}
        report["regen_answer_tok_s"] = report["regen"].get("flex", {}).get("answer_tok_s")
        dump(out / "decode_gpu_regen.json", report)
        return
    model, tok = load_target(args.model, dtype=args.dtype, device=args.device)
    identity = model_identity(args.model, model.config, tok)
    drafter = load_checked_drafter(args.drafter, model, identity) if args.drafter else None
    depth = args.steps or (drafter.config.depth if drafter else 7)
    aux = drafter.config.aux_layer_ids if drafter else ()
    eos = set(eos_ids(model.generation_config, tok))
    paths = args.paths
    sessions, methods = {}, {}
    for path in paths:
        cfg = EvalConfig(model=args.model, decode=path.split("-")[0], steps=depth,
                         max_new_tokens=args.max_new_tokens)
        sessions[path] = target_session(model, aux, cfg)
        methods[path] = [Proposer(), PromptLookup(depth)]
        if drafter is not None:
            for tree in (False, True)[: 1 + drafter.config.kind.drafts_trees]:
                methods[path].append(drafter_proposer(drafter, replace(cfg, tree=tree), None))
    prompts = load_prompts(args.mt_bench)
    order = [prompts[i] for i in stratified(prompts)][: args.questions]
    if args.profile_only:  # a process of its own, so that a profiler hanging on graphs loses nothing else
        report = {"command": " ".join(sys.argv), "commit": git("rev-parse", "HEAD"), "device": device_name(args.device),
                  "settings": vars(args), "depth": depth}
        report["profile"] = profile_steps(sessions, tok, methods, order[0], args.profile_tokens, eos)
        report["replay_ms"] = {p: replay_ms(s) for p, s in sessions.items() if replay_ms(s) is not None}
        dump(out / "decode_gpu_profile.json", report)
        if args.regen_profile_rows:
            say("profile regeneration")
            report["regen_profile"] = regen_profile(args)
            dump(out / "decode_gpu_profile.json", report)
            say(report["regen_profile"])
        say(report["profile"])
        return
    records: dict[str, list[dict]] = {p: [] for p in paths}
    per_question = 0.0
    for i, prompt in enumerate(order):
        if i and time.monotonic() - t0 + per_question > 60 * args.minutes:
            break
        q0 = time.monotonic()
        for path in (paths if i % 2 == 0 else paths[::-1]):  # the paths' order alternates per question
            with variant(path):
                records[path] += run_methods(sessions[path], tok, methods[path], [prompt], args.max_new_tokens, eos,
                                             progress=False, warmup=i == 0)
        per_question = max(per_question, time.monotonic() - q0)
        say(f"question {prompt.id}: {time.monotonic() - q0:.1f} s")
    positions = {m.name: depth for m in methods[paths[-1]] if m.name != "plain"}
    summaries = {p: summarize(records[p], positions) for p in paths}
    same = {p: _same_answers(records, p, paths[0]) for p in paths[1:]}
    report = {"command": " ".join(sys.argv), "commit": git("rev-parse", "HEAD"), "device": device_name(args.device),
              "settings": vars(args), "depth": depth,
              "questions": len({r["prompt_id"] for r in records[paths[-1]]}),
              "paths": {p: {m: s.to_dict() for m, s in summaries[p].items()} for p in paths},
              "identical_to_plain": {p: {m: f"{s.identical}/{s.answers}" for m, s in summaries[p].items()
                                         if s.identical is not None} for p in paths},
              f"answers_equal_{paths[0]}": same}
    first = summaries[paths[0]]
    name = methods[paths[-1]][2].name if drafter else None  # the drafter's chain (or block)
    report["identical_to_plain"] = all(s.identical == s.answers for p in paths for s in summaries[p].values()
                                       if s.identical is not None) and all(v for d in same.values() for v in d.values())
    for p in paths:
        plain, chain = summaries[p]["plain"], summaries[p].get(name)
        report[p] = {"plain_tok_s": round(plain.tokens_per_s, 1),
                     f"plain_tok_s_over_{paths[0]}": round(plain.tokens_per_s / first["plain"].tokens_per_s, 3),
                     "chain_tau": round(chain.tau, 3) if chain else None,
                     "chain_speedup": round(chain.speedup, 3) if chain else None,
                     "chain_speedup_over_tau": round(chain.speedup / chain.tau, 3) if chain else None}
    best = paths[-1]  # the keys: the last path's (the fastest variant asked for)
    report.update({"path": best, "plain_tok_s_over_eager": report[best].get("plain_tok_s_over_eager"),
                   "chain_speedup_over_tau": report[best]["chain_speedup_over_tau"]})
    dump(out / "decode_gpu.json", report)
    if args.regen_prompts:
        say("regeneration")
        report["regen"] = regen(args)
        report["regen_answer_tok_s"] = report["regen"].get("flex", {}).get("answer_tok_s")
        report["identical_to_plain"] = report["identical_to_plain"] and report["regen"]["answers_equal"]
    if args.timing_questions:
        say("timing")
        report["ms_per_step"] = {}
        for p in paths:
            with variant(p):
                report["ms_per_step"][p] = timing(sessions[p], tok, methods[p], order[: args.timing_questions],
                                                  args.max_new_tokens, eos)
        dump(out / "decode_gpu.json", report)
    report["replay_ms"] = {p: replay_ms(s) for p, s in sessions.items() if replay_ms(s) is not None}
    report["ops_per_pass"] = ops_per_pass(model, aux, tok, order[0])
    report["graphs"] = {p: {"target_replays": sessions[p].graphs.replays, "target_eager_passes": sessions[p].eager_passes,
                            "recorded": len(sessions[p].graphs.graphs), "cache_slots": sessions[p].cache.capacity}
                        for p in paths if p != "eager"}
    dump(out / "decode_gpu.json", report)
    if args.profile_tokens:  # last: a profiler that hangs on graphs (pytorch#75504) loses nothing else
        say("profile")
        report["profile"] = profile_steps(sessions, tok, methods, order[0], args.profile_tokens, eos)
    report["seconds"] = round(time.monotonic() - t0, 1)
    dump(out / "decode_gpu.json", report)
    for p in paths:
        say(f"{p}: " + ", ".join(f"{m} {s.tokens_per_s:.0f} tok/s tau {s.tau:.2f} x{s.speedup:.2f}"
                                 for m, s in summaries[p].items()))
    say({k: report[k] for k in ("identical_to_plain", *paths)})


@contextmanager
def variant(path: str) -> Iterator[None]:
    """The static path as it was before one change, the baseline measured beside it. On
    `static-whole` the target's recorded passes read the whole cache and multiply probs by
    values in one product over it (before `read_width` and the split into parts of keys); on
    `static-tree-eager` a tree's levels are launched from Python, not replayed as a graph.
    Graphs recorded inside keep the kernels and widths they were recorded with."""
    import torch

    import eyas.evaluate.static_target as static_target
    import eyas.models.attention as attention
    from eyas.models.graphs import Recorder

    saved = attention._weighted_values, static_target.read_width, Recorder.run
    if path == "static-whole":
        attention._weighted_values = torch.matmul
        static_target.read_width = lambda slots, capacity: capacity
    elif path == "static-tree-eager":
        Recorder.run = lambda self, key, inputs, fn: None if key[0] == "tree" else saved[2](self, key, inputs, fn)
    try:
        yield
    finally:
        attention._weighted_values, static_target.read_width, Recorder.run = saved


def _same_answers(records: dict[str, list[dict]], path: str, first: str) -> dict[str, bool]:
    """Per method: every answer of `path` equals the `first` path's, token for token."""
    key = ("prompt_id", "turn", "method")
    eager = {tuple(r[k] for k in key): r["generated_ids"] for r in records[first]}
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


def profile_steps(sessions: dict, tok, methods: dict, prompt, tokens: int, eos: set[int]) -> dict:
    """Where a step's milliseconds go, per path, for plain decoding and the drafter's chain:
    one prompt's steps under torch.profiler (after an unprofiled run of the same, so graphs
    are recorded and kernels chosen). Device milliseconds per step against wall milliseconds
    tell a step bound by the host (Python, launches, copies, synchronisation) from one bound
    by the GPU; the profiler slows the host, so the wall figure is also given unprofiled. On a
    recorded path, see `replay_ms`."""
    from torch.profiler import ProfilerActivity, profile

    from eyas.evaluate.run import run_methods

    out: dict = {}
    for path, session in sessions.items():
        out[path] = {}
        with variant(path):  # each path as its own, as when it decoded
            for m in methods[path]:
                if m.name == "prompt-lookup":
                    continue
                run_methods(session, tok, [m], [prompt], tokens, eos, progress=False, warmup=False)
                plain = run_methods(session, tok, [m], [prompt], tokens, eos, progress=False, warmup=False)
                say(f"profile {path} {m.name}")
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    records = run_methods(session, tok, [m], [prompt], tokens, eos, progress=False, warmup=False)
                steps = max(sum(len(r["accept_counts"]) for r in records), 1)
                table = profile_table(prof, limit=12)
                out[path][m.name] = {
                    "steps": steps, "wall_ms": round(1e3 * sum(r["seconds"] for r in plain) / steps, 3),
                    "wall_ms_profiled": round(1e3 * sum(r["seconds"] for r in records) / steps, 3),
                    "device_ms": round(table["device_ms"] / steps, 3),
                    "kernels": round(table["kernel_launches"] / steps, 1),
                    "top_kernels_ms": {r["kernel"]: round(r["ms"] / steps, 4) for r in table["top"][:8]},
                    "top_host_ms": {r["op"]: round(r["ms"] / steps, 4) for r in table["host_top"]}}
    return out


def regen_prompts(args, gen) -> list[list[int]]:
    """`--regen-rows` prompts: each conversation of `--regen-prompts` rendered up to its first
    user turn (at most 1,024 tokens), or with `--regen-prompts random`, random ids of 16 to 1,024
    tokens, skewed short as chat prompts are (any target, a random one included)."""
    import torch

    from eyas.prompts import load_prompts, render

    if args.regen_prompts == "random":
        g = torch.Generator().manual_seed(0)
        lengths = (16 * torch.exp(torch.rand(args.regen_rows, generator=g) * 4.16)).long().tolist()  # 16 to 1,024
        return [torch.randint(10, gen.model.config.vocab_size, (n,), generator=g).tolist() for n in lengths]
    prompts = [ids for p in load_prompts(args.regen_prompts)
               if len(ids := render(gen.tokenizer, [*p.history, {"role": "user", "content": p.turns[0]}])) <= 1024]
    return prompts[: args.regen_rows]


def regen(args) -> dict:
    """`eyas regenerate`'s greedy loop (bf16, batches as its cache budget cuts them, each decode
    step a CUDA graph) over the same prompts in the arms of `--regen-arms`, one after another
    after a warm-up each: `before`, the batch prefilled whole and decoded on the math attention
    path (the loop before prefill parts and flex decoding); `parts`, prefilled in parts of like
    length; `flex`, regenerate's default (parts, and flex decode attention on CUDA); `slots=N`,
    the default loop given N cache slots (the default: half the memory left after the weights,
    at most 2M). Answer tokens a second, prefill and decode seconds, and each arm's answers
    against the first arm's, row by row."""
    from eyas.regenerate.generate import HFGenerator
    from eyas.regenerate.static import StaticGreedy

    gen = HFGenerator(args.model, dtype="bf16", device=args.device)
    prompts = regen_prompts(args, gen)
    budgets = [args.regen_new_tokens] * len(prompts)

    def loop(arm: str) -> StaticGreedy:
        common = (gen.model, gen.pad, gen.stops)
        if arm == "before":
            return StaticGreedy(*common, gen.slots, flex=False, prefill_tokens=1 << 62)
        if arm == "parts":
            return StaticGreedy(*common, gen.slots, flex=False)
        if arm == "flex":
            return gen.greedy
        return StaticGreedy(*common, int(arm.removeprefix("slots=")))

    out, answers = {}, {}
    first = args.regen_arms[0]
    for name in args.regen_arms:
        say(f"regeneration: {name}")
        greedy = loop(name)
        greedy.generate(prompts[:64], budgets[:64])  # warm-up: kernels chosen (flex compiled), first graphs recorded
        greedy.stats = dict.fromkeys(greedy.stats, 0)
        sync(args.device)
        t0 = time.perf_counter()
        answers[name] = greedy.generate(prompts, budgets)
        sync(args.device)
        seconds = time.perf_counter() - t0
        tokens = sum(map(len, answers[name]))
        out[name] = {"answer_tokens": tokens, "seconds": round(seconds, 2), "answer_tok_s": round(tokens / seconds, 1),
                     "cache_slots": greedy.cache_tokens, "flex": greedy.flex, "graph_replays": greedy.graphs.replays,
                     f"rows_equal_{first}": sum(a == b for a, b in zip(answers[name], answers[first])),
                     **{k: round(v, 2) for k, v in greedy.stats.items()}}
        say(out[name])
    return {"prompts": len(prompts), "prompt_tokens": sum(map(len, prompts)), "max_new_tokens": args.regen_new_tokens,
            **out, **{f"{n}_over_{first}": round(out[n]["answer_tok_s"] / out[first]["answer_tok_s"], 3)
                      for n in args.regen_arms[1:]},
            "answers_equal": all(answers[n] == answers[first] for n in args.regen_arms)}


def regen_profile(args) -> dict:
    """Where a regeneration decode step's milliseconds go: `eyas regenerate`'s greedy loop (bf16,
    each step a CUDA graph) on `--regen-profile-rows` prompts of random token ids, 128 to 768
    long, `--profile-tokens` new tokens each, once unprofiled (graphs recorded) and once under
    torch.profiler. Ids, not text, so that any target (a random one included) runs the same shapes."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from eyas.models import attention
    from eyas.regenerate.generate import HFGenerator

    gen = HFGenerator(args.model, dtype="bf16", device=args.device)
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(128, 769, (args.regen_profile_rows,), generator=g).tolist()
    prompts = [torch.randint(10, gen.model.config.vocab_size, (n,), generator=g).tolist() for n in lengths]
    budgets = [args.profile_tokens] * len(prompts)
    loop = gen.greedy
    loop.flex = args.regen_flex and attention.flex_fits(gen.model.config)
    loop.generate(prompts, budgets)
    loop.stats = dict.fromkeys(loop.stats, 0)
    replays = loop.graphs.replays
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        loop.generate(prompts, budgets)
        sync(args.device)
    steps = max(loop.graphs.replays - replays, 1)
    table = profile_table(prof, limit=14)
    return {"rows": len(prompts), "new_tokens": args.profile_tokens, "decode_steps": steps,
            **{k: round(v, 3) for k, v in loop.stats.items()},
            "decode_ms_per_step_profiled": round(1e3 * loop.stats["decode_s"] / steps, 2),
            "device_ms_total": table["device_ms"], "kernels": table["kernel_launches"],
            "top_kernels_ms_per_step": {r["kernel"]: round(r["ms"] / steps, 3) for r in table["top"]},
            "top_kernel_calls": {r["kernel"][:60]: r["calls"] for r in table["top"]},
            "top_host_ms": {r["op"]: r["ms"] for r in table["host_top"][:8]}}


def replay_ms(session) -> dict[str, float] | None:
    """A recorded path's one-row verification graphs replayed back to back, alone, per slots
    read: the GPU's share of a plain step (None where nothing was recorded)."""
    import torch

    graphs = getattr(session, "graphs", None)
    one_row = sorted(k for k in (graphs.graphs if graphs is not None else {}) if k[0] == 1)
    if not one_row:
        return None
    out = {}
    for key in one_row:
        graph = graphs.graphs[key][1]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(100):
            graph.replay()
        torch.cuda.synchronize()
        out[str(key[1])] = round(1e3 * (time.perf_counter() - t0) / 100, 3)
    return out


VIEWS = {"view", "reshape", "_unsafe_view", "unsqueeze", "squeeze", "transpose", "t", "permute", "slice", "select",
         "expand", "alias", "detach", "detach_", "lift_fresh", "as_strided", "split", "chunk"}


def ops_per_pass(model, aux: tuple[int, ...], tok, prompt) -> dict:
    """The aten ops of one eager one-row verification on the static path (what its graph
    records, plus the few host ops that build its inputs), counted by a dispatch mode: a
    device-free view of a plain step, since on a GPU the profiler can hang on graphs. Views
    launch no kernel; every other op launches one or more."""
    import collections

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from eyas.prompts import render
    from eyas.evaluate.static_target import StaticTargetSession
    from eyas.evaluate.tree import DraftTree

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    session = StaticTargetSession(model, aux, graphs=False)
    ids = torch.tensor(render(tok, [{"role": "user", "content": prompt.turns[0]}]))
    logits, _ = session.prefill(ids)
    with Count() as count:
        session.verify(int(logits.argmax()), DraftTree())
    session.close()
    views = sum(n for op, n in count.ops.items() if op in VIEWS)
    return {"ops": sum(count.ops.values()), "views": views, "launching": sum(count.ops.values()) - views,
            "top": dict(count.ops.most_common(16))}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="packaged:smollm2-135m", help="the target: any model eyas loads")
    p.add_argument("--drafter", help="a trained drafter folder (its chain and, for EAGLE-3, tree are decoded)")
    p.add_argument("--random-shape", choices=["135m", "1b", "8b"],
                   help="instead of --model, a random-weight Llama of this shape (135m: SmolLM2's), built under --out: "
                        "step times only, as answers run to --max-new-tokens and nothing is accepted")
    p.add_argument("--mt-bench", default="mt-bench", help="MT-bench question.jsonl (default: the packaged one)")
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="float32", help="the target's, as eyas eval's default")
    p.add_argument("--steps", type=int, help="draft depth (default: the drafter's trained depth)")
    p.add_argument("--questions", type=int, default=80)
    p.add_argument("--minutes", type=float, default=5.0, help="stop starting questions after this long")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--timing-questions", type=int, default=2)
    p.add_argument("--profile-tokens", type=int, default=64,
                   help="tokens of the first question profiled per path (plain and chain); 0: no profile")
    p.add_argument("--regen-prompts", help="a JSONL of prompts or conversations, or `random`: also time regeneration's "
                                           "greedy loop over their first user turns, before and after prefill parts "
                                           "and flex decode attention")
    p.add_argument("--regen-only", action="store_true",
                   help="only regeneration's arms (needs --regen-prompts), into decode_gpu_regen.json")
    p.add_argument("--regen-rows", type=int, default=4096, help="prompts regenerated (the recipe's group size)")
    p.add_argument("--regen-profile-rows", type=int, default=0,
                   help="with --profile-only: also profile regeneration's decode steps on this many rows of random "
                        "ids (--profile-tokens new tokens each)")
    p.add_argument("--regen-new-tokens", type=int, default=256, help="answer budget, as the SmolLM2 recipe's")
    p.add_argument("--regen-flex", action="store_true", help="profile regeneration with flex decode attention")
    p.add_argument("--regen-arms", type=lambda t: t.split(","), default=["before", "parts", "flex"],
                   help="regeneration's loops timed, the first the baseline: before, parts, flex (the default loop), "
                        "slots=N (the default loop with N cache slots)")
    p.add_argument("--profile-only", action="store_true",
                   help="only the profile (and the one-row replay), into decode_gpu_profile.json: run it per path "
                        "under `timeout`, as torch.profiler can hang on CUDA graphs")
    p.add_argument("--paths", type=lambda t: tuple(t.split(",")), default=PATHS,
                   help="comma-separated, the baseline first: the paths decoded side by side, of eager, static-whole "
                        "(the static path reading the whole cache, probs @ values in one product, as before read_width "
                        "and the split), static-tree-eager (a tree's levels launched from Python, not one graph) "
                        "and static (default eager,static)")
    p.add_argument("--smoke", action="store_true", help="CPU, 2 questions, 24 tokens: checks the script runs")
    args = p.parse_args()
    if unknown := set(args.paths) - set(KNOWN_PATHS):
        p.error(f"--paths: unknown {sorted(unknown)}; choose from {','.join(KNOWN_PATHS)}")
    if args.regen_only and not args.regen_prompts:
        p.error("--regen-only times regeneration: name its prompts with --regen-prompts")
    if args.random_shape and args.drafter:
        p.error("--random-shape builds a new random target, which no trained --drafter was made for")
    if args.smoke:
        args.device, args.questions, args.max_new_tokens, args.timing_questions = "cpu", 2, 24, 1
        args.profile_tokens, args.regen_rows, args.regen_new_tokens = 8, 24, 16
    return args


if __name__ == "__main__":
    main()
