"""`eyas inspect --repair`: rebuild a store's manifest from the shards that verify.

The manifest's header (target, layer ids, dtype, hidden size, prepared data) must still be
readable: it is what a shard is checked against. Every `shard-NNNNN.safetensors` on disk is
checked completely (structure, NaN/inf; its sha256 is recomputed); one that fails, or that
repeats samples of a shard kept before it, is renamed `*.dropped` (never deleted), and its
samples are captured again by the next `eyas capture`. The store is marked incomplete.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from eyas.errors import EyasError
from eyas.lock import output_lock
from eyas.paths import atomic_write_json, sha256_file
from eyas.store.format import MANIFEST, SHARD_PATTERN, check_layer_ids, check_manifest, shard_entry, with_shard
from eyas.store.reader import Store
from eyas.store.verify import check_shard, read_header
from eyas.store.writer import store_lock


def _header(path: Path) -> dict[str, Any]:
    """The manifest's header with no shards, checked; raises if even that is unreadable."""
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
    return header


def _entry(file: Path) -> dict[str, Any]:
    """A manifest entry for `file`, its counts read from its own header."""
    size = file.stat().st_size
    header = read_header(file, size)
    try:
        n, T = header["sample_index"]["shape"][0], header["input_ids"]["shape"][0]
    except (KeyError, IndexError, TypeError):
        raise EyasError(f"{file.name}: not an eyas shard.") from None
    return shard_entry(file.name, sha256_file(file), size, n, T)


def repair_store(path: str | Path) -> tuple[list[str], list[tuple[str, str]]]:
    """Rewrite the manifest of `path`; return the shards kept and (shard, reason) for those dropped."""
    path = Path(path)
    with output_lock(path, "inspect --repair"), store_lock(path):
        return _repair(path)


def _repair(path: Path) -> tuple[list[str], list[tuple[str, str]]]:
    manifest = _header(path)
    kept: list[str] = []
    dropped: list[tuple[str, str]] = []
    seen: set[int] = set()
    for file in sorted(p for p in path.iterdir() if SHARD_PATTERN.fullmatch(p.name)):
        try:
            entry = _entry(file)
            trial = {**manifest, "shards": [entry]}
            seen.update(check_shard(Store(path, trial), 0, seen, full=True))
        except EyasError as e:
            dropped.append((file.name, str(e).removeprefix(f"{file.name}: ").split("; run `eyas inspect")[0]))
            file.rename(file.with_name(file.name + ".dropped"))
            continue
        manifest = with_shard(manifest, entry)
        kept.append(file.name)
    atomic_write_json(path / MANIFEST, manifest)
    return kept, dropped
