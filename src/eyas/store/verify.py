"""`eyas inspect --verify`: checksums, shapes, layer ids, value ranges, NaN/inf."""

from __future__ import annotations

import torch
from safetensors import SafetensorError, safe_open

from eyas.errors import EyasError
from eyas.paths import sha256_file
from eyas.store.format import STORE_DTYPES, first_nonfinite


def verify_store(store) -> None:
    m = store.manifest
    layer_ids = list(m["layer_ids"])
    n_layers = m["target"]["num_layers"]
    if layer_ids[-1] != n_layers or any(not 0 <= k < n_layers for k in layer_ids[:-1]):
        raise EyasError(f"Layer ids {layer_ids} do not fit a {n_layers}-layer target (last id must be {n_layers}).")
    expected_dtype = STORE_DTYPES[m["dtype"]]
    seen: set[int] = set()
    samples = tokens = 0
    for shard in m["shards"]:
        path = store.path / shard["file"]
        if not path.is_file():
            raise EyasError(f"{shard['file']}: missing.")
        if sha256_file(path) != shard["sha256"]:
            raise EyasError(f"{shard['file']}: sha256 mismatch, the file is corrupted.")
        try:
            f = safe_open(str(path), framework="pt")
            t = {k: f.get_tensor(k) for k in f.keys()}
        except SafetensorError as e:
            raise EyasError(f"{shard['file']}: unreadable ({e}).") from None
        _check_shard(shard, t, len(layer_ids), m["hidden_size"], expected_dtype, m["target"]["vocab_size"])
        dup = seen.intersection(t["sample_index"].tolist())
        if dup:
            raise EyasError(f"{shard['file']}: sample(s) {sorted(dup)[:5]} stored twice.")
        seen.update(t["sample_index"].tolist())
        samples += shard["num_samples"]
        tokens += shard["num_tokens"]
    if samples != m["num_samples"] or tokens != m["num_tokens"]:
        raise EyasError(f"Manifest totals ({m['num_samples']} samples, {m['num_tokens']} tokens) disagree with its shards.")


def _check_shard(shard, t, n_ids: int, hidden_size: int, dtype: torch.dtype, vocab: int) -> None:
    name = shard["file"]
    need = {"input_ids", "loss_mask", "hidden", "offsets", "sample_index"} | ({"scale"} if dtype == torch.float8_e4m3fn else set())
    if missing := need - t.keys():
        raise EyasError(f"{name}: missing tensors {sorted(missing)}.")
    T, n = shard["num_tokens"], shard["num_samples"]
    shapes = {"input_ids": (T,), "loss_mask": (T,), "hidden": (T, n_ids, hidden_size), "offsets": (n + 1,), "sample_index": (n,)}
    if dtype == torch.float8_e4m3fn:
        shapes["scale"] = (T, n_ids)
    for key, shape in shapes.items():
        if tuple(t[key].shape) != shape:
            raise EyasError(f"{name}: {key} has shape {tuple(t[key].shape)}, expected {shape} (layer ids x hidden size).")
    if t["hidden"].dtype != dtype:
        raise EyasError(f"{name}: hidden is {t['hidden'].dtype}, the manifest says {dtype}.")
    off = t["offsets"]
    if off[0] != 0 or off[-1] != T or (off[1:] <= off[:-1]).any():
        raise EyasError(f"{name}: offsets are not increasing from 0 to {T}.")
    ids = t["input_ids"]
    if T and (ids.min() < 0 or ids.max() >= vocab):
        raise EyasError(f"{name}: input ids outside the vocabulary 0..{vocab - 1}.")
    if (t["loss_mask"] > 1).any():
        raise EyasError(f"{name}: loss_mask holds values other than 0 and 1.")
    for key in ("hidden", "scale"):
        if key in t:
            if (where := first_nonfinite(t[key])) is not None:
                raise EyasError(f"{name}: {key} holds NaN/inf (token {where[0]}, layer slot {where[1]}).")
