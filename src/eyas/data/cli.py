"""Turn conversations into training samples for one target model.

Applies the target's chat template and marks assistant tokens as trained (the loss mask),
whatever the template family. Sources: .json/.jsonl files, parquet and Arrow files and
`datasets` save_to_disk folders (pyarrow: pip install 'eyas[data]'), in the column layouts
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

import argparse
import importlib
import sys

from eyas.errors import EyasError

HELP = "conversations -> token ids + assistant-only loss mask"
ON_INTERRUPT = "interrupted; nothing was written, run the same command again to start over."


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="target model: folder, .gguf, packaged:smollm2-135m or hub id")
    p.add_argument("--data", nargs="+", help="source(s): FILE.json(l), FILE.parquet, FILE.arrow, a save_to_disk "
                   "folder, packaged:sharegpt, packaged:chitchat or packaged:synthetic:N:SEED; mix several as SRC@WEIGHT")
    p.add_argument("--out", help="output folder for the prepared samples")
    p.add_argument("--max-len", type=int, default=2048, help="truncate samples to this many tokens (default 2048)")
    p.add_argument("--limit", type=int, help="keep at most this many samples")
    p.add_argument("--window", type=int, metavar="TURNS",
                   help="cut conversations into windows of this many user turns, a sample each (e.g. 2, as MT-bench)")
    p.add_argument("--exclude-prompts", action="append", metavar="PROMPTS",
                   help="drop conversations sharing 8 words in a row with these eval prompts (mt-bench or a "
                        "prompt file; repeatable)")
    p.add_argument("--strict", action="store_true", help="stop at the first bad record instead of skipping it")
    p.add_argument("--chat-template", metavar="FILE", help="a Jinja chat template to use instead of the tokenizer's")
    p.add_argument("--workers", type=int, help="processes that tokenize (default: up to 8 of the machine's cores; "
                   "1 tokenizes in this process); the result does not depend on it")
    p.add_argument("--show", type=int, metavar="N", help="print sample N of DIR with trained tokens highlighted")
    p.add_argument("dir", nargs="?", help="prepared folder to read (with --show)")


def run(args: argparse.Namespace) -> int:
    stage = importlib.import_module("eyas.data.prepare")  # transformers: loaded to run, never for --help
    if args.show is not None:
        if not args.dir:
            raise EyasError("--show N needs the prepared folder: eyas prepare --show N DIR")
        print(stage.show_sample(args.dir, args.show, color=sys.stdout.isatty()))
        return 0
    missing = [f"--{k}" for k in ("model", "data", "out") if not getattr(args, k)]
    if missing:
        raise EyasError(f"missing {', '.join(missing)} (see eyas prepare --help)")
    summary = stage.prepare(args.model, args.data, args.out, max_len=args.max_len, limit=args.limit,
                      strict=args.strict, chat_template=args.chat_template, workers=args.workers,
                      window=args.window, exclude=args.exclude_prompts)
    print(stage.format_summary(summary, args.out))
    return 0
