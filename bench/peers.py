"""eyas beside its peer, speculators 0.9.0, on the same GPU, in one process tree (issue 21).

  --part speed    eyas train's step and the peer's step on the same random batches at two
                  shapes (Llama-3.1-8B's drafter; the seed's: hidden 7168, target vocabulary
                  163840, draft vocabulary 32000), 8192 tokens per step, 7 TTT steps, AdamW:
                  tokens/s, TFLOP/s by bench/speed_gpu.py's FLOP_FORMULA (the same formula for
                  both, so the TFLOP/s ratio is the tokens/s ratio), peak memory, and at the 8B
                  shape the largest single sequence that trains within 140 GiB. The peer's step is
                  its own Trainer.train_epoch (autocast bf16, its loss, clipping, optimizers,
                  scheduler) over its own CollateFn + shift_batch batches, already on the GPU;
                  eyas's is loop.train_step over in-memory batches on the GPU. Data loading is
                  outside both figures. The peer also runs once with its own defaults (3 TTT
                  steps, Muon, norm_before_fc, norm_output).
  --part quality  SmolLM2: a prepared set is captured to a bf16 store once and converted to
                  the peer's offline layout (bench/peer_layout.py); then, each for the same
                  wall-clock minutes on the same samples: eyas train (its recipe: 7 TTT steps,
                  decay 0.8, AdamW lr 1e-3, 65536 tokens per step), the peer matched to it (the
                  same draft vocabulary, layers, TTT steps, decay, AdamW, lr, schedule shape,
                  tokens per step, full attention) and the peer with its own defaults; the
                  peer's drafters are brought in with `eyas import` (its forward checked against
                  eyas's on held-out samples), and all three are scored by the same held-out
                  teacher-forced check and the same decoding (MT-bench both turns + a second
                  prompt set, chain 7 and tree, every answer compared with plain decoding).
  --part quality --kind dflash
                  the same for DFlash (issue 41): eyas's DFlash at eyas train's defaults
                  (8,192-token steps, one anchor per 16 tokens; --block-size, --anchors,
                  --position-weights change them) against the peer's dflash trainer matched to it (block,
                  layers, mask token, decay as gamma, KL loss, AdamW, schedule, tokens per step,
                  anchors per token, full attention) and at its own defaults (block 16, 5 layers,
                  D-PACE, hard cross-entropy, Muon, 512 anchors a row of 8,192 tokens); held-out
                  accuracy per block position; then bench/parallel_gpu.py trains eyas's EAGLE-3
                  chain on the same store for the same minutes and decodes every drafter, prompt
                  lookup and plain in one process on eval's static path.
  --smoke         both parts at toy sizes on the CPU (the peer on sdpa attention).

The peer is imported from PYTHONPATH (speculators and its dependencies installed --no-deps
into a folder PEER; bench/README.md lists them).

  PYTHONPATH=src:PEER python3 -u bench/peers.py --part speed --peer-loss eager --out OUT --minutes 9.3 \
      --speed-parts speed_8b,speed_seed_shape,eyas_uncompiled_8b
  PYTHONPATH=src:PEER python3 -u bench/peers.py --part quality --peer-loss eager --model SMOLLM2.gguf --out OUT \
      --minutes 9.3
  PYTHONPATH=src:PEER python bench/peers.py --smoke --out /tmp/peers
"""

from __future__ import annotations

import time

STARTED = time.monotonic()

import argparse
import contextlib
import functools
import json
import math
import os
import random
import re
import shutil
import sys
import tempfile
import traceback
from itertools import zip_longest
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Peak, free_memory, git, say, sync, train_options  # noqa: E402
from random_target import SEED_SHAPES  # noqa: E402
from speed_gpu import FLOP_FORMULA, PEAK_TFLOPS, InMemorySource, in_memory_run, train_flops  # noqa: E402

MATCHED_TTT = 7
PEER_DEFAULT_TTT = 3
STEP_TOKENS = 8192  # the peer's default --total-seq-len; eyas's default --batch-tokens
LIMIT_GIB = 140.0
LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                vocab_size=128256, num_hidden_layers=32, rope_theta=500000.0)
TOY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
           num_hidden_layers=8, rope_theta=10000.0)


# ---------------------------------------------------------------- the record


class Record:
    """The results JSON, rewritten atomically after every part; the issue's keys at the top."""

    KEYS = ("train_over_peer_8b", "train_over_peer_seed_shape", "peak_gib_eyas_8b", "peak_gib_peer_8b",
            "budget_minutes", "tau_chain_eyas", "tau_chain_peer_best", "tau_tree_eyas", "tau_tree_peer_best",
            "heldout_eyas", "heldout_peer_best", "gain_on_policy", "gain_lk", "identical_to_plain")

    def __init__(self, path: Path, minutes: float, meta: dict[str, Any]):
        self.path, self.budget = path, 60 * minutes
        self.keep: Path | None = None
        self.data: dict[str, Any] = {k: None for k in self.KEYS}
        self.data.update(meta, parts={})

    def resume(self, path: Path) -> None:
        """The parts an earlier call on the same work folder recorded (--stages), and every call's
        commit, command and device in order: `commit` and `command` are this call's alone."""
        earlier = json.loads(path.read_text()) if path.exists() else {}
        self.data["parts"] = {**earlier.get("parts", {}), **self.data["parts"]}
        self.data["calls"] = [*earlier.get("calls", []), {k: self.data[k] for k in ("commit", "command", "device")}]

    def left(self) -> float:
        return self.budget - (time.monotonic() - STARTED)

    def run(self, name: str, need_s: float, fn: Callable[[], dict[str, Any]]) -> dict[str, Any] | None:
        if self.left() < need_s:
            self.data["parts"][name] = {"ok": False, "skipped": f"{self.left():.0f} s left, needs ~{need_s:.0f}"}
            say(f"[{name}] skipped: {self.data['parts'][name]['skipped']}")
            self.save()
            return None
        say(f"[{name}] ...")
        start = time.monotonic()
        try:
            out = {"ok": True, **fn()}
        except Exception as e:  # a part's failure is recorded; the others still run
            out = {"ok": False, "error": repr(e)[:2000], "traceback": traceback.format_exc()[-6000:]}
        out["seconds"] = round(time.monotonic() - start, 2)
        self.data["parts"][name] = out
        say(f"[{name}] {json.dumps({k: v for k, v in out.items() if k != 'traceback'}, default=str)[:1500]}")
        free_memory()
        self.save()
        return out

    def save(self) -> None:
        """To the results JSON, and to `keep` (the work folder's copy the next call resumes from)
        at every part, so that a call stopped by its timeout loses only the part it was in."""
        for path in (self.path, *([self.keep] if self.keep else [])):
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.data, indent=2, default=str))
            os.replace(tmp, path)


# ---------------------------------------------------------------- shapes and the two drafters


def draft_config(shape: str, toy: bool):
    """eyas's DraftConfig for the shape (as `eyas train` builds it), and the target vocabulary."""
    from transformers import DeepseekV3Config, LlamaConfig

    from eyas.draft.config import DraftConfig
    from eyas.models.identity import ModelIdentity

    if shape == "8b":
        sizes = dict(TOY if toy else LLAMA_8B)
        theta = sizes.pop("rope_theta")
        config = LlamaConfig(**sizes, head_dim=sizes["hidden_size"] // sizes["num_attention_heads"],
                             rope_parameters={"rope_type": "default", "rope_theta": theta})
    else:
        sizes = dict(SEED_SHAPES["tiny" if toy else "8b"])
        config = DeepseekV3Config(**sizes, rope_parameters={"rope_type": "default", "rope_theta": 50000.0})
    N, V, H = sizes["num_hidden_layers"], sizes["vocab_size"], sizes["hidden_size"]
    identity = ModelIdentity(model=f"{shape}-shape", config_hash="random", tokenizer_hash="random", num_layers=N,
                             hidden_size=H, vocab_size=V)
    vd = min(32000, V // 2)
    return DraftConfig.for_target(config, identity, (2, N // 2, N - 3, N), vd, ttt_steps=MATCHED_TTT), V


def peer_model(draft, ttt: int, *, defaults: bool, attn: str, window: int | None = 2048):
    """speculators' Eagle3DraftModel of `draft`'s sizes, built as its `from_training_args` builds
    one (its layer config, its eagle3 flags), with random target embeddings and head rows.
    defaults: its eagle3 defaults (norm_before_residual, norm_before_fc, norm_output, a sliding
    window); else matched to eyas (none of them, full attention)."""
    from transformers import LlamaConfig

    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3SpeculatorConfig
    from speculators.models.eagle3.core import Eagle3DraftModel
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    sliding = defaults and window is not None
    layer = LlamaConfig(
        vocab_size=draft.vocab_size, hidden_size=draft.hidden_size, intermediate_size=draft.intermediate_size,
        num_hidden_layers=1, num_attention_heads=draft.num_attention_heads,
        num_key_value_heads=draft.num_key_value_heads, head_dim=draft.head_dim, hidden_act="silu",
        rms_norm_eps=draft.rms_norm_eps, max_position_embeddings=1 << 20, tie_word_embeddings=False,
        rope_parameters=dict(draft.rope_parameters), sliding_window=window if sliding else None,
        use_sliding_window=sliding, layer_types=["sliding_attention" if sliding else "full_attention"])
    layer._attn_implementation = attn
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=draft.draft_vocab_size,
        norm_before_residual=defaults, norm_before_fc=defaults, norm_output=defaults,
        eagle_aux_hidden_state_layer_ids=list(draft.aux_layer_ids),
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=ttt)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=None, architectures=["LlamaForCausalLM"])))
    return Eagle3DraftModel(config)


def set_peer_vocab(model, draft_to_target: torch.Tensor, embed: torch.Tensor, norm_weight: torch.Tensor,
                   lm_head: torch.Tensor) -> None:
    """The target's frozen pieces as the peer's `load_verifier_weights` sets them: embeddings, the
    final norm, and the lm_head rows of the draft vocabulary; d2t/t2d from `draft_to_target`."""
    V = embed.shape[0]
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[draft_to_target.cpu()] = True
    model.load_vocab_mappings(t2d, (draft_to_target.cpu() - torch.arange(len(draft_to_target))).long())
    with torch.no_grad():
        model.embed_tokens.weight.copy_(embed)
        model.verifier_norm.weight.copy_(norm_weight)
        model.verifier_lm_head.weight.copy_(lm_head[draft_to_target])
        if model.lm_head.weight.isnan().any():  # as load_verifier_weights: the draft head starts from these rows
            model.lm_head.weight.copy_(lm_head[draft_to_target])


PEER_LOSS = ["eager"]  # the peer's --loss-implementation on a GPU, set from --peer-loss


def trainer_config(save: Path, *, optimizer: str, lr: float, steps: int, ttt: int, decay: float, device: torch.device,
                   warmup: int | None = None, scheduler: str = "linear"):
    """The peer's TrainerConfig as its cli builds it (loss kl_div, its default). Its fused loss is a
    Triton kernel, so the CPU takes its eager one; on a GPU `--peer-loss` chooses (on torch 2.11
    the fused kernel's backward fails inside torch.compile: "ListVariable ... already tracked for
    mutation", seen on an H200)."""
    from speculators.losses import resolve_loss_config
    from speculators.train.trainer import TrainerConfig

    loss = {"ttt_steps": ttt, "ttt_step_loss_decay": decay, "loss_config": resolve_loss_config("kl_div", PEER_LOSS[0] if device.type == "cuda" else "eager")}
    return TrainerConfig(lr=lr, num_epochs=1, save_path=str(save), resume_from_checkpoint=False,
                         train_call_kwargs=loss, val_call_kwargs=loss, optimizer=optimizer, weight_decay=0.01,
                         muon_lr=lr, scheduler_type=scheduler, scheduler_warmup_steps=warmup,
                         scheduler_total_steps=steps, checkpoint_freq=1, hidden_states_dtype=torch.bfloat16,
                         log_freq=1 << 30, max_steps=steps)


def peer_batches(lengths: list[int], draft, device: torch.device, step_tokens: int, seed: int = 0) -> list[dict]:
    """Random samples packed into `step_tokens` rows by the peer's own sampler and CollateFn
    (+shift_batch), moved to `device` once (its Trainer's `.to(device)` is then a no-op)."""
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import CollateFn
    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2

    g = torch.Generator().manual_seed(seed)
    L, H = len(draft.aux_layer_ids), draft.hidden_size
    collate = CollateFn(max(step_tokens, max(lengths)), H, num_target_layers=L, preprocess=shift_batch)
    # Speed does not depend on values: every sample's states are views of one random tensor.
    aux = torch.randn(max(lengths), L * H, generator=g).bfloat16()  # [T_max, L*H]
    last = torch.randn(max(lengths), H, generator=g).bfloat16()  # [T_max, H]
    samples = []
    for n in lengths:
        mask = torch.ones(n, dtype=torch.long)
        mask[: n // 5] = 0
        samples.append({"hidden_states": aux[:n], "input_ids": torch.randint(2, draft.vocab_size, (n,), generator=g),
                        "verifier_last_hidden_states": last[:n], "loss_mask": mask,
                        "lengths": torch.tensor([n]), "position_ids": torch.arange(n)})
    # Its own sampler packs the rows (as its dataloader does: one process, seed 0), so both sides
    # train the same real tokens per step (on these lengths 7124 of 8192, as eyas's batches).
    sampler = MultipackDistributedBatchSamplerV2(batch_max_length=collate.max_len, lengths=lengths, num_replicas=1,
                                                 rank=0, seed=seed)
    out = []
    for row in sampler:
        b = collate([samples[i] for i in row])
        out.append({k: v.to(device) if torch.is_tensor(v) else v for k, v in b.items()})
    return out


def peer_trainer(model, config, batches: list[dict], device: torch.device):
    """The peer's Trainer over `batches` (a DataLoader that hands them over as they are). On the CPU
    (smoke runs only) its model goes to the CPU instead of its local rank, and autocast follows."""
    from torch.utils.data import DataLoader

    from speculators.train.trainer import Trainer

    class OnDevice(Trainer):
        def setup_model(self):
            if device.type != "cuda":
                self.local_rank, self.device_type = device, device.type
            super().setup_model()

    return OnDevice(model, config, DataLoader(batches, batch_size=None, shuffle=False))


@contextlib.contextmanager
def _cpu_accelerator_sync(device: torch.device):
    """Smoke runs only: the peer's step timer calls torch.accelerator.synchronize(), which raises
    where there is no accelerator; on the CPU there is nothing to wait for."""
    if device.type == "cuda" or torch.accelerator.is_available():
        yield
        return
    saved = torch.accelerator.synchronize
    torch.accelerator.synchronize = lambda *a, **k: None
    try:
        yield
    finally:
        torch.accelerator.synchronize = saved


class Steps:
    """A step callback for the peer's Trainer.train_epoch: times the steps after `warm`."""

    def __init__(self, device: torch.device, warm: int, lengths_per_step: list[list[int]]):
        self.device, self.warm, self.lengths = device, warm, lengths_per_step
        self.done, self.start, self.end = 0, None, None

    def __call__(self) -> None:
        self.done += 1
        if self.done == self.warm:
            sync(self.device)
            self.start = time.perf_counter()
        elif self.done > self.warm:
            sync(self.device)
            self.end = time.perf_counter()


def peer_rate(draft, V: int, lengths: list[int], device: torch.device, *, ttt: int, defaults: bool, attn: str,
              warm: int, timed: int, optimizer: str, step_tokens: int = STEP_TOKENS) -> dict[str, Any]:
    """The peer's Trainer over its packed batches: real tok/s and TFLOP/s (FLOP_FORMULA), peak memory."""
    batches = peer_batches(lengths, draft, device, step_tokens)
    per_step = [[int(n) for n in torch.bincount(b["document_ids"][0][b["document_ids"][0] >= 0]).tolist()]
                for b in batches]
    steps = warm + timed
    order = [i % len(batches) for i in range(steps)]
    save = Path(tempfile.mkdtemp(prefix="peer-speed-"))
    try:
        with Peak(device) as peak:
            g = torch.Generator().manual_seed(0)
            torch.manual_seed(0)
            model = peer_model(draft, ttt, defaults=defaults, attn=attn)
            H = draft.hidden_size
            draft_ids = torch.randperm(V, generator=g)[: draft.draft_vocab_size].sort().values
            set_peer_vocab(model, draft_ids, torch.randn(V, H, generator=g) * 0.02, torch.ones(H),
                           torch.randn(V, H, generator=g) * 0.02)
            config = trainer_config(save, optimizer=optimizer, lr=1e-4, steps=steps, ttt=ttt, decay=0.8, device=device)
            trainer = peer_trainer(model, config, [batches[i] for i in order], device)
            counter = Steps(device, warm, [per_step[i] for i in order])
            with _cpu_accelerator_sync(device):
                trainer.train_epoch(0, step_callback=counter)
        wall = counter.end - counter.start
        timed_lengths = [n for i in order[warm:] for n in per_step[i]]
        flops = train_flops(draft, V, timed_lengths, steps=ttt)["total"]
        tokens = sum(timed_lengths)
        return {"tok_s": tokens / wall, "tflops": flops / wall / 1e12, "fraction_of_790": flops / wall / 1e12 / PEAK_TFLOPS,
                "steps": timed, "tokens": tokens, "wall_s": wall, "tokens_per_step": tokens / timed, **peak.report(),
                "ttt_steps": ttt, "optimizer": optimizer, "attention": attn,
                "flags": "its eagle3 defaults" if defaults else "matched to eyas (no norm_before_fc/norm_output)"}
    finally:
        shutil.rmtree(save, ignore_errors=True)


def eyas_rate(draft, V: int, lengths: list[int], device: torch.device, *, warm: int, seconds: float,
              max_steps: int, batch_tokens: int = STEP_TOKENS) -> dict[str, Any]:
    """eyas's loop.train_step over in-memory batches (the speed bench's own setup)."""
    from eyas.train.config import TrainConfig
    from eyas.train.loop import train_step
    from eyas.models.target_head import TargetHead
    from speed_gpu import timed_steps

    H = draft.hidden_size
    cfg = TrainConfig(out=tempfile.mkdtemp(prefix="eyas-speed-"), store="(in memory)", draft_vocab=draft.draft_vocab_size,
                      steps=1_000_000, batch_tokens=batch_tokens, ttt_steps=draft.ttt_steps, device=str(device),
                      progress=False, eval_fraction=0.0, max_len=max(lengths))
    with Peak(device) as peak:
        g = torch.Generator().manual_seed(0)
        norm = torch.nn.RMSNorm(H, eps=draft.rms_norm_eps).to(device)
        embed = (torch.randn(V, H, generator=g) * 0.02).to(device)
        lm_head = (torch.randn(V, H, generator=g) * 0.02).to(device)
        source = InMemorySource(lengths, draft, device)
        run = in_memory_run(cfg, draft, TargetHead(embed, norm, lm_head), source, device)
        del embed
        # As `eyas train` holds it (TargetHead.to: bf16 on CUDA); the drafter has its own embeddings.
        run.head = TargetHead(None, norm, lm_head).to(device)
        del lm_head
        for _ in range(warm):
            train_step(run)
        sync(device)
        timed = timed_steps(run, seconds, max_steps)
    shutil.rmtree(cfg.out, ignore_errors=True)
    return {**timed, **peak.report(), "tokens_per_step": timed["tokens"] / timed["steps"], "ttt_steps": draft.ttt_steps,
            "optimizer": "AdamW"}


def sample_lengths(toy: bool, seed: int = 1) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(32, 256) for _ in range(12)] if toy else [rng.randint(256, 2048) for _ in range(96)]


def speed_shape(args, shape: str) -> dict[str, Any]:
    draft, V = draft_config(shape, args.toy)
    lengths = sample_lengths(args.toy)
    device = torch.device(args.device)
    attn = "sdpa" if device.type == "cpu" else "simple_flex_attention"
    eyas = eyas_rate(draft, V, lengths, device, warm=args.warm_steps, seconds=args.train_seconds, max_steps=60,
                     batch_tokens=args.step_tokens)
    free_memory()
    timed = max(3, min(40, round(eyas["steps"] * 0.8)))
    peer = peer_rate(draft, V, lengths, device, ttt=MATCHED_TTT, defaults=False, attn=attn, warm=args.warm_steps,
                     timed=timed, optimizer="adamw", step_tokens=args.step_tokens)
    return {"eyas": eyas, "peer_matched": peer, "eyas_over_peer_tok_s": eyas["tok_s"] / peer["tok_s"],
            "draft": {k: getattr(draft, k) for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                                     "num_key_value_heads", "head_dim", "vocab_size", "draft_vocab_size")}}


def speed_uncompiled(args) -> dict[str, Any]:
    """eyas's step at the 8B shape with the parts around attention left uncompiled
    (draft/model.py COMPILE_STEP_PARTS): what compiling them, as speculators compiles its step, brings."""
    import eyas.draft.model as dm

    draft, V = draft_config("8b", args.toy)
    dm.COMPILE_STEP_PARTS = False
    try:
        return eyas_rate(draft, V, sample_lengths(args.toy), torch.device(args.device), warm=args.warm_steps,
                         seconds=args.train_seconds, max_steps=60, batch_tokens=args.step_tokens)
    finally:
        dm.COMPILE_STEP_PARTS = True


def speed_defaults(args) -> dict[str, Any]:
    """The peer with its own eagle3 defaults (3 TTT steps, Muon, its norms, sliding window) at 8B."""
    draft, V = draft_config("8b", args.toy)
    device = torch.device(args.device)
    attn = "sdpa" if device.type == "cpu" else "simple_flex_attention"
    return peer_rate(draft, V, sample_lengths(args.toy), device, ttt=PEER_DEFAULT_TTT, defaults=True, attn=attn,
                     warm=args.warm_steps, timed=20 if not args.toy else 3, optimizer="muon", step_tokens=args.step_tokens)


def _oom(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


def longest(args, side: str) -> dict[str, Any]:
    """The longest single sample that trains one step at the 8B shape within LIMIT_GIB (doubling)."""
    draft, V = draft_config("8b", args.toy)
    device = torch.device(args.device)
    attn = "sdpa" if device.type == "cpu" else "simple_flex_attention"
    tried: dict[int, Any] = {}
    best = None
    T = 256 if args.toy else 16384
    deadline = time.monotonic() + args.longest_seconds
    while time.monotonic() < deadline and T <= (512 if args.toy else 262144):
        try:
            if side == "eyas":
                r = eyas_rate(draft, V, [T], device, warm=1, seconds=0.0, max_steps=1, batch_tokens=T)
            else:
                r = peer_rate(draft, V, [T], device, ttt=MATCHED_TTT, defaults=False, attn=attn, warm=1, timed=1,
                              optimizer="adamw", step_tokens=T)
            peak = r.get("peak_gib", 0.0)
            tried[T] = {"peak_gib": peak, "tok_s": r["tok_s"]}
            if peak > LIMIT_GIB:
                break
            best = T
        except Exception as e:
            if not _oom(e):
                raise
            tried[T] = "out of memory"
            break
        finally:
            free_memory()
        T *= 2
    return {"longest_fitting": best, "tried": tried, "limit_gib": LIMIT_GIB,
            "note": "one sample of T tokens per step, 7 TTT steps, doubling from 16384 until it does not fit or time "
                    "runs out (then the figure is a lower bound)"}


def part_speed(args, record: Record) -> None:
    parts = record.data["parts"]
    runs = {"speed_8b": (60, lambda: speed_shape(args, "8b")),
            "speed_seed_shape": (60, lambda: speed_shape(args, "seed")),
            "longest_eyas_8b": (40, lambda: longest(args, "eyas")),
            "longest_peer_8b": (40, lambda: longest(args, "peer")),
            "peer_defaults_8b": (40, lambda: speed_defaults(args)),
            "eyas_uncompiled_8b": (30, lambda: speed_uncompiled(args))}
    for name in args.speed_parts.split(",") if args.speed_parts else runs:
        record.run(name, *runs[name])
    for key, part in (("train_over_peer_8b", "speed_8b"), ("train_over_peer_seed_shape", "speed_seed_shape")):
        if (parts.get(part) or {}).get("ok"):
            record.data[key] = parts[part]["eyas_over_peer_tok_s"]
    if (parts.get("speed_8b") or {}).get("ok"):
        record.data["peak_gib_eyas_8b"] = parts["speed_8b"]["eyas"].get("peak_gib")
        record.data["peak_gib_peer_8b"] = parts["speed_8b"]["peer_matched"].get("peak_gib")
        if (parts.get("eyas_uncompiled_8b") or {}).get("ok"):
            record.data["eyas_compiled_over_uncompiled_8b"] = (parts["speed_8b"]["eyas"]["tok_s"] /
                                                                parts["eyas_uncompiled_8b"]["tok_s"])
    record.save()


# ---------------------------------------------------------------- main


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=["speed", "quality"], help="one part per GPU call")
    p.add_argument("--smoke", action="store_true", help="toy sizes on the CPU (both parts unless --part)")
    p.add_argument("--out", required=True, help="a folder: peers_<part>.json is written there")
    p.add_argument("--device", default=None)
    p.add_argument("--speed-parts", default=None,
                   help="comma-separated subset of speed_8b, speed_seed_shape, longest_eyas_8b, longest_peer_8b, "
                        "peer_defaults_8b, eyas_uncompiled_8b (default: all, in that order), so one part can have a "
                        "call of its own")
    p.add_argument("--peer-loss", choices=["fused", "eager"], default="eager",
                   help="the peer's loss implementation on a GPU. Default eager: the peer's own default, its fused "
                        "Triton KL loss, failed inside torch.compile on torch 2.11 on an H200 (\"ListVariable ... "
                        "already tracked for mutation\"); its eager loss still runs inside its compiled step")
    p.add_argument("--minutes", type=float, default=8.5, help="the run's budget; parts that would not fit are skipped")
    p.add_argument("--warm-steps", type=int, default=3)
    p.add_argument("--train-seconds", type=float, default=10.0, help="eyas's timed seconds per shape")
    p.add_argument("--longest-seconds", type=float, default=75.0, help="per side, for the longest-sequence search")
    add_quality_args(p)
    args = p.parse_args()
    PEER_LOSS[0] = args.peer_loss
    if not args.smoke and not args.part:
        p.error("give --part speed, --part quality, or --smoke")
    args.toy = args.smoke
    args.batch_tokens = args.batch_tokens or (STEP_TOKENS if args.kind == "dflash" else 65536)
    args.step_tokens = 512 if args.smoke else STEP_TOKENS
    if args.smoke:
        args.warm_steps, args.train_seconds, args.longest_seconds = 1, 2.0, 20.0
        torch.set_num_threads(1)  # small CPU machines: more threads than cores thrash
        args.limit, args.regen_minutes, args.arm_minutes, args.batch_tokens, args.max_len = 40, 0.0, 0.4, 1024, 256
        args.heldout_samples, args.questions, args.second_set, args.max_new_tokens = 2, 1, 1, 8
        args.workers, args.eval_seconds = 1, 120.0
        args.minutes = 60.0  # the CPU is slow at the peer's set-up: a smoke run proves the path, not the budget
    args.stages = [x for x in QUALITY_STAGES if x in args.stages.split(",")]
    if args.part == "quality" and args.stages != list(QUALITY_STAGES) and not args.work:
        p.error("--stages needs --work: the stages of one part share that folder")
    args.device = args.device or ("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    out = Path(args.out)
    from importlib.metadata import version

    meta = {"commit": git("rev-parse", "HEAD"), "command": " ".join(sys.argv), "device": _device_name(args.device),
            "torch": torch.__version__, "peer": f"speculators {version('speculators')}", "flop_formula": FLOP_FORMULA,
            "smoke": args.smoke}
    for part in ([args.part] if args.part else ["speed", "quality"]):
        kind = "_dflash" if part == "quality" and args.kind == "dflash" else ""
        record = Record(out / f"peers_{part}{kind}{'_smoke' if args.smoke else ''}.json", args.minutes,
                        {**meta, "part": part})
        (part_speed if part == "speed" else part_quality)(args, record)
        say(json.dumps({k: v for k, v in record.data.items() if k != "parts"}, default=str)[:3000])


def _device_name(device: str) -> str:
    return torch.cuda.get_device_name(0) if device.startswith("cuda") else "cpu"


def add_quality_args(p) -> None:
    q = p.add_argument_group("--part quality")
    q.add_argument("--model", help="the target: any model eyas loads (folder, .gguf, packaged:...)")
    q.add_argument("--conversations", nargs="+", default=["packaged:chitchat"],
                   help="any source(s) eyas prepare reads, mixed as SRC@WEIGHT")
    q.add_argument("--mt-bench", help="MT-bench question.jsonl (default: the packaged one)")
    q.add_argument("--work", default=None, help="scratch folder (default: a temp folder, removed at the end)")
    q.add_argument("--stages", default=",".join(QUALITY_STAGES),
                   help="comma-separated, in order: a subset of " + ", ".join(QUALITY_STAGES) + " (default all), so "
                        "the part can span two calls on one --work: the later call goes on from what the earlier one "
                        "left there")
    q.add_argument("--limit", type=int, default=6000, help="conversations prepared")
    q.add_argument("--regen-minutes", type=float, default=0.25, help="0: train on the prepared answers as they are")
    q.add_argument("--regen-group", type=int, default=4096,
                   help="conversations regenerated together (at eyas's default of 64, 1.5 minutes on an H200 "
                        "regenerated 320 conversations of SmolLM2)")
    q.add_argument("--arm-minutes", type=float, default=0.5, help="wall-clock minutes of each training run")
    q.add_argument("--batch-tokens", type=int, default=None,
                   help="eyas's tokens a step (default: its EAGLE-3 recipe's 65,536; with --kind dflash, eyas train's "
                        f"default, {STEP_TOKENS:,}); the matched peer packs as many")
    q.add_argument("--max-len", type=int, default=1024)
    q.add_argument("--lr", type=float, default=1e-3)
    q.add_argument("--ttt-steps", type=int, default=7, help="eyas's recipe; the matched peer unrolls as many")
    q.add_argument("--kind", choices=["eagle3", "dflash"], default="eagle3",
                   help="the drafter every arm trains: eyas's EAGLE-3 recipe against the peer's eagle3 (default), or "
                        "eyas's DFlash against the peer's dflash trainer (then the decode stage also trains eyas's "
                        "EAGLE-3 chain on the same store for the same minutes, and decodes all of them in one process "
                        "with bench/parallel_gpu.py)")
    q.add_argument("--block-size", type=int, default=None,
                   help="dflash: eyas's block (default eyas train's), and the matched peer's")
    q.add_argument("--draft-layers", type=int, default=None,
                   help="decoder layers of eyas's drafter (eagle3: `eyas train --draft-layers`, default 1; dflash: "
                        "eyas's and the matched peer's, default eyas's, a tenth of the target's)")
    q.add_argument("--anchors", default=None,
                   help="dflash: eyas's --anchors, N a sample or 1/S (default eyas train's, one per 16 tokens of a "
                        "sample); the matched peer gets as many per token")
    q.add_argument("--position-weights", choices=["decay", "dpace"], default="decay",
                   help="dflash: eyas's --position-weights, and the matched peer's (fixed-exp-decay or dpace)")
    q.add_argument("--chain-minutes", type=float, default=None,
                   help="dflash: minutes of eyas's EAGLE-3 chain trained for the decode stage (default --arm-minutes, "
                        "equal to the DFlash arms'; 0: none, the DFlash drafters are decoded beside prompt lookup only)")
    q.add_argument("--also", action="append", default=[], metavar="NAME=FOLDER",
                   help="an eyas drafter of --kind trained elsewhere on this run's store (e.g. bench/parallel_gpu.py "
                        "--store W/store, one setting changed): scored by the heldout stage and decoded beside the arms")
    q.add_argument("--variant", action="append", default=[], metavar="NAME=OPTION=VALUE,...",
                   help="eyas's arm with `eyas train` options changed, e.g. peer=batch_tokens=8192,block_size=16,"
                        "draft_layers=5,causal_layers=all,position_weights=dpace,loss=hard-ce,optimizer=muon,lr=0.01 "
                        "(options separated by ',' or ':'): the variants stage trains each on the store for "
                        "--arm-minutes after its own warm-up, and the later stages score and decode it as eyas-NAME. "
                        "init=eyas starts it from eyas's arm (on_policy=init=eyas,position_weights=on-policy: the "
                        "recipe's on-policy stage after it); the EAGLE-3 record's gain_lk and gain_on_policy are the "
                        "chain tau of the variants named lk and on_policy over eyas's arm")
    q.add_argument("--peer-steps", type=int, default=None,
                   help="the schedule of the peer at its defaults (--max-steps; default: as many tokens as eyas's arm "
                        "trained). It has no --minutes: at 7.5 minutes it ran eyas's 3,275 steps in 230 s, where its "
                        "rate fits ~6,400")
    q.add_argument("--optimizer", choices=["adamw", "muon"], default="adamw",
                   help="eyas's (`eyas train --optimizer`); the matched peer uses the same")
    q.add_argument("--heldout-samples", type=int, default=24)
    q.add_argument("--questions", type=int, default=12, help="MT-bench questions (both turns)")
    q.add_argument("--second-set", type=int, default=12, help="held-out conversations' first prompts")
    q.add_argument("--max-new-tokens", type=int, default=128)
    q.add_argument("--workers", type=int, default=6)
    q.add_argument("--eval-seconds", type=float, default=50.0, help="each eval worker's decoding budget")


# eyas's SmolLM2 recipe (bench/quality_gpu.py RECIPE + its train settings)
EYAS_RECIPE = {"fc_norm": True, "norm_output": True, "ttt_decay": 0.8}  # + --ttt-steps, --optimizer
ARMS = ("eyas", "peer_matched", "peer_defaults")


def part_quality(args, record: Record) -> None:
    work = Path(args.work or tempfile.mkdtemp(prefix="peers-quality-"))
    work.mkdir(parents=True, exist_ok=True)
    if args.smoke and not args.model:  # a tiny random Llama (tests/tiny.py) stands in for SmolLM2
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        from tiny import build_model

        args.model = str(build_model(work / "tiny-target"))
    ctx: dict[str, Any] = {"work": work, **load_ctx(work, args.stages), "left": record.left,
                           "also": dict(a.split("=", 1) for a in args.also)}
    record.resume(work / RECORD)
    record.keep = work / RECORD if args.work else None
    scoring = ("import" in args.stages) * 30 + ("decode" in args.stages) * (args.eval_seconds + 20)
    peer_reserve = 90 + scoring
    record.data["tau_definition"] = "tau = 1 + accepted draft tokens per verification step (mean over all steps)"
    steps = [("data", 60, lambda: q_data(args, ctx)),
             ("eyas", 60 * args.arm_minutes + 60, lambda: q_eyas(args, ctx)),
             ("variants", 60 * args.arm_minutes + 60, lambda: q_variants(args, ctx)),
             ("convert", 20, lambda: q_convert(args, ctx)),
             # A peer arm also needs its set-up (~90 s on an H200: imports, data, compiling its step) and
             # leaves the scoring stages of this run their time (import and held-out ~30 s, decoding its
             # seconds + ~20 s of loading); else it is skipped, so that the arms before it are still scored.
             ("peer_matched", 60 * args.arm_minutes + 20 + peer_reserve, lambda: q_peer(args, ctx, matched=True)),
             ("peer_defaults", 60 * args.arm_minutes + 20 + peer_reserve, lambda: q_peer(args, ctx, matched=False)),
             ("import", 10, lambda: q_import(args, ctx)),
             ("heldout", 20, lambda: q_heldout(args, ctx)),
             ("decode", 40, lambda: (q_decode_parallel if args.kind == "dflash" else q_decode)(args, ctx))]
    for name, need, fn in steps:
        if name not in args.stages:
            continue
        out = record.run(name, need, fn)
        save_ctx(ctx)
        if not (out or {}).get("ok") and name in ("data", "eyas", "convert"):
            break
    decode = record.data["parts"].get("decode") or {}
    if args.kind == "dflash":
        for key in Record.KEYS:  # the EAGLE-3 run's keys; dflash_keys has its own identical_to_plain
            record.data.pop(key, None)
        record.data = {**dflash_keys(record.data["parts"]), **record.data, "kind": "dflash"}
    elif decode.get("ok"):
        record.data.update(frontier_keys(args, record.data["parts"]))
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)
    record.save()


LEVERS = ("lk", "on_policy")  # --variant names whose chain tau over eyas's arm is issue 38's gain_NAME


def frontier_keys(args, parts: dict[str, Any]) -> dict[str, Any]:
    """Issue 38's keys from the parts that ran: eyas's best drafter (its arm or a --variant, by chain
    tau over both prompt sets) against the peer's best, chain and tree; held-out accuracy per step of
    that drafter and the peer's best at each step; each lever's chain tau over eyas's arm (a variant
    named `lk` or `on_policy`); and every answer against plain decoding."""
    taus = parts["decode"]["tau"]
    held = (parts.get("heldout") or {}).get("drafters", {})
    ours = [a for a in ("eyas", *(f"eyas-{n}" for n in _variant_names(args))) if f"{a}-chain" in taus]
    peers = [a for a in ARMS[1:] if f"{a}-chain" in taus]
    best = max(ours, key=lambda a: taus[f"{a}-chain"], default=None)
    peer = max(peers, key=lambda a: taus[f"{a}-chain"], default=None)
    return {"budget_minutes": args.arm_minutes, "eyas_best": best, "peer_best": peer,
            "tau_chain_eyas": taus.get(f"{best}-chain"), "tau_tree_eyas": taus.get(f"{best}-tree"),
            "tau_chain_peer_best": taus.get(f"{peer}-chain"), "tau_tree_peer_best": taus.get(f"{peer}-tree"),
            "heldout_eyas": (held.get(best) or {}).get("acc_per_step"), "heldout_peer_best": _peer_best(held) or None,
            **{f"gain_{lever}": (round(taus[f"eyas-{lever}-chain"] - taus["eyas-chain"], 4)
                                 if f"eyas-{lever}-chain" in taus and "eyas-chain" in taus else None)
               for lever in LEVERS},
            "identical_to_plain": parts["decode"]["identical_to_plain"]}


def _variant_names(args) -> list[str]:
    return [v.partition("=")[0] for v in args.variant]


def dflash_keys(parts: dict[str, Any]) -> dict[str, Any]:
    """Issue 41's keys from the parts that ran: eyas's best DFlash (its arm or a --variant) held-out
    accuracy over the peer's best at its worst block position, DFlash's tau and MT-bench speed-up over
    eyas's EAGLE-3 chain on the same store and minutes, and eyas's anchors and peak memory a step."""
    eyas, held, decode = (parts.get(k) or {} for k in ("eyas", "heldout", "decode"))
    return {"dflash_heldout_over_peer_min": held.get("eyas_over_peer_best_min"),
            "dflash_heldout_eyas_best": held.get("eyas_best"),
            "tau_dflash_over_chain": decode.get("tau_dflash_over_chain"),
            "speedup_dflash_over_chain": decode.get("speedup_dflash_over_chain"),
            "tau_dflash_eyas": decode.get("tau_dflash_eyas"), "dflash_eyas_best": decode.get("dflash_eyas_best"),
            "tau_dflash_eyas_best": decode.get("tau_dflash_eyas_best"),
            "tau_dflash_peer_best": decode.get("tau_dflash_peer_best"),
            "anchors_per_step": eyas.get("anchors_per_step"), "peak_gib_dflash": eyas.get("peak_gib"),
            "identical_to_plain": decode.get("identical_to_plain")}


QUALITY_STAGES = ("data", "eyas", "variants", "convert", "peer_matched", "peer_defaults", "import", "heldout",
                  "decode")
RECORD, CTX = "record.json", "ctx.json"


def save_ctx(ctx: dict[str, Any]) -> None:
    """What later stages need from earlier ones, in the work folder: a later call (--stages) on the
    same --work goes on from there."""
    keep = {k: (str(v) if isinstance(v, Path) else v) for k, v in ctx.items()
            if k not in ("work", "left", "draft_to_target")}
    tmp = ctx["work"] / (CTX + ".tmp")
    tmp.write_text(json.dumps(keep, default=list))
    os.replace(tmp, ctx["work"] / CTX)


def load_ctx(work: Path, stages: list[str]) -> dict[str, Any]:
    """The earlier stages' context for a run of later ones; refuses stages whose inputs are missing."""
    first = QUALITY_STAGES.index(stages[0])
    if first == 0:
        return {}
    if not (work / CTX).exists():
        raise SystemExit(f"--stages {','.join(stages)}: {work / CTX} is missing; run the stages before "
                         f"{stages[0]} with this --work first")
    ctx = json.loads((work / CTX).read_text())
    for k in ("data", "store", "folder", "eyas", "peer_matched", "peer_defaults", "peer_matched-eyas",
              "peer_defaults-eyas"):
        if k in ctx:
            ctx[k] = Path(ctx[k])
    if "eyas" in ctx:
        ctx["draft_to_target"] = _draft_to_target(ctx["eyas"])
    return ctx


def q_data(args, ctx) -> dict[str, Any]:
    """Prepare (+ regenerate with the target) and capture one bf16 store: every arm's data, MT-bench
    kept out (so recorded: the decode stage decodes it and checks that record)."""
    from eyas.capture.config import CaptureConfig
    from eyas.capture.run import capture
    from eyas.data.config import PrepareConfig
    from eyas.data.prepare import prepare
    from eyas.models import resolve_model
    from eyas.store import Store
    from eyas.train.data import split

    work = ctx["work"]
    source = args.conversations
    for old in ("prepared", "regen", "store"):
        shutil.rmtree(work / old, ignore_errors=True)
    t0 = time.monotonic()
    prepared = prepare(PrepareConfig(model=args.model, data=source, out=str(work / "prepared"),
                                     max_len=args.max_len, limit=args.limit,
                                     exclude_prompts=[args.mt_bench or "mt-bench"]), progress=False)
    data, regen = work / "prepared", None
    if args.regen_minutes > 0:
        from eyas.regenerate.config import RegenerateConfig
        from eyas.regenerate.run import regenerate

        regen = regenerate(RegenerateConfig(model=args.model, data=str(work / "prepared"), out=str(work / "regen"),
                                            max_new_tokens=256, device=args.device, group_size=args.regen_group,
                                            minutes=args.regen_minutes), progress=False)
        data = work / "regen"
    t1 = time.monotonic()
    capture(CaptureConfig(model=args.model, data=str(data), out=str(work / "store"), dtype="bf16", device=args.device,
                          batch_tokens=65536 if args.device.startswith("cuda") else 4096), progress=False)
    store = Store(work / "store")
    train_pos, held_pos = split(store.sample_indices().tolist(), 0.05, 0)  # eyas train's own split (seed 0)
    ctx.update(data=data, store=work / "store", train_pos=train_pos, held_pos=held_pos,
               folder=resolve_model(args.model), layer_ids=store.layer_ids)
    return {"prepared": prepared.get("kept"), "regenerated": (regen or {}).get("kept"), "samples": len(store),
            "tokens": store.num_tokens, "train_samples": len(train_pos), "held_out_samples": len(held_pos),
            "layer_ids": list(store.layer_ids), "prepare_regen_s": round(t1 - t0, 1),
            "capture_s": round(time.monotonic() - t1, 1), "store_gib": round(store.bytes_per_token() *
                                                                             store.num_tokens / (1 << 30), 2)}


def eyas_options(args) -> dict[str, Any]:
    """eyas's arm: its EAGLE-3 recipe (+ --ttt-steps and --draft-layers), or DFlash at eyas train's
    defaults but for --position-weights and what --block-size, --anchors and --draft-layers give."""
    if args.kind == "dflash":
        given = {"block_size": args.block_size, "anchors": args.anchors, "draft_layers": args.draft_layers}
        return {"drafter": "dflash", "position_weights": args.position_weights,
                **{k: v for k, v in given.items() if v is not None}}
    layers = {} if args.draft_layers is None else {"draft_layers": args.draft_layers}
    return {**EYAS_RECIPE, "ttt_steps": args.ttt_steps, **layers}


def q_eyas(args, ctx) -> dict[str, Any]:
    """eyas train offline from the store with its recipe, its schedule sized by `--minutes`."""
    out = _train_eyas(args, ctx, "eyas", eyas_options(args))
    ctx.update(eyas=ctx["work"] / "eyas", steps=out["steps"], draft_to_target=_draft_to_target(ctx["work"] / "eyas"))
    return out


def q_variants(args, ctx) -> dict[str, Any]:
    """Each --variant: eyas's arm with its options changed, trained the same way into eyas-NAME, while
    the run's minutes allow one more (the arms after it keep their time: a variant that does not fit is
    left out, and said so). A variant an earlier call on this --work trained with the same options is
    kept, so that the variants can span several calls."""
    runs = ctx.setdefault("variant_runs", {})
    ctx.setdefault("variants", {})
    skipped = []
    for given in args.variant:
        name, _, text = given.partition("=")
        folder = ctx["work"] / f"eyas-{name}"
        if runs.get(name, {}).get("given") == text and (folder / "model.safetensors").is_file():
            continue
        if ctx["left"]() < 60 * args.arm_minutes + 60:
            skipped.append(name)
            continue
        options = {**eyas_options(args), **train_options(text)}
        if options.get("init") == "eyas":  # starts from eyas's arm, as the recipe's on-policy stage does
            options["init"] = str(ctx["eyas"])
        runs[name] = {"given": text, **_train_eyas(args, ctx, folder.name, options)}
        ctx["variants"][name] = str(folder)
        save_ctx(ctx)
    return {"variants": runs, "skipped_for_time": skipped}


def _train_eyas(args, ctx, name: str, options: dict[str, Any]) -> dict[str, Any]:
    """One eyas arm into WORK/name, offline from the store, its schedule sized by --arm-minutes. A
    peer's minutes start after its first step, which compiles its step; so eyas's start after a
    warm-up run of a few steps into a scratch folder, which compiles eyas's step and held-out pass
    (on one H200, 18 steps fit a cold 1-minute budget and 119 a warm one)."""
    from eyas.train import TrainConfig, train

    work = ctx["work"]
    for old in (f"{name}-warmup", name):  # a rerun in the same --work starts afresh
        shutil.rmtree(work / old, ignore_errors=True)
    common = {**dict(store=str(ctx["store"]), batch_tokens=args.batch_tokens, lr=args.lr, max_len=args.max_len,
                     device=args.device, progress=False, save_every=10**6, eval_fraction=0.05, seed=0,
                     optimizer=args.optimizer), **options}
    t0 = time.monotonic()
    train(TrainConfig(**{**common, "out": str(work / f"{name}-warmup"), "steps": 8, "eval_every": 10**6,
                         "log_every": 8}))  # over a variant's own steps=
    warmup_s = time.monotonic() - t0
    shutil.rmtree(work / f"{name}-warmup")
    cuda = args.device.startswith("cuda")
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.monotonic()
    final = train(TrainConfig(out=str(work / name), minutes=args.arm_minutes, eval_every=10**6,
                              log_every=10, **common))
    wall = time.monotonic() - t0
    dflash = common.get("drafter") == "dflash"
    return {"steps": final["step"], "wall_s": round(wall, 1), "warmup_s": round(warmup_s, 1),
            "schedule": "eyas train --minutes (steady-state rate), after an 8-step warm-up run",
            "tokens_per_step": common["batch_tokens"],
            "recipe": {k: v for k, v in common.items() if k not in ("store", "device", "progress", "save_every")},
            "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
            **({"anchors_per_step": anchors_per_step(ctx, common.get("anchors"), common["batch_tokens"])} if dflash
               else {}), "final": final}


def anchors_per_step(ctx, anchors: int | str | None, step_tokens: int) -> int:
    """The rows eyas anchors blocks at in a step of `step_tokens`, on average: what --anchors
    (None: eyas train's default) gives each sample, or each of its trained rows where it has
    fewer (train/anchors.py), over its tokens."""
    from eyas.train.config import ANCHORS, anchors_per_sample, anchors_spec

    spec = anchors_spec(ANCHORS if anchors is None else anchors)
    rows = _sample_rows(ctx, ctx["train_pos"])
    anchored = sum(min(anchors_per_sample(spec, n), masked) for n, masked in rows)
    return max(1, round(anchored / max(sum(n for n, _ in rows), 1) * step_tokens))


def _draft_to_target(ckpt: Path) -> torch.Tensor:
    from safetensors.torch import load_file

    d2t = load_file(ckpt / "model.safetensors")["d2t"]
    return torch.arange(len(d2t)) + d2t


def q_convert(args, ctx) -> dict[str, Any]:
    """The same samples in the peer's layout: eyas's training samples first, its held-out ones last,
    so the peer's row-order split (train_data_ratio) holds out the very same samples; eyas's draft
    vocabulary as the peer's d2t/t2d files (both peer arms read them: the same vocabulary)."""
    from peer_layout import convert

    work = ctx["work"]
    shutil.rmtree(work / "peer-data", ignore_errors=True)
    t0 = time.monotonic()
    summary = convert(ctx["store"], work / "peer-data", positions=ctx["train_pos"] + ctx["held_pos"],
                      draft_to_target=ctx["draft_to_target"])
    n, n_train = len(summary["positions"]), len(ctx["train_pos"])
    ctx["ratio"] = (n_train + 0.5) / n  # int(n * ratio) == n_train
    summary.pop("positions")
    return {**summary, "seconds": round(time.monotonic() - t0, 1), "train_data_ratio": ctx["ratio"],
            "loader_check": peer_loader_check(work / "peer-data", ctx["store"], ctx["train_pos"][:4])}


def peer_loader_check(folder: Path, store_path: Path, positions: list[int]) -> dict[str, Any]:
    """The converted rows read back by the peer's own ArrowDataset: the same ids, mask and states
    (bf16 rounding) as the eyas store holds."""
    from peer_layout import datasets_quiet

    datasets_quiet()
    from speculators.train.data import ArrowDataset

    from eyas.store import Store

    store = Store(store_path)
    data = ArrowDataset(max_len=1 << 20, datapath=str(folder), on_missing="raise", train_ratio=1.0)
    worst = 0.0
    for row, pos in enumerate(positions):
        got, want = data[row], store.sample(pos)
        assert torch.equal(got["input_ids"], want["input_ids"]), f"input ids differ at row {row}"
        assert torch.equal(got["loss_mask"].bool(), want["loss_mask"]), f"loss mask differs at row {row}"
        aux = got["hidden_states"].float().unflatten(-1, (want["hidden"].shape[1] - 1, -1))
        states = torch.cat([aux, got["verifier_last_hidden_states"].float()[:, None]], 1)  # [T, L, H]
        rel = ((states - want["hidden"]).abs() / want["hidden"].abs().clamp_min(1e-3)).max().item()
        worst = max(worst, rel)
    assert worst <= 2**-8, f"states differ by {worst} (relative), more than bf16 rounding"
    return {"rows": len(positions), "equal_ids_and_mask": True, "max_relative_state_error": worst}


def peer_command(args, ctx, save: Path, matched: bool) -> list[str]:
    """`python -m speculators.train` on the converted data. Matched: eyas's recipe in the peer's
    flags (same draft vocabulary, layers, --ttt-steps, decay 0.8, --optimizer at eyas's lr without
    weight decay, cosine with 3% warm-up over eyas's step count, eyas's tokens per step, eyas's
    drafter options fc_norm + norm_output, full attention). Defaults: only what the data needs."""
    aux = [str(k) for k in ctx["layer_ids"][:-1]]
    launcher = [__file__, "peer-train"] + ([] if args.device.startswith("cuda") else ["--cpu"])
    cmd = [sys.executable, *launcher, "--verifier-name-or-path", str(ctx["folder"]),
           "--data-path", str(ctx["work"] / "peer-data"), "--save-path", str(save),
           "--log-dir", str(save / "logs"), "--draft-vocab-size", str(len(ctx["draft_to_target"])),
           "--target-layer-ids", *aux, "--train-data-ratio", repr(ctx["ratio"]), "--on-missing", "raise",
           "--num-workers", "2" if args.smoke else "4", "--hidden-states-dtype", "bfloat16", "--seed", "0"]
    if args.device == "cpu":
        cmd += ["--draft-attn-impl", "sdpa", "--loss-implementation", "eager"]
    else:
        cmd += ["--loss-implementation", PEER_LOSS[0]]
    tokens = ctx["steps"] * args.batch_tokens  # eyas's planned tokens: the schedule's length for both
    train_tokens = sum(_lengths(ctx, ctx["train_pos"]))
    if args.kind == "dflash":
        cmd += ["--speculator-type", "dflash"]
    if matched:
        per_step = args.batch_tokens
        cmd += ["--optimizer", args.optimizer, "--lr", str(args.lr), "--weight-decay", "0", "--muon-weight-decay", "0",
                "--scheduler-type", "cosine", "--scheduler-warmup-ratio", "0.03", "--total-seq-len", str(per_step)]
        cmd += matched_dflash(args, ctx, per_step) if args.kind == "dflash" else [
            "--ttt-steps", str(args.ttt_steps), "--ttt-step-loss-decay", "0.8", "--no-norm-before-fc",
            "--no-norm-before-residual", "--fc-norm", "--norm-output", "--full-attention-indices", "0"]
    else:
        per_step = 8192  # its --total-seq-len default
    steps = args.peer_steps if args.peer_steps and not matched else max(1, tokens // per_step)
    epochs = max(1, -(-steps * per_step // max(train_tokens, 1)))
    return cmd + ["--max-steps", str(steps), "--epochs", str(epochs)]


def matched_dflash(args, ctx, per_step: int) -> list[str]:
    """eyas's DFlash settings in the peer's flags: its block, layers, mask token, position weights
    (decay^k as exp(-k/gamma)), the soft loss (KL: eyas's soft cross-entropy less a constant, the
    same gradients), full attention, and eyas's anchor density. eyas draws --anchors rows a sample,
    the peer --max-anchors a packed row of per_step tokens: the same anchors per token is eyas's
    anchored rows over all the training tokens, times the row."""
    from eyas.draft.checkpoint import load_config

    cfg = load_config(ctx["eyas"])
    anchors = anchors_per_step(ctx, args.anchors, per_step)
    weights = ["--per-position-loss-weight", "dpace"] if args.position_weights == "dpace" else [
        "--per-position-loss-weight", "fixed-exp-decay", "--dflash-decay-gamma", repr(-1 / math.log(cfg.ttt_decay))]
    return ["--block-size", str(cfg.ttt_steps + 1), "--num-layers", str(cfg.num_hidden_layers),
            "--mask-token-id", str(cfg.mask_token_id), "--max-anchors", str(anchors), "--loss-fn", "kl_div",
            *weights, "--full-attention-indices", *map(str, range(cfg.num_hidden_layers))]


def _sample_rows(ctx, positions: list[int]) -> list[tuple[int, int]]:
    """Each sample's (tokens, rows that train a pair: its loss mask)."""
    rows = _store_rows(str(ctx["store"]))
    return [rows[p] for p in positions]


@functools.cache
def _store_rows(store_path: str) -> list[tuple[int, int]]:
    """Every sample's (tokens, masked rows) of a store, read once without its states (the arms'
    schedules and anchor counts each ask)."""
    from eyas.store import Store

    store = Store(store_path)
    rows = [store.stored(p, rows=(0, 0)) for p in range(len(store))]
    return [(len(r["input_ids"]), int(r["loss_mask"].sum())) for r in rows]


def _lengths(ctx, positions: list[int]) -> list[int]:
    return [n for n, _ in _sample_rows(ctx, positions)]


def q_peer(args, ctx, matched: bool) -> dict[str, Any]:
    """The peer's own trainer in a child process for the arm's minutes, counted from the end of
    its first step (FIRST_STEP in its log): imports, data, model set-up and the compilation
    of its step in that first one are not counted, as eyas's warm-up run (which compiles eyas's
    step) is not; at the deadline it gets SIGINT, on which it saves its `interrupted`
    checkpoint (its graceful shutdown)."""
    import signal
    import subprocess

    arm = "peer_matched" if matched else "peer_defaults"
    save = ctx["work"] / arm
    shutil.rmtree(save, ignore_errors=True)  # else the peer resumes from what it finds there
    cmd = peer_command(args, ctx, save, matched)
    log = ctx["work"] / f"{arm}.log"
    t0 = time.monotonic()
    with open(log, "w") as f:
        child = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        while child.poll() is None and not FIRST_STEP.search(log.read_text(errors="replace")) \
                and time.monotonic() - t0 < SETUP_CAP_S:
            time.sleep(0.5)
        started = time.monotonic()
        try:
            child.wait(timeout=60 * args.arm_minutes)
            stopped = False
        except subprocess.TimeoutExpired:
            child.send_signal(signal.SIGINT)
            stopped = True
            child.wait(timeout=150)
    wall = time.monotonic() - started
    setup = started - t0
    text = log.read_text(errors="replace")
    tail = text[-3000:]
    ckpt = _peer_checkpoint(save)
    if ckpt is None:
        raise RuntimeError(f"the peer saved no checkpoint (exit {child.returncode}); log tail: {tail}")
    ctx[arm] = ckpt
    steps_done = _peer_steps(save, text)
    return {"command": " ".join(cmd), "exit_code": child.returncode, "stopped_at_deadline": stopped,
            "wall_s": round(wall, 1), "setup_s": round(setup, 1), "checkpoint": str(ckpt), "steps_done": steps_done, "log_tail": tail[-1200:]}


# The end of its first step: its metric logger's record of step 0 (always logged: 0 % log_freq
# is 0), or its progress bar past 0.
FIRST_STEP = re.compile(r"global_step=\d|Epoch 0:[^\r\n]*\|\s*[1-9]\d*/\d+")
SETUP_CAP_S = 300  # past this without a first step, the arm's minutes start anyway


def _peer_checkpoint(save: Path) -> Path | None:
    """Its interrupted checkpoint if it was stopped, else its last epoch's."""
    if (save / "interrupted" / "config.json").exists():
        return save / "interrupted"
    epochs = sorted((int(d.name) for d in save.glob("[0-9]*") if (d / "config.json").exists()), reverse=True)
    return save / str(epochs[0]) if epochs else None


def _peer_steps(save: Path, log: str) -> int | None:
    """Steps the peer trained: its epoch checkpoints' global step, or its progress bar's last
    count where that is further. Its `interrupted` checkpoint (a stop at the deadline) records no
    step, so the checkpoints alone gave the last whole epoch's count (352 where its bar showed
    epoch 1 at 224 of 352 steps, on 2026-12-06)."""
    states = [json.loads(p.read_text()) for p in save.glob("*/training_state.json")]
    counts = [s.get("global_step", 0) for s in states]
    counts += [int(e) * int(n) + int(k) for e, k, n in PROGRESS.findall(log)]
    return max(counts, default=None)


# Its progress bar: "Epoch E  64% ━━━━╸  224/352 [...]" (rich) or "Epoch E: 64%|███| 224/352" (tqdm).
PROGRESS = re.compile(r"Epoch (\d+)\b[^\r\n/]*?(\d+)/(\d+)")


def q_import(args, ctx) -> dict[str, Any]:
    """`eyas import` of each peer checkpoint as its trainer saved it; its forward checked against
    the peer's own on held-out store samples (draft tokens at every TTT step it trained)."""
    from eyas.export import import_drafter

    out = {}
    for arm in ARMS[1:]:
        if arm not in ctx:
            continue
        folder = ctx["work"] / f"{arm}-eyas"
        shutil.rmtree(folder, ignore_errors=True)
        summary = import_drafter(ctx[arm], folder, target=args.model)
        ctx[f"{arm}-eyas"] = folder
        agreement = dflash_forward_agreement if args.kind == "dflash" else forward_agreement
        out[arm] = {**summary, "forward_vs_peer": agreement(ctx, ctx[arm], folder, args.device)}
    return out


def forward_agreement(ctx, peer_dir: Path, eyas_dir: Path, device: str) -> dict[str, Any]:
    """Share of positions where the peer's model (loaded by its own code, eager attention) and the
    imported eyas drafter draft the same token at each TTT step, on 2 held-out samples, float32."""
    from safetensors.torch import load_file

    from speculators.models.eagle3.core import Eagle3DraftModel

    from eyas.draft import load_drafter
    from eyas.store import Store

    cfg = Eagle3DraftModel.config_class.from_pretrained(str(peer_dir))
    cfg.transformer_layer_config._attn_implementation = "eager"
    peer = Eagle3DraftModel.from_pretrained(str(peer_dir), config=cfg).float().eval().to(device)
    embed = load_file(peer_dir / "model.safetensors")["embed_tokens.weight"].float()
    ours = load_drafter(eyas_dir, embed).float().eval().to(device)
    store = Store(ctx["store"])
    K = cfg.speculators_config.proposal_methods[0].speculative_tokens
    same = torch.zeros(K)
    total = torch.zeros(K)
    for pos in ctx["held_pos"][:2]:
        s = store.sample(pos)
        ids, hidden = s["input_ids"][None].to(device), s["hidden"][None].to(device)  # [1, T], [1, T, L, H]
        T = ids.shape[1]
        forward = getattr(type(peer).forward, "_torchdynamo_orig_callable", type(peer).forward)  # uncompiled
        with torch.no_grad():
            drafts = forward(peer, hidden_states=hidden[:, :-1, :-1].flatten(2), input_ids=ids[:, 1:],
                          document_ids=torch.zeros(1, T - 1, dtype=torch.long, device=device),
                          position_ids=torch.arange(1, T, device=device)[None], ttt_steps=K)
            logits = ours.forward_ttt(ids, hidden[:, :, :-1], K)
        for k in range(K):
            n = T - 1 - k
            same[k] += (logits[k][0, :n].argmax(-1) == drafts[k][0, :n]).sum().item()
            total[k] += n
    return {"same_draft_token_per_step": [round(x, 4) for x in (same / total.clamp_min(1)).tolist()],
            "positions_per_step": total.int().tolist()}


def dflash_forward_agreement(ctx, peer_dir: Path, eyas_dir: Path, device: str) -> dict[str, Any]:
    """bench/peer_check.py's comparison of the peer's own DFlash forward with the import's, per
    block position, on 2 held-out samples (64 anchors each), float32."""
    from peer_check import dflash_agreement

    from eyas.store import Store

    store = Store(ctx["store"])
    samples = [(s["input_ids"], s["hidden"][:, :-1], s["hidden"][:, -1])
               for s in (store.sample(pos) for pos in ctx["held_pos"][:2])]
    return dflash_agreement(peer_dir, eyas_dir, samples, device)


def q_heldout(args, ctx) -> dict[str, Any]:
    """The same teacher-forced check for every drafter: eyas's own held-out scorer
    (`eyas.train.loop.score`, what `eyas train` and `eyas eval --teacher-forced` report) on the
    store's held-out samples (the ones no arm trained on), 7 steps; labels the target's greedy
    tokens over its whole vocabulary (a token outside a drafter's vocabulary counts as a miss)."""
    from eyas import distributed
    from eyas.draft import load_drafter
    from eyas.models import resolve_model
    from eyas.train.data import StoreSource
    from eyas.train.loop import score
    from eyas.models.target_head import load_target_head

    device = torch.device(args.device)
    source = StoreSource(ctx["store"], args.max_len)
    head = load_target_head(resolve_model(args.model)).to(device)
    held = ctx["held_pos"][: args.heldout_samples]
    out = {}
    for arm, folder in _drafters(ctx).items():
        drafter = load_drafter(folder, head.embed_weight).to(device).eval()
        draft_ids = torch.arange(len(drafter.d2t), device=device) + drafter.d2t
        depth = drafter.config.depth if args.kind == "dflash" else 7  # a block's drafted slots; EAGLE-3: 7 steps
        m = score(source, head, drafter, draft_ids, depth, held, args.batch_tokens, 0, device, distributed.Dist())
        out[arm] = {"acc_per_step": [round(a, 4) for a in m["acc_per_step"]], "tau_sim": round(m["tau_sim"], 3),
                    "positions": m.get("positions"),
                    **{k: m[k] for k in ("tau_walk", "accept_walk_per_step", "chains", "greedy_path") if k in m}}
        del drafter
    source.close()
    ratios = {arm: _over_peer_best_min(out, arm) for arm in out if arm == "eyas" or arm.startswith("eyas-")}
    best = max((a for a in ratios if ratios[a] is not None), key=lambda a: ratios[a], default=None)
    return {"samples": len(held), "drafters": out, "eyas_at_least_peer_best_every_step": _ge_every_step(out, best),
            "eyas_over_peer_best_min_by_drafter": ratios, "eyas_best": best,
            "eyas_over_peer_best_min": ratios.get(best) if best else None}


def _peer_best(out: dict) -> list[float]:
    """The best peer drafter's accuracy at each step (or block position) every peer drafter reaches."""
    peers = [out[a]["acc_per_step"] for a in ARMS[1:] if a in out]
    return [max(p[k] for p in peers) for k in range(min(map(len, peers)))] if peers else []


def _ge_every_step(out: dict, arm: str | None = "eyas") -> bool | None:
    best = _peer_best(out)
    if arm not in out or not best:
        return None
    return all(e >= b for e, b in zip(out[arm]["acc_per_step"], best))


def _over_peer_best_min(out: dict, arm: str = "eyas") -> float | None:
    """An eyas drafter's accuracy over the peer's best at its worst step (or block position), over the
    steps both reach."""
    best = _peer_best(out)
    if arm not in out or not best:
        return None
    return round(min(e / max(b, 1e-9) for e, b in zip(out[arm]["acc_per_step"], best)), 4)


def _drafters(ctx) -> dict[str, Path]:
    """eyas's arm and its --variants (eyas-NAME), the peer's imported ones, then --also's."""
    return {"eyas": ctx["eyas"], **{f"eyas-{name}": Path(f) for name, f in ctx.get("variants", {}).items()},
            **{a: ctx[f"{a}-eyas"] for a in ARMS[1:] if f"{a}-eyas" in ctx},
            **{name: Path(folder) for name, folder in ctx.get("also", {}).items()}}


def q_decode(args, ctx) -> dict[str, Any]:
    """eyas's lossless decoding, greedy, float32: plain, then chain 7 and tree for each drafter, on
    MT-bench (both turns) and a second set (held-out conversations' first prompts), spread over
    worker processes; every answer compared with plain decoding's."""
    import subprocess

    from eyas.evaluate.report import summarize

    work = ctx["work"]
    mt = load_mt_bench(args)
    second = second_set(args, ctx)
    # The two sets interleaved: workers that run out of seconds still answer some of each.
    rows = [p for pair in zip_longest(mt[: args.questions], second) for p in pair if p is not None]
    prompts = work / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in rows))
    ids = [str(p.get("question_id", p.get("id"))) for p in rows]
    drafters = _drafters(ctx)
    seconds = max(20.0, min(args.eval_seconds, ctx["left"]() - 30))  # the workers' load and the call's end
    procs, outs = [], []
    for w in range(min(args.workers, len(ids))):
        out = work / f"decode{w}.json"
        outs.append(out)
        cmd = [sys.executable, __file__, "decode-worker", "--model", args.model, "--prompts", str(prompts),
               "--ids", ",".join(ids[w :: args.workers]), "--out", str(out), "--device", args.device,
               "--seconds", str(seconds), "--max-new-tokens", str(args.max_new_tokens),
               "--drafters", json.dumps({k: str(v) for k, v in drafters.items()})]
        procs.append(subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "2"}))
    codes = [p.wait() for p in procs]
    records = [r for o in outs if o.exists() for r in json.loads(o.read_text())]
    methods = {f"{a}-{m}": 7 for a in drafters for m in ("chain", "tree")}
    every = summarize(records, methods)
    identical = {m: f"{s.identical}/{s.answers}" for m, s in every.items() if s.identical is not None}
    by_set = {}
    for name, keep in (("mt_bench", lambda r: not r["prompt_id"].startswith("heldout-")),
                       ("second_set", lambda r: r["prompt_id"].startswith("heldout-")), ("all", lambda r: True)):
        rs = [r for r in records if keep(r)]
        if rs:
            by_set[name] = {m: round(s.tau, 3) for m, s in summarize(rs, methods).items() if m != "plain"}
    return {"tau": by_set.get("all", {}), "tau_by_set": by_set, "identical_to_plain": identical,
            "answers": every["plain"].answers if "plain" in every else 0,
            "prompts_answered": len({r["prompt_id"] for r in records}),
            "worker_exit_codes": codes, "max_new_tokens": args.max_new_tokens, "worker_seconds": seconds}


def second_set(args, ctx) -> list[dict[str, str]]:
    """The second prompt set: the first user turn of held-out conversations (no arm trained on them)."""
    from eyas.data.prepared import PreparedData

    conversations = PreparedData(ctx["data"]).conversations()
    store_index = _store_index(ctx)
    second = []
    for pos in ctx["held_pos"]:
        first = next((m["content"] for m in conversations[store_index[pos]] if m["role"] == "user"), None)
        if first:
            second.append({"id": f"heldout-{pos}", "prompt": first})
        if len(second) >= args.second_set:
            break
    return second


def q_decode_parallel(args, ctx) -> dict[str, Any]:
    """DFlash: bench/parallel_gpu.py trains eyas's EAGLE-3 chain on the same store for the same
    minutes, at the DFlash arm's tokens a step and the depth eyas train's budget rule picks for
    them (as a user's run without --ttt-steps gets), then decodes it, prompt lookup and every
    DFlash drafter in one process on eval's static path (MT-bench both turns, interleaved with
    the second set), each answer compared with plain decoding; wall-clock speed-ups are the
    MT-bench ones."""
    import subprocess

    work = ctx["work"] / "parallel"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    prompts = work / "second.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in second_set(args, ctx)))
    drafters = {"dflash" if arm == "eyas" else f"dflash:{arm.replace('_', '-')}": folder
                for arm, folder in _drafters(ctx).items()}
    left = ctx["left"]() / 60
    chain = args.arm_minutes if args.chain_minutes is None else args.chain_minutes
    cmd = [sys.executable, str(Path(__file__).with_name("parallel_gpu.py")), "--model", args.model,
           "--store", str(ctx["store"]), "--work", str(work), "--out", str(work), "--device", args.device,
           "--arms", "eagle3:ttt_steps=null" if chain else "", "--arm-minutes", str(chain), "--batch-tokens", str(args.batch_tokens),
           "--max-len", str(args.max_len), "--lr", str(args.lr), "--mt-bench", args.mt_bench or "mt-bench",
           "--second-prompts", str(prompts), "--questions", str(args.questions),
           "--second-questions", str(args.second_set), "--max-new-tokens", str(args.max_new_tokens),
           "--timing-questions", "0", "--minutes", f"{left - 0.3:.2f}",
           "--eval-minutes", f"{max(left - chain - 1.5 * bool(chain) - 0.5, 0.5):.2f}",
           *[x for arm, folder in drafters.items() for x in ("--drafter", f"{arm}={folder}")]]
    subprocess.run(cmd, check=True)
    report = json.loads((work / "parallel_gpu.json").read_text())
    if report.get("errors"):
        raise RuntimeError(f"parallel_gpu.py: {report['errors']}")
    decoded = report["arms_decoded"]
    summary = report["mt_bench"]["summary"]
    peers = [f"dflash[{a.replace('_', '-')}]" for a in ARMS[1:] if f"dflash[{a.replace('_', '-')}]" in decoded]
    chain_tau = decoded.get("eagle3-chain", {}).get("tau_both")
    # eyas's best DFlash decoded: its arm or a --variant (method dflash[eyas-NAME])
    best = max((m for m in decoded if m == "dflash" or m.startswith("dflash[eyas-")),
               key=lambda m: decoded[m]["tau_both"])
    return {"command": " ".join(cmd[1:]), "tau": {m: v["tau_both"] for m, v in decoded.items()},
            "tau_by_set": decoded, "speedup_mt_bench": {m: v.get("speedup") for m, v in summary.items()},
            "tau_dflash_eyas": decoded["dflash"]["tau_both"], "dflash_eyas_best": best,
            "tau_dflash_eyas_best": decoded[best]["tau_both"],
            "tau_dflash_peer_best": max((decoded[m]["tau_both"] for m in peers), default=None),
            "tau_dflash_over_chain": round(decoded[best]["tau_both"] / chain_tau, 4) if chain_tau else None,
            "speedup_dflash_over_chain": _speedup_ratio(summary, best, "eagle3-chain"),
            "identical_to_plain": report["identical_to_plain"], "kept_out_of_training": report["kept_out_of_training"],
            "eagle3_chain_arm": next((v for arm, v in report["train"].items() if arm.startswith("eagle3")), None),
            "mt_bench": report["mt_bench"],
            "second_set": report["second_set"]}


def _speedup_ratio(summary: dict[str, Any], method: str, over: str) -> float | None:
    """`method`'s MT-bench wall-clock speed-up over `over`'s, from parallel_gpu.py's summary."""
    a, b = ((summary.get(m) or {}).get("speedup") for m in (method, over))
    return round(a / b, 4) if a and b else None


def _store_index(ctx) -> list[int]:
    from eyas.store import Store

    return Store(ctx["store"]).sample_indices().tolist()


def load_mt_bench(args) -> list[dict]:
    """MT-bench (the packaged one, or --mt-bench) as JSONL rows, round-robin over its categories
    (eyas.evaluate.prompts.stratified): any prefix covers them all."""
    from eyas.evaluate.prompts import stratified
    from eyas.prompts import load_prompts

    prompts = load_prompts(args.mt_bench or "mt-bench")
    return [{"question_id": prompts[i].id, "turns": prompts[i].turns, "category": prompts[i].category}
            for i in stratified(prompts)]


def peer_train(argv: list[str]) -> None:
    """`python -m speculators.train ARGV`, with `datasets` kept off torchvision (`datasets_quiet`)
    here and in its spawned data workers (`quiet_worker`).
    With --cpu first (smoke runs only): on the CPU, where its Trainer would move the model to an
    accelerator (its `local_rank`) and its step timer would wait for one."""
    import runpy

    import speculators.train.dataloader as dataloader
    from peer_layout import datasets_quiet, quiet_worker

    datasets_quiet()
    dataloader._worker_init_fn = quiet_worker  # read when its DataLoader is built; pickled by name
    if argv[:1] == ["--cpu"]:
        argv = argv[1:]
        import speculators.train.trainer as trainer

        setup = trainer.Trainer.setup_model

        def on_cpu(self):
            self.local_rank, self.device_type = torch.device("cpu"), "cpu"
            setup(self)

        trainer.Trainer.setup_model = on_cpu
        torch.accelerator.synchronize = lambda *a, **k: None
        torch.set_num_threads(1)
    sys.argv = ["speculators.train", *argv]
    runpy.run_module("speculators.train", run_name="__main__")


def decode_worker(argv: list[str]) -> None:
    """One process: plain + every drafter's chain and tree on its prompts, until its time is up."""
    from eyas.evaluate.drafter import DrafterSession
    from eyas.prompts import load_prompts
    from eyas.evaluate.proposers import Eagle3, Proposer
    from eyas.evaluate.run import load_checked_drafter, run_methods
    from eyas.models.eos import eos_ids
    from eyas.evaluate.target import TargetSession
    from eyas.models import load_target, model_identity

    p = argparse.ArgumentParser()
    for a in ("--model", "--prompts", "--ids", "--out", "--device", "--drafters"):
        p.add_argument(a, required=True)
    p.add_argument("--seconds", type=float, required=True)
    p.add_argument("--max-new-tokens", type=int, required=True)
    args = p.parse_args(argv)
    t0 = time.monotonic()
    model, tok = load_target(args.model, dtype="float32", device=args.device)
    identity = model_identity(args.model, model.config, tok)
    proposers, aux = [Proposer()], None
    for arm, folder in json.loads(args.drafters).items():
        drafter = load_checked_drafter(folder, model, identity)
        aux = drafter.config.aux_layer_ids
        for tree in (False, True):
            proposer = Eagle3(DrafterSession(drafter), 7, tree=tree, top_k=10, max_nodes=60)
            proposer.name = f"{arm}-{'tree' if tree else 'chain'}"
            proposers.append(proposer)
    target = TargetSession(model, aux)
    prompts = {x.id: x for x in load_prompts(args.prompts)}
    records, longest = [], 0.0
    for i, pid in enumerate(args.ids.split(",")):
        if i and time.monotonic() - t0 + longest > args.seconds:
            break
        q0 = time.monotonic()
        records += run_methods(target, tok, proposers, [prompts[pid]], args.max_new_tokens, set(eos_ids(model.generation_config, tok)),
                               progress=False, warmup=i == 0)
        longest = max(longest, time.monotonic() - q0)
        Path(args.out).write_text(json.dumps(records))


if __name__ == "__main__":
    if sys.argv[1:2] == ["decode-worker"]:
        decode_worker(sys.argv[2:])
    elif sys.argv[1:2] == ["peer-train"]:
        peer_train(sys.argv[2:])
    else:
        main()
