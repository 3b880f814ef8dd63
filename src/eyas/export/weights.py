"""Read a drafter's tensors from the files a checkpoint folder holds, check them against a
config, and write an export folder.

Checking happens on a weightless (meta-device) drafter, so neither export nor import ever
allocates the target's embedding table, however large the target.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save

from eyas.draft.checkpoint import _NOT_SAVED
from eyas.draft.config import DraftConfig
from eyas.draft.model import Eagle3Drafter
from eyas.errors import EyasError
from eyas.paths import atomic_write_bytes, atomic_write_json

WEIGHT_FILES = ("model.safetensors.index.json", "model.safetensors", "pytorch_model.bin.index.json", "pytorch_model.bin")


def read_tensors(folder: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a folder: safetensors (single or sharded) or, for older checkpoints,
    `pytorch_model.bin` read with `weights_only=True` (tensors only, never pickled code)."""
    folder = Path(folder)
    for name in WEIGHT_FILES:
        path = folder / name
        if not path.is_file():
            continue
        if name.endswith(".index.json"):
            shards = sorted(set(json.loads(path.read_text())["weight_map"].values()))
            load = load_file if name.startswith("model.safetensors") else _load_bin
            return {k: v for shard in shards for k, v in load(folder / shard).items()}
        return load_file(path) if name.endswith(".safetensors") else _load_bin(path)
    raise EyasError(f"{folder} holds no weights: looked for {', '.join(WEIGHT_FILES)}.")


def _load_bin(path: Path) -> dict[str, torch.Tensor]:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise EyasError(f"Cannot read {path} as a plain tensor file: {e}") from e
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise EyasError(f"{path} is not a flat name -> tensor dictionary.")
    return state


def build_drafter(cfg: DraftConfig, state: dict[str, torch.Tensor], what: str) -> Eagle3Drafter:
    """A drafter whose saved tensors are exactly `state` (shared, not copied; the target's
    embeddings stay on the meta device). Raises naming every missing, extra or misshapen tensor."""
    with torch.device("meta"):
        model = Eagle3Drafter(cfg)
    expected = {k: v.shape for k, v in model.state_dict().items() if not k.startswith(_NOT_SAVED)}
    missing = sorted(expected.keys() - state.keys())
    extra = sorted(state.keys() - expected.keys())
    wrong = [f"{k} {list(state[k].shape)} (config wants {list(expected[k])})"
             for k in sorted(expected.keys() & state.keys()) if state[k].shape != expected[k]]
    problems = [f"missing {missing}" if missing else "", f"unexpected {extra}" if extra else "",
                f"wrong shapes: {'; '.join(wrong)}" if wrong else ""]
    if any(problems):
        raise EyasError(f"The weights of {what} do not match its config: {', '.join(p for p in problems if p)}.")
    model.load_state_dict(state, strict=False, assign=True)
    return model


def prepare_out(out: Path, force: bool, source: Path) -> None:
    """Refuse to mix a new drafter into a folder holding other files, unless told to replace it."""
    if out.resolve() == source.resolve():
        raise EyasError(f"--out {out} is the folder being read; write to another folder.")
    if out.exists() and not out.is_dir():
        raise EyasError(f"{out} exists and is not a folder.")
    if out.is_dir() and any(out.iterdir()):
        if not force:
            raise EyasError(f"{out} is not empty; pass --force to replace the drafter in it.")
        for name in (*WEIGHT_FILES, "config.json"):
            (out / name).unlink(missing_ok=True)


def write_folder(out: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> int:
    """config.json + model.safetensors, each written atomically; returns the weight bytes."""
    data = save({k: v.contiguous() for k, v in tensors.items()}, metadata={"format": "pt"})
    atomic_write_bytes(out / "model.safetensors", data)
    atomic_write_json(out / "config.json", config)
    return len(data)
