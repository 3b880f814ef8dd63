"""Read a drafter's tensors from the files a checkpoint folder holds, check them against a
config, and write an export folder.

Checking happens on a weightless (meta-device) drafter, so neither export nor import ever
allocates the target's embedding table, however large the target.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors.torch import save

from eyas.draft.build import new_drafter
from eyas.draft.checkpoint import CONFIG, DRAFTER_FILES, WEIGHTS, check_finite, read_safetensors, saved_names
from eyas.draft.config import DraftConfig
from eyas import __version__
from eyas.errors import EyasError
from eyas.lock import LOCK_FILE, output_lock
from eyas.paths import atomic_write_bytes, atomic_write_json, plain_name, remove_leftovers

WEIGHT_FILES = (f"{WEIGHTS}.index.json", WEIGHTS, "pytorch_model.bin.index.json", "pytorch_model.bin")


def read_tensors(folder: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a folder: safetensors (single or sharded) or, for older checkpoints,
    `pytorch_model.bin` read with `weights_only=True` (tensors only, never pickled code)."""
    folder = Path(folder)
    for name in WEIGHT_FILES:
        path = folder / name
        if not path.is_file():
            continue
        if name.endswith(".index.json"):
            shards = sorted({plain_name(f, str(path)) for f in _weight_map(path).values()})
            load = read_safetensors if name.startswith(WEIGHTS) else _load_bin
            return {k: v for shard in shards for k, v in load(folder / shard).items()}
        return read_safetensors(path) if name.endswith(".safetensors") else _load_bin(path)
    raise EyasError(f"{folder} holds no weights: looked for {', '.join(WEIGHT_FILES)}.")


def _weight_map(index: Path) -> dict[str, Any]:
    try:
        weight_map = json.loads(index.read_bytes())["weight_map"]
    except (ValueError, KeyError, TypeError, RecursionError):
        raise EyasError(f"{index} is not a weight index (no readable `weight_map`).") from None
    if not isinstance(weight_map, dict):
        raise EyasError(f"{index} is not a weight index (no readable `weight_map`).")
    return weight_map


def _load_bin(path: Path) -> dict[str, torch.Tensor]:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise EyasError(f"Cannot read {path} as a plain tensor file: {e}") from e
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise EyasError(f"{path} is not a flat name -> tensor dictionary.")
    return state


def build_drafter(cfg: DraftConfig, state: dict[str, torch.Tensor], what: str) -> torch.nn.Module:
    """A drafter whose saved tensors are exactly `state` (shared, not copied; the target's
    embeddings stay on the meta device). Raises naming every missing, extra or misshapen tensor."""
    with torch.device("meta"):
        model = new_drafter(cfg)
    expected = saved_names(model)
    missing = sorted(expected.keys() - state.keys())
    extra = sorted(state.keys() - expected.keys())
    wrong = [f"{k} {list(state[k].shape)} (config wants {list(expected[k])})"
             for k in sorted(expected.keys() & state.keys()) if state[k].shape != expected[k]]
    problems = [f"missing {missing}" if missing else "", f"unexpected {extra}" if extra else "",
                f"wrong shapes: {'; '.join(wrong)}" if wrong else ""]
    if any(problems):
        raise EyasError(f"The weights of {what} do not match its config: {', '.join(p for p in problems if p)}.")
    check_finite(state, f"The weights of {what}")
    model.load_state_dict(state, strict=False, assign=True)
    return model


RECORD = "eyas-export.json"  # the files eyas wrote into an output folder: all that --force may replace
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".npz", ".index.json")


@contextmanager
def owned_out(out: Path, force: bool, source: Path, command: str) -> Iterator[None]:
    """Hold `out` (locked) for writing a drafter into it. A non-empty folder is refused unless
    `force`, and even then only the files an earlier eyas run recorded there are replaced:
    a file eyas did not write that the new drafter would overwrite, or another weight file an
    engine would load beside it, is refused."""
    with output_lock(out, command):
        remove_leftovers(out, (*DRAFTER_FILES, RECORD))  # a killed export's half-written files
        present = {p.name for p in out.iterdir()} - {LOCK_FILE}
        if present and not force:
            raise EyasError(f"{out} is not empty; pass --force to replace the drafter in it.")
        ours = _recorded(out) if present else set()
        foreign = present - ours - {RECORD}
        if clash := sorted(foreign & set(DRAFTER_FILES)):
            raise EyasError(f"{out} holds {', '.join(clash)}, which eyas did not write there; --force replaces only "
                            f"the files of an earlier eyas export. Move it away or choose another --out.")
        if weights := sorted(f for f in foreign if f.endswith(WEIGHT_SUFFIXES)):
            raise EyasError(f"{out} holds weight files eyas did not write ({', '.join(weights[:3])}), which an engine "
                            f"would load beside the new drafter. Move them away or choose another --out.")
        for name in ours:
            (out / name).unlink(missing_ok=True)
        atomic_write_json(out / RECORD, {"eyas_version": __version__, "files": list(DRAFTER_FILES)})
        yield


def _recorded(out: Path) -> set[str]:
    """The files an earlier eyas export recorded in `out` (none without a record)."""
    try:
        record = json.loads((out / RECORD).read_bytes())
    except FileNotFoundError:
        return set()
    except ValueError:
        raise EyasError(f"{out / RECORD} is corrupt; delete the folder's drafter files by hand.") from None
    files = record.get("files") if isinstance(record, dict) else None
    if not isinstance(files, list):
        raise EyasError(f"{out / RECORD} is corrupt; delete the folder's drafter files by hand.")
    return {plain_name(f, str(out / RECORD)) for f in files}


def write_folder(out: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> int:
    """config.json + model.safetensors, each written atomically; returns the weight bytes."""
    data = save({k: v.contiguous() for k, v in tensors.items()}, metadata={"format": "pt"})
    atomic_write_bytes(out / WEIGHTS, data)
    atomic_write_json(out / CONFIG, config)
    return len(data)
