"""Write a trained drafter in the layout a serving engine loads, and print the command that serves it.

formats:
  vllm         vLLM's LlamaForCausalLMEagle3 folder (config.json + model.safetensors); layer ids
               as eyas counts them (id k = input of target layer k).
  speculators  vLLM's speculators format (Eagle3Speculator); names its target, so
               `vllm serve DIR` alone also works.
  sglang       SGLang's LlamaForCausalLMEagle3 folder; layer ids shifted to SGLang's
               output-of-layer convention (k-1) in eagle_config. Needs exactly three aux layers.

Every field written was checked against the engine's own loader code; the vllm format is
proven by serving it in vLLM in eyas's tests.

examples:
  eyas export runs/drafter --to vllm --out exported/vllm
  eyas export runs/drafter --to sglang --out exported/sglang --dtype bf16
  eyas export runs/drafter --to vllm --out exported/vllm --serve-command   # print only
"""

from __future__ import annotations

import argparse
import importlib

from eyas.export.layouts import LAYOUTS

HELP = "drafter checkpoint -> a folder vLLM or SGLang serves"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("ckpt", help="the eyas drafter checkpoint folder (from eyas train or eyas import)")
    p.add_argument("--to", required=True, choices=sorted(LAYOUTS), help="the serving layout to write")
    p.add_argument("--out", required=True, help="output folder (created; must be empty unless --force)")
    p.add_argument("--dtype", default="keep", choices=["keep", "bf16", "fp16", "fp32"],
                   help="cast the weights (default: keep the checkpoint's dtype; engines cast at load anyway)")
    p.add_argument("--target", help="the target to serve, if not the one recorded in the drafter (checked to be "
                   "the same model and tokenizer)")
    p.add_argument("--num-speculative-tokens", type=int, metavar="K",
                   help="draft tokens per step in the serve command and the speculators config (default 3; "
                        "a DFlash drafter's block size - 1)")
    p.add_argument("--serve-command", action="store_true",
                   help="only print the command that serves the target with the drafter at --out; write nothing")
    p.add_argument("--force", action="store_true", help="replace the drafter files in a non-empty --out")


def run(args: argparse.Namespace) -> int:
    exporter = importlib.import_module("eyas.export.exporter")  # torch: loaded to run, never for --help
    if args.serve_command:
        print(exporter.planned_serve_command(args.ckpt, args.to, args.out, target=args.target,
                                    num_speculative_tokens=args.num_speculative_tokens))
        return 0
    summary = exporter.export_drafter(args.ckpt, args.to, args.out, target=args.target, dtype=args.dtype,
                             num_speculative_tokens=args.num_speculative_tokens, force=args.force)
    print(f"exported {args.ckpt} as {summary['format']} to {summary['out']}: "
          f"{summary['tensors']} tensors, {summary['bytes'] / 2**20:.1f} MiB")
    for engine, ids in summary["aux_layer_ids"].items():
        print(f"  aux layer ids for {engine}: {ids}")
    print(f"serve it with:\n  {summary['serve_command']}")
    return 0
