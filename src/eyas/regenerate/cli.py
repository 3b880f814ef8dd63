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

import importlib

from eyas.regenerate.config import RegenerateConfig

HELP = "replace assistant turns with the target's own answers (hf or vLLM)"
CONFIG = RegenerateConfig  # its options (eyas.options)
ON_INTERRUPT = "interrupted; run the same command again to resume."
ON_OUT_OF_MEMORY = ("its batches take half the device's memory: free the device of other work, then run the same "
                    "command again to resume")


def run(cfg: RegenerateConfig) -> int:
    format_summary = importlib.import_module("eyas.data.prepare").format_summary
    regenerate = importlib.import_module("eyas.regenerate.run").regenerate

    summary = regenerate(cfg)
    print(format_summary(summary, cfg.out))
    t = summary.get("regenerate_seconds")
    if t:
        print(f"time: loading the model {t['load']} s, prompts and answer text {t['render']} s, "
              f"generating {t['generate']} s, preparing {t['prepare']} s")
    if d := summary.get("static_decoding"):
        print(f"generating: prefill {d['prefill_s']} s, decode {d['decode_s']} s over {d['batches']} batch(es); "
              f"{100 * d['kept_share']:.0f}% of decoded row-steps made a kept token (stopped rows ride along until "
              f"a quarter of a batch has stopped; {d['compactions']} compaction(s))")
    return 0
