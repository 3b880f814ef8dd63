"""Training checkpoints.

out/
  config.json, model.safetensors     the newest drafter (draft/checkpoint.py): what eval and export read
  metrics.jsonl                      one row per logged step
  checkpoints/step-0000500/          a complete, resumable checkpoint:
      config.json, model.safetensors the drafter at that step (draft/checkpoint.py)
      optimizer.pt                   AdamW's (and Muon's) state (tensors only; loaded with weights_only)
      trainer.json                   step, the run's settings, the stream position, the data it trains on
                                     and the micro-batches a step takes (checked on --resume)
  checkpoints/latest                 the name of the newest complete checkpoint folder

A checkpoint folder is written under a temporary name and renamed when complete, and
`latest` moves only after that, so a run killed at any moment resumes from a whole one.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict, set_optimizer_state_dict

from eyas.draft.checkpoint import DRAFTER_FILES, load_config, save_drafter
from eyas.draft.config import DraftConfig
from eyas.errors import EyasError
from eyas.lock import LOCK_FILE
from eyas.paths import atomic_write_bytes, fsync_dir, plain_name, remove_leftovers

CHECKPOINTS = "checkpoints"
LATEST = "latest"
OPTIMIZER = "optimizer.pt"
TRAINER = "trainer.json"


def full_states(model: nn.Module, optimizers: list[torch.optim.Optimizer]) -> tuple[dict, dict]:
    """Unsharded model and optimizer state dicts on the CPU (identical on every process;
    collective under DDP/FSDP, so every process must call it)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options), get_optimizer_state_dict(model, optimizers, options=options)


def load_optimizer(model: nn.Module, optimizers: list[torch.optim.Optimizer], optim_state: dict) -> None:
    """Restore an unsharded optimizer state (as `full_states` saved it) into this process."""
    set_optimizer_state_dict(model, optimizers, _current_names(optim_state),
                             options=StateDictOptions(full_state_dict=True))


OLD_PREFIX = "drafter."  # parameter names in checkpoints from before the drafter computed its own loss


def _current_names(optim_state: dict) -> dict:
    """The state keyed by today's parameter names: runs started before the drafter computed its
    own loss keyed it by a wrapper's (`drafter.fc.weight`), which a resumed run still reads."""
    def name(key):
        return key.removeprefix(OLD_PREFIX) if isinstance(key, str) else key

    return {**optim_state,
            "state": {name(k): v for k, v in optim_state.get("state", {}).items()},
            "param_groups": [{**g, "params": [name(p) for p in g["params"]]} for g in optim_state.get("param_groups", [])]}


def save_checkpoint(out: Path, step: int, drafter_cpu: nn.Module, optim_state: dict, trainer: dict[str, Any],
                    keep: int) -> Path:
    """Write checkpoints/step-N completely, point `latest` at it, refresh the top-level drafter."""
    root = out / CHECKPOINTS
    name = f"step-{step:07d}"
    final, tmp = root / name, root / f".{name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    save_drafter(drafter_cpu, tmp)
    buffer = _to_bytes(optim_state)
    atomic_write_bytes(tmp / OPTIMIZER, buffer)
    atomic_write_bytes(tmp / TRAINER, (json.dumps({**trainer, "step": step}, indent=2) + "\n").encode())
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    fsync_dir(root)
    atomic_write_bytes(root / LATEST, f"{name}\n".encode())
    for file in DRAFTER_FILES:
        atomic_write_bytes(out / file, (final / file).read_bytes())
    for old in _pruned(root, name, keep):
        shutil.rmtree(old, ignore_errors=True)
    return final


def _pruned(root: Path, current: str, keep: int) -> list[Path]:
    """The step folders to delete once `current` is saved and `latest`: all but the `keep` newest up
    to it (never it), and every one numbered above it, left by a timeline that `latest` moved back
    from (a kill before `latest` moved, or `latest` rewritten by hand to an earlier step)."""
    steps = sorted(p for p in root.glob("step-*") if p.is_dir())
    older = [p for p in steps if p.name < current]
    return [p for p in steps if p.name > current] + older[: max(len(older) - (keep - 1), 0)]


def _to_bytes(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


METRICS = "metrics.jsonl"
OUR_FILES = {*DRAFTER_FILES, METRICS, "tensorboard", CHECKPOINTS, LOCK_FILE}


def check_out_folder(out: Path) -> None:
    """Refuse to write into a folder that holds something other than a training run. What a
    run of ours killed mid-write left (atomic writers' temp files, a checkpoint folder never
    renamed into place) is removed first: it is ours, and no complete checkpoint refers to it."""
    if out.exists() and not out.is_dir():
        raise EyasError(f"--out {out} is a file, not a folder.")
    if not out.is_dir():
        return
    remove_leftovers(out, OUR_FILES)
    root = out / CHECKPOINTS
    if root.is_dir() and not root.is_symlink():
        remove_leftovers(root, [LATEST])
        for unfinished in root.glob(".step-*.tmp"):
            if unfinished.is_dir() and not unfinished.is_symlink():
                shutil.rmtree(unfinished)
    foreign = sorted(p.name for p in out.iterdir() if p.name not in OUR_FILES)
    if foreign:
        raise EyasError(f"--out {out} already holds other files ({', '.join(foreign[:3])}); choose an empty or new folder.")


def latest_checkpoint(out: Path) -> Path | None:
    pointer = out / CHECKPOINTS / LATEST
    if not pointer.is_file():
        return None
    folder = out / CHECKPOINTS / plain_name(pointer.read_text(errors="replace").strip(), str(pointer))
    if not (folder / TRAINER).is_file():
        raise EyasError(f"{pointer} names {folder.name}, which is missing or incomplete; delete {out} to start over.")
    return folder


def _latest_trainer(folder: str | Path) -> dict[str, Any]:
    """The trainer record of the latest checkpoint in `folder`; {} for a folder that is no eyas
    training run, or whose record cannot be read (the notes built on it then say nothing)."""
    try:
        latest = latest_checkpoint(Path(folder))
        trainer = json.loads((latest / TRAINER).read_bytes()) if latest is not None else {}
    except (EyasError, OSError, ValueError):
        return {}
    return trainer if isinstance(trainer, dict) else {}


def unfinished_note(folder: str | Path) -> str | None:
    """A note for eval and export when `folder` is a training run stopped before the end of its
    schedule (--minutes, Ctrl-C): its drafter is that of an earlier step. None otherwise."""
    trainer = _latest_trainer(folder)
    step, total = trainer.get("step"), trainer.get("total_steps")
    if not (isinstance(step, int) and isinstance(total, int) and step < total):
        return None
    return (f"note: the drafter in {folder} is from step {step} of {total}: its training stopped early; add --resume "
            f"to its `eyas train` command to finish it.")


def data_of(folder: str | Path) -> dict[str, Any] | None:
    """The record of what the training run in `folder` trained on (`loop.data_record`), from its
    latest checkpoint; None for a folder that is no eyas training run or records none."""
    data = _latest_trainer(folder).get("data")
    return data if isinstance(data, dict) else None


def read_checkpoint(folder: Path) -> tuple[DraftConfig, dict[str, Any]]:
    try:
        trainer = json.loads((folder / TRAINER).read_bytes())
    except (OSError, ValueError) as e:
        raise _damaged(folder, TRAINER, e) from None
    if not isinstance(trainer, dict) or not isinstance(trainer.get("step"), int) or \
            not isinstance(trainer.get("config"), dict) or not isinstance(trainer.get("total_steps"), int):
        raise _damaged(folder, TRAINER, ValueError("its step, total_steps or config is missing"))
    return load_config(folder), trainer


def read_optimizer(folder: Path) -> dict:
    try:
        return torch.load(folder / OPTIMIZER, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, ValueError, EOFError, pickle.UnpicklingError) as e:
        raise _damaged(folder, OPTIMIZER, e) from None


def _damaged(folder: Path, name: str, e: BaseException) -> EyasError:
    """One line for a checkpoint file that cannot be read back (eyas writes them whole, so it
    was changed or damaged since): what, and how to resume from the checkpoint before it."""
    why = (str(e).strip().splitlines() or [type(e).__name__])[0][:120]
    earlier = sorted(p.name for p in folder.parent.glob("step-*") if p.is_dir() and p.name < folder.name)
    fix = (f"to resume from {earlier[-1]} instead, write `{earlier[-1]}` into {folder.parent / LATEST}"
           if earlier else "no earlier checkpoint is kept; train into a new --out")
    return EyasError(f"{folder / name} cannot be read ({why}): the checkpoint is damaged, and nothing was changed; "
                     f"{fix}.")


def check_store_matches(cfg: DraftConfig, identity, layer_ids: tuple[int, ...], hidden_size: int, what: str) -> None:
    """Refuse training (or scoring) data that disagrees with the drafter."""
    cfg.identity.check_same(identity, what)
    if tuple(layer_ids) != cfg.layer_ids:
        raise EyasError(f"{what} holds layer ids {list(layer_ids)}, but the drafter was trained on "
                        f"{list(cfg.layer_ids)}.")
    if hidden_size != cfg.hidden_size:
        raise EyasError(f"{what} has hidden size {hidden_size}, the drafter {cfg.hidden_size}.")
