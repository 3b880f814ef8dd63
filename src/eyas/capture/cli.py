"""Run the target over prepared samples and store its hidden states.

Captures, for every token, the aux layer ids (vLLM's convention: id k is the input of
decoder layer k) plus id N (the last layer's output before the final norm, from which
training derives its labels) into sharded, checksummed safetensors. Re-running the same
command after a crash or Ctrl-C completes only what is missing.

examples:
  eyas capture --model packaged:smollm2-135m --data prepared --out store
  eyas capture --model ./llama --data prepared --out store --layers 2,16,29 --dtype fp8
  eyas capture --backend vllm --model ./big-moe --data prepared --out store --tensor-parallel-size 8
  eyas capture --backend vllm --model ./big-moe --spool /shared/spool --print-serve-command
  eyas capture --backend vllm --model ./big-moe --data prepared --out store --endpoint http://gpu-node:8000 --spool /shared/spool
"""

from __future__ import annotations

import argparse
import importlib
import os

from eyas.device_flag import TORCHRUN_NOTE, add_device_argument
from eyas.errors import EyasError
from eyas.store.cli import summary
from eyas.vllm import add_vllm_arguments, print_serve_command, vllm_options

HELP = "run the target and store its hidden states (transformers or vLLM)"
ON_INTERRUPT = "interrupted; run the same command again to resume."


def add_arguments(p: argparse.ArgumentParser) -> None:
    # --data and --out are required except by --print-serve-command, which captures nothing.
    p.usage = ("%(prog)s --model MODEL --data PREPARED --out STORE [options]\n"
               "       %(prog)s --backend vllm --model MODEL --print-serve-command [options]")
    p.add_argument("--model", required=True, help="target model: folder, .gguf, packaged:smollm2-135m or hub id")
    p.add_argument("--data", help="prepared folder (from eyas prepare); required unless --print-serve-command")
    p.add_argument("--out", help="store folder (created, or resumed if it exists); required unless --print-serve-command")
    p.add_argument("--backend", default="hf", help="hf (transformers, default) or vllm")
    p.add_argument("--layers", default="auto", help="aux layer ids, e.g. 2,15,27; auto = (2, N//2, N-3). Id N is always added")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32", "fp8"], help="store dtype (default bf16; fp8 halves it)")
    add_device_argument(p, f"{TORCHRUN_NOTE}; hf backend only (vLLM places the model itself)")
    p.add_argument("--model-dtype", default=None, help="dtype the target runs in (default float32 on cpu, bf16 on cuda)")
    p.add_argument("--batch-tokens", type=int, default=8192, help="padded tokens per forward (default 8192)")
    p.add_argument("--chat-template", metavar="FILE",
                   help="not needed: the template `prepare` used is recorded with --data; if given, it must be that one")
    p.add_argument("--shard-mb", type=float, default=1024, help="target shard size in MiB (default 1024)")
    # --- vLLM backend: flags defined in src/eyas/vllm/options.py ---
    add_vllm_arguments(p)


def run(args: argparse.Namespace) -> int:
    capture = importlib.import_module("eyas.capture.run").capture  # torch: loaded to run, never for --help
    Store = importlib.import_module("eyas.store.reader").Store
    # --- vLLM backend (src/eyas/vllm): serve command, options, vLLM's own dtype default ---
    options, model_dtype = {}, args.model_dtype
    if args.backend == "vllm":
        if args.print_serve_command:
            print_serve_command(args)
            return 0
        options, model_dtype = vllm_options(args), model_dtype or "auto"
    # --- end vLLM backend ---
    missing = [f"--{k}" for k in ("data", "out") if not getattr(args, k)]
    if missing:
        raise EyasError(f"missing {', '.join(missing)} (see eyas capture --help)")
    capture(args.model, args.data, args.out, backend=args.backend, layers=args.layers, dtype=args.dtype,
            device=args.device, model_dtype=model_dtype, batch_tokens=args.batch_tokens, shard_mb=args.shard_mb,
            chat_template=args.chat_template, **options)
    if int(os.environ.get("RANK", "0")) == 0:  # under torchrun, one summary
        print(summary(Store(args.out)))
    return 0
