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

import importlib

from eyas.train.config import TrainConfig

HELP = "train an EAGLE-3 (training-time test) or DFlash (block) drafter from a store or online"
CONFIG = TrainConfig  # its options (eyas.options)
ON_INTERRUPT = "interrupted; add --resume to the same command to continue from its last checkpoint."
ON_OUT_OF_MEMORY = ("lower --batch-tokens (with --drafter dflash, --anchors too), then add --resume to the same "
                    "command to continue from its last checkpoint")


def run(cfg: TrainConfig) -> int:
    train = importlib.import_module("eyas.train.loop").train

    train(cfg)
    return 0
