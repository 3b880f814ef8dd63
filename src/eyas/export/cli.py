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

import importlib

from eyas.export.config import ExportConfig

HELP = "drafter checkpoint -> a folder vLLM or SGLang serves"
CONFIG = ExportConfig  # its options (eyas.options)


def run(cfg: ExportConfig) -> int:
    export_drafter = importlib.import_module("eyas.export.exporter").export_drafter
    planned_serve_command = importlib.import_module("eyas.export.exporter").planned_serve_command

    if cfg.serve_command:
        print(planned_serve_command(cfg))
        return 0
    summary = export_drafter(cfg)
    print(f"exported {cfg.ckpt} as {summary['format']} to {summary['out']}: "
          f"{summary['tensors']} tensors, {summary['bytes'] / 2**20:.1f} MiB")
    for engine, ids in summary["aux_layer_ids"].items():
        print(f"  aux layer ids for {engine}: {ids}")
    print(f"serve it with:\n  {summary['serve_command']}")
    return 0
