"""Every training option, in one typed config (eyas.options): the CLI is generated from it, the
recipe's `train:` keys are checked against it, the checkpoint records it, and `--resume`
checks that the run it continues was started with the same settings."""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, fields
from typing import Any

from eyas.errors import EyasError
from eyas.device_flag import TORCHRUN_NOTE
from eyas.draft import kinds
from eyas.draft.config import DraftConfig
from eyas.draft.objective import LOSSES
from eyas.draft.mla_config import ATTENTION_CHOICES, AUTO_ATTENTION
from eyas.options import (AUTO_LAYERS, batch_tokens_option, check_rules, crop_length, device_option,
                          layers_option, option, seed_option)
from eyas.train import budget
from eyas.validate import COUNT, POSITIVE, SHARE, Number

ANCHORS = "1/16"  # one anchor row per 16 tokens of a sample: speculators' density (512 a packed row of 8,192)

# Options added after runs were recorded, with the value such a run had (its drafter, restored
# from the checkpoint, keeps the attention it was built with).
ADDED = {"draft_attention": AUTO_ATTENTION, "optimizer": "adamw", "position_weights": "decay", "dpace_alpha": 0.5,
         "loss": "soft-ce", "lk_eta": 3.0, "init": None, "context_parallel": False, "causal_layers": None,
         "lm_head": "own"}


DATA, DRAFTER, SCHEDULE, RUN = "data", "drafter", "schedule", "run"  # the --help sections
OPTIMIZERS = ("adamw", "muon")  # train/optim.py
LM_HEADS = ("own", "target", "frozen")  # the drafter's output head: train/loop.py `_target_head_rows`
POSITION_WEIGHTS = ("decay", "dpace", "on-policy")  # draft/loss.py, draft/reach.py
NO_LAYERS, ALL_LAYERS = "none", "all"  # --causal-layers' words


def causal_spec(spec: Any) -> str:
    """--causal-layers as given (a recipe's number is its text) -> `none`, `all` or its distinct
    indices ascending ("0,2"), so that a resumed run compares what it means, not how it was typed."""
    text = str(spec).strip().lower()
    if text in (NO_LAYERS, ALL_LAYERS):
        return text
    parts = [p.strip() for p in text.split(",")]
    if not all(p.isdigit() for p in parts):
        raise EyasError(f"--causal-layers {spec!r}: give {NO_LAYERS}, {ALL_LAYERS} or drafter layer indices such "
                        f"as 0,2.")
    return ",".join(map(str, sorted({int(p) for p in parts})))


def anchors_spec(spec: Any) -> int | str:
    """--anchors as given (a recipe's number is its count) -> a count of rows a sample (int) or
    one row per S tokens of it ("1/S"), so that a resumed run compares what it means."""
    text = str(spec).strip().replace(" ", "")
    count, per = re.fullmatch(r"[1-9][0-9]*", text), re.fullmatch(r"1/([1-9][0-9]*)", text)
    if isinstance(spec, bool) or not (count or per):
        raise EyasError(f"--anchors {spec!r}: give rows a sample (e.g. 45) or one row per S tokens of it as 1/S "
                        f"(e.g. {ANCHORS}).")
    return int(text) if count else text


def anchors_per_sample(spec: int | str, length: int) -> int:
    """The rows of a `length`-token sample that anchor a block under --anchors `spec`: its count,
    or one per S tokens (at least one); never more than the sample has."""
    n = spec if isinstance(spec, int) else math.ceil(length / int(spec.split("/")[1]))
    return max(1, min(n, length))


def causal_text(layers: tuple[int, ...], count: int) -> str:
    """A drafter's `causal_layers` of its `count` layers, as --causal-layers writes them."""
    return NO_LAYERS if not layers else ALL_LAYERS if layers == tuple(range(count)) else ",".join(map(str, layers))


@dataclass(kw_only=True)
class TrainConfig:
    store: str | None = option("hidden-state store (offline training)", None, group=DATA)
    online: bool = option("capture on the fly with --model over --data (no store)", False, group=DATA)
    model: str | None = option("the target (offline: default is the model the store records)", None, group=DATA)
    data: str | None = option("prepared folder (with --online)", None, group=DATA)
    layers: str = layers_option("with --online", group=DATA)
    out: str = option("output folder: the drafter, metrics.jsonl, checkpoints/", group=DATA)
    eval_fraction: float = option("share of samples held out", 0.05, rule=SHARE, group=DATA)
    max_len: int | None = option("crop samples to this many tokens (default: --batch-tokens)", None,
                                 rule=Number(lo=2, integer=True), group=DATA)
    allow_incomplete: bool = option(
        "train on a store whose capture has not finished (refused otherwise, naming what is missing)", False,
        group=DATA)

    drafter: str = option("; ".join(f"{k.name}: {k.summary}" for k in kinds.KINDS.values()), kinds.DEFAULT,
                          choices=kinds.KINDS.keys(), group=DRAFTER)  # live: a kind registered later counts
    block_size: int | None = option(
        f"dflash: the last token plus the K drafted ones (default --ttt-steps + 1 = {DraftConfig.ttt_steps + 1}); at "
        "most a sample's length (--max-len)", None, rule=Number(lo=2, integer=True),
        group=DRAFTER)  # sets ttt_steps = block_size - 1
    draft_layers: int | None = option(
        "decoder layers, at most the target's: eagle3: the first reads [token embedding, hidden state] as EAGLE-3's "
        "one layer does, the others are plain Llama layers after it, as vLLM builds them (default 1); dflash: "
        "default a tenth of the target's, >= 1", None, rule=Number(lo=1, hi=kinds.MAX_LAYERS, integer=True),
        group=DRAFTER)
    causal_layers: str | None = option(
        f"dflash: the drafter layers whose block slots attend causally within the block (slot s sees slots 0..s, "
        f"the others the whole block): {NO_LAYERS}, {ALL_LAYERS} or indices such as 0,2 (default {NO_LAYERS}; "
        f"with --init, the drafter's own). speculators' DFlash default is {ALL_LAYERS} (its sliding-window "
        f"layers). vLLM cannot serve such a drafter (eyas export refuses it); eyas eval runs it", None,
        metavar="SPEC", group=DRAFTER)
    mask_token_id: int | None = option(
        "dflash, peagle: the token whose (frozen) embedding marks the slots to fill (default: the last id)", None,
        group=DRAFTER)
    anchors: int | str | None = option(
        "dflash: the rows of each sample that anchor a block, drawn afresh each step among those with a trained "
        f"label: N a sample, or 1/S for one per S tokens of it (default {ANCHORS}, speculators' density); bounds the "
        "block tokens at anchors x block size a sample. At equal minutes sparser anchors and more steps trained "
        "better (docs/train.md)", None, parse=anchors_spec, metavar="N|1/S", group=DRAFTER)
    draft_vocab: int | None = option("draft vocabulary size (default min(32000, target vocab))", None, rule=COUNT,
                                     group=DRAFTER)
    lm_head: str | None = option(
        "the drafter's output head over the draft vocabulary: own = a new one, trained; target = the target's "
        "lm_head rows as its start, trained; frozen = the target's rows, never trained (speculators' EAGLE-3 and "
        "DFlash, SpecForge's DFlash). Default: frozen for dflash (it trained better, docs/train.md), own for the "
        "others, and own wherever the target's rows cannot be the drafter's head (--fsdp, a target that scales, "
        "caps or biases its logits). A drafter from --init or --resume keeps its head; frozen still freezes it",
        None, choices=LM_HEADS, group=DRAFTER)
    ttt_steps: int | None = option(
        f"unrolled training-time-test steps (default {DraftConfig.ttt_steps}; an eagle3 run on a short --minutes "
        f"budget: {budget.SHORT_RUN_DEPTH}, see --minutes)", None, rule=COUNT, group=DRAFTER)
    ttt_decay: float = option("loss weight decay^k of step k (dflash: of block slot k+1); SpecForge's DFlash "
                              "weight exp(-(k-1)/gamma) is --ttt-decay exp(-1/gamma) (gamma 7: 0.867)",
                              DraftConfig.ttt_decay, rule=Number(lo=0, hi=1, lo_open=True, required=True), group=DRAFTER)
    position_weights: str = option(
        "how TTT steps (dflash: block slots) weigh in the loss: decay = --ttt-decay^k on each step's mean; dpace = "
        "speculators' D-PACE: each pair weighs what it is worth to the acceptance length, from the drafter's own "
        "current chance of reaching and passing it (--dpace-alpha), over the mean of all pairs; on-policy = "
        "on-policy distillation: only the steps that greedy decoding with the drafter as it now is reaches (its "
        "accepted drafts and the first rejected one, chains walked along each answer as the target verifies "
        "them), each answer token once, at the step that drafts it; for the target's own greedy answers "
        "(eyas regenerate), after a first run (--init); not for blocks drafted from anchors",
        "decay", choices=POSITION_WEIGHTS, group=DRAFTER)
    dpace_alpha: float = option("dpace: each step passes with (1 - alpha) p + alpha, p the drafter's probability "
                                "of the target's token", 0.5, rule=Number(lo=0, hi=1, lo_open=True, required=True),
                                group=DRAFTER)
    loss: str = option(
        "what each scored pair's loss is, with p the target's distribution over the draft vocabulary, q the "
        "drafter's and alpha = sum min(p, q) the chance speculative sampling accepts the drafter's token: soft-ce = "
        "-sum p log q; hard-ce = -log q(t), t the target's greedy token (cross-entropy against its argmax, "
        "speculators' DFlash default; a t outside the draft vocabulary adds no loss, as under every loss); "
        "lk-hybrid = lambda KL(p||q) + (1 - lambda)(1 - alpha), lambda = exp(-eta alpha) "
        "(--lk-eta); lk-alpha = -log alpha (the LK losses, arXiv 2602.23881). Metrics' loss is this loss",
        "soft-ce", choices=LOSSES, group=DRAFTER)
    lk_eta: float = option("lk-hybrid: how soon the loss moves from KL to the acceptance rate as the two overlap",
                           3.0, rule=Number(lo=0, required=True), group=DRAFTER)
    init: str | None = option(
        "start from this trained drafter's weights (its folder: a run's --out or a checkpoint), of the same kind, "
        "target and layers; its shape and draft vocabulary are kept, the optimizer starts afresh", None,
        group=DRAFTER)
    intermediate_size: int | None = option(
        "the drafter's MLP width (default: the target's); vLLM and SGLang read it from the exported config", None,
        rule=COUNT, group=DRAFTER)
    draft_attention: str = option(
        "the drafter layer's attention: gqa (Llama-style) or mla (the target's multi-head latent attention, its "
        "ranks and head dims); auto = mla for DeepSeek-V2/V3-style targets (Kimi-K2/K2.5 included), else gqa "
        "(peagle: always gqa, the head vLLM serves it with; dflash has its own layers)",
        AUTO_ATTENTION, choices=ATTENTION_CHOICES, group=DRAFTER)  # draft/mla_config.py
    fc_norm: bool = option("an RMSNorm on each aux state before fc (EAGLE 3.1; served by vLLM, not SGLang)", False,
                           negatable=True, group=DRAFTER)
    norm_output: bool = option("feed the normed output back between steps (EAGLE 3.1; served by vLLM, not SGLang)",
                               False, negatable=True, group=DRAFTER)

    epochs: float | None = option("passes over the training samples (default 1)", None, rule=POSITIVE,
                                  group=SCHEDULE)
    steps: int | None = option("optimizer steps instead of --epochs", None, rule=COUNT, group=SCHEDULE)
    minutes: float | None = option(
        "fit the whole schedule into this many minutes: its length follows the steady-state rate (after warm-up), "
        "at most --steps/--epochs when given. An eagle3 run without --ttt-steps that fits fewer than "
        f"{budget.SHORT_RUN_TOKENS // 10**6} M tokens trains {budget.SHORT_RUN_DEPTH} TTT steps: more, cheaper "
        "steps (the budget rule; it prints its choice and why)", None, rule=POSITIVE, group=SCHEDULE)
    lr: float = option("peak learning rate, cosine to 0", 1e-4, rule=Number(lo=0, lo_open=True, required=True),
                       group=SCHEDULE)
    warmup: float = option("warm-up: share of steps if < 1, else steps", 0.03, rule=Number(lo=0, required=True),
                           group=SCHEDULE)
    optimizer: str = option(
        "adamw, or muon: Muon on the drafter's weight matrices and AdamW on the rest; Muon wants a larger "
        "--lr (about 10x AdamW's in docs/train.md's comparison)", "adamw",
        choices=OPTIMIZERS, group=SCHEDULE)
    weight_decay: float = option("weight decay (AdamW's, and Muon's)", 0.0, rule=Number(lo=0, required=True),
                                 group=SCHEDULE)
    clip: float = option("gradient-norm clipping", 0.5, rule=Number(lo=0, lo_open=True, required=True),
                         group=SCHEDULE)
    batch_tokens: int = batch_tokens_option("padded tokens per micro-batch per process", group=SCHEDULE)
    grad_accum: int = option("micro-batches per process per step", 1, rule=COUNT, group=SCHEDULE)
    seed: int = seed_option("seed for initialisation, split and order", group=SCHEDULE)

    # How a run is watched and stopped; these may change on --resume.
    resume: bool = option("continue the run in --out from its last checkpoint", False, group=RUN)
    device: str | None = device_option(TORCHRUN_NOTE, group=RUN)  # None: auto
    fsdp: bool = option("under torchrun: shard the drafter across GPUs (FSDP2)", False, group=RUN)
    context_parallel: bool = option(
        "under torchrun: split each sample's positions over the processes (context parallelism), for samples "
        "longer than one GPU trains; every process trains the same batches, each its own part of them, and a step "
        "is --grad-accum micro-batches (EAGLE-3, P-EAGLE)", False, group=RUN)
    checkpoint_steps: bool = option(
        "recompute each TTT step's activations in backward instead of keeping them (activation checkpointing): "
        "less memory per token, for long samples, for about one more drafter forward's time; the same "
        "gradients", False, group=RUN)
    save_every: int = option("checkpoint every N steps, and at the end", 500, rule=COUNT, group=RUN)
    eval_every: int = option("held-out metrics every N steps, and at the end", 500, rule=COUNT, group=RUN)
    log_every: int = option("metrics row every N steps", 10, rule=COUNT, group=RUN)
    keep: int = option("checkpoints kept in OUT/checkpoints", 2, rule=COUNT, group=RUN)
    progress: bool = option("no progress bar", True, flag="--no-progress", show_default=False, group=RUN)

    # May differ on --resume: how the run is watched, and where the same data comes from (a
    # moved store, offline <-> online); the data's model and layer ids are checked separately.
    MAY_CHANGE = ("resume", "allow_incomplete", "minutes", "save_every", "eval_every", "log_every", "keep", "progress",
                  "device", "out", "checkpoint_steps",
                  "store", "online", "model", "data", "layers")

    def __post_init__(self) -> None:
        if self.online:
            if not (self.model and self.data):
                raise EyasError("--online needs --model and --data (a prepared folder).")
            if self.store:
                raise EyasError("--online captures on the fly: drop --store.")
        elif not self.store:
            raise EyasError("Give --store STORE (offline), or --online --model MODEL --data PREPARED.")
        elif self.layers != AUTO_LAYERS:
            raise EyasError(f"--layers {self.layers} is for --online: offline training reads the layer ids the store "
                            f"was captured with. Drop --layers, or capture a store with them (eyas capture --layers).")
        if self.data and not self.online:
            raise EyasError("--data is for --online; offline training reads --store.")
        check_rules(self)
        if self.steps is not None and self.epochs is not None:
            raise EyasError("give --steps or --epochs, not both.")
        if self.position_weights in ("dpace", "on-policy") and self.ttt_decay != DraftConfig.ttt_decay:
            raise EyasError(f"--ttt-decay weighs steps under --position-weights decay; --position-weights "
                            f"{self.position_weights} weighs them its own way. Drop --ttt-decay, or use "
                            f"--position-weights decay.")
        if self.fsdp and self.context_parallel:
            raise EyasError("--context-parallel replicates the drafter on every process; drop --fsdp.")
        if self.fsdp and self.lm_head == "frozen":
            raise EyasError("--lm-head frozen keeps the target's head whole on every process, and --fsdp shards the "
                            "drafter for a head too big for one GPU: drop one of them.")
        if self.fsdp and self.optimizer == "muon":
            # Muon's bf16 Newton-Schulz on sharded matrices: a step's update then differs from one
            # process's by up to ~20% (measured on 4 gloo processes); under DDP by ~0.5%, as between any two runs.
            raise EyasError("--optimizer muon does not take --fsdp: on sharded weights its updates differ from "
                            "one process's. Use torchrun without --fsdp (data parallel), or --optimizer adamw.")
        self._check_kind()

    def _check_kind(self) -> None:
        """The options the kind takes (its record in draft/kinds.py), and a block's bounds."""
        kind = kinds.get(self.drafter)
        for flag, value, feature in (("--block-size", self.block_size, "anchored"), ("--anchors", self.anchors,
                                     "anchored"), ("--draft-layers", self.draft_layers, "deep"),
                                     ("--mask-token-id", self.mask_token_id, "mask_token"),
                                     ("--causal-layers", self.causal_layers, "drafts_blocks")):
            if value is not None and not getattr(kind, feature):
                raise EyasError(f"{flag} is for --drafter {kinds.names(lambda k: getattr(k, feature))}, not "
                                f"{kind.name}.")
        if self.causal_layers is not None:
            self.causal_layers = causal_spec(self.causal_layers)
            if self.draft_layers is not None:
                self.causal_layer_ids(self.draft_layers)
        if kind.anchored and self.context_parallel:
            raise EyasError(f"--context-parallel splits the positions of {kinds.names(lambda k: not k.anchored)} "
                            f"drafters' samples; {kind.a_title()} drafter's blocks attend across a split.")
        if kind.anchored and self.checkpoint_steps:
            raise EyasError(f"--checkpoint-steps recomputes the TTT steps of {kinds.names(lambda k: not k.anchored)} "
                            f"drafters; {kind.a_title()} drafter drafts its block in one pass.")
        if kind.anchored and self.position_weights == "on-policy":
            raise EyasError(f"--position-weights on-policy follows chains drafted from every row; {kind.a_title()} "
                            f"drafter trains on blocks from sampled anchors. Use it with --drafter "
                            f"{kinds.names(lambda k: not k.anchored)}.")
        if not kind.eagle_options and (self.fc_norm or self.norm_output):
            raise EyasError(f"--fc-norm and --norm-output are EAGLE-3 options; drop them with --drafter {kind.name}.")
        if self.draft_attention not in (AUTO_ATTENTION, *kind.attentions):
            raise EyasError(f"--draft-attention {self.draft_attention} is for --drafter "
                            f"{kinds.names(lambda k: self.draft_attention in k.attentions)}; {kind.a_title()} "
                            f"drafter's layer has {' or '.join(kind.attentions)} attention.")
        if self.block_size is not None:  # an anchored kind's (refused above for the others)
            if self.ttt_steps not in (None, self.block_size - 1):
                raise EyasError(f"--ttt-steps {self.ttt_steps} and --block-size {self.block_size} disagree: a block "
                                f"drafts --block-size - 1 tokens. Give one of them (--ttt-steps "
                                f"{self.block_size - 1} with --block-size {self.block_size}).")
            self.ttt_steps = self.block_size - 1
        if kind.drafting != kinds.STEPS:  # a block's or one pass's slots: its depth is its shape, no budget rule
            self.ttt_steps = self.start_depth
        if not kind.anchored:
            return
        # A sample holds at most `crop` tokens: a block's slot s predicts s tokens past its anchor
        # row, and the anchors are rows of one sample, so neither can be longer and still train.
        if self.ttt_steps + 1 > self.crop:
            given = f"--block-size {self.block_size}" if self.block_size is not None else \
                f"--ttt-steps {self.ttt_steps} (a block of {self.ttt_steps + 1})"
            raise EyasError(f"{given} is longer than any sample: samples are cropped to {self.crop} tokens "
                            f"(--max-len, --batch-tokens); use a block of at most {self.crop}.")
        self.anchors = ANCHORS if self.anchors is None else anchors_spec(self.anchors)
        if isinstance(self.anchors, int) and self.anchors > self.crop:
            raise EyasError(f"--anchors {self.anchors} is more than a sample's rows: samples are cropped to "
                            f"{self.crop} tokens (--max-len, --batch-tokens); use at most {self.crop}.")

    def check_target(self, num_layers: int) -> None:
        """Once the target is known, before any drafter is built: a deep kind's layers are a few
        beside its target, never more than it has, and --causal-layers names only layers the new
        drafter has (its default depth follows the target's)."""
        kind = kinds.get(self.drafter)
        if self.draft_layers is not None and self.draft_layers > num_layers:
            raise EyasError(f"--draft-layers {self.draft_layers} is more than the target's {num_layers} layers; "
                            f"{kind.a_title()} drafter takes a few (default {kind.default_layers(num_layers)}).")
        if not self.init:  # a run from --init has the drafter's layers, checked against it then
            self.causal_layer_ids(self.draft_layers or kind.default_layers(num_layers))

    def causal_layer_ids(self, count: int, whose: str = "the drafter (--draft-layers)") -> tuple[int, ...] | None:
        """The layers --causal-layers names, of `whose` `count` layers (None: not asked)."""
        if self.causal_layers is None:
            return None
        if self.causal_layers in (NO_LAYERS, ALL_LAYERS):
            return tuple(range(count)) if self.causal_layers == ALL_LAYERS else ()
        ids = tuple(int(k) for k in self.causal_layers.split(","))
        if ids[-1] >= count:
            raise EyasError(f"--causal-layers {self.causal_layers} names layer {ids[-1]}: {whose} has layers "
                            f"0..{count - 1}.")
        return ids

    def kind_options(self, identity) -> dict[str, Any]:
        """The DraftConfig fields of the kind, given the target's identity."""
        kind = kinds.get(self.drafter)
        options: dict[str, Any] = {"drafter": kind.name}
        if kind.mask_token:
            options["mask_token_id"] = identity.vocab_size - 1 if self.mask_token_id is None else self.mask_token_id
        if kind.deep:
            options["num_hidden_layers"] = self.draft_layers or kind.default_layers(identity.num_layers)
        if kind.drafts_blocks:
            options["causal_layers"] = self.causal_layer_ids(options.get("num_hidden_layers", 1)) or ()
        return options

    @property
    def start_depth(self) -> int:
        """The TTT steps a new drafter starts with; under --minutes the budget rule may lower an EAGLE-3's
        (loop.py), when --ttt-steps leaves the depth to it."""
        return self.ttt_steps or DraftConfig.ttt_steps

    @property
    def depth_rule(self) -> bool:
        """Whether the budget rule picks the depth: an EAGLE-3 (step-by-step drafter) whose --ttt-steps is not
        given, under --minutes, with every process training different batches (--context-parallel reads
        each batch's positions by the depth)."""
        return self.ttt_steps is None and self.minutes is not None and not self.context_parallel

    @property
    def crop(self) -> int:
        return crop_length(self.max_len, self.batch_tokens)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def check_resumable(self, recorded: dict[str, Any], also: tuple[str, ...] = ()) -> None:
        """Raise unless this command trains the same run as the one recorded in a checkpoint;
        `also` names settings the caller has checked another way (--grad-accum, where the run
        records its step's micro-batches). --ttt-decay weighs nothing under dpace or on-policy."""
        unused = ("ttt_decay",) if self.position_weights != "decay" else ()
        if self.ttt_steps is None:  # left to the budget rule: the run's depth stands (its checkpoint's drafter)
            unused += ("ttt_steps",)
        names = {f.name for f in fields(self)} - set(self.MAY_CHANGE) - set(also) - set(unused)
        had = {k: recorded.get(k, ADDED.get(k)) for k in names}
        differ = [
            f"{k.replace('_', '-')} {getattr(self, k)!r} "
            + ("(the run left it unset)" if had[k] is None else f"(the run has {had[k]!r})")
            for k in sorted(names) if had[k] != getattr(self, k)
        ]
        if differ:
            raise EyasError(
                "--resume continues a run with its own settings, but this command changes: " + "; ".join(differ)
                + ". Repeat the original options, or train into another --out."
            )
