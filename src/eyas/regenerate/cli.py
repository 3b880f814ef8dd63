"""Replace each assistant turn of prepared conversations with the target's own answer.

Turn by turn: every later turn is generated after the target's earlier answers, as in a
real chat with it. Drafters trained on the target's own outputs accept more tokens. The
result is a prepared folder (same target, same --max-len) ready for `eyas capture`; the
run resumes where it stopped if killed. --temperature 0 (default) is greedy.

examples:
  eyas regenerate --model packaged:smollm2-135m --data prepared --out regen
  eyas regenerate --model ./llama --data prepared --out regen --backend vllm --tensor-parallel-size 4 --temperature 0.7
"""

from __future__ import annotations

import argparse
import importlib

from eyas.device_flag import add_device_argument
from eyas.vllm.engine import parse_engine_args
from eyas.vllm.options import add_engine_arguments

HELP = "replace assistant turns with the target's own answers (hf or vLLM)"
ON_INTERRUPT = "interrupted; run the same command again to resume."


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="target model (the one the data was prepared for)")
    p.add_argument("--data", required=True, help="prepared folder (from eyas prepare)")
    p.add_argument("--out", required=True, help="new prepared folder (resumed if it exists)")
    p.add_argument("--backend", default="hf", choices=["hf", "vllm"], help="hf (transformers, default) or vllm")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy (default)")
    p.add_argument("--max-new-tokens", type=int, default=1024, help="longest answer per turn (default 1024)")
    p.add_argument("--group-size", type=int, default=64,
                   help="conversations generated together, and saved together for resume (default 64)")
    p.add_argument("--minutes", type=float,
                   help="stop after the group that ends past this many minutes; the output holds what is done, "
                        "and the same command continues")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (with --temperature > 0)")
    add_device_argument(p, "hf backend only (vLLM places the model itself)")
    p.add_argument("--model-dtype", default=None,
                   help="dtype the target runs in (hf: float32 on cpu, bf16 on cuda; vllm: the checkpoint's)")
    add_engine_arguments(p.add_argument_group("vLLM backend (--backend vllm)"), data_parallel=False)


def run(args: argparse.Namespace) -> int:
    regenerate = importlib.import_module("eyas.regenerate.run").regenerate  # torch: loaded to run, never for --help
    format_summary = importlib.import_module("eyas.data.prepare").format_summary
    vllm = {}
    if args.backend == "vllm":
        vllm = {"tensor_parallel_size": args.tensor_parallel_size, "pipeline_parallel_size": args.pipeline_parallel_size,
                "engine_args": parse_engine_args(args.engine_arg)}
    summary = regenerate(args.model, args.data, args.out, backend=args.backend, temperature=args.temperature,
                         max_new_tokens=args.max_new_tokens, group_size=args.group_size, seed=args.seed,
                         minutes=args.minutes, device=args.device, model_dtype=args.model_dtype, **vllm)
    print(format_summary(summary, args.out))
    t = summary.get("regenerate_seconds")
    if t:
        print(f"time: loading the model {t['load']} s, prompts and answer text {t['render']} s, "
              f"generating {t['generate']} s, preparing {t['prepare']} s")
    if d := summary.get("static_decoding"):
        print(f"generating: prefill {d['prefill_s']} s, decode {d['decode_s']} s over {d['batches']} batch(es); "
              f"{100 * d['kept_share']:.0f}% of decoded row-steps made a kept token (stopped rows ride along until "
              f"a quarter of a batch has stopped; {d['compactions']} compaction(s))")
    return 0
