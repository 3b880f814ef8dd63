"""speculators 0.9.0's own DFlash forward beside eyas's import of the same checkpoint.

`dflash_agreement(peer_dir, eyas_dir, samples, device)` loads the folder the peer's trainer
saved with the peer's own classes (`DFlashDraftModel.from_pretrained`, eager attention,
float32; it reloads the verifier's embeddings itself) and the folder `eyas import` made of it
(with the target's embeddings), runs both on the same samples at the same anchors and compares
every block position's logits. The peer runs `_backbone_forward`, which its `forward` wraps in
`torch.compile` on CUDA; eyas runs `forward_ttt` as its trainer and held-out scorer do. Anchor
p (the peer's: slot 0 holds token p at position p, the context is positions < p) is eyas's row
p - 1; the peer's slot k (1..block_size - 1) is eyas's step k - 1. The peer draws its anchors
at random among the loss-masked positions short of the last block; marking exactly the chosen
ones with no more anchors than marked makes it take all of them, in order.

`dflash_loss_agreement(peer_dir, eyas_dir, samples, device, weighting=...)` compares the
training objective at speculators' DFlash defaults: the peer's own `forward` with loss "ce" and
per-position weight "dpace" (alpha 0.5) or "fixed-exp-decay" (gamma 4) against eyas's drafter
forward with Objective("hard-ce"), D-PACE or --ttt-decay exp(-1/gamma), and the per-step weights
of `train/loop.py` `_weights`, at the same forced anchors; it compares the loss and every shared
parameter's gradient. Measured (2026-12-06, float32, CPU): with the full vocabulary D-PACE agrees
(loss 1e-7, gradients 8e-7 relative); two differences remain. (1) The hard label: the peer takes
the argmax of the verifier's logits over the draft vocabulary (its `verifier_lm_head` holds only
those rows), eyas over the whole vocabulary, a pair whose argmax lies outside getting no loss and
q = 0 under D-PACE; with the peer's rule eyas's loss matches again. (2) The decay normaliser: the
peer divides sum_k exp(-(k-1)/gamma) CE by every trained slot of every step, eyas each step by its
own trained pairs, so with every block whole eyas's loss and gradients are block_size - 1 times
the peer's. The exponents agree (slot k of the peer is eyas's step k - 1). The peer also never
trains `lm_head` (frozen to the verifier's rows); eyas does.

Run as a script, it is the local proof of the import (speculators on the path):
  PYTHONPATH=src:PEER python3 bench/peer_check.py --target packaged:smollm2-135m \
      --out bench/results/peer_check_dflash_cpu.json
builds a tiny random Llama target (tests/tiny.py), then for each variant (VARIANTS; with
--target also that model at the peer's defaults) a DFlash drafter with the peer's
`from_training_args` (the decoder config from its `create_transformer_layer_config`, as
`speculators.train` builds it), its weights drawn at random (norm weights around 1) so that
every term matters, saved by the peer's `SingleGPUCheckpointer` (bf16, `save_pretrained`);
imports it and compares on random samples with the target's own states, the logits and the
objective under both weightings ("loss_vs_peer"): ~25 s on 2 CPU cores, `dflash_agreement`
itself 0.1-2 s a tiny variant and ~10 s on SmolLM2 (2 x 384 tokens).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterable

import torch

Sample = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # input_ids [T], aux [T, L_aux, H], last hidden [T, H]


def dflash_agreement(peer_dir: str | Path, eyas_dir: str | Path, samples: Iterable[Sample], device: str,
                     anchors: int = 64) -> dict[str, Any]:
    """Per block position k = 1..block_size-1 (the drafted slots): the share of blocks where the
    peer's and eyas's argmax agree, and the largest |logit difference| (absolute, and relative to
    the largest |logit|), over up to `anchors` anchors per sample spread evenly over
    1..T-block_size-1 (a sample shorter than block_size + 2 has none: counted in `skipped`).
    `samples`: (input_ids [T], aux [T, L_aux, H] in the drafter's aux-id order, last [T, H] the
    target's final state before its norm (the peer's training targets; no logit depends on it)),
    e.g. a store sample's `input_ids`, `hidden[:, :-1]`, `hidden[:, -1]`."""
    t0 = time.monotonic()
    peer, ours = load_peer(peer_dir, device), load_eyas(eyas_dir, device)
    S = peer.block_size
    if ours.block_size != S:
        raise ValueError(f"the peer's block is {S} slots, the import's {ours.block_size}")
    same, worst, scale, blocks, skipped = torch.zeros(S - 1), torch.zeros(S - 1), torch.zeros(S - 1), 0, 0
    for input_ids, aux, last in samples:
        ids, aux, last = input_ids.to(device).long(), aux.to(device).float(), last.to(device).float()
        p = anchor_positions(len(ids), S, anchors).to(device)
        if not len(p):
            skipped += 1
            continue
        with torch.no_grad():
            theirs = peer_blocks(peer, ids, aux, last, p)[:, 1:]  # [N, S-1, Vd]: the drafted slots
            mine = eyas_blocks(ours, ids, aux, p)  # [N, S-1, Vd]
        same += (theirs.argmax(-1) == mine.argmax(-1)).sum(0).cpu()
        worst = torch.maximum(worst, (theirs - mine).abs().amax((0, 2)).cpu())
        scale = torch.maximum(scale, theirs.abs().amax((0, 2)).cpu())
        blocks += len(p)
    return {"block_positions": list(range(1, S)), "blocks": blocks, "skipped": skipped,
            "same_argmax": [round(x, 4) for x in (same / max(blocks, 1)).tolist()],
            "max_abs_logit_diff": [float(f"{x:.3g}") for x in worst.tolist()],
            "max_rel_logit_diff": [float(f"{x:.3g}") for x in (worst / scale.clamp_min(1e-30)).tolist()],
            "seconds": round(time.monotonic() - t0, 1)}


def dflash_loss_agreement(peer_dir: str | Path, eyas_dir: str | Path, samples: Iterable[Sample], device: str,
                          anchors: int = 64, weighting: str = "dpace", gamma: float = 4.0,
                          dpace_alpha: float = 0.5) -> dict[str, Any]:
    """The training objective on both sides at the same anchors (as `dflash_agreement` spreads
    them): the peer's own `forward` (uncompiled) with loss "ce" (eager) and per-position weight
    "dpace" (alpha `dpace_alpha`) or "fixed-exp-decay" (gamma `gamma`), its random
    `select_anchors` replaced by those anchors, against eyas's drafter forward with
    Objective("hard-ce", dpace_alpha) and `_weights`'s per-step weights for one process
    (--ttt-decay exp(-1/gamma)). Every position is trained (loss_mask all ones), so forcing the
    anchors changes nothing that is trained. Each sample is its own batch on both sides; the
    losses are averaged over samples and their gradients summed. Returns both losses, their
    |difference| over the peer's and ratio, the worst shared parameter's max |gradient
    difference| over its max |peer gradient|, the trainable parameters only one side has, the
    trained pairs whose target argmax over the whole vocabulary lies outside the draft
    vocabulary (eyas gives them no loss and q = 0 under D-PACE; the peer's argmax is over the
    draft vocabulary alone), and eyas's loss with the peer's label rule (`loss_eyas_draft_argmax`),
    which separates that difference from the weighting's."""
    import speculators.models.dflash.core as core
    from speculators.losses import resolve_loss_config

    from eyas.draft.loss import COUNT, IN_VOCAB, step_counts
    from eyas.draft.objective import Objective
    from eyas.train.labels import make_labels

    if weighting not in ("dpace", "decay"):
        raise ValueError(f"weighting is dpace or decay, not {weighting!r}")
    t0 = time.monotonic()
    head = target_head(eyas_dir)
    peer, ours, head = load_peer(peer_dir, device), load_eyas(eyas_dir, device, head), head.to(device)
    S, K = peer.block_size, ours.block_size - 1
    if K != S - 1:
        raise ValueError(f"the peer's block is {S} slots, the import's {ours.block_size}")
    peer_forward = getattr(type(peer).forward, "_torchdynamo_orig_callable", type(peer).forward)  # never compiled
    peer_kwargs = dict(loss_config=resolve_loss_config("ce", "eager"), gamma=gamma, dpace_alpha=dpace_alpha,
                       per_position_loss_weight="dpace" if weighting == "dpace" else "fixed-exp-decay")
    objective = Objective("hard-ce", dpace_alpha=dpace_alpha if weighting == "dpace" else None)
    draft_ids = torch.arange(len(ours.d2t), device=device) + ours.d2t  # [Vd] target ids
    theirs_params = {n: p for n, p in peer.named_parameters() if p.requires_grad}
    mine_params = {n: p for n, p in ours.named_parameters() if p.requires_grad}
    samples = list(samples)
    loss_peer = loss_eyas = loss_draft = 0.0
    blocks = pairs = outside = 0
    select = core.select_anchors
    try:
        for input_ids, aux, last in samples:
            ids, aux, last = input_ids.to(device).long(), aux.to(device).float(), last.to(device).float()
            T = len(ids)
            p = anchor_positions(T, S, anchors).to(device)  # [N]
            core.select_anchors = lambda mask, n, size, p=p: (p, torch.ones(len(p), dtype=torch.bool, device=device))
            ones = torch.ones(1, T, dtype=torch.long, device=device)
            _, theirs, _ = peer_forward(peer, aux.flatten(-2)[None], ids[None], ones, last[None], 0 * ones,
                                        max_anchors=len(p), **peer_kwargs)
            (theirs / len(samples)).backward()
            rows = torch.zeros(1, T, dtype=torch.bool, device=device)
            rows[0, p - 1] = True
            labels = make_labels(head, last[None], ones.bool(), draft_ids)
            counts = step_counts(ones.bool(), K, rows).to(device)  # [K] trained pairs a step
            weights = (torch.full((K,), 1 / counts.sum().item(), device=device) if weighting == "dpace"
                       else torch.exp(-torch.arange(K, device=device) / gamma) / counts)  # _weights, world 1
            mine, stats, _ = ours(ids[None], aux[None], labels, weights, rows, objective)
            (mine / len(samples)).backward()
            with torch.no_grad():  # the peer's hard label: the argmax over the draft vocabulary alone
                drafted = replace(labels, target_draft=labels.teacher(labels.hidden).argmax(-1))  # [1, T]
                loss_draft += ours(ids[None], aux[None], drafted, weights, rows, objective)[0].item() / len(samples)
            loss_peer += theirs.item() / len(samples)
            loss_eyas += mine.item() / len(samples)
            blocks, pairs = blocks + len(p), pairs + int(counts.sum())
            outside += int((stats[:, COUNT] - stats[:, IN_VOCAB]).sum())  # target argmax outside the draft vocab
    finally:
        core.select_anchors = select
    worst, worst_name = 0.0, None
    for name in sorted(theirs_params.keys() & mine_params.keys()):
        g, h = theirs_params[name].grad, mine_params[name].grad
        diff = ((g - h).abs().max() / g.abs().max().clamp_min(1e-30)).item()
        if diff >= worst:
            worst, worst_name = diff, name
    return {"weighting": weighting, "gamma": gamma if weighting == "decay" else None,
            "dpace_alpha": dpace_alpha if weighting == "dpace" else None, "loss_peer": loss_peer,
            "loss_eyas": loss_eyas, "rel_loss_diff": float(f"{abs(loss_peer - loss_eyas) / abs(loss_peer):.3g}"),
            "loss_eyas_over_peer": float(f"{loss_eyas / loss_peer:.7g}"), "loss_eyas_draft_argmax": loss_draft,
            "draft_argmax_over_peer": float(f"{loss_draft / loss_peer:.7g}"),
            "max_rel_grad_diff": float(f"{worst:.3g}"), "worst_param": worst_name,
            "params_compared": len(theirs_params.keys() & mine_params.keys()),
            "params_peer_only": sorted(theirs_params.keys() - mine_params.keys()),
            "params_eyas_only": sorted(mine_params.keys() - theirs_params.keys()),
            "anchors": blocks, "pairs": pairs, "pairs_target_outside_draft_vocab": outside,
            "seconds": round(time.monotonic() - t0, 1)}


def anchor_positions(T: int, S: int, anchors: int) -> torch.Tensor:
    """Up to `anchors` anchors spread evenly over 1..T-S-1 (none where T < S + 2): anchor 0 has no
    context row in eyas, and the peer never anchors in the last S positions."""
    return torch.linspace(1, T - S - 1, max(0, min(anchors, T - S - 1))).round().long().unique()


def load_peer(folder: str | Path, device: str):
    """The peer's model as its own code loads it, in float32 with eager attention."""
    from speculators.models.dflash import DFlashDraftModel

    cfg = DFlashDraftModel.config_class.from_pretrained(str(folder))
    cfg.transformer_layer_config._attn_implementation = "eager"
    model = DFlashDraftModel.from_pretrained(str(folder), config=cfg, dtype=torch.float32)
    return model.float().eval().to(device)


def load_eyas(folder: str | Path, device: str, head=None):
    """The imported drafter with its target's input embeddings (from `head`, else read), in float32."""
    from eyas.draft import load_drafter

    head = target_head(folder) if head is None else head
    return load_drafter(folder, head.embed_weight).float().eval().to(device)


def target_head(folder: str | Path):
    """The import's target head as eyas reads it: the embeddings, and the norm and lm_head of its labels."""
    from eyas.draft import load_config
    from eyas.models import resolve_model
    from eyas.models.target_head import load_target_head

    return load_target_head(resolve_model(load_config(folder).identity.model))


def peer_blocks(peer, ids: torch.Tensor, aux: torch.Tensor, last: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """The peer's logits [N, S, Vd] of the blocks anchored at p [N] (ascending)."""
    T = len(ids)
    loss_mask = torch.zeros(1, T, dtype=torch.long, device=ids.device)
    loss_mask[0, p] = 1
    _, logits, *_ = peer._backbone_forward(
        aux.flatten(-2)[None], ids[None], loss_mask, last[None],
        torch.zeros(1, T, dtype=torch.long, device=ids.device), max_anchors=len(p))
    return logits.view(len(p), peer.block_size, -1)


def eyas_blocks(ours, ids: torch.Tensor, aux: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """eyas's logits [N, S-1, Vd] of slots 1.. of the same blocks: anchor p is row p - 1."""
    rows = torch.zeros(1, len(ids), dtype=torch.bool, device=ids.device)
    rows[0, p - 1] = True
    steps = ours.forward_ttt(ids[None], aux[None], ours.block_size - 1, rows)  # K x [1, T, Vd]
    return torch.stack([logits[0, p - 1] for logits in steps], 1)


# ---------------------------------------------------------------- the local proof (a script)

VARIANTS = {  # name -> the peer's training flags that shape the drafter
    "defaults": dict(full_attention=[], non_causal=False, draft_vocab=96),  # every layer sliding, causal blocks
    "full_attention": dict(full_attention=[0, 1], non_causal=False, draft_vocab=96),
    "sliding_non_causal": dict(full_attention=[], non_causal=True, draft_vocab=96),
    "mixed_full_vocab": dict(full_attention=[1], non_causal=False, draft_vocab=None),
}
# On a real target: the peer's own defaults (5 layers, block 16, every layer sliding and causal,
# the full vocabulary, as without a token-frequency file).
REAL = dict(full_attention=[], non_causal=False, draft_vocab=None, layers=5, block=16)


def peer_drafter(target: Path, out: Path, *, full_attention: list[int], non_causal: bool, draft_vocab: int | None,
                 layers: int = 2, block: int = 4, seed: int = 0) -> Path:
    """A random DFlash drafter built and saved as `speculators.train` does; returns its folder."""
    from speculators.models.dflash import DFlashDraftModel
    from speculators.train.checkpointer import SingleGPUCheckpointer
    from speculators.train.cli import create_transformer_layer_config
    from speculators.train.utils import resolve_mask_token_id

    layer = create_transformer_layer_config(str(target), num_layers=layers, draft_arch="qwen3", hidden_act=None,
                                            sliding_window=2048, full_attention_indices=full_attention)
    V = layer.vocab_size
    g = torch.Generator().manual_seed(seed)
    t2d = d2t = None
    if draft_vocab:
        ids = torch.randperm(V, generator=g)[:draft_vocab].sort().values
        t2d, d2t = torch.zeros(V, dtype=torch.bool), ids - torch.arange(draft_vocab)
        t2d[ids] = True
    model = DFlashDraftModel.from_training_args(
        layer, t2d=t2d, d2t=d2t, draft_vocab_size=draft_vocab or V, block_size=block,
        verifier_name_or_path=str(target), target_layer_ids=None, draft_attn_impl="sdpa",
        mask_token_id=resolve_mask_token_id(str(target), V, None), sliding_window_non_causal=non_causal)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:  # norms around 1, matrices scaled by fan-in
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g) if p.dim() == 1
                        else torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    SingleGPUCheckpointer(out).save_checkpoint(model, optimizer, 0)
    return out / "0"


def random_samples(target: str, aux_ids: list[int], count: int, length: int, seed: int = 1) -> list[Sample]:
    """Random token samples and the target's own states at them, as eyas captures them."""
    from eyas.models.states import TargetStates

    states = TargetStates(target, ",".join(map(str, aux_ids)))  # the aux ids, then id N
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        ids = torch.randint(0, states.identity.vocab_size, (length,), generator=g)
        hidden = states.states(ids[None], torch.ones(1, length, dtype=torch.long))[0].clone()  # [T, L+1, H]
        out.append((ids, hidden[:, :-1], hidden[:, -1]))
    return out


def check(target: str, label: str, work: Path, name: str, flags: dict[str, Any], samples: int,
          length: int) -> dict[str, Any]:
    """One variant: the peer's drafter for `target` (`label` in the record), `eyas import`, and their agreement."""
    from eyas.export import import_drafter
    from eyas.models import resolve_model

    peer = peer_drafter(Path(resolve_model(target)), work / name, **flags)
    summary = import_drafter(peer, work / f"{name}-eyas", target=target)
    data = random_samples(target, summary["aux_layer_ids"], samples, length)
    agreement = dflash_agreement(peer, work / f"{name}-eyas", data, "cpu")
    loss = {w: dflash_loss_agreement(peer, work / f"{name}-eyas", data, "cpu", weighting=w) for w in ("dpace", "decay")}
    keep = ("layout", "depth", "num_hidden_layers", "causal_layers", "draft_vocab_size", "sliding_window")
    return {"target": label, "flags": flags, "import": {k: summary[k] for k in keep if k in summary},
            "agreement": agreement, "loss_vs_peer": loss}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--target", help="also a real target (e.g. packaged:smollm2-135m) with the peer's defaults")
    p.add_argument("--samples", type=int, default=2)
    p.add_argument("--length", type=int, default=96, help="tokens a sample (the real target's: 4x)")
    args = p.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from common import git
    from tiny import build_model

    torch.manual_seed(0)
    results: dict[str, Any] = {"command": "python3 " + " ".join(sys.argv), "commit": git("rev-parse", "HEAD"),
                               "device": "cpu", "float": "float32 (weights saved in bf16 by the peer's checkpointer)"}
    with tempfile.TemporaryDirectory() as tmp:
        tiny = str(build_model(Path(tmp) / "tiny-target", "llama"))
        runs = [(tiny, "tests/tiny.py llama (random)", name, flags, args.length) for name, flags in VARIANTS.items()]
        runs += [(args.target, args.target, "real_target_defaults", REAL, 4 * args.length)] if args.target else []
        for target, label, name, flags, length in runs:
            results[name] = check(target, label, Path(tmp), name, flags, args.samples, length)
            print(name, json.dumps(results[name]["agreement"]), flush=True)
            print(name, "loss", json.dumps(results[name]["loss_vs_peer"]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
