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
  eyas eval --model MODEL --draft CKPT --prompts long:8k,32k   # tau by context length, on long chat histories
  eyas eval --model MODEL --draft drafter --teacher-forced prepared --held-out   # accuracy per TTT step
"""

from __future__ import annotations

import importlib

from eyas.evaluate.config import EvalConfig

HELP = "lossless speculative decoding: acceptance length tau, speed-up, per-position acceptance"
CONFIG = EvalConfig  # its options (eyas.options)


def run(cfg: EvalConfig) -> int:
    evaluate = importlib.import_module("eyas.evaluate.run").evaluate

    if cfg.teacher_forced:
        format_result = importlib.import_module("eyas.evaluate.teacher_forced").format_result
        teacher_forced = importlib.import_module("eyas.evaluate.teacher_forced").teacher_forced
        write = importlib.import_module("eyas.evaluate.teacher_forced").write

        cfg.check_paths()
        result = teacher_forced(cfg.model, cfg.draft, cfg.teacher_forced, held_out=cfg.held_out, limit=cfg.limit,
                                device=cfg.device)
        write(result, cfg.output)
        print(format_result(result) + f"\nwrote {cfg.output}")
        return 0
    evaluate(cfg)
    return 0
