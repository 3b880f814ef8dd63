"""Every training option, in one dataclass: the CLI fills it, the checkpoint records it, and
`--resume` checks that the run it continues was started with the same settings."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from eyas.errors import EyasError


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
    fc_norm: bool = False
    norm_output: bool = False
    drafter: str = "eagle3"  # the kind (draft/kinds.py)
    block_size: int | None = None  # dflash: slot 0 plus the drafted tokens (sets ttt_steps = block_size - 1)
    draft_layers: int | None = None  # dflash: decoder layers (default draft/dflash.py default_num_layers)
    mask_token_id: int | None = None  # dflash: default the target vocabulary's last id
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
    device: str | None = None  # default cuda (the local rank's) when available, else cpu
    fsdp: bool = False
    # How a run is watched and stopped; these may change on --resume.
    resume: bool = False
    minutes: float | None = None  # stop (with a checkpoint) after this long; the schedule is unchanged
    save_every: int = 500
    eval_every: int = 500
    log_every: int = 10
    keep: int = 2  # checkpoints kept under out/checkpoints
    progress: bool = True

    # May differ on --resume: how the run is watched, and where the same data comes from (a
    # moved store, offline <-> online); the data's model and layer ids are checked separately.
    MAY_CHANGE = ("resume", "minutes", "save_every", "eval_every", "log_every", "keep", "progress", "device", "out",
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
        checks = [
            (self.ttt_steps >= 1, "--ttt-steps must be at least 1"),
            (0 < self.ttt_decay <= 1, "--ttt-decay must lie in (0, 1]"),
            (self.intermediate_size is None or self.intermediate_size >= 1, "--intermediate-size must be at least 1"),
            (self.lr > 0, "--lr must be positive"),
            (self.batch_tokens >= 2, "--batch-tokens must be at least 2"),
            (self.grad_accum >= 1, "--grad-accum must be at least 1"),
            (0 <= self.eval_fraction < 1, "--eval-fraction must lie in [0, 1)"),
            (self.steps is None or self.steps >= 1, "--steps must be at least 1"),
            (self.epochs is None or self.epochs > 0, "--epochs must be positive"),
            (self.steps is None or self.epochs is None, "give --steps or --epochs, not both"),
            (self.max_len is None or self.max_len >= 2, "--max-len must be at least 2"),
            (self.save_every >= 1 and self.eval_every >= 1 and self.log_every >= 1, "--*-every must be at least 1"),
            (self.minutes is None or self.minutes > 0, "--minutes must be positive"),
            (self.clip > 0, "--clip must be positive"),
            (self.warmup >= 0, "--warmup must not be negative"),
            (self.keep >= 1, "--keep must be at least 1"),
        ]
        for ok, message in checks:
            if not ok:
                raise EyasError(message + ".")
        self._check_kind()

    def _check_kind(self) -> None:
        from eyas.draft.kinds import DRAFTERS

        if self.drafter not in DRAFTERS:
            raise EyasError(f"--drafter must be one of {', '.join(DRAFTERS)}, not {self.drafter!r}.")
        if self.drafter != "dflash":
            if (self.block_size, self.draft_layers, self.mask_token_id) != (None, None, None):
                raise EyasError("--block-size, --draft-layers and --mask-token-id are for --drafter dflash.")
            return
        if self.fc_norm or self.norm_output:
            raise EyasError("--fc-norm and --norm-output are EAGLE-3 options; drop them with --drafter dflash.")
        if self.block_size is not None:
            if self.block_size < 2:
                raise EyasError("--block-size must be at least 2 (the last token and one to draft).")
            self.ttt_steps = self.block_size - 1
        if self.draft_layers is not None and self.draft_layers < 1:
            raise EyasError("--draft-layers must be at least 1.")

    def kind_options(self, identity) -> dict[str, Any]:
        """The DraftConfig fields of the kind, given the target's identity."""
        if self.drafter != "dflash":
            return {}
        from eyas.draft.dflash import default_num_layers

        return {"drafter": "dflash", "num_hidden_layers": self.draft_layers or default_num_layers(identity.num_layers),
                "mask_token_id": identity.vocab_size - 1 if self.mask_token_id is None else self.mask_token_id}

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
            for k in sorted(names - set(self.MAY_CHANGE)) if recorded.get(k) != getattr(self, k)
        ]
        if differ:
            raise EyasError(
                "--resume continues a run with its own settings, but this command changes: " + "; ".join(differ)
                + ". Repeat the original options, or train into another --out."
            )
