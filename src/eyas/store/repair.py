"""`eyas inspect --repair`: rebuild a store's manifest from the shards that verify.

The manifest's header (target, layer ids, dtype, hidden size, prepared data) must still be
readable: it is what a shard is checked against. Every `shard-NNNNN.safetensors` on disk is
checked completely (structure, NaN/inf, and its sha256 against the one the old manifest
records for it, as a shard or as pending): a flipped bit that still decodes to a finite
number shows in nothing else. A shard that fails, that the old manifest does not record
(nothing says what it should hold), or that repeats samples of a shard kept before it, is
renamed `*.dropped` (never deleted), and its samples are captured again by the next `eyas
capture`. The store is marked complete when it still holds every sample the capture expected.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from eyas.errors import EyasError
from eyas.lock import output_lock
from eyas.paths import atomic_write_json
from eyas.store.format import MANIFEST, SHARD_PATTERN, check_layer_ids, check_manifest, shard_entry, with_shard
from eyas.store.reader import Store
from eyas.store.verify import check_shard, read_header
from eyas.store.writer import store_lock


def _header(path: Path) -> tuple[dict[str, Any], dict[str, set[str]]]:
    """The manifest's header with no shards, checked, and the sha256s it records for each shard
    file (listed or pending); raises if even the header is unreadable."""
    try:
        raw = json.loads((path / MANIFEST).read_bytes())
    except FileNotFoundError:
        raise EyasError(f"{path} is not an eyas store: it has no {MANIFEST}.") from None
    except (ValueError, RecursionError) as e:
        raise EyasError(f"{path / MANIFEST} is unreadable ({e}); a store cannot be repaired without it.") from None
    if not isinstance(raw, dict):
        raise EyasError(f"{path / MANIFEST} is not an eyas store manifest; it cannot be repaired.")
    header = {k: v for k, v in raw.items() if k not in ("shards", "pending")}
    header.update(shards=[], num_samples=0, num_tokens=0, complete=False)
    check_manifest(header, path / MANIFEST)
    check_layer_ids(header)
    recorded: dict[str, set[str]] = {}
    for key in ("shards", "pending"):
        entries = raw.get(key)
        for e in entries if isinstance(entries, list) else []:
            if isinstance(e, dict) and isinstance(e.get("file"), str) and isinstance(e.get("sha256"), str):
                recorded.setdefault(e["file"], set()).add(e["sha256"])
    return header, recorded


def _entry(file: Path, recorded: set[str]) -> dict[str, Any]:
    """A manifest entry for `file` with the one sha256 `recorded` for it (checked against the file
    later), its counts read from its own header."""
    if len(recorded) != 1:
        raise EyasError(f"{file.name}: " + ("not listed in the manifest" if not recorded else
                                            "listed with different sha256s in the manifest")
                        + ", so nothing says what it should hold")
    size = file.stat().st_size
    header = read_header(file, size)
    try:
        n, T = header["sample_index"]["shape"][0], header["input_ids"]["shape"][0]
    except (KeyError, IndexError, TypeError):
        raise EyasError(f"{file.name}: not an eyas shard.") from None
    return shard_entry(file.name, next(iter(recorded)), size, n, T)


def repair_store(path: str | Path) -> tuple[list[str], list[tuple[str, str]]]:
    """Rewrite the manifest of `path`; return the shards kept and (shard, reason) for those dropped."""
    path = Path(path)
    with output_lock(path, "inspect --repair"), store_lock(path):
        return _repair(path)


def _repair(path: Path) -> tuple[list[str], list[tuple[str, str]]]:
    manifest, recorded = _header(path)
    kept: list[str] = []
    dropped: list[tuple[str, str]] = []
    seen: set[int] = set()
    for file in sorted(p for p in path.iterdir() if SHARD_PATTERN.fullmatch(p.name)):
        try:
            entry = _entry(file, recorded.get(file.name, set()))
            trial = {**manifest, "shards": [entry]}
            seen.update(check_shard(Store(path, trial), 0, seen, full=True))
        except EyasError as e:
            dropped.append((file.name, str(e).removeprefix(f"{file.name}: ").split("; run `eyas inspect")[0]))
            file.rename(file.with_name(file.name + ".dropped"))
            continue
        manifest = with_shard(manifest, entry)
        kept.append(file.name)
    expected = manifest.get("expected_samples")
    manifest["complete"] = isinstance(expected, int) and seen == set(range(expected))
    atomic_write_json(path / MANIFEST, manifest)
    return kept, dropped
