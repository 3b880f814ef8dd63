"""Where is drafter accuracy lost? Held-out top-1 accuracy, on the SAME held-out tokens of one
store, for: a bigram baseline, eyas's drafter (with and without `fc_norm`), an independent
reference drafter written here in plain PyTorch from the EAGLE-3 paper (it shares no code
with eyas's draft/train modules: it reads the shards with safetensors, makes its own labels
from the target's final norm and lm_head, and has its own model, TTT loop, loss, batches and
schedule), and two linear probes (the step-0 information, and the aux states one position
late, which the target turns into the label within a few more layers).

Accuracy is eyas's: on trained positions (the label token's successor is an assistant token),
the share where the top-1 draft token equals the target's greedy token; a target argmax
outside the draft vocabulary counts as a miss. Step 0 at position i reads the aux states at i
and token i+1 and predicts the target's argmax at i+1.

Run on the CPU (a store captured in fp32 from `eyas prepare ... --max-len 256`):

    eyas prepare --model packaged:smollm2-135m --data packaged:sharegpt --out out/diag/prepared \\
        --limit 200 --max-len 256
    eyas capture --model packaged:smollm2-135m --data out/diag/prepared --out out/diag/store --dtype fp32
    HF_HUB_OFFLINE=1 PYTHONPATH=src python bench/diagnose.py --store out/diag/store \\
        --work out/diag/runs --seeds 0 1 --output bench/results/diagnose_cpu.json

`--regen-store` adds eyas's drafter trained and measured on a second store (e.g. from
`eyas regenerate`); its held-out tokens are that store's own, not the first store's (both
drafters are also evaluated on the other's held-out split).

`--pieces streams` trains each drafter on the other's batch stream (the reference on
`eyas.train.data.BatchStream`'s batches, eyas on the reference's random packing) and the
reference from eyas's own initial weights on eyas's stream; `--reuse-eyas DIR` reads eyas's
first-seed drafter from an earlier run instead of training it again.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file


# ---------------------------------------------------------------- the store, read directly


class Data:
    """Every sample of a store: tokens, masks, aux states, the target's argmax and normed
    id-N state (the label source), and the held-out split (eyas's rule, rebuilt here)."""

    def __init__(self, store: Path, model_dir: Path, eval_fraction: float):
        manifest = json.loads((store / "manifest.json").read_text())
        config = json.loads((model_dir / "config.json").read_text())
        self.ids, self.mask, self.aux, self.last, self.index = [], [], [], [], []
        for shard in manifest["shards"]:
            t = load_file(str(store / shard["file"]))
            off = t["offsets"].tolist()
            for n, (a, b) in enumerate(zip(off[:-1], off[1:])):
                self.ids.append(t["input_ids"][a:b].long())  # [T]
                self.mask.append(t["loss_mask"][a:b].bool())  # [T]
                self.aux.append(t["hidden"][a:b, :-1].float())  # [T, 3, H] ids 2, 15, 27
                self.last.append(t["hidden"][a:b, -1].float())  # [T, H] id 30, before the final norm
                self.index.append(int(t["sample_index"][n]))
        with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
            self.embed = f.get_tensor("model.embed_tokens.weight").float()  # [V, H]; SmolLM2 ties lm_head to it
            norm_w = f.get_tensor("model.norm.weight").float()  # [H]
        assert config.get("tie_word_embeddings"), "this script reads lm_head as the tied embeddings"
        self.config = config
        eps = config["rms_norm_eps"]
        self.normed = [rms(h, eps) * norm_w for h in self.last]  # [T, H]: what lm_head reads
        self.argmax = [(h @ self.embed.T).argmax(-1) for h in self.normed]  # [T] the target's greedy token
        order = sorted(range(len(self.index)), key=lambda p: self.index[p])
        random.Random(0).shuffle(order)
        n_eval = math.ceil(eval_fraction * len(order))
        self.eval, self.train = sorted(order[:n_eval]), sorted(order[n_eval:])

    def trained(self, p: int, k: int = 0) -> torch.Tensor:
        """[T-1-k] bool: step k at position i is trained (label position j = i+1+k, token j+1 assistant)."""
        m = self.mask[p]
        return m[2 + k :] if len(m) > 2 + k else m[:0]


def rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def draft_vocab(data: Data, size: int) -> torch.Tensor:
    """Top-`size` target ids by frequency over loss-masked tokens of the training split, ascending."""
    counts = torch.zeros(data.embed.shape[0], dtype=torch.long)
    for p in data.train:
        counts += torch.bincount(data.ids[p][data.mask[p]], minlength=len(counts))
    return counts.topk(size).indices.sort().values


# ---------------------------------------------------------------- the reference drafter


class RefDrafter(nn.Module):
    """EAGLE-3 as the paper describes it: fc over the 3 concatenated aux states, one Llama
    decoder layer over cat(input_layernorm(embed(token)), hidden_norm(hidden)), final norm and
    lm_head over the draft vocabulary; embeddings frozen (the target's)."""

    def __init__(self, embed: torch.Tensor, cfg: dict, vocab: int):
        super().__init__()
        H, self.d = cfg["hidden_size"], cfg["head_dim"]
        self.nh, self.nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        self.eps = cfg["rms_norm_eps"]
        self.embed = nn.Parameter(embed.clone(), requires_grad=False)
        self.fc = nn.Linear(3 * H, H, bias=False)
        self.w_in, self.w_hid, self.w_post, self.w_final = (nn.Parameter(torch.ones(H)) for _ in range(4))
        self.q = nn.Linear(2 * H, self.nh * self.d, bias=False)
        self.k = nn.Linear(2 * H, self.nkv * self.d, bias=False)
        self.v = nn.Linear(2 * H, self.nkv * self.d, bias=False)
        self.o = nn.Linear(self.nh * self.d, H, bias=False)
        self.gate = nn.Linear(H, cfg["intermediate_size"], bias=False)
        self.up = nn.Linear(H, cfg["intermediate_size"], bias=False)
        self.down = nn.Linear(cfg["intermediate_size"], H, bias=False)
        self.head = nn.Linear(H, vocab, bias=False)
        theta = cfg.get("rope_parameters", {}).get("rope_theta") or cfg.get("rope_theta", 10000.0)
        self.register_buffer("inv_freq", 1.0 / theta ** (torch.arange(0, self.d, 2).float() / self.d))

    def rotate(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """x [B, h, T, d], pos [T] -> x with rotary position embedding (rotate-half form)."""
        f = pos.float()[:, None] * self.inv_freq  # [T, d/2]
        cos, sin = torch.cat([f, f], -1).cos(), torch.cat([f, f], -1).sin()
        x1, x2 = x[..., : self.d // 2], x[..., self.d // 2 :]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    def forward(self, ids: torch.Tensor, aux: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """ids [B, T], aux [B, T, 3, H] -> `steps` logits [B, T, Vd]; step k at i reads token
        i+1+k, position i+k, and attends to step-0 keys at <= i plus step-j keys at i (j <= k)."""
        B, T = ids.shape
        hidden = self.fc(aux.flatten(2))  # [B, T, H]
        ids = F.pad(ids, (0, steps))
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        keys, values, out = [], [], []
        for k in range(steps):
            e = self.embed[ids[:, 1 + k : 1 + k + T]]  # [B, T, H]
            x = torch.cat([rms(e, self.eps) * self.w_in, rms(hidden, self.eps) * self.w_hid], -1)  # [B, T, 2H]
            pos = torch.arange(T) + k
            q = self.rotate(self.q(x).view(B, T, self.nh, self.d).transpose(1, 2), pos)  # [B, nh, T, d]
            kk = self.rotate(self.k(x).view(B, T, self.nkv, self.d).transpose(1, 2), pos)
            vv = self.v(x).view(B, T, self.nkv, self.d).transpose(1, 2)
            rep = self.nh // self.nkv
            keys.append(kk.repeat_interleave(rep, 1))
            values.append(vv.repeat_interleave(rep, 1))
            s0 = (q @ keys[0].transpose(-1, -2)).masked_fill(~causal, float("-inf"))  # [B, nh, T, T]
            same = [(q * kj).sum(-1, keepdim=True) for kj in keys[1:]]  # [B, nh, T, 1] each
            p = (torch.cat([s0, *same], -1) / math.sqrt(self.d)).softmax(-1)
            a = p[..., :T] @ values[0] + sum(p[..., T + j - 1 : T + j] * values[j] for j in range(1, k + 1))
            h = self.o(a.transpose(1, 2).reshape(B, T, -1)) + hidden  # residual: the un-normed hidden input
            m = rms(h, self.eps) * self.w_post
            h = h + self.down(F.silu(self.gate(m)) * self.up(m))
            out.append(self.head(rms(h, self.eps) * self.w_final))
            hidden = h  # the pre-norm output feeds the next step
        return out


def batches(positions: list[int], lengths: list[int], budget: int, rng: random.Random) -> list[list[int]]:
    """Shuffled samples packed greedily into batches of <= `budget` padded tokens."""
    order = positions[:]
    rng.shuffle(order)
    out, cur = [], []
    for p in order:
        if cur and (len(cur) + 1) * max(lengths[q] for q in cur + [p]) > budget:
            out.append(cur)
            cur = []
        cur.append(p)
    return out + [cur] if cur else out


def ref_batch(data: Data, ps: list[int], draft_w: torch.Tensor, to_draft: torch.Tensor, K: int):
    """Padded tensors of samples `ps`: ids [B, T], aux [B, T, 3, H], per step k the soft labels
    [B, T, Vd], the target's draft id [B, T] (-1 outside) and the trained mask [B, T]."""
    T = max(len(data.ids[p]) for p in ps)
    B = len(ps)
    ids = torch.zeros(B, T, dtype=torch.long)
    aux = torch.zeros(B, T, 3, data.aux[0].shape[-1])
    probs = torch.zeros(B, T, draft_w.shape[0])
    tgt = torch.full((B, T), -1, dtype=torch.long)
    trained = torch.zeros(K, B, T, dtype=torch.bool)
    for b, p in enumerate(ps):
        n = len(data.ids[p])
        ids[b, :n], aux[b, :n] = data.ids[p], data.aux[p]
        probs[b, :n] = (data.normed[p] @ draft_w.T).softmax(-1)  # label at position j
        tgt[b, :n] = to_draft[data.argmax[p]]
        for k in range(K):
            t = data.trained(p, k)
            trained[k, b, : len(t)] = t
    return ids, aux, probs, tgt, trained


def ref_loss(model: RefDrafter, batch, K: int, decay: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Soft CE weighted decay^k over trained pairs of each step; also [K, 2] (correct, trained)."""
    ids, aux, probs, tgt, trained = batch
    T = ids.shape[1]
    loss, stats = 0.0, torch.zeros(K, 2)
    for k, logits in enumerate(model(ids, aux, K)):
        n = T - 1 - k
        lab, y, tr = probs[:, 1 + k :], tgt[:, 1 + k :], trained[k, :, :n]  # label position j = i+1+k
        ok = tr & (y >= 0)
        ce = -(lab * logits[:, :n].log_softmax(-1)).sum(-1)  # [B, n]
        loss = loss + decay**k * (ce * ok).sum() / tr.sum().clamp_min(1)
        stats[k] += torch.stack([((logits[:, :n].argmax(-1) == y) & ok).sum(), tr.sum()]).float()
    return loss, stats


def ref_plan(data: Data, a: argparse.Namespace, seed: int) -> list[list[int]]:
    """The reference's own batch stream: the samples of each of `a.steps` steps (a fresh
    random packing of the training split every epoch)."""
    lengths = [len(x) for x in data.ids]
    rng, queue, plan = random.Random(seed), [], []
    for _ in range(a.steps):
        if not queue:
            queue = batches(data.train, lengths, a.batch_tokens, rng)
        plan.append(queue.pop())
    return plan


def eyas_plan(data: Data, a: argparse.Namespace, seed: int) -> list[list[int]]:
    """eyas's batch stream for the same split, budget and seed (`eyas.train.data.BatchStream`,
    one process, no accumulation: step s trains on item s). Positions are store positions,
    which Data shares with eyas's StoreSource (checked in main)."""
    from eyas.train.data import BatchStream

    stream = BatchStream(data.train, [len(x) for x in data.ids], data.index, a.batch_tokens, seed)
    return [stream.item(s) for s in range(a.steps)]


def plan_stats(data: Data, plan: list[list[int]], a: argparse.Namespace) -> dict[str, float]:
    """What a stream feeds: samples, real and padded tokens per step, passes over the split."""
    real = [sum(len(data.ids[p]) for p in b) for b in plan]
    padded = [len(b) * max(len(data.ids[p]) for p in b) for b in plan]
    trained = [sum(int(data.trained(p).sum()) for p in b) for b in plan]
    n = len(plan)
    split_tokens = sum(len(data.ids[p]) for p in data.train)
    return {"steps": n, "samples_per_step": round(sum(map(len, plan)) / n, 2),
            "real_tokens_per_step": round(sum(real) / n, 1), "padded_tokens_per_step": round(sum(padded) / n, 1),
            "trained_positions_per_step": round(sum(trained) / n, 1),
            "epochs": round(sum(real) / split_tokens, 3), "distinct_samples": len({p for b in plan for p in b}),
            "samples_per_step_min_max": [min(map(len, plan)), max(map(len, plan))]}


REF_NAMES = {"fc": "fc", "w_in": "midlayer.input_layernorm", "w_hid": "midlayer.hidden_norm",
             "w_post": "midlayer.post_attention_layernorm", "w_final": "norm", "q": "midlayer.self_attn.q_proj",
             "k": "midlayer.self_attn.k_proj", "v": "midlayer.self_attn.v_proj", "o": "midlayer.self_attn.o_proj",
             "gate": "midlayer.mlp.gate_proj", "up": "midlayer.mlp.up_proj", "down": "midlayer.mlp.down_proj",
             "head": "lm_head"}


def ref_state(w: dict[str, torch.Tensor], ref: RefDrafter, embed: torch.Tensor) -> dict[str, torch.Tensor]:
    """An eyas drafter's weights (vLLM names) as the reference's state dict."""
    return {(f"{r}.weight" if not r.startswith("w_") else r): w[f"{e}.weight"].clone()
            for r, e in REF_NAMES.items()} | {"embed": embed, "inv_freq": ref.inv_freq}


def train_reference(data: Data, d2t: torch.Tensor, a: argparse.Namespace, seed: int,
                    plan: list[list[int]] | None = None, init: dict[str, torch.Tensor] | None = None) -> dict[str, Any]:
    """The reference, on its own batch stream unless `plan` gives the samples of each step,
    from its own initial draw unless `init` (eyas-named weights) gives one."""
    draft_ids = torch.arange(len(d2t)) + d2t  # [Vd] target ids
    to_draft = torch.full((data.embed.shape[0],), -1, dtype=torch.long)
    to_draft[draft_ids] = torch.arange(len(draft_ids))
    draft_w = data.embed[draft_ids]  # [Vd, H] the target's lm_head rows of the draft vocab
    torch.manual_seed(seed)
    model = RefDrafter(data.embed, data.config, len(draft_ids))
    if init is not None:
        model.load_state_dict(ref_state(init, model, data.embed))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=a.lr, betas=(0.9, 0.95), weight_decay=0.0)
    lengths = [len(x) for x in data.ids]
    plan = plan if plan is not None else ref_plan(data, a, seed)
    started = time.monotonic()
    for step in range(a.steps):
        warm = a.warmup
        lr = a.lr * (step + 1) / (warm + 1) if step < warm else \
            a.lr * 0.5 * (1 + math.cos(math.pi * min((step - warm) / max(a.steps - warm, 1), 1.0)))
        for g in opt.param_groups:
            g["lr"] = lr
        loss, _ = ref_loss(model, ref_batch(data, plan[step], draft_w, to_draft, a.ttt_steps), a.ttt_steps, a.decay)
        loss.backward()
        nn.utils.clip_grad_norm_(params, a.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    stats = torch.zeros(a.ttt_steps, 2)
    with torch.no_grad():
        for ps in batches(data.eval, lengths, a.batch_tokens, random.Random(0)):
            stats += ref_loss(model, ref_batch(data, ps, draft_w, to_draft, a.ttt_steps), a.ttt_steps, a.decay)[1]
    acc = (stats[:, 0] / stats[:, 1]).tolist()
    return {"seed": seed, "acc_per_step": [round(x, 4) for x in acc], "positions": int(stats[0, 1]),
            "train_seconds": round(time.monotonic() - started, 1)}


@torch.no_grad()
def eval_drafter(data: Data, drafter_dir: Path, a: argparse.Namespace) -> dict[str, Any]:
    """Held-out accuracy of a trained eyas drafter on `data`'s held-out split, through the
    reference's forward pass (the transplant check shows it computes the same logits) with
    the drafter's own draft vocabulary."""
    w = load_file(str(drafter_dir / "model.safetensors"))
    draft_ids = torch.arange(len(w["d2t"])) + w["d2t"]
    to_draft = torch.full((data.embed.shape[0],), -1, dtype=torch.long)
    to_draft[draft_ids] = torch.arange(len(draft_ids))
    model = RefDrafter(data.embed, data.config, len(draft_ids))
    model.load_state_dict(ref_state(w, model, data.embed))
    lengths = [len(x) for x in data.ids]
    stats = torch.zeros(a.ttt_steps, 2)
    for ps in batches(data.eval, lengths, a.batch_tokens, random.Random(0)):
        stats += ref_loss(model, ref_batch(data, ps, data.embed[draft_ids], to_draft, a.ttt_steps), a.ttt_steps, a.decay)[1]
    return {"acc_per_step": [round(x, 4) for x in (stats[:, 0] / stats[:, 1]).tolist()], "positions": int(stats[0, 1])}


# ---------------------------------------------------------------- eyas's drafter


def eyas_config(store: Path, out: Path, a: argparse.Namespace, seed: int, fc_norm: bool):
    from eyas.train.config import TrainConfig

    return TrainConfig(out=str(out), store=str(store), draft_vocab=a.draft_vocab, ttt_steps=a.ttt_steps,
                       ttt_decay=a.decay, fc_norm=fc_norm, steps=a.steps, lr=a.lr, warmup=a.warmup, clip=a.clip,
                       batch_tokens=a.batch_tokens, eval_fraction=a.eval_fraction, seed=seed, device="cpu",
                       eval_every=10**9, save_every=10**9, log_every=max(a.steps // 5, 1), progress=False)


def eyas_init(store: Path, out: Path, a: argparse.Namespace, seed: int) -> dict[str, torch.Tensor]:
    """The weights eyas's drafter starts from for `seed` (eyas's own setup; no step taken)."""
    from eyas import distributed
    from eyas.train import loop
    from eyas.train.data import split

    loop.split = lambda index, fraction, _seed: split(index, fraction, 0)  # as train_eyas: the vocab reads the split
    d, device = distributed.init("cpu", False)
    run = loop.setup(eyas_config(store, out, a, seed, False), d, device)
    return {k: v.detach().clone() for k, v in run.drafter.state_dict().items() if not k.startswith("embed_tokens")}


def eyas_result(out: Path) -> dict[str, Any]:
    """The held-out result of an eyas run already trained into `out` (its last eval row)."""
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    m = [r for r in rows if r["split"] == "eval"][-1]
    return {"seed": json.loads((out / "config.json").read_text()).get("seed") if (out / "config.json").exists() else None,
            "fc_norm": False, "stream": "eyas", "acc_per_step": [round(x, 4) for x in m["acc_per_step"]],
            "positions": m["positions"], "vocab_coverage": m["vocab_coverage"], "reused_from": str(out)}


def train_eyas(store: Path, out: Path, a: argparse.Namespace, seed: int, fc_norm: bool,
               plan: list[list[int]] | None = None) -> dict[str, Any]:
    """eyas.train on the store; its held-out split is pinned to seed 0 so that every seed is
    measured on the same held-out samples (the seed still sets the init and batch order).
    With `plan`, step s trains on the samples plan[s] (store positions) instead of eyas's own
    stream. The drafter's initial weights are kept in out/init.safetensors."""
    from safetensors.torch import save_file

    from eyas.train import loop
    from eyas.train.data import BatchStream, split

    loop.split = lambda index, fraction, _seed: split(index, fraction, 0)

    class Planned(BatchStream):
        def for_step(self, step: int, group: int, rank: int, world: int) -> list[list[int]]:
            assert (group, rank, world) == (1, 0, 1), "a plan is for one process without accumulation"
            return [plan[step]]

    def setup(cfg, d, device):  # eyas's own setup, then the initial weights kept and the stream swapped
        run = setup.eyas(cfg, d, device)
        out.mkdir(parents=True, exist_ok=True)
        save_file({k: v.detach().clone().contiguous() for k, v in run.drafter.state_dict().items()
                   if not k.startswith("embed_tokens")},
                  str(out / "init.safetensors"))
        if plan is not None:
            run.train_stream.__class__ = Planned
        return run

    setup.eyas = getattr(loop.setup, "eyas", loop.setup)
    loop.setup = setup
    cfg = eyas_config(store, out, a, seed, fc_norm)
    started = time.monotonic()
    try:
        m = loop.train(cfg)["eval"]
    finally:
        loop.setup = setup.eyas
    return {"seed": seed, "fc_norm": fc_norm, "stream": "eyas" if plan is None else "reference", "acc_per_step": [round(x, 4) for x in m["acc_per_step"]],
            "positions": m["positions"], "vocab_coverage": m["vocab_coverage"],
            "train_seconds": round(time.monotonic() - started, 1)}


# ---------------------------------------------------------------- baselines and probes


def bigram(data: Data, to_draft: torch.Tensor) -> dict[str, float]:
    """Predict the target's argmax at j from token j alone (most frequent in training)."""
    table: dict[tuple[int, int], int] = {}
    for p in data.train:
        t = data.trained(p)
        for tok, y in zip(data.ids[p][1:][: len(t)][t].tolist(), data.argmax[p][1:][: len(t)][t].tolist()):
            table[(tok, y)] = table.get((tok, y), 0) + 1
    best: dict[int, tuple[int, int]] = {}
    best_in: dict[int, tuple[int, int]] = {}
    for (tok, y), c in table.items():
        if c > best.get(tok, (0, -1))[0]:
            best[tok] = (c, y)
        if to_draft[y] >= 0 and c > best_in.get(tok, (0, -1))[0]:
            best_in[tok] = (c, y)
    hit = hit_in = n = 0
    for p in data.eval:
        t = data.trained(p)
        for tok, y in zip(data.ids[p][1:][: len(t)][t].tolist(), data.argmax[p][1:][: len(t)][t].tolist()):
            n += 1
            hit += best.get(tok, (0, -2))[1] == y
            hit_in += best_in.get(tok, (0, -2))[1] == y
    return {"acc": round(hit / n, 4), "acc_draft_vocab_only": round(hit_in / n, 4), "positions": n}


def probe(data: Data, draft_w: torch.Tensor, to_draft: torch.Tensor, late: bool, a: argparse.Namespace) -> dict:
    """A linear probe on trained positions, soft CE over the draft vocab. Early (step-0
    information): per-layer RMS-normed aux states at i plus the embedding of token i+1.
    Late: the normed aux states at i+1, from which the target makes the label."""
    eps = data.config["rms_norm_eps"]

    def features(ps: list[int]):
        xs, ys, labs = [], [], []
        for p in ps:
            t = data.trained(p)
            n = len(t)
            if late:
                x = rms(data.aux[p][1 : 1 + n], eps).flatten(1)  # [n, 3H]
            else:
                x = torch.cat([rms(data.aux[p][:n], eps).flatten(1), data.embed[data.ids[p][1 : 1 + n]]], -1)  # [n, 4H]
            xs.append(x[t])
            ys.append(to_draft[data.argmax[p][1 : 1 + n]][t])
            labs.append((data.normed[p][1 : 1 + n][t] @ draft_w.T).softmax(-1))
        return torch.cat(xs), torch.cat(ys), torch.cat(labs)

    xtr, _, ltr = features(data.train)
    xev, yev, _ = features(data.eval)
    torch.manual_seed(0)
    lin = nn.Linear(xtr.shape[1], draft_w.shape[0])
    opt = torch.optim.Adam(lin.parameters(), lr=1e-3)
    for epoch in range(a.probe_epochs):
        for idx in torch.randperm(len(xtr)).split(1024):
            loss = -(ltr[idx] * lin(xtr[idx]).log_softmax(-1)).sum(-1).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
    with torch.no_grad():
        acc = ((lin(xev).argmax(-1) == yev) & (yev >= 0)).float().mean().item()
    return {"acc": round(acc, 4), "positions": len(yev), "train_positions": len(xtr), "epochs": a.probe_epochs}


def transplant_check(data: Data, drafter_dir: Path, K: int) -> list[float]:
    """Max |logit difference| per TTT step between eyas's trained drafter and a reference
    drafter given the same weights, on one held-out sample: zero (float noise) iff the two
    forward passes are the same function."""
    from eyas.draft.checkpoint import load_drafter

    eyas_model = load_drafter(drafter_dir, data.embed).eval()
    w = load_file(str(drafter_dir / "model.safetensors"))
    ref = RefDrafter(data.embed, data.config, w["lm_head.weight"].shape[0])
    ref.load_state_dict(ref_state(w, ref, data.embed))
    p = data.eval[0]
    ids, aux = data.ids[p][None], data.aux[p][None]  # [1, T], [1, T, 3, H]
    with torch.no_grad():
        mine, theirs = ref(ids, aux, K), eyas_model.forward_ttt(ids, aux, K)
    T = ids.shape[1]
    return [float((m[:, : T - 1 - k] - t[:, : T - 1 - k]).abs().max()) for k, (m, t) in enumerate(zip(mine, theirs))]


# ---------------------------------------------------------------- main


def spread(xs: list[float]) -> dict[str, float]:
    return {"mean": round(sum(xs) / len(xs), 4), "min": min(xs), "max": max(xs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", type=Path, required=True)
    ap.add_argument("--regen-store", type=Path, help="optional second store (regenerated answers)")
    ap.add_argument("--model", default="packaged:smollm2-135m", help="the target (a folder, or an eyas spec)")
    ap.add_argument("--work", type=Path, required=True, help="where eyas's drafters are written (must not exist)")
    ap.add_argument("--output", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--clip", type=float, default=0.5)
    ap.add_argument("--decay", type=float, default=0.8)
    ap.add_argument("--batch-tokens", type=int, default=1024)
    ap.add_argument("--ttt-steps", type=int, default=2)
    ap.add_argument("--draft-vocab", type=int, default=4096)
    ap.add_argument("--eval-fraction", type=float, default=0.2)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--fc-norm-seeds", type=int, nargs="+", help="seeds of the fc_norm runs (default: the first seed)")
    ap.add_argument("--probe-epochs", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--pieces", nargs="+", default=["base", "fc_norm"], choices=["base", "fc_norm", "streams", "regen"],
                    help="what to run besides eyas's first drafter: base (reference, bigram, probes, further seeds), "
                         "fc_norm, streams (each drafter on the other's batch stream; the reference from eyas's "
                         "initial weights), regen (implied by --regen-store)")
    ap.add_argument("--reuse-eyas", type=Path, help="an eyas drafter already trained on --store with these settings "
                                                     "and the first seed: read instead of trained again")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from eyas.models import resolve_model  # only to find the converted model folder

    model_dir = Path(resolve_model(a.model))
    t0 = time.monotonic()
    result: dict[str, Any] = {"args": {k: str(v) for k, v in vars(a).items()}, "threads": a.threads,
                              "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}"}

    data = Data(a.store, model_dir, a.eval_fraction)
    result["store"] = {"samples": len(data.ids), "tokens": sum(len(x) for x in data.ids),
                       "train_samples": len(data.train), "eval_samples": len(data.eval),
                       "eval_trained_positions": int(sum(data.trained(p).sum() for p in data.eval))}
    print(json.dumps(result["store"]), flush=True)

    def save() -> None:  # after every piece, so that a run cut short keeps what it measured
        result["wall_seconds"] = round(time.monotonic() - t0, 1)
        a.output.parent.mkdir(parents=True, exist_ok=True)
        a.output.write_text(json.dumps(result, indent=1) + "\n")

    def record(name: str, runs: list[dict[str, Any]], run: dict[str, Any]) -> None:
        runs.append(run)
        result[name] = {"runs": runs, "step0": spread([r["acc_per_step"][0] for r in runs])}
        print(name, run, flush=True)
        save()

    pieces = set(a.pieces) | ({"regen"} if a.regen_store else set())
    first = a.reuse_eyas or a.work / f"eyas-seed{a.seeds[0]}"
    eyas_runs: list[dict[str, Any]] = []
    record("eyas", eyas_runs, eyas_result(first) if a.reuse_eyas else train_eyas(a.store, first, a, a.seeds[0], False))
    d2t = load_file(str(first / "model.safetensors"))["d2t"]
    draft_ids = torch.arange(len(d2t)) + d2t
    own = draft_vocab(data, a.draft_vocab)
    result["draft_vocab_check"] = {"same_as_rebuilt": bool(torch.equal(own, draft_ids)),
                                   "overlap": len(set(own.tolist()) & set(draft_ids.tolist()))}
    to_draft = torch.full((data.embed.shape[0],), -1, dtype=torch.long)
    to_draft[draft_ids] = torch.arange(len(draft_ids))
    draft_w = data.embed[draft_ids]
    result["transplant_max_logit_diff_per_step"] = transplant_check(data, first, a.ttt_steps)
    print("transplant", result["transplant_max_logit_diff_per_step"], result["draft_vocab_check"], flush=True)

    if "base" in pieces:
        ref_runs: list[dict[str, Any]] = []
        record("reference", ref_runs, train_reference(data, d2t, a, a.seeds[0]))
        result["bigram"] = bigram(data, to_draft)
        result["probe_late"] = probe(data, draft_w, to_draft, True, a)
        result["probe_step0_information"] = probe(data, draft_w, to_draft, False, a)
        print("bigram", result["bigram"], "probes", result["probe_step0_information"], result["probe_late"], flush=True)
        save()
        for s in a.seeds[1:]:
            record("eyas", eyas_runs, train_eyas(a.store, a.work / f"eyas-seed{s}", a, s, False))
            record("reference", ref_runs, train_reference(data, d2t, a, s))
    if "fc_norm" in pieces:
        fc_norm_runs: list[dict[str, Any]] = []
        for s in a.fc_norm_seeds or a.seeds[:1]:
            record("eyas_fc_norm", fc_norm_runs, train_eyas(a.store, a.work / f"eyas-fcnorm-seed{s}", a, s, True))
    if "streams" in pieces:
        # The two drafters on each other's batch streams, and the reference from eyas's very
        # initial weights on eyas's stream (everything then shared but the training code).
        from eyas.train.data import StoreSource

        assert StoreSource(a.store, a.batch_tokens).sample_index == data.index, "store positions differ"
        on_eyas, matched, on_ref = [], [], []
        result["streams"] = {}
        for s in a.seeds:
            eplan, rplan = eyas_plan(data, a, s), ref_plan(data, a, s)
            result["streams"][f"seed{s}"] = {"eyas": plan_stats(data, eplan, a), "reference": plan_stats(data, rplan, a)}
            print("streams", s, result["streams"][f"seed{s}"], flush=True)
            record("reference_on_eyas_stream", on_eyas, train_reference(data, d2t, a, s, plan=eplan))
            record("eyas_on_reference_stream", on_ref, train_eyas(a.store, a.work / f"eyas-refstream-seed{s}", a, s,
                                                                   False, plan=rplan))
            init = eyas_init(a.store, a.work / f"init-seed{s}", a, s)
            record("reference_eyas_init_on_eyas_stream", matched, train_reference(data, d2t, a, s, plan=eplan, init=init))
    if "regen" in pieces:
        regen = Data(a.regen_store, model_dir, a.eval_fraction)
        regen_dir = a.work / "eyas-regen"
        run = train_eyas(a.regen_store, regen_dir, a, a.seeds[0], False)
        result["eyas_regenerated"] = {
            "note": "a different store: its own held-out tokens (regenerated answers), not the ones above",
            "samples": len(regen.ids), "tokens": sum(len(x) for x in regen.ids),
            "train_samples": len(regen.train), "eval_samples": len(regen.eval),
            "eval_trained_positions": int(sum(regen.trained(p).sum() for p in regen.eval)),
            "same_heldout_sample_indices": sorted(regen.index[p] for p in regen.eval) == sorted(data.index[p] for p in data.eval),
            "bigram": bigram(regen, to_draft), "runs": [run],
            "cross": {"regen_drafter_on_original_heldout": eval_drafter(data, regen_dir, a),
                      "original_drafter_on_regen_heldout": eval_drafter(regen, first, a),
                      "original_drafter_on_original_heldout_same_eval_code": eval_drafter(data, first, a)}}
        print("regenerated", result["eyas_regenerated"], flush=True)
        save()
    print(json.dumps(result, indent=1))

if __name__ == "__main__":
    main()
