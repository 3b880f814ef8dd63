"""Measure a drafter the way serving will use it: lossless speculative decoding.

For every prompt, plain decoding of the target, each baseline and the drafter answer in
turn, in transformers with KV caches. The drafter proposes a chain of --steps tokens, or
with --tree an EAGLE-2-style dynamic tree (--top-k children per expanded node, the best
--draft-tokens nodes kept, --steps levels deep), and the target verifies all of them in
one forward pass. At temperature 0 the output is the target's greedy output token for
token; at T > 0 the rejection-sampling rule keeps it distributed exactly as the target's.

Reported per method: tau = 1 + accepted draft tokens per verification step, the share of
steps that accepted at least j tokens (per position j), tokens/s and speed-up over plain
decoding. results.json keeps every prompt's token ids, generated ids and per-step accept
counts; a PNG plots the per-position acceptance.

examples:
  eyas eval --model packaged:smollm2-135m --draft out/drafter --prompts mt-bench --limit 10
  eyas eval --model MODEL --draft CKPT --tree --top-k 10 --draft-tokens 60 --output tree.json
  eyas eval --model MODEL --draft CKPT --temperature 0.7 --prompts my_prompts.jsonl
  eyas eval --model MODEL --draft CKPT --workers 4          # 4 processes, prompts dealt by category
  eyas eval --model MODEL --draft drafter --teacher-forced prepared --held-out   # accuracy per TTT step
"""

from __future__ import annotations

import argparse

from eyas.device import add_device_argument

HELP = "lossless speculative decoding: acceptance length tau, speed-up, per-position acceptance"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="the target: packaged:smollm2-135m, a .gguf, a folder or a hub id")
    p.add_argument("--draft", help="drafter checkpoint folder (from `eyas train`); without it only baselines run")
    p.add_argument("--prompts", default="mt-bench",
                   help="mt-bench (80 questions, both turns) or a JSONL file of {'prompt'}, {'turns'} or "
                        "{'messages'} lines (default: %(default)s)")
    p.add_argument("--limit", type=int, help="use only the first N prompts")
    p.add_argument("--max-new-tokens", type=int, default=256, help="per answer (default: %(default)s)")
    p.add_argument("--steps", type=int, default=7,
                   help="draft tokens per step (chain), tree depth with --tree; also prompt lookup's length "
                        "(default: %(default)s)")
    p.add_argument("--tree", action="store_true", help="draft a dynamic tree instead of a chain")
    p.add_argument("--top-k", type=int, default=10, help="tree: children per expanded node (default: %(default)s)")
    p.add_argument("--draft-tokens", type=int, default=60,
                   help="tree: drafted nodes verified per step (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: %(default)s)")
    p.add_argument("--baseline", default="prompt-lookup",
                   help="comma-separated baselines besides plain decoding: prompt-lookup, or none "
                        "(default: %(default)s)")
    p.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16 (default: %(default)s)")
    add_device_argument(p)
    p.add_argument("--seed", type=int, default=0, help="sampling seed for T > 0 (default: %(default)s)")
    p.add_argument("--output", default="results.json", help="results file (default: %(default)s)")
    p.add_argument("--plot", help="PNG of per-position acceptance (default: the output path with .png)")
    p.add_argument("--workers", type=int, default=1,
                   help="processes sharing the prompts, dealt round-robin over categories; the same answers as one "
                        "process, the timings contended (default: %(default)s)")
    p.add_argument("--teacher-forced", metavar="PREPARED",
                   help="instead of decoding: the drafter's accuracy per TTT step on this prepared folder (or "
                        "hidden-state store, whose states are used as captured), scored as the trainer scores its "
                        "held-out samples")
    p.add_argument("--held-out", action="store_true",
                   help="with --teacher-forced: only the samples the drafter's training run held out (--draft is "
                        "that run's folder)")


def run(args: argparse.Namespace) -> int:
    from eyas.errors import EyasError
    from eyas.evaluate.run import EvalConfig, evaluate

    if args.teacher_forced:
        from eyas.evaluate.teacher_forced import format_result, teacher_forced, write

        if not args.draft:
            raise EyasError("--teacher-forced scores a drafter: give --draft.")
        result = teacher_forced(args.model, args.draft, args.teacher_forced, held_out=args.held_out,
                                limit=args.limit, device=args.device)
        write(result, args.output)
        print(format_result(result) + f"\nwrote {args.output}")
        return 0
    if args.held_out:
        raise EyasError("--held-out goes with --teacher-forced PREPARED.")
    baselines = tuple(b.strip() for b in args.baseline.split(",") if b.strip() and b.strip() != "none")
    evaluate(EvalConfig(
        model=args.model, draft=args.draft, prompts=args.prompts, limit=args.limit,
        max_new_tokens=args.max_new_tokens, steps=args.steps, tree=args.tree, top_k=args.top_k,
        draft_tokens=args.draft_tokens, temperature=args.temperature, baselines=baselines, dtype=args.dtype,
        device=args.device, seed=args.seed, output=args.output, plot=args.plot, workers=args.workers,
    ))
    return 0
