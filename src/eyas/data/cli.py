"""Turn conversations into training samples for one target model.

Applies the target's chat template and marks assistant tokens as trained (the loss mask),
whatever the template family. Sources: .json/.jsonl files, parquet and Arrow files and
`datasets` save_to_disk folders (pyarrow: pip install '.[data]' in the clone), in the column layouts
`conversations: [{from, value}]` (ShareGPT), `messages`/`conversations: [{role, content}]`
(OpenAI, UltraChat-200k) or `data: [str, ...]` (UltraChat); `packaged:sharegpt`,
`packaged:chitchat` and `packaged:synthetic:N:SEED` (N synthetic two-turn instruction
prompts, free of MT-bench; their answers are placeholders for `eyas regenerate`). Several
sources mix as SRC@WEIGHT (samples in those proportions, until one source runs out). Bad records are skipped and counted by reason; the summary names
the layouts found.

examples:
  eyas prepare --model packaged:smollm2-135m --data packaged:sharegpt --out prepared --limit 1000
  eyas prepare --model packaged:smollm2-135m --out prepared --window 2 \
      --data packaged:sharegpt@1 packaged:synthetic:30000:0@1 chats.parquet@0.5
  eyas prepare --show 0 prepared        # check the mask by eye
"""

from __future__ import annotations

import importlib
import sys

from eyas.data.config import PrepareConfig

HELP = "conversations -> token ids + assistant-only loss mask"
CONFIG = PrepareConfig  # its options (eyas.options)
ON_INTERRUPT = "interrupted; nothing was written, run the same command again to start over."


def run(cfg: PrepareConfig) -> int:
    format_summary = importlib.import_module("eyas.data.prepare").format_summary
    prepare = importlib.import_module("eyas.data.prepare").prepare
    show_sample = importlib.import_module("eyas.data.prepare").show_sample

    if cfg.show is not None:
        print(show_sample(cfg.dir, cfg.show, color=sys.stdout.isatty()))
        return 0
    summary = prepare(cfg)
    print(format_summary(summary, cfg.out))
    return 0
