"""The TTT loss step (labels, the drafter head's loss, backward) chunked, as eyas computes it
(draft/loss.py), against the same loss with every logit held: the target's distribution over
the draft vocabulary at every position in float32, then per step the scored pairs' logits and
an autograd soft cross-entropy (what eyas ran before the chunked loss, and what a plain
trainer does). Random weights and states at a target's shape, bf16 autocast, EAGLE-3's rows
(every row, K steps): median milliseconds, peak memory above what was resident, and the two
losses (equal to float32 rounding).

  PYTHONPATH=src python3 bench/loss_step_gpu.py --out OUT/loss_step.json     # H200, ~30 s
  PYTHONPATH=src python3 bench/loss_step_gpu.py --smoke --out /tmp/loss.json  # CPU
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import device_name, dump, git, say, sync  # noqa: E402


def whole_loss(head, lm_head, states, last, mask, draft_ids, weights) -> torch.Tensor:
    """Every logit held: probs [B, T, Vd] float32 for all positions, then per step k the scored
    pairs' logits [N_k, Vd] and their log-softmax kept for backward."""
    from eyas.draft.loss import trained_positions

    with torch.no_grad():
        probs = torch.softmax(head.logits(last, draft_ids).float(), -1)  # [B, T, Vd]
        to_draft = torch.full((head.lm_head_weight.shape[0],), -1, dtype=torch.long, device=last.device)
        to_draft[draft_ids] = torch.arange(len(draft_ids), device=last.device)
        target = to_draft[head.logits(last).argmax(-1)]  # [B, T]
    trained = trained_positions(mask)
    loss = last.new_zeros((), dtype=torch.float32)
    for k, normed in enumerate(states):
        b, i = (trained[:, 1 + k :] & (target[:, 1 + k :] >= 0)).nonzero(as_tuple=True)
        logits = lm_head(normed[b, i])  # [N_k, Vd]
        loss = loss + weights[k] * -(probs[b, i + 1 + k] * logits.float().log_softmax(-1)).sum()
    return loss


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--length", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=576, help="the target's and drafter's width (SmolLM2's)")
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--draft-vocab", type=int, default=32000)
    p.add_argument("--steps", type=int, default=7, help="TTT steps")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args()
    if args.smoke:
        args.device, args.rows, args.length, args.hidden, args.vocab, args.draft_vocab = "cpu", 2, 64, 32, 500, 300
        args.steps, args.repeats = 3, 3
    from eyas.draft.loss import ttt_loss
    from eyas.models.target_head import TargetHead
    from eyas.train.labels import make_labels

    dev, cuda = torch.device(args.device), args.device.startswith("cuda")
    g = torch.Generator().manual_seed(0)
    H, K = args.hidden, args.steps
    head = TargetHead(None, torch.nn.RMSNorm(H, eps=1e-6).to(dev),
                      (torch.randn(args.vocab, H, generator=g) * 0.05).to(dev, torch.bfloat16 if cuda else torch.float32))
    lm_head = torch.nn.Linear(H, args.draft_vocab, bias=False).to(dev)
    draft_ids = torch.randperm(args.vocab, generator=g)[: args.draft_vocab].sort().values.to(dev)
    last = torch.randn(args.rows, args.length, H, generator=g).to(dev)
    mask = (torch.rand(args.rows, args.length, generator=g) < 0.65).to(dev)
    states = [torch.randn(args.rows, args.length, H, generator=g).to(dev).requires_grad_() for _ in range(K)]
    weights = torch.full((K,), 1e-5, device=dev)

    def step(which: str) -> float:
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cuda):
            if which == "chunked":
                loss = ttt_loss(lm_head, states, make_labels(head, last, mask, draft_ids), weights)[0]
            else:
                loss = whole_loss(head, lm_head, states, last, mask, draft_ids, weights)
        loss.backward()
        return float(loss)

    report: dict = {"command": " ".join(sys.argv), "commit": git("rev-parse", "HEAD"), "device": device_name(args.device),
                    "settings": vars(args)}
    for which in ("whole", "chunked", "whole", "chunked"):  # each twice: the second of each is kept
        for _ in range(3):
            step(which)
        sync(dev)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() if cuda else 0
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            value = step(which)
            sync(dev)
            times.append(time.perf_counter() - start)
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30 if cuda else None
        report[which] = {"median_ms": round(1e3 * statistics.median(times), 2), "peak_gib": peak and round(peak, 2),
                         "loss": value}
        say(f"{which:<8} {report[which]}")
    report["chunked_over_whole_time"] = round(report["chunked"]["median_ms"] / report["whole"]["median_ms"], 3)
    report["loss_rel_diff"] = abs(report["chunked"]["loss"] - report["whole"]["loss"]) / abs(report["whole"]["loss"])
    dump(Path(args.out), report)
    say(f"chunked / whole time {report['chunked_over_whole_time']}, loss rel. diff {report['loss_rel_diff']:.1e}")


if __name__ == "__main__":
    main()
