"""Two checks of a store against its manifest.

`check_structure` is the cheap one, run by `train` (and a resumed `capture`) before any use:
the manifest's types and totals, the shard files present and no others, and every shard's
size, safetensors header (tensor names, dtypes, shapes, byte ranges), layer ids, offsets,
sample indices and token ids. It reads headers and the small per-token tensors, never the
hidden states. `verify_store` (`eyas inspect --verify`) adds what needs every byte: each
shard's sha256 and a NaN/inf scan of the hidden states.
"""

from __future__ import annotations

import json
import math
import struct
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from eyas.errors import EyasError
from eyas.paths import sha256_file
from eyas.store.format import (MANIFEST, REPAIR, SAFETENSORS_DTYPES, STORE_DTYPES, check_files, check_layer_ids,
                               check_manifest, first_nonfinite, shard_metadata)

MAX_HEADER = 1 << 24  # far above any real shard header; a larger length field is corruption
SMALL = ("input_ids", "loss_mask", "offsets", "sample_index")


def check_structure(store) -> None:
    """Raise `EyasError` naming the first structural problem of `store` (a `Store`)."""
    _check_store(store, full=False)


def _check_store(store, full: bool) -> None:
    """The manifest, the files it names, then every shard (`full`: sha256 and NaN/inf too)."""
    check_manifest(store.manifest, store.path / MANIFEST)
    check_layer_ids(store.manifest)
    check_files(store.path, store.manifest)
    seen: set[int] = set()
    for i in range(len(store.manifest["shards"])):
        seen.update(check_shard(store, i, seen, full=full))


def check_shard(store, i: int, seen: set[int], full: bool) -> list[int]:
    """Check shard `i` (with `full`, also its sha256 and NaN/inf); return its sample indices,
    which must not repeat each other or `seen`."""
    m = store.manifest
    shard = m["shards"][i]
    name = shard["file"]
    header = read_header(store.path / name, shard["bytes"])
    _check_header(name, header, shard, m)
    t = {k: store.shard_tensor(i, k) for k in SMALL}
    _check_small(name, t, shard["num_tokens"], m["target"]["vocab_size"])
    indices = t["sample_index"].tolist()
    dup = seen.intersection(indices)
    if not dup and len(set(indices)) < len(indices):
        dup = {k for k, c in Counter(indices).items() if c > 1}
    if dup:
        raise EyasError(f"{name}: sample(s) {sorted(dup)[:5]} stored twice; {REPAIR.format(path=store.path)}.")
    if full:
        if sha256_file(store.path / name) != shard["sha256"]:
            raise EyasError(f"{name}: sha256 mismatch, the file is corrupted.")
        for key in ("hidden", "scale") if m["dtype"] == "fp8" else ("hidden",):
            if (where := first_nonfinite(store.shard_tensor(i, key))) is not None:
                raise EyasError(f"{name}: {key} holds NaN/inf (token {where[0]}, layer slot {where[1]}).")
    return indices


def read_header(path: Path, size: int) -> dict[str, Any]:
    """A shard's safetensors header, checked to fit the file the manifest describes."""
    name = path.name
    actual = path.stat().st_size
    if actual != size:
        raise EyasError(f"{name}: {actual} bytes, the manifest says {size} (truncated or replaced).")
    with open(path, "rb") as f:
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if not 2 <= n <= min(MAX_HEADER, size - 8):
            raise EyasError(f"{name}: not a safetensors file (bad header length).")
        try:
            header = json.loads(f.read(n))
        except (ValueError, RecursionError):
            raise EyasError(f"{name}: its safetensors header is corrupt.") from None
    if not isinstance(header, dict):
        raise EyasError(f"{name}: its safetensors header is corrupt.")
    header["__data_bytes__"] = size - 8 - n
    return header


def _check_header(name: str, header: dict[str, Any], shard: dict[str, Any], m: dict[str, Any]) -> None:
    dtype = STORE_DTYPES[m["dtype"]]
    T, n, L, H = shard["num_tokens"], shard["num_samples"], len(m["layer_ids"]), m["hidden_size"]
    want = {"input_ids": (torch.int32, [T]), "loss_mask": (torch.uint8, [T]), "hidden": (dtype, [T, L, H]),
            "offsets": (torch.int64, [n + 1]), "sample_index": (torch.int64, [n])}
    if dtype == torch.float8_e4m3fn:
        want["scale"] = (torch.float32, [T, L])
    meta = header.pop("__metadata__", None) or {}
    data_bytes = header.pop("__data_bytes__")
    if not isinstance(meta, dict) or meta.get("layer_ids") != shard_metadata(m["layer_ids"])["layer_ids"]:
        got = meta.get("layer_ids") if isinstance(meta, dict) else None
        raise EyasError(f"{name}: holds layer ids {got!r}, the manifest says {m['layer_ids']}.")
    if header.keys() != want.keys():
        raise EyasError(f"{name}: holds tensors {sorted(header)}, expected {sorted(want)}.")
    spans = []
    for key, (dt, shape) in want.items():
        entry = header[key]
        if not isinstance(entry, dict) or entry.get("dtype") != SAFETENSORS_DTYPES[dt]:
            raise EyasError(f"{name}: {key} is not {SAFETENSORS_DTYPES[dt]} (the manifest's dtype is {m['dtype']}).")
        if entry.get("shape") != shape:
            raise EyasError(f"{name}: {key} has shape {entry.get('shape')}, expected {shape} "
                            f"(samples, tokens, layer ids and hidden size from the manifest).")
        span = entry.get("data_offsets")
        nbytes = dt.itemsize * math.prod(shape)
        if not (isinstance(span, list) and len(span) == 2 and all(isinstance(x, int) for x in span)
                and span[1] - span[0] == nbytes and 0 <= span[0] and span[1] <= data_bytes):
            raise EyasError(f"{name}: {key}'s byte range {span} does not fit its shape or the file.")
        spans.append(span)
    spans.sort()
    if spans[0][0] != 0 or spans[-1][1] != data_bytes or any(a[1] != b[0] for a, b in zip(spans, spans[1:])):
        raise EyasError(f"{name}: its tensors overlap or leave gaps in the file.")


def _check_small(name: str, t: dict[str, torch.Tensor], T: int, vocab: int) -> None:
    off = t["offsets"]
    if off[0] != 0 or off[-1] != T or (off[1:] <= off[:-1]).any():
        raise EyasError(f"{name}: offsets are not increasing from 0 to {T}.")
    ids = t["input_ids"]
    if T and (ids.min() < 0 or ids.max() >= vocab):
        raise EyasError(f"{name}: input ids outside the vocabulary 0..{vocab - 1}.")
    if (t["loss_mask"] > 1).any():
        raise EyasError(f"{name}: loss_mask holds values other than 0 and 1.")
    if (t["sample_index"] < 0).any():
        raise EyasError(f"{name}: negative sample indices.")


def verify_store(store) -> None:
    """Everything `check_structure` checks, plus every shard's sha256 and NaN/inf in its states."""
    _check_store(store, full=True)
