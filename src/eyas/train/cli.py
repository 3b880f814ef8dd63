"""Train an EAGLE-3 drafter with training-time test (TTT).

Offline, from a hidden-state store (eyas capture); online, with the target loaded beside
the drafter so hidden states are computed on the fly and no store touches the disk.

The drafter reads the target's aux states (the store's layer ids) and learns, over
--ttt-steps unrolled steps, to predict the target's next-token distribution (restricted
to a --draft-vocab of the most frequent trained tokens). Step k's loss is weighted
--ttt-decay^k. Per step k it reports the loss, the top-1 accuracy against the target's
greedy token and a simulated acceptance length tau_sim = 1 + sum_k prod_{j<=k} acc_j, on
the training batches and on a held-out --eval-fraction of the samples: on the progress
bar, in OUT/metrics.jsonl and, when tensorboard is installed, under OUT/tensorboard.

With --drafter dflash it trains a DFlash drafter instead (vLLM's method dflash): a block of
--block-size - 1 tokens drafted in one forward pass, every position an anchor, slot k+1 of a
block scored like TTT step k (same labels, vocabulary, metrics and data paths).

OUT ends up an HF-style drafter folder (config.json + model.safetensors) ready for eval
and export; resumable checkpoints live in OUT/checkpoints (every --save-every steps and at
the end). bf16 autocast on GPU, float32 on CPU. Under torchrun each process takes its
share of every step's batches (DDP; --fsdp shards the head across GPUs).

examples:
  eyas train --store store --out drafter
  eyas train --store store --out drafter --minutes 30       # as many steps as fit in 30 minutes
  eyas train --store store --out drafter --steps 200 --minutes 5 --batch-tokens 2048
  eyas train --store store --out drafter --resume          # continue an interrupted run
  eyas train --online --model packaged:smollm2-135m --data prepared --out drafter
  eyas train --store store --out dflash --drafter dflash --block-size 8   # a block of 7 in one pass
  torchrun --nproc-per-node 8 -m eyas train --store store --out drafter --epochs 3
"""

from __future__ import annotations

import argparse

from eyas.device import TORCHRUN_NOTE, add_device_argument

HELP = "train an EAGLE-3 (training-time test) or DFlash (block) drafter from a store or online"
ON_INTERRUPT = "interrupted; add --resume to the same command to continue from its last checkpoint."


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_argument_group("data")
    src.add_argument("--store", help="hidden-state store (offline training)")
    src.add_argument("--online", action="store_true", help="capture on the fly with --model over --data (no store)")
    src.add_argument("--model", help="the target (offline: default is the model the store records)")
    src.add_argument("--data", help="prepared folder (with --online)")
    src.add_argument("--layers", default="auto", help="aux layer ids with --online (default auto = 2, N//2, N-3)")
    src.add_argument("--out", required=True, help="output folder: the drafter, metrics.jsonl, checkpoints/")
    src.add_argument("--eval-fraction", type=float, default=0.05, help="share of samples held out (default 0.05)")
    src.add_argument("--max-len", type=int, help="crop samples to this many tokens (default: --batch-tokens)")
    src.add_argument("--allow-incomplete", action="store_true",
                     help="train on a store whose capture has not finished (refused otherwise, naming what is missing)")

    head = p.add_argument_group("drafter")
    head.add_argument("--drafter", default="eagle3", choices=("eagle3", "dflash", "peagle"),
                      help="eagle3: K tokens, one forward pass each (default); dflash: a block of K in one pass; "
                           "peagle: EAGLE-3 drafting its K in one pass (vLLM's parallel_drafting)")
    head.add_argument("--block-size", type=int,
                      help="dflash: the last token plus the K drafted ones (default --ttt-steps + 1 = 8)")
    head.add_argument("--draft-layers", type=int, help="dflash: decoder layers (default: a tenth of the target's, >= 1)")
    head.add_argument("--mask-token-id", type=int,
                      help="dflash, peagle: the token whose (frozen) embedding marks the slots to fill (default: the last id)")
    head.add_argument("--anchors", type=int,
                      help="dflash: rows per sample and step that anchor a block, drawn afresh each step among those "
                           "with a trained label (default 512); bounds the block tokens at anchors x block size a sample")
    head.add_argument("--draft-vocab", type=int, help="draft vocabulary size (default min(32000, target vocab))")
    head.add_argument("--ttt-steps", type=int, default=7, help="unrolled training-time-test steps (default 7)")
    head.add_argument("--ttt-decay", type=float, default=0.8,
                      help="loss weight decay^k of step k (dflash: of block slot k+1) (default 0.8)")
    head.add_argument("--intermediate-size", type=int,
                      help="the drafter's MLP width (default: the target's); vLLM and SGLang read it from the "
                           "exported config")
    head.add_argument("--draft-attention", choices=("auto", "gqa", "mla"), default="auto",
                      help="the drafter layer's attention: gqa (Llama-style) or mla (the target's multi-head latent "
                           "attention, its ranks and head dims); default auto = mla for DeepSeek-V2/V3-style targets "
                           "(Kimi-K2/K2.5 included), else gqa")
    head.add_argument("--fc-norm", action=argparse.BooleanOptionalAction, default=False,
                      help="an RMSNorm on each aux state before fc (EAGLE 3.1; served by vLLM, not SGLang)")
    head.add_argument("--norm-output", action=argparse.BooleanOptionalAction, default=False,
                      help="feed the normed output back between steps (EAGLE 3.1; served by vLLM, not SGLang)")

    opt = p.add_argument_group("schedule")
    opt.add_argument("--epochs", type=float, help="passes over the training samples (default 1)")
    opt.add_argument("--steps", type=int, help="optimizer steps instead of --epochs")
    opt.add_argument("--minutes", type=float,
                     help="fit the whole schedule into this many minutes: its length follows the steady-state rate "
                          "(after warm-up), at most --steps/--epochs when given")
    opt.add_argument("--lr", type=float, default=1e-4, help="peak learning rate (default 1e-4), cosine to 0")
    opt.add_argument("--warmup", type=float, default=0.03, help="warm-up: share of steps if < 1, else steps (default 0.03)")
    opt.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay (default 0)")
    opt.add_argument("--clip", type=float, default=0.5, help="gradient-norm clipping (default 0.5)")
    opt.add_argument("--batch-tokens", type=int, default=8192, help="padded tokens per micro-batch per process (default 8192)")
    opt.add_argument("--grad-accum", type=int, default=1, help="micro-batches per process per step (default 1)")
    opt.add_argument("--seed", type=int, default=0, help="seed for initialisation, split and order (default 0)")

    run = p.add_argument_group("run")
    run.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint")
    add_device_argument(run, TORCHRUN_NOTE)
    run.add_argument("--fsdp", action="store_true", help="under torchrun: shard the drafter across GPUs (FSDP2)")
    run.add_argument("--save-every", type=int, default=500, help="checkpoint every N steps (default 500) and at the end")
    run.add_argument("--eval-every", type=int, default=500, help="held-out metrics every N steps (default 500) and at the end")
    run.add_argument("--log-every", type=int, default=10, help="metrics row every N steps (default 10)")
    run.add_argument("--keep", type=int, default=2, help="checkpoints kept in OUT/checkpoints (default 2)")
    run.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    from eyas.train.config import TrainConfig
    from eyas.train.loop import train

    options = {k: v for k, v in vars(args).items() if not k.startswith("_") and k != "command"}
    train(TrainConfig(**options))
    return 0
