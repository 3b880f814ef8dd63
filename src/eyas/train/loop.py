"""`train(config)`: set up the source, the drafter and its optimizer, then run the steps.

One step = G = processes x grad_accum token-budget micro-batches. The loss of a step is the
token mean over all of them (per TTT step k, weighted decay^k), whatever the number of
processes, so a DDP run and a single process over the same global batch take the same step.
Under --context-parallel every process trains the same grad_accum micro-batches, each its own
positions of them (draft/context.py), and the step is again one process's.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterator

import torch
from tqdm import tqdm
from transformers import AutoConfig

from eyas.draft import kinds
from eyas.draft import mla_config as latent
from eyas.draft.base import Drafter
from eyas.draft.build import drafter_class, new_drafter
from eyas.draft.checkpoint import load_drafter
from eyas.draft.config import DraftConfig
from eyas.draft.context import Shard, shard_length
from eyas.draft.model import FLEX_PAD
from eyas.draft.loss import STATS, step_counts
from eyas.draft.objective import Objective
from eyas.draft.vocab import TokenCounter, build_draft_vocab, coverage, default_draft_vocab_size
from eyas.errors import EyasError
from eyas.device import GIB, check_fits, free_bytes
from eyas.lock import output_lock, reading_lock
from eyas.models import load_tokenizer, model_identity, resolve_model
from eyas.models.identity import text_config
from eyas.models.target_head import TargetHead, load_target_head
from eyas.options import AUTO_LAYERS, AUTO_LAYERS_MEANS
from eyas.paths import check_confined
from eyas.store.format import first_nonfinite
from eyas.train import budget
from eyas.train import checkpoint as ckpt
from eyas import distributed
from eyas.train.config import TrainConfig, anchors_per_sample, causal_text
from eyas.train.data import Batch, BatchStream, OnlineSource, SampleSource, StoreSource, split
from eyas.train.metrics import MetricsLog, format_table, summarize
from eyas.train.anchors import HELD_OUT, batch_rows, loss_masks
from eyas.timing import StepTimer, timed
from eyas.train.labels import make_labels
from eyas.train.optim import build_optimizers


@dataclass
class InMemory:
    """A run's samples, the target's output head and the drafter's config held in memory, in
    place of a store (or the target) and the target's folder: what a benchmark times with the
    trainer's own setup and steps. The draft vocabulary is still counted from the samples."""
    source: SampleSource
    head: TargetHead
    draft: DraftConfig


@dataclass
class Run:
    cfg: TrainConfig
    d: distributed.Dist
    device: torch.device
    source: SampleSource
    head: TargetHead
    draft: DraftConfig
    model: torch.nn.Module  # the drafter, wrapped for DDP/FSDP
    optimizers: list[torch.optim.Optimizer]  # [AdamW] or [Muon, AdamW] (train/optim.py)
    train_stream: BatchStream
    eval_positions: list[int]
    total_steps: int  # the schedule's length; under --minutes, revised to fit the budget
    data: dict[str, Any] = field(default_factory=dict)  # `data_record`: what samples the run trains and holds out
    step: int = 0  # optimizer steps done
    resumed_from: int | None = None
    started: float = field(default_factory=lambda: budget.clock())
    cap: int | None = None  # the --steps / --epochs length, which a --minutes plan never exceeds
    depth_rule: dict[str, Any] | None = None  # the budget rule's choice, once made (budget.depth_choice)

    @property
    def drafter(self) -> Drafter:
        return getattr(self.model, "module", self.model)

    @property
    def dp(self) -> int:
        """Processes training different batches: one under context parallelism."""
        return data_parallel(self.cfg, self.d)

    @property
    def group(self) -> int:
        return self.dp * self.cfg.grad_accum

    @property
    def steps_per_epoch(self) -> float:
        """Optimizer steps one pass over the training batches takes."""
        return len(self.train_stream) / self.group


def data_parallel(cfg: TrainConfig, d: distributed.Dist) -> int:
    return 1 if cfg.context_parallel else d.world


def train(cfg: TrainConfig, stop_at: int | None = None) -> dict[str, Any]:
    """Train (or resume) the run described by `cfg`; return the final metrics.

    `stop_at` ends the run after that step with a checkpoint, exactly as an interruption
    would, while the schedule still spans the whole run (tests use it to prove resumption).
    """
    check_confined(cfg.out, {"--store": cfg.store, "--data": cfg.data, "--model": cfg.model, "--init": cfg.init})
    started = budget.clock()  # a --minutes budget counts the set-up (model loads) too
    d, device = distributed.init(cfg.device, cfg.fsdp)
    created_group = d.enabled
    try:
        # The out folder is shared by this job's processes; the store is read while no capture writes it.
        with output_lock(cfg.out, "train"), \
                (reading_lock(cfg.store, "The store") if cfg.store else contextlib.nullcontext()):
            run = setup(cfg, d, device)
            run.started = started
            return fit(run, stop_at)
    finally:
        if created_group:
            distributed.shutdown(d)


def _log(d: distributed.Dist, message: str) -> None:
    if d.main:
        print(f"eyas train: {message}", flush=True)


# ---------------------------------------------------------------- setup


def setup(cfg: TrainConfig, d: distributed.Dist, device: torch.device, memory: InMemory | None = None) -> Run:
    """The run `cfg` describes, resumed where --out holds one; from `memory` instead of the
    store (or target) and the target's folder when given."""
    out = Path(cfg.out)
    ckpt.check_out_folder(out)
    previous = ckpt.latest_checkpoint(out)
    if previous is not None and not cfg.resume:
        raise EyasError(f"{out} already holds a training run (at {previous.name}); pass --resume to continue it, "
                        f"or choose another --out.")
    if previous is None and (trained := [f for f in ckpt.DRAFTER_FILES if (out / f).exists()]):
        raise EyasError(f"{out} already holds a trained drafter ({trained[0]}) and no checkpoint to resume it from "
                        f"({ckpt.CHECKPOINTS}/ is gone); choose another --out, or delete {out} to train anew.")
    source, folder = _open_source(cfg, device) if memory is None else (memory.source, None)
    _check_layer_ids(source)
    _say_layers(cfg, source, d)
    cfg.check_target(source.identity.num_layers)
    if source.cropped:
        _log(d, f"{source.cropped} sample(s) longer than {cfg.crop} tokens are cropped (--max-len, --batch-tokens)")
    train_pos, eval_pos = split(source.sample_index, cfg.eval_fraction, cfg.seed)
    data = data_record(source, eval_pos)
    if not train_pos:
        raise EyasError("No training sample left after the held-out split; lower --eval-fraction or add data.")
    stream = BatchStream(train_pos, source.lengths, source.sample_index, cfg.batch_tokens, cfg.seed)
    _check_group(cfg, len(stream), d)
    if cfg.context_parallel and d.world < 2:
        raise EyasError("--context-parallel splits each sample over torchrun's processes: run it under torchrun "
                        "with --nproc-per-node 2 or more.")
    head = load_target_head(folder).to(device) if memory is None else memory.head
    if cfg.lm_head is None:
        cfg.lm_head = _default_lm_head(cfg, head, d)
    if previous is not None:
        draft, trainer = ckpt.read_checkpoint(previous)
        where = f"The store {cfg.store}" if cfg.store else f"The target {cfg.model}"
        ckpt.check_store_matches(draft, source.identity, source.layer_ids, source.hidden_size, where)
        _check_same_data(trainer.get("data"), data, cfg)
        cfg.check_resumable(trainer["config"], also=_check_same_group(trainer, cfg, d))
        drafter = load_drafter(previous, head.embed_weight)
        _log(d, f"resuming {out} from {previous.name}")
    elif cfg.init:
        drafter = _init_drafter(cfg, source, head, d)
        draft = drafter.config
        _check_step(cfg, draft, [(len(b), max(source.lengths[p] for p in b)) for b in stream.batches], d, device)
    else:
        draft, draft_ids = _new_draft_config(cfg, source, folder, train_pos, d, memory and memory.draft)
        _check_fits(draft, d, device)
        _check_step(cfg, draft, [(len(b), max(source.lengths[p] for p in b)) for b in stream.batches], d,
                          device)
        torch.manual_seed(cfg.seed)
        drafter = new_drafter(draft, head.embed_weight)
        drafter.set_vocab(draft_ids)
        if cfg.lm_head != "own":
            drafter.lm_head.weight.data.copy_(_target_head_rows(cfg, head, draft_ids))
    drafter.lm_head.weight.requires_grad_(cfg.lm_head != "frozen")
    drafter.checkpoint_steps = cfg.checkpoint_steps
    model = distributed.wrap(drafter.to(device), d, device)
    optimizers = build_optimizers(model, cfg.optimizer, cfg.lr, cfg.weight_decay)
    per_epoch = len(stream) / (data_parallel(cfg, d) * cfg.grad_accum)
    cap = cfg.steps or (math.ceil(cfg.epochs * per_epoch) if cfg.epochs else None)
    # Under --minutes this is provisional, long enough to reach the steady state, whose rate then
    # plans the run; it does not depend on time, so neither do the first steps' learning rates.
    first = max(math.ceil(per_epoch), budget.SETTLE + budget.STEADY) if cfg.minutes else math.ceil(per_epoch)
    total = trainer["total_steps"] if previous is not None else cap or first
    run = Run(cfg=cfg, d=d, device=device, source=source, head=head, draft=draft, model=model, optimizers=optimizers,
              train_stream=stream, eval_positions=eval_pos, total_steps=total, cap=cap, data=data)
    if previous is not None:
        run.step = run.resumed_from = trainer["step"]
        run.depth_rule = trainer.get("depth_rule")
        ckpt.load_optimizer(model, optimizers, ckpt.read_optimizer(previous))
    return run


def _open_source(cfg: TrainConfig, device: torch.device):
    """The sample source and the target's model folder (where its head weights are read)."""
    if cfg.online:
        source = OnlineSource(cfg.model, cfg.data, cfg.layers, cfg.crop, device)
        return source, resolve_model(cfg.model)
    source = StoreSource(cfg.store, cfg.crop)
    _check_complete(source.store, cfg.allow_incomplete)
    spec = cfg.model or source.identity.model
    try:
        folder = resolve_model(spec)
    except EyasError as e:
        raise EyasError(f"The store was captured from {spec!r}, which cannot be loaded here ({e}); pass --model.") from None
    try:
        _check_identity(spec, folder, source)
    except (OSError, ValueError) as e:  # transformers' own errors for a folder or hub id it cannot load
        first = (str(e).splitlines() or [""])[0]
        raise EyasError(f"The target {spec!r} cannot be loaded here ({type(e).__name__}: {first}); pass --model.") from None
    return source, folder


def _check_complete(store, allowed: bool) -> None:
    """Say, first, that the store's capture has not finished: how much is there and how to
    finish it; train on it only when --allow-incomplete makes that the user's choice."""
    m = store.manifest
    if m.get("complete"):
        return
    expected = m.get("expected_samples")  # recorded by `eyas capture`; a store written otherwise only gets the note
    held = f"{len(store)} of {expected} samples ({100 * len(store) / expected:.0f}%)" if expected else \
        f"{len(store)} samples, not all of its prepared data"
    if not allowed and expected:
        raise EyasError(f"The store {store.path} is incomplete: it holds {held}. Run the same `eyas capture` command "
                        f"again to finish it, or pass --allow-incomplete to train on what is there.")
    print(f"eyas train: note: the store {store.path} is incomplete ({held}); training on what is there "
          f"(--allow-incomplete).", flush=True)


def _check_identity(spec: str, folder: str, source: StoreSource) -> None:
    identity = model_identity(spec, AutoConfig.from_pretrained(folder), load_tokenizer(spec), folder)
    identity.check_same(source.identity, f"The store {source.store.path}")


def data_record(source, eval_pos: list[int]) -> dict[str, Any]:
    """What the run trains on, recorded with each checkpoint: the prepared data, the eval prompts
    it was kept free of (which eval checks its own against), and which of its samples the run
    holds (they set the held-out split and the batches)."""
    def digest(indices: list[int]) -> str:
        return hashlib.sha256(json.dumps(sorted(indices)).encode()).hexdigest()

    return {"prepared": getattr(source, "fingerprint", None), "excluded_prompts": getattr(source, "excluded_prompts", None),
            "samples": len(source.sample_index),
            "samples_sha256": digest(source.sample_index), "held_out": len(eval_pos),
            "held_out_sha256": digest([source.sample_index[p] for p in eval_pos])}


def _check_same_data(recorded: dict[str, Any] | None, now: dict[str, Any], cfg: TrainConfig) -> None:
    """Refuse a resume over other samples than the run's (a store captured further since an
    --allow-incomplete run, other prepared data): its held-out split and batches would change, and
    trained samples be scored as held-out. Runs from before the record resume as they are."""
    if recorded is None:
        return
    where = f"the store {cfg.store}" if cfg.store else f"the prepared data {cfg.data}"
    if None not in (recorded.get("prepared"), now["prepared"]) and recorded.get("prepared") != now["prepared"]:
        cause = f"{where} comes from other prepared data than the run's"
    elif recorded.get("samples") != now["samples"]:
        cause = f"{where} holds {now['samples']} samples, the run trained on {recorded.get('samples')}"
    elif any(recorded.get(k) != now[k] for k in ("samples_sha256", "held_out_sha256")):
        cause = f"{where} holds other samples than the run's {recorded.get('samples')}"
    else:
        return
    raise EyasError(f"--resume: {cause}, so its held-out split and batches would change. Resume with the samples "
                    f"the run started with, or train a new run into another --out (--init {cfg.out} starts it from "
                    f"this drafter).")


def _check_same_group(trainer: dict[str, Any], cfg: TrainConfig, d: distributed.Dist) -> tuple[str, ...]:
    """Step s trains stream items s*G .. s*G+G-1 (G = processes x --grad-accum): a resume takes
    the same G, or its steps skip or repeat batches. Where the run records G, --grad-accum may
    change with the process count; returns the settings so checked (for `check_resumable`)."""
    recorded, processes = trainer.get("group"), trainer.get("processes")
    if not isinstance(recorded, int) or not isinstance(processes, int):
        return ()  # a run from before the record: --grad-accum is compared as it was given
    dp = data_parallel(cfg, d)
    if dp * cfg.grad_accum == recorded:
        return ("grad_accum",)
    keep = f"with --grad-accum {recorded // dp}, or " if recorded % dp == 0 else ""
    raise EyasError(f"--resume: the run's steps each train {recorded} micro-batch(es) ({processes} process(es) x "
                    f"--grad-accum {recorded // processes}), this command's {dp * cfg.grad_accum} ({dp} process(es) "
                    f"x --grad-accum {cfg.grad_accum}), so its steps would skip or repeat batches. Resume {keep}on "
                    f"{processes} process(es) with --grad-accum {recorded // processes}.")


def _default_lm_head(cfg: TrainConfig, head: TargetHead, d: distributed.Dist) -> str:
    """--lm-head when not given: the kind's (DFlash: the target's rows, frozen, which trained
    better than its own head at equal minutes), but own where those rows cannot serve: --fsdp
    shards the drafter for a head too big for one GPU, and a target that scales, caps or biases
    its logits has rows that are not its head. The fallback is said, so the run says what it trains."""
    kind = kinds.get(cfg.drafter)
    if kind.lm_head == "own":
        return "own"
    if cfg.fsdp:
        why = "--fsdp shards the drafter"
    elif not head.logits_are_the_product():
        why = "the target scales, caps or biases its logits"
    else:
        _log(d, f"--lm-head {kind.lm_head}, {kind.title}'s default: the target's lm_head rows of the draft vocabulary")
        return kind.lm_head
    _log(d, f"--lm-head own, not {kind.title}'s default {kind.lm_head}: {why}")
    return "own"


def _target_head_rows(cfg: TrainConfig, head: TargetHead, draft_ids: torch.Tensor) -> torch.Tensor:
    """The target's lm_head rows of the draft vocabulary [Vd, H] (draft_ids [Vd] target ids), the
    start of a drafter's head under --lm-head target or frozen: the drafter's head is a plain
    linear map after its own norm, as the target's is after its own, so the rows carry over
    only where the target does nothing else to its logits."""
    if not head.logits_are_the_product():
        raise EyasError(f"--lm-head {cfg.lm_head} starts the drafter's head from the target's, but the target adds "
                        f"a bias to its logits or transforms them (scales or caps them), which the drafter's plain "
                        f"lm_head cannot hold: use --lm-head own.")
    return head.lm_head_weight[draft_ids.to(head.lm_head_weight.device)].float()


def _init_drafter(cfg: TrainConfig, source, head: TargetHead, d: distributed.Dist) -> Drafter:
    """--init: the trained drafter this run starts from, checked against the data and against
    the options that would shape another drafter; it keeps its layers and draft vocabulary and
    takes this run's TTT steps, decay and the data's chat template."""
    trained = load_drafter(cfg.init, head.embed_weight)
    given = trained.config
    where = f"The store {cfg.store}" if cfg.store else f"The target {cfg.model}"
    ckpt.check_store_matches(given, source.identity, source.layer_ids, source.hidden_size,
                             f"{where} (training from --init {cfg.init})")
    if given.drafter != cfg.drafter:
        raise EyasError(f"--init {cfg.init} is {given.kind.a_title()} drafter; pass --drafter {given.drafter}.")
    # An option asked for (given, on, not auto) that the drafter does not have: it keeps its own.
    shaped = {"--draft-layers": (cfg.draft_layers, given.num_hidden_layers),
              "--draft-vocab": (cfg.draft_vocab, given.draft_vocab_size),
              "--intermediate-size": (cfg.intermediate_size, given.intermediate_size),
              "--fc-norm": (cfg.fc_norm or None, given.fc_norm),
              "--norm-output": (cfg.norm_output or None, given.norm_output),
              "--draft-attention": (None if cfg.draft_attention == latent.AUTO_ATTENTION else cfg.draft_attention,
                                    given.attention),
              "--mask-token-id": (cfg.mask_token_id, given.mask_token_id),
              "--causal-layers": (_causal_asked(cfg, given), causal_text(given.causal_layers, given.num_hidden_layers))}
    for flag, (asked, has) in shaped.items():
        if asked is not None and asked != has:
            shown, own = (flag, "it off") if asked is True else (f"{flag} {asked}", has)
            raise EyasError(f"{shown}: --init {cfg.init} has {own}; a run from it keeps its shape and settings "
                            f"(drop {flag}, or train a new drafter without --init).")
    # No module is shaped by these: every kind reads them from its config as it runs.
    trained.config = replace(given, ttt_steps=cfg.start_depth, ttt_decay=cfg.ttt_decay,
                             chat_template=source.chat_template)
    _log(d, f"starting from --init {cfg.init}: {given.kind.a_title()} drafter, {given.num_hidden_layers} layer(s), "
            f"a draft vocabulary of {given.draft_vocab_size}")
    return trained


def _causal_asked(cfg: TrainConfig, given: DraftConfig) -> str | None:
    """--causal-layers as the --init drafter's layers would write it ("0,1" of two is `all`); None
    if not asked."""
    layers = cfg.causal_layer_ids(given.num_hidden_layers, f"--init {cfg.init}")
    return None if layers is None else causal_text(layers, given.num_hidden_layers)


def _say_layers(cfg: TrainConfig, source, d: distributed.Dist) -> None:
    """An online run under `--layers auto` names the ids it read: auto is one rule for every kind,
    so a kind whose peers read other layers (DFlash: five) says why it reads these."""
    if not cfg.online or cfg.layers != AUTO_LAYERS:
        return
    ids = ",".join(map(str, source.layer_ids[:-1]))
    why = f"; {note}" if (note := kinds.get(cfg.drafter).auto_layers) else ""
    _log(d, f"--layers {AUTO_LAYERS}: the target's layer ids {ids} {AUTO_LAYERS_MEANS} and "
            f"{source.layer_ids[-1]}, the label source{why}")


def _check_layer_ids(source) -> None:
    ids, n = list(source.layer_ids), source.identity.num_layers
    if len(ids) < 2 or ids[-1] != n or any(not 0 <= k < n for k in ids[:-1]):
        raise EyasError(f"The store's layer ids {ids} do not fit the {n}-layer target: training needs aux ids in "
                        f"0..{n - 1} followed by {n} (the last layer's output, the label source).")
    if source.hidden_size != source.identity.hidden_size:
        raise EyasError(f"The store's hidden size {source.hidden_size} differs from the target's "
                        f"{source.identity.hidden_size}.")


def _new_draft_config(cfg: TrainConfig, source, folder: str | None, train_pos: list[int], d: distributed.Dist,
                      given: DraftConfig | None = None) -> tuple[DraftConfig, torch.Tensor]:
    """The drafter's config (`given`, or built for the target in `folder`) and its draft
    vocabulary [Vd], the tokens most frequent in the training samples."""
    counter = TokenCounter(source.identity.vocab_size).update(source.tokens(p) for p in train_pos)
    size = given.draft_vocab_size if given else cfg.draft_vocab or default_draft_vocab_size(source.identity.vocab_size)
    draft_ids = build_draft_vocab(counter, size)
    _log(d, f"draft vocabulary: {size} of {source.identity.vocab_size} tokens, covering "
            f"{100 * coverage(counter, draft_ids):.2f}% of the trained tokens in the data")
    if given is not None:
        return given, draft_ids
    width = {"intermediate_size": cfg.intermediate_size} if cfg.intermediate_size else {}
    target_config = AutoConfig.from_pretrained(folder)
    draft = DraftConfig.for_target(target_config, source.identity, source.layer_ids, size,
                                   ttt_steps=cfg.start_depth, ttt_decay=cfg.ttt_decay, fc_norm=cfg.fc_norm,
                                   norm_output=cfg.norm_output, chat_template=source.chat_template,
                                   attention=_draft_attention(cfg, target_config, d), **width,
                                   **cfg.kind_options(source.identity))
    return draft, draft_ids


def _draft_attention(cfg: TrainConfig, target_config, d: distributed.Dist) -> str:
    """--draft-attention for the kind: a kind with one attention has it; `auto` is the kind's
    own choice where it has one (P-EAGLE keeps the Llama layer vLLM serves it with, noted on an
    MLA target), else MLA for an MLA target (draft/mla_config.py)."""
    kind = kinds.get(cfg.drafter)
    if len(kind.attentions) == 1:
        return kind.attentions[0]
    if cfg.draft_attention == latent.AUTO_ATTENTION and kind.auto_attention is not None:
        attention, why = kind.auto_attention
        own = latent.resolve_attention(latent.AUTO_ATTENTION, text_config(target_config))
        if own != attention:
            _log(d, f"note: --drafter {kind.name} takes a {attention.upper()} layer on this {own.upper()} target "
                    f"(--draft-attention {latent.AUTO_ATTENTION}): {why}")
        return attention
    return cfg.draft_attention


def _check_fits(draft: DraftConfig, d: distributed.Dist, device: torch.device) -> None:
    """Refuse a drafter whose float32 weights, gradients and AdamW moments (16 bytes a trained
    parameter, sharded under FSDP) cannot fit in the device, before allocating any of it."""
    with torch.device("meta"):
        shape = new_drafter(draft)
    params = sum(p.numel() for name, p in shape.named_parameters() if not name.startswith("embed_tokens."))
    check_fits(16 * params // (d.world if d.fsdp else 1), device, f"A drafter of {params:,} parameters (weights, "
               f"gradients and optimizer state)", "lower --intermediate-size or --draft-vocab")


def _check_group(cfg: TrainConfig, batches: int, d: distributed.Dist) -> None:
    """A step trains G = processes x --grad-accum micro-batches. With more than an epoch's
    batches it repeats samples: it costs more than an epoch and gives about an epoch's gradient.
    Refused where --epochs or --minutes set the length (one such step already passes over the
    data more often than asked, under a step count that hides it); said in a note where --steps
    asks for such steps."""
    world = data_parallel(cfg, d)
    group = world * cfg.grad_accum
    if group <= batches:
        return
    what = (f"a step of {group} micro-batches ({world} process(es) x --grad-accum {cfg.grad_accum}) is more than "
            f"the {batches} batch(es) of <= {cfg.batch_tokens} tokens an epoch holds")
    if cfg.steps is None:
        most = batches // world
        fix = f"Lower --grad-accum to at most {most}" if most else f"Run at most {batches} process(es)"
        raise EyasError(f"--grad-accum {cfg.grad_accum}: {what}, so its samples would repeat within the step. {fix} "
                        f"(or lower --batch-tokens, for more batches an epoch), or give --steps to train such steps "
                        f"anyway.")
    _log(d, f"note: {what}: its samples repeat within each step")


def _check_step(cfg: TrainConfig, draft: DraftConfig, batches: list[tuple[int, int]], d: distributed.Dist,
                device: torch.device) -> None:
    """Refuse a step whose largest tensors (the kind's `step_bytes` estimate, where it has one)
    on the largest of the `batches` (rows, longest sample) exceed the memory `device` has free,
    before allocating any."""
    estimate = drafter_class(draft).step_bytes
    needs = [estimate(draft, rows, length, cfg.anchors and anchors_per_sample(cfg.anchors, length), device)
             for rows, length in batches]
    if not needs or None in needs:
        return
    need, have = max(needs), free_bytes(device)
    if distributed.max_over_processes(float(need > have), d, device):
        block = f" of --block-size {draft.ttt_steps + 1} at --anchors {cfg.anchors}" \
            if cfg.anchors else ""
        raise EyasError(f"A {draft.kind.title} step{block} needs about {need / GIB:,.1f} GiB, more than the "
                        f"{have / GIB:,.1f} GiB free on {device}; lower "
                        + ("--anchors, --block-size or --batch-tokens (or --draft-layers)." if cfg.anchors else
                           "--batch-tokens."))


# ---------------------------------------------------------------- steps


def lr_at(cfg: TrainConfig, step: int, total: int) -> float:
    """Linear warm-up, then cosine decay to zero at the last step."""
    warm = cfg.warmup if cfg.warmup >= 1 else cfg.warmup * total
    if step < warm:
        return cfg.lr * (step + 1) / (warm + 1)
    progress = (step - warm) / max(total - warm, 1)
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def _autocast(device: torch.device):
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _bad_inputs(samples: list[int]) -> EyasError:
    return EyasError(f"Sample(s) {samples} hold NaN/inf hidden states; "
                     f"run `eyas inspect --verify` on the store and capture them again.")


def _check_inputs(batch: Batch) -> None:
    if first_nonfinite(batch.hidden) is not None:
        rows = _nonfinite_rows(batch.hidden).nonzero().flatten().tolist()
        raise _bad_inputs([batch.sample_index[r] for r in rows])


def _nonfinite_rows(hidden: torch.Tensor) -> torch.Tensor:
    """hidden [B, T, L, H] -> [B] bool: the rows holding a NaN/inf (both reach a row's min or max)."""
    lo, hi = torch.aminmax(hidden.flatten(1), dim=-1)
    return ~(torch.isfinite(lo) & torch.isfinite(hi))


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor onto `device` without waiting for the GPU (a copy from pageable memory would)."""
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)


def forward(run: Run, batch: Batch, weights: torch.Tensor, wrapped: bool = True, timer: StepTimer | None = None,
            rows: torch.Tensor | None = None):
    """One micro-batch: labels from the target head, then the drafter's own loss (through the
    DDP/FSDP wrapper when `wrapped`, which training needs for its gradient hooks), scoring
    the rows [B, T] that anchor a block when given."""
    model = run.model if wrapped else run.drafter
    shard = _shard(run.d, run.device, batch.input_ids.shape[1]) if run.cfg.context_parallel else None
    input_ids, hidden, loss_mask, last = _sharded(batch, shard, run.draft.ttt_steps)
    with _autocast(run.device):
        with timed(timer, "labels"):
            # The samples' greedy path only where the loss walks it: the walk waits for the GPU.
            greedy = input_ids if run.cfg.position_weights == "on-policy" else None
            labels = make_labels(run.head, last, loss_mask, _draft_ids(run), greedy)
        with timed(timer, "forward"):
            return model(input_ids, hidden, labels, weights, rows, objective(run.cfg), shard)


def _shard(d: distributed.Dist, device: torch.device, T: int) -> Shard:
    """This process's part of a batch of T positions under --context-parallel: equal shards, on a
    GPU whole flex blocks."""
    align = FLEX_PAD if device.type == "cuda" else 1
    return Shard(torch.distributed.group.WORLD, d.rank, d.world, shard_length(T, d.world, align))


def _halo(K: int) -> int:
    """Positions after a shard that its rows read, for K TTT steps: step k at row i embeds token
    i+1+k and is scored at label i+1+k, which position i+2+k's mask trains."""
    return K + 1


def _sharded(batch: Batch, shard: Shard | None, K: int):
    """(input_ids, aux states, loss_mask, last states) of `batch`, or of `shard`'s positions and
    the halo its rows read: [B, T(+h)], [B, T, L-1, H], [B, T(+h)], [B, T(+h), H]."""
    if shard is None:
        return batch.input_ids, batch.hidden[:, :, :-1], batch.loss_mask, batch.hidden[:, :, -1]
    window = batch.hidden if batch.rows is not None else shard.slice(batch.hidden, _halo(K))
    input_ids, loss_mask = (shard.slice(t, _halo(K)) for t in (batch.input_ids, batch.loss_mask))
    return input_ids, window[:, : shard.length, :-1], loss_mask, window[:, :, -1]


def _shard_rows(shard: Shard | None, K: int) -> tuple[int, int] | None:
    """The positions of a batch whose states `shard`'s process reads from the store: its own and
    the halo (None: all)."""
    return None if shard is None else (shard.start, min(shard.start + shard.length + _halo(K), shard.total))


def _batch_shard(run: Run, positions: list[int]) -> Shard | None:
    """Under --context-parallel, this process's part of the batch `positions`."""
    if not run.cfg.context_parallel:
        return None
    return _shard(run.d, run.device, max(run.source.lengths[p] for p in positions))


def _anchor_rows(source, positions: list[int], steps: int, anchors: int | str | None, seed: int, step: int,
                 device: torch.device) -> torch.Tensor | None:
    """The batch's anchor rows [B, T] on `device`, for a kind trained on anchored blocks (None
    for the others: every row is scored)."""
    if anchors is None:
        return None
    return _to_device(batch_rows(source, positions, steps, anchors, seed, step), device)


def _draft_ids(run: Run) -> torch.Tensor:
    drafter = run.drafter
    return torch.arange(len(drafter.d2t), device=drafter.d2t.device) + drafter.d2t


def objective(cfg: TrainConfig) -> Objective:
    """The pairs' loss and, under D-PACE, its alpha; on-policy or not."""
    return Objective(cfg.loss, cfg.lk_eta, cfg.dpace_alpha if cfg.position_weights == "dpace" else None,
                     cfg.position_weights == "on-policy")


def _weights(run: Run, positions: list[list[int]]) -> torch.Tensor:
    """[K] decay^k x world / (trained pairs of step k over the whole global batch); under
    D-PACE world / (trained pairs of every step), each pair's own weight applied in the loss;
    on-policy world / (trained pairs of step 0), about the pairs decoding reaches (one per
    answer token), which are known only in the forward."""
    K = run.draft.ttt_steps
    counts = torch.zeros(K)
    for batch in positions:
        if run.cfg.anchors is None:
            for p in batch:
                counts += step_counts(run.source.tokens(p)[1][None], K)
        else:  # anchored blocks: the trained pairs of their anchor rows
            rows = batch_rows(run.source, batch, K, run.cfg.anchors, run.cfg.seed, run.step)
            counts += step_counts(loss_masks(run.source, batch), K, rows)
    counts = _to_device(counts, run.device)
    if not run.cfg.context_parallel:  # under it every process counted the same batches
        counts = distributed.all_reduce(counts, run.d)
    if objective(run.cfg).dpace_alpha is not None:
        return torch.where(counts > 0, run.d.world / counts.sum().clamp_min(1), torch.zeros_like(counts))
    if objective(run.cfg).on_policy:
        return torch.where(counts > 0, run.d.world / counts[0].clamp_min(1), torch.zeros_like(counts))
    decay = _to_device(torch.tensor([run.draft.ttt_decay ** k for k in range(K)]), run.device)
    return torch.where(counts > 0, decay * run.d.world / counts.clamp_min(1), torch.zeros_like(decay))


def _upcoming(run: Run) -> Iterator[list[int]]:
    """This process's micro-batches from the current step to the last, in the order `accumulate` loads them
    (under --minutes the last step is not known yet: up to the cap, or on until the reader is closed)."""
    end = (run.cap or math.inf) if run.cfg.minutes else run.total_steps
    step = run.step
    while step < end:
        yield from run.train_stream.for_step(step, run.group, *_data_rank(run))
        step += 1


def _data_rank(run: Run) -> tuple[int, int]:
    """(rank, world) among the processes training different batches."""
    return (0, 1) if run.cfg.context_parallel else (run.d.rank, run.d.world)


def accumulate(run: Run, timer: StepTimer | None = None
               ) -> tuple[torch.Tensor, list[tuple[list[int], torch.Tensor, torch.Tensor]]]:
    """Forward and backward over this process's micro-batches of the current step, leaving
    the step's gradient in `.grad`; returns the statistics [K, STATS] and, per micro-batch, its
    prepared indices with [B] device flags: NaN/inf hidden states, a loss that is not finite.
    The flags are read on the host once per step (`train_step`), so nothing here waits for the GPU."""
    # A store's next batches, read on the host in a thread (each process its shard's states).
    K = run.draft.ttt_steps
    run.source.read_ahead(_upcoming(run), run.device, lambda positions: _shard_rows(_batch_shard(run, positions), K))
    micro = run.train_stream.for_step(run.step, run.group, *_data_rank(run))
    with timed(timer, "weights"):
        weights = _weights(run, micro)
    stats, checks = torch.zeros(run.draft.ttt_steps, STATS, device=run.device), []
    for i, positions in enumerate(micro):
        with timed(timer, "load"):
            batch = run.source.load(positions, run.device, _shard_rows(_batch_shard(run, positions), K))
        with distributed.no_sync(run.model, last=i == len(micro) - 1):
            anchored = _anchor_rows(run.source, positions, run.draft.ttt_steps, run.cfg.anchors, run.cfg.seed,
                                    run.step, run.device)
            loss, s, rows = forward(run, batch, weights, timer=timer, rows=anchored)
            with timed(timer, "backward"):
                loss.backward()
        stats += s
        checks.append((batch.sample_index, _nonfinite_rows(batch.hidden), ~torch.isfinite(rows)))
    return stats, checks


def train_step(run: Run, timer: StepTimer | None = None) -> torch.Tensor:
    """One optimizer step; returns the summed statistics [K, STATS] of its micro-batches.
    `timer`, if given, records the seconds of each part of the step (see StepTimer)."""
    lr = lr_at(run.cfg, run.step, run.total_steps)
    for opt in run.optimizers:
        for group in opt.param_groups:
            group["lr"] = lr
    stats, checks = accumulate(run, timer)
    with timed(timer, "clip"):
        norm = torch.nn.utils.clip_grad_norm_([p for p in run.model.parameters() if p.requires_grad], run.cfg.clip)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    # The step's one wait for the GPU: every micro-batch's flags and the norm, read together.
    samples = [index for sample_index, _, _ in checks for index in sample_index]
    with timed(timer, "checks"):
        flags = torch.cat([torch.cat([torch.stack([h, l]) for _, h, l in checks], dim=1),
                           torch.isfinite(norm).expand(2, 1)], dim=1).tolist()  # [2, rows + 1]
    if bad_inputs := [index for index, bad in zip(samples, flags[0]) if bad]:
        raise _bad_inputs(bad_inputs)  # before any weight update, as a bad loss below
    if not flags[1][-1]:
        bad = [index for index, bad in zip(samples, flags[1]) if bad]
        where = f"sample(s) {bad}" if bad else "a sample on another process"
        latest = ckpt.latest_checkpoint(Path(run.cfg.out))
        kept = f"the newest checkpoint, {latest.name}, is untouched" if latest else "no checkpoint was written"
        raise EyasError(f"The loss or its gradient is not finite at step {run.step + 1} ({where}); training stopped "
                        f"before updating the weights and {kept}. Check those samples, or lower --lr.")
    with timed(timer, "optimizer"):
        for opt in run.optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
    run.step += 1
    with timed(timer, "weight_check"):
        _check_weights(run)
    return stats


def _check_weights(run: Run) -> None:
    """Stop at the first update that leaves a weight NaN/inf (a finite loss and gradient can
    still overflow them, e.g. a huge --lr): such a drafter is never saved."""
    params = [p for p in run.model.parameters() if p.requires_grad]
    local = torch.stack([_nonfinite_rows(getattr(p, "_local_tensor", p).detach().reshape(1, -1)).any()
                         for p in params]).sum().float()
    if distributed.all_reduce(local[None], run.d).item():
        latest = ckpt.latest_checkpoint(Path(run.cfg.out))
        kept = f"the newest checkpoint, {latest.name}, is untouched" if latest else "nothing was saved"
        raise EyasError(f"The weights are not finite after step {run.step} (the update overflowed; --lr "
                        f"{run.cfg.lr:g}); training stopped and {kept}. Lower --lr or --clip.")


@torch.no_grad()
def evaluate(run: Run, positions: list[int]) -> dict[str, Any] | None:
    """Metrics over `positions` (split among the processes, or under --context-parallel each
    batch over them), with the current weights."""
    model = run.model if run.cfg.fsdp else run.drafter
    return score(run.source, run.head, model, _draft_ids(run), run.draft.ttt_steps, positions, run.cfg.batch_tokens,
                 run.cfg.seed, run.device, run.d, anchors=run.cfg.anchors, context_parallel=run.cfg.context_parallel,
                 objective=Objective(run.cfg.loss, run.cfg.lk_eta))


@torch.no_grad()
def score(source, head: TargetHead, model: torch.nn.Module, draft_ids: torch.Tensor, K: int, positions: list[int],
          batch_tokens: int, seed: int, device: torch.device, d: distributed.Dist,
          anchors: int | str | None = None, context_parallel: bool = False, objective: Objective = Objective()
          ) -> dict[str, Any] | None:
    """Teacher-forced metrics per TTT step over `positions` of `source`: the trainer's held-out
    pass, and `eyas eval --teacher-forced` (one scorer, so the two agree by construction).
    `model` is the drafter (or its FSDP wrapper, which gathers weights in every forward, so
    each process runs the same number of them). A drafter trained on --anchors `anchors` is
    scored on as many rows a sample, drawn the same way at every evaluation. With
    `context_parallel`, every process scores every batch, its own shard of each (as training
    splits them), and the statistics add up to the whole batch's. The loss is `objective`'s per-pair
    loss (the trainer's --loss; its pair weighting is not the metric's), so train and held-out
    rows report the same quantity."""
    if not positions:
        return None
    stream = BatchStream(positions, source.lengths, source.sample_index, batch_tokens, seed)
    stats = torch.zeros(K, STATS, device=device)
    weights = torch.zeros(K, device=device)
    rank, world = (0, 1) if context_parallel else (d.rank, d.world)
    rounds = math.ceil(len(stream) / world)
    for i in range(rank, rounds * world, world):
        positions_i = stream.batches[min(i, len(stream) - 1)]
        shard = _shard(d, device, max(source.lengths[p] for p in positions_i)) if context_parallel else None
        batch = source.load(positions_i, device, _shard_rows(shard, K))
        _check_inputs(batch)
        rows = _anchor_rows(source, positions_i, K, anchors, seed, HELD_OUT, device)
        input_ids, hidden, loss_mask, last = _sharded(batch, shard, K)
        with _autocast(device):
            labels = make_labels(head, last, loss_mask, draft_ids, input_ids)
            s = model(input_ids, hidden, labels, weights, rows, objective, shard)[1]
        if i < len(stream):
            stats += s
    return summarize(distributed.all_reduce(stats, d))


# ---------------------------------------------------------------- the loop


def save(run: Run) -> None:
    """A resumable checkpoint (collective: every process takes part, the first one writes)."""
    model_state, optim_state = ckpt.full_states(run.model, run.optimizers)
    if run.d.main:
        with torch.device("meta"):
            cpu = new_drafter(run.draft)
        cpu.load_state_dict(model_state, assign=True)
        trainer = {"config": run.cfg.to_dict(), "total_steps": run.total_steps, "data": run.data,
                   "group": run.group, "processes": run.dp, "depth_rule": run.depth_rule}
        ckpt.save_checkpoint(Path(run.cfg.out), run.step, cpu, optim_state, trainer, run.cfg.keep)
    distributed.barrier(run.d)


def _out_of_time(run: Run) -> bool:
    if run.cfg.minutes is None:
        return False
    late = float(budget.clock() - run.started > 60 * run.cfg.minutes)
    return distributed.max_over_processes(late, run.d, run.device) > 0


def _replan(run: Run, plan: budget.Budget, eval_batches: int) -> None:
    """Size the schedule to the time left at the steady-state rate (the slowest process's)."""
    if not plan.steady:  # the same on every process: it counts steps
        return
    step_s = distributed.max_over_processes(plan.step_s, run.d, run.device)
    eval_guess = step_s / run.cfg.grad_accum * math.ceil(eval_batches / run.d.world)  # with backward: an upper bound
    total = plan.plan(run.step, step_s, run.cfg.eval_every, run.cfg.save_every, eval_guess if eval_batches else 0.0)
    # Every process must run the same schedule: each reads its own clock and stalls, so all take
    # the shortest plan; a process that is spent (None) keeps everyone's plan as it stands.
    agreed = distributed.max_over_processes(-total if total is not None else math.inf, run.d, run.device)
    total = None if math.isinf(agreed) else int(-agreed)
    if total is None or abs(total - run.total_steps) <= run.total_steps // 200:  # jitter: keep the lr smooth
        return
    if not plan.logged or abs(total - run.total_steps) > run.total_steps // 10:
        # The epochs say what the minutes buy on this data: 20 passes over 3.6 M tokens fit them at 0.92
        # (step 0) against 0.83 held out (bench/results/peers_quality_frontier_7p5_h100.json).
        epochs = total / run.steps_per_epoch
        _log(run.d, f"{step_s:.3g} s/step in the steady state: {total} steps fit --minutes {run.cfg.minutes}"
                    f" ({epochs:.3g} epochs of the training samples)"
                    + (f" (--steps/--epochs allow {run.cap})" if run.cap else ""))
        plan.logged = True
    run.total_steps = total


def _apply_depth_rule(run: Run, plan: budget.Budget) -> bool:
    """The budget rule, once the steady state shows: keep the starting depth, or lower it for the
    rest of the run (returns whether it did). The steps so far trained the deeper unroll of the same
    weights; the rate is measured afresh at the new depth (its first steps compile) and replans the run."""
    tokens_per_step = sum(run.source.lengths[p] for b in run.train_stream.batches for p in b) / run.steps_per_epoch
    step_s = distributed.max_over_processes(plan.step_s, run.d, run.device)
    depth, why = budget.depth_choice(run.total_steps, tokens_per_step, run.draft.ttt_steps, step_s,
                                     run.cfg.minutes, run.cap is not None and run.total_steps >= run.cap)
    run.depth_rule = {"from": run.draft.ttt_steps, "depth": depth, "at_step": run.step,
                      "planned_steps": run.total_steps, "tokens_per_step": round(tokens_per_step, 1),
                      "step_s": step_s, "why": why}
    _log(run.d, f"budget rule: {why}")
    if depth == run.draft.ttt_steps:
        return False
    run.draft = replace(run.draft, ttt_steps=depth)
    run.drafter.config = run.draft
    plan.restart()
    return True


def fit(run: Run, stop_at: int | None = None) -> dict[str, Any]:
    cfg, d = run.cfg, run.d
    log = MetricsLog(Path(cfg.out), run.resumed_from) if d.main else None
    _log(d, f"{len(run.train_stream)} batches of <= {cfg.batch_tokens} tokens per epoch, {run.total_steps} steps, "
            f"{d.world} process(es) on {run.device}" + (", FSDP" if cfg.fsdp else "")
            + (", each sample split over them (context parallel)" if cfg.context_parallel else ""))
    bar = tqdm(total=run.total_steps, initial=run.step, desc="train", unit="step", disable=not (cfg.progress and d.main))
    window = torch.zeros(run.draft.ttt_steps, STATS, device=run.device)
    window_start, tokens, last = time.monotonic(), 0, {}
    plan = budget.Budget(cfg.minutes, run.started, run.cap) if cfg.minutes else None
    eval_batches = len(BatchStream(run.eval_positions, run.source.lengths, run.source.sample_index,
                                   cfg.batch_tokens, cfg.seed)) if plan and run.eval_positions else 0
    pick_depth = plan is not None and cfg.depth_rule and run.depth_rule is None
    try:
        while run.step < (end := min(run.total_steps, stop_at or run.total_steps)):
            tokens += sum(run.source.lengths[p] for b in run.train_stream.for_step(run.step, run.group, 0, 1) for p in b)
            t0 = budget.clock()
            window += train_step(run)
            bar.update(1)
            if plan is not None:
                plan.step_took(budget.clock() - t0)
                _replan(run, plan, eval_batches)
                end = min(run.total_steps, stop_at or run.total_steps)
                bar.total = run.total_steps
            stopping = _out_of_time(run)
            if run.step % cfg.log_every == 0 or run.step == end or stopping:
                last["train"] = _log_window(log, run, window, bar, tokens, window_start)
                window.zero_()
                window_start, tokens = time.monotonic(), 0
            if pick_depth and plan.steady and not stopping:
                pick_depth = False
                if _apply_depth_rule(run, plan):
                    if not (run.step % cfg.log_every == 0 or run.step == end):  # the old depth's steps unlogged
                        last["train"] = _log_window(log, run, window, bar, tokens, window_start)
                    window = torch.zeros(run.draft.ttt_steps, STATS, device=run.device)
                    window_start, tokens = time.monotonic(), 0
            t0 = budget.clock()
            early = plan is not None and plan.steady and not plan.evaluated and bool(run.eval_positions)
            due = run.step % cfg.eval_every == 0 or early
            if due and run.step < end and not stopping and (m := evaluate(run, run.eval_positions)):
                last["eval"] = m
                _write(log, run, "eval", m, bar, None)
                if plan is not None:  # the first pass compiles: its time is not the pass's cost
                    if plan.evaluated:
                        plan.eval_s = budget.clock() - t0
                    plan.evaluated, t0 = True, budget.clock()
            if run.step % cfg.save_every == 0 and run.step < end and not stopping:
                save(run)
                if plan is not None:
                    plan.save_s = budget.clock() - t0
            if stopping:
                _log(d, f"--minutes {cfg.minutes} reached at step {run.step}; run the same command with --resume to go on.")
                break
    except KeyboardInterrupt:
        latest = ckpt.latest_checkpoint(Path(cfg.out))
        _log(d, f"interrupted at step {run.step}; " + (f"add --resume to continue from {latest.name}." if latest else
                                                       "no checkpoint was written yet."))
        raise
    finally:
        bar.close()
        run.source.close()  # the batches read ahead are not needed any more
    if (m := evaluate(run, run.eval_positions)) is not None:
        last["eval"] = m
        _write(log, run, "eval", m, None, None)
    save(run)
    if log is not None:
        log.close()
    if last:
        _log(d, f"step {run.step}/{run.total_steps}; drafter in {cfg.out}\n" + format_table(last)
             + (walk_note(cfg) if kinds.get(run.draft.drafter).anchored and "eval" in last else ""))
    return {"step": run.step, **last}


def walk_note(cfg: TrainConfig) -> str:
    """A block drafter's held-out rows are its sampled anchors' blocks: accuracy over them overstates
    decoding, which drafts a block right after each rejection (on one H100, 0.67 at the first block
    position against 0.18-0.36 of steps accepting it). Say where the walk of decoding's blocks is."""
    return ("\nthe held-out blocks are drafted from the sampled anchors; decoding drafts each block right after the "
            "last rejection and accepts less. For the blocks it drafts (tau_walk): eyas eval --draft "
            f"{cfg.out} --teacher-forced DATA --held-out")


def _log_window(log: MetricsLog | None, run: Run, window: torch.Tensor, bar, tokens: int, since: float
                ) -> dict[str, Any]:
    """The training metrics of the steps summed in `window` [K, STATS] (every process's), written as one row."""
    m = summarize(distributed.all_reduce(window, run.d))
    _write(log, run, "train", m, bar, tokens / (time.monotonic() - since))
    return m


def _write(log: MetricsLog | None, run: Run, split_name: str, m: dict[str, Any], bar,
           tokens_per_s: float | None) -> None:
    if log is None:
        return
    row = {"step": run.step, "split": split_name, **m}
    if split_name == "train":
        row["lr"] = lr_at(run.cfg, run.step - 1, run.total_steps)
        row["total_steps"] = run.total_steps
        row["tokens_per_s"] = round(tokens_per_s, 1)
    log.write(row)
    if bar is not None and split_name == "train":
        bar.set_postfix(loss=f"{m['loss']:.3f}", acc0=f"{m['acc_per_step'][0]:.3f}", tau=f"{m['tau_sim']:.2f}")
