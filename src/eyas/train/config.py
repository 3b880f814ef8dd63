"""Every training option, in one dataclass: the CLI fills it, the checkpoint records it, and
`--resume` checks that the run it continues was started with the same settings."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from eyas.errors import EyasError
from eyas.validate import COUNT, POSITIVE, SHARE, Number, check_options

# Every number option of `eyas train`, with its accepted range (see eyas.validate).
OPTIONS = {
    "draft_vocab": COUNT, "ttt_steps": COUNT, "ttt_decay": Number(lo=0, hi=1, lo_open=True, required=True),
    "intermediate_size": COUNT, "epochs": POSITIVE, "steps": COUNT, "minutes": POSITIVE,
    "lr": Number(lo=0, lo_open=True, required=True), "warmup": Number(lo=0, required=True),
    "weight_decay": Number(lo=0, required=True), "clip": Number(lo=0, lo_open=True, required=True),
    "batch_tokens": Number(lo=2, integer=True, required=True), "grad_accum": COUNT,
    "max_len": Number(lo=2, integer=True),
    "eval_fraction": SHARE, "seed": Number(integer=True, required=True),
    "save_every": COUNT, "eval_every": COUNT, "log_every": COUNT, "keep": COUNT, "anchors": COUNT,
}

DFLASH_ANCHORS = 512  # SpecForge's and speculators' default: bounds a sample's block tokens at 512 x block size


# Options added after runs were recorded, with the value such a run had (its drafter, restored
# from the checkpoint, keeps the attention it was built with).
ADDED = {"draft_attention": "auto"}


@dataclass(kw_only=True)
class TrainConfig:
    out: str
    store: str | None = None  # offline: a hidden-state store
    online: bool = False  # online: capture with the target on the fly, no store
    model: str | None = None  # the target (offline: defaults to the one the store records)
    data: str | None = None  # online: a prepared folder
    layers: str = "auto"  # online: aux layer ids
    draft_vocab: int | None = None  # default min(32000, target vocab)
    ttt_steps: int = 7
    ttt_decay: float = 0.8
    intermediate_size: int | None = None  # the drafter's MLP width (default: the target's)
    draft_attention: str = "auto"  # gqa, mla, or auto (the target's kind: draft/mla.py)
    fc_norm: bool = False
    norm_output: bool = False
    drafter: str = "eagle3"  # the kind (draft/kinds.py)
    block_size: int | None = None  # dflash: slot 0 plus the drafted tokens (sets ttt_steps = block_size - 1)
    draft_layers: int | None = None  # dflash: decoder layers (default draft/dflash.py default_num_layers)
    mask_token_id: int | None = None  # dflash, peagle: default the target vocabulary's last id
    anchors: int | None = None  # dflash: block anchors drawn per sample and step (default DFLASH_ANCHORS)
    epochs: float | None = None  # default 1 unless steps is given
    steps: int | None = None
    lr: float = 1e-4
    warmup: float = 0.03  # share of the steps (< 1) or a number of steps (>= 1)
    weight_decay: float = 0.0
    clip: float = 0.5
    batch_tokens: int = 8192  # padded tokens per micro-batch and process
    grad_accum: int = 1
    max_len: int | None = None  # crop longer samples (default: batch_tokens)
    eval_fraction: float = 0.05
    seed: int = 0
    device: str | None = "auto"  # eyas.device.resolve_device: CUDA (the local rank's) when visible, else cpu
    fsdp: bool = False
    # How a run is watched and stopped; these may change on --resume.
    resume: bool = False
    minutes: float | None = None  # size the schedule to end within this long (at most steps/epochs)
    save_every: int = 500
    eval_every: int = 500
    log_every: int = 10
    keep: int = 2  # checkpoints kept under out/checkpoints
    progress: bool = True
    allow_incomplete: bool = False  # train on a store whose capture has not finished

    # May differ on --resume: how the run is watched, and where the same data comes from (a
    # moved store, offline <-> online); the data's model and layer ids are checked separately.
    MAY_CHANGE = ("resume", "allow_incomplete", "minutes", "save_every", "eval_every", "log_every", "keep", "progress",
                  "device", "out",
                  "store", "online", "model", "data", "layers")

    def __post_init__(self) -> None:
        if self.online:
            if not (self.model and self.data):
                raise EyasError("--online needs --model and --data (a prepared folder).")
            if self.store:
                raise EyasError("--online captures on the fly: drop --store.")
        elif not self.store:
            raise EyasError("Give --store STORE (offline), or --online --model MODEL --data PREPARED.")
        if self.data and not self.online:
            raise EyasError("--data is for --online; offline training reads --store.")
        check_options(self, OPTIONS)
        if self.steps is not None and self.epochs is not None:
            raise EyasError("give --steps or --epochs, not both.")
        self._check_kind()

    def _check_kind(self) -> None:
        from eyas.draft.kinds import DRAFTERS

        if self.drafter not in DRAFTERS:
            raise EyasError(f"--drafter must be one of {', '.join(DRAFTERS)}, not {self.drafter!r}.")
        if self.drafter != "dflash":
            if (self.block_size, self.draft_layers, self.anchors) != (None,) * 3:
                raise EyasError("--block-size, --draft-layers and --anchors are for --drafter dflash.")
            if self.mask_token_id is not None and self.drafter == "eagle3":
                raise EyasError("--mask-token-id is for --drafter dflash or peagle.")
            return
        if self.fc_norm or self.norm_output:
            raise EyasError("--fc-norm and --norm-output are EAGLE-3 options; drop them with --drafter dflash.")
        if self.block_size is not None:
            if self.block_size < 2:
                raise EyasError("--block-size must be at least 2 (the last token and one to draft).")
            self.ttt_steps = self.block_size - 1
        if self.draft_layers is not None and self.draft_layers < 1:
            raise EyasError("--draft-layers must be at least 1.")
        if self.anchors is None:
            self.anchors = DFLASH_ANCHORS

    def kind_options(self, identity) -> dict[str, Any]:
        """The DraftConfig fields of the kind, given the target's identity."""
        mask = {"mask_token_id": identity.vocab_size - 1 if self.mask_token_id is None else self.mask_token_id}
        if self.drafter == "peagle":
            return {"drafter": "peagle", **mask}
        if self.drafter != "dflash":
            return {}
        from eyas.draft.dflash import default_num_layers

        return {"drafter": "dflash", "num_hidden_layers": self.draft_layers or default_num_layers(identity.num_layers),
                **mask}

    @property
    def crop(self) -> int:
        return min(self.max_len or self.batch_tokens, self.batch_tokens)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def check_resumable(self, recorded: dict[str, Any]) -> None:
        """Raise unless this command trains the same run as the one recorded in a checkpoint."""
        names = {f.name for f in fields(self)}
        differ = [
            f"{k.replace('_', '-')} {getattr(self, k)!r} (the run has {recorded.get(k)!r})"
            for k in sorted(names - set(self.MAY_CHANGE)) if recorded.get(k, ADDED.get(k)) != getattr(self, k)
        ]
        if differ:
            raise EyasError(
                "--resume continues a run with its own settings, but this command changes: " + "; ".join(differ)
                + ". Repeat the original options, or train into another --out."
            )
