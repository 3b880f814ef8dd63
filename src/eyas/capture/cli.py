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

import importlib
import os

from eyas.capture.config import CaptureConfig

HELP = "run the target and store its hidden states (transformers or vLLM)"
CONFIG = CaptureConfig  # its options (eyas.options)
# --data and --out are required except by --print-serve-command, which captures nothing.
USAGE = ("%(prog)s --model MODEL --data PREPARED --out STORE [options]\n"
         "       %(prog)s --backend vllm --model MODEL --print-serve-command [options]")
ON_INTERRUPT = "interrupted; run the same command again to resume."
ON_OUT_OF_MEMORY = "lower --batch-tokens, then run the same command again to resume"


def run(cfg: CaptureConfig) -> int:
    capture = importlib.import_module("eyas.capture.run").capture
    Store = importlib.import_module("eyas.store.reader").Store
    summary = importlib.import_module("eyas.store.cli").summary

    if cfg.serve_command_only:
        print_serve_command = importlib.import_module("eyas.vllm").print_serve_command

        print_serve_command(cfg.model, cfg.layers, cfg.model_dtype, cfg.vllm)
        return 0
    capture(cfg)
    if int(os.environ.get("RANK", "0")) == 0:  # under torchrun, one summary
        print(summary(Store(cfg.out)))
    return 0
