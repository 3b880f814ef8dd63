"""The on-disk layout, in one place: the manifest is built, read and checked only here.

store/
  manifest.json              format and its version, eyas version; the header every shard agrees
                             with (target identity, layer ids, dtype, hidden size, the prepared
                             data and its chat template); the shards (file, sha256, bytes, counts),
                             totals, and whether the capture is complete
  shard-00000.safetensors    many samples packed along the token axis:
      input_ids    [T] int32
      loss_mask    [T] uint8      1 where the token is an assistant token (trained)
      hidden       [T, L, H]      bf16/fp16/fp32, or float8_e4m3fn with `scale`
      scale        [T, L] float32 (fp8 only) hidden ≈ hidden_fp8 * scale
      offsets      [n+1] int64    sample j is tokens offsets[j]:offsets[j+1]
      sample_index [n] int64      position of each sample in the prepared data
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from pathlib import Path
from typing import Any, BinaryIO, Iterable, Sequence

import torch

from eyas import __version__
from eyas.data.template import ChatTemplate
from eyas.errors import EyasError
from eyas.models.identity import ModelIdentity
from eyas.paths import plain_name
from eyas.versions import check_version

FORMAT = "eyas-store"
FORMAT_VERSION = 1  # the manifest and shard layout this eyas writes and reads (and every earlier one)
MANIFEST = "manifest.json"
REPAIR = "run `eyas inspect {path} --repair` to rebuild the manifest from the shards that verify"
FP8_MAX = 448.0  # largest finite float8_e4m3fn

STORE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp8": torch.float8_e4m3fn}


# safetensors' names for the dtypes a shard holds.
SAFETENSORS_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.float8_e4m3fn: "F8_E4M3",
                      torch.int32: "I32", torch.int64: "I64", torch.uint8: "U8"}


def write_safetensors(f: BinaryIO, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> str:
    """Write `tensors` to `f` in the safetensors format and return the file's sha256.

    Written here rather than with safetensors' own `save`, which copies a shard twice, once
    holding the GIL (the capture loop then stalls for a second per GiB): tensors go to the file
    straight from their memory, and are hashed on the way, with the GIL released.
    """
    # Widest dtypes first, and a header padded to 8 bytes: every tensor stays aligned.
    order = sorted(tensors, key=lambda k: (-tensors[k].element_size(), k))
    header: dict[str, object] = {"__metadata__": metadata}
    start = 0
    for k in order:
        t = tensors[k]
        end = start + t.numel() * t.element_size()
        header[k] = {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [start, end]}
        start = end
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    digest = hashlib.sha256()
    for chunk in (struct.pack("<Q", len(text)), text,
                  *(memoryview(tensors[k].contiguous().reshape(-1).view(torch.uint8).numpy()) for k in order)):
        digest.update(chunk)
        f.write(chunk)
    return digest.hexdigest()


SHARD_PATTERN = re.compile(r"shard-(\d{5,})\.safetensors")


def shard_name(i: int) -> str:
    return f"shard-{i:05d}.safetensors"


def next_shard_name(names: Iterable[str]) -> str:
    """The name after the highest shard number among `names` (`*.dropped` ones included): never
    one that exists, is listed, or was set aside by `eyas inspect --repair`."""
    numbers = [int(m.group(1)) for n in names if (m := SHARD_PATTERN.match(n))]
    return shard_name(max(numbers, default=-1) + 1)


def manifest_header(target: ModelIdentity, layer_ids: Sequence[int], dtype: str, hidden_size: int, prepared: str,
                    chat_template: ChatTemplate | None, *, backend: str | None = None,
                    model_dtype: str | None = None, excluded_prompts: list[str] | None = None) -> dict[str, Any]:
    """What every shard of a store agrees with, and a resumed capture must match: the target,
    its layer ids, the store's dtype and hidden size, the prepared data's fingerprint, the
    template that data was rendered with (passed on to the drafter, so that eval renders
    prompts as the training data was rendered), and how the target ran (`backend`, its
    `model_dtype`): a capture resumed in bfloat16 after a float32 start would store two
    precisions in one store. `excluded_prompts`, the eval prompts the prepared data was kept
    free of, passes on to the drafter's training record (data/exclusion.py)."""
    header = {"target": target.to_dict(), "layer_ids": list(layer_ids), "dtype": dtype, "hidden_size": hidden_size,
              "prepared": prepared, "chat_template": None if chat_template is None else chat_template.to_dict()}
    added = (("backend", backend), ("model_dtype", model_dtype), ("excluded_prompts", excluded_prompts))
    return {**header, **{k: v for k, v in added if v is not None}}


# Header keys added after stores were written: a store without one resumes as before.
ADDED_HEADER_KEYS = ("backend", "model_dtype", "excluded_prompts")


def new_manifest(header: dict[str, Any], expected_samples: int | None = None) -> dict[str, Any]:
    """The manifest of a store holding no shard yet; `expected_samples` is recorded, so that a
    reader can say how much is missing."""
    return {"format": FORMAT, "format_version": FORMAT_VERSION, "eyas_version": __version__,
            **header, "shards": [], "num_samples": 0, "num_tokens": 0, "complete": False,
            **({"expected_samples": expected_samples} if expected_samples is not None else {})}


def shard_entry(name: str, sha256: str, size: int, num_samples: int, num_tokens: int) -> dict[str, Any]:
    return {"file": name, "sha256": sha256, "bytes": size, "num_samples": num_samples, "num_tokens": num_tokens}


def with_shard(manifest: dict[str, Any], entry: dict[str, Any]) -> dict[str, Any]:
    """`manifest` with `entry` appended to its shards and totals (and nothing pending)."""
    manifest = {k: v for k, v in manifest.items() if k != "pending"}
    manifest["shards"] = [*manifest["shards"], entry]
    manifest["num_samples"] += entry["num_samples"]
    manifest["num_tokens"] += entry["num_tokens"]
    return manifest


def shard_metadata(layer_ids: Sequence[int]) -> dict[str, str]:
    """The metadata each shard file carries: it names its layer ids, checked against the manifest's."""
    return {"format": FORMAT, "layer_ids": ",".join(map(str, layer_ids))}


def read_manifest(path: str | Path) -> dict[str, Any]:
    """The manifest, checked to be well-formed and self-consistent; any flaw is an `EyasError`."""
    path = Path(path)
    try:
        manifest = json.loads((path / MANIFEST).read_bytes())
    except FileNotFoundError:
        raise EyasError(f"{path} is not an eyas store: it has no {MANIFEST}.") from None
    except (ValueError, RecursionError, OSError) as e:
        raise EyasError(f"{path / MANIFEST} is unreadable or corrupt ({type(e).__name__}: {e}).") from None
    check_manifest(manifest, path / MANIFEST)
    return manifest


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def check_manifest(m: Any, where: Path) -> None:
    """Format, version, types, ranges and totals: what every reader relies on before it opens a
    shard. The one check of a manifest: reading, verifying and repairing a store all run it."""
    def bad(what: str) -> EyasError:
        return EyasError(f"{where}: {what}.")

    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise EyasError(f"{where} is not an eyas store manifest.")
    check_version(m.get("format_version"), FORMAT_VERSION, "store", where)
    target = m.get("target")
    if not isinstance(target, dict) or not all(isinstance(target.get(k), str) for k in ("model", "config_hash", "tokenizer_hash")) \
            or not all(_count(target.get(k)) and target[k] > 0 for k in ("num_layers", "hidden_size", "vocab_size")):
        raise bad("`target` is not a complete model record")
    ids = m.get("layer_ids")
    if not isinstance(ids, list) or len(ids) < 2 or not all(_count(k) for k in ids):
        raise bad(f"`layer_ids` {ids!r} is not a list of at least two layer ids")
    if m.get("dtype") not in STORE_DTYPES:
        raise bad(f"`dtype` {m.get('dtype')!r} is not one of {', '.join(STORE_DTYPES)}")
    if not _count(m.get("hidden_size")) or m["hidden_size"] == 0:
        raise bad(f"`hidden_size` {m.get('hidden_size')!r} is not a positive integer")
    shards = m.get("shards")
    if not isinstance(shards, list) or not _count(m.get("num_samples")) or not _count(m.get("num_tokens")):
        raise bad("`shards`, `num_samples` or `num_tokens` is missing or of the wrong type")
    seen: set[str] = set()
    for i, shard in enumerate(shards):
        if not isinstance(shard, dict) or not isinstance(shard.get("sha256"), str) or \
                not all(_count(shard.get(k)) for k in ("bytes", "num_samples", "num_tokens")):
            raise bad(f"shard entry {i} is malformed")
        name = plain_name(shard.get("file"), f"{where}, shard entry {i},")
        if not SHARD_PATTERN.fullmatch(name):
            raise bad(f"shard entry {i} names {name!r}, which is not a shard file name (shard-NNNNN.safetensors)")
        if name in seen:
            raise bad(f"{name} is listed twice; {REPAIR.format(path=where.parent)}")
        seen.add(name)
    if sum(s["num_samples"] for s in shards) != m["num_samples"] or sum(s["num_tokens"] for s in shards) != m["num_tokens"]:
        raise bad(f"its totals ({m['num_samples']} samples, {m['num_tokens']} tokens) disagree with its shard entries")


def check_layer_ids(m: dict[str, Any]) -> None:
    """The layer ids must fit the target: aux ids inside it, then the label source N."""
    layer_ids, n_layers = list(m["layer_ids"]), m["target"]["num_layers"]
    if layer_ids[-1] != n_layers or any(not 0 <= k < n_layers for k in layer_ids[:-1]):
        raise EyasError(f"The store's layer ids {layer_ids} do not fit the {n_layers}-layer target: aux ids must lie in "
                        f"0..{n_layers - 1}, followed by {n_layers} (the last layer's output, the label source).")


def check_files(path: Path, m: dict[str, Any]) -> None:
    """The shard files on disk must be exactly those the manifest lists."""
    pending = m.get("pending")
    listed = {s["file"] for s in m["shards"]} | {s.get("file") for s in (pending if isinstance(pending, list) else [])
                                                 if isinstance(s, dict)}
    on_disk = {p.name for p in path.iterdir() if SHARD_PATTERN.fullmatch(p.name)}
    if missing := sorted({s["file"] for s in m["shards"]} - on_disk):
        raise EyasError(f"{path}: {missing[0]} is listed in the manifest but missing"
                        f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}; {REPAIR.format(path=path)}.")
    if unlisted := sorted(on_disk - listed):
        raise EyasError(f"{path}: {unlisted[0]} is on disk but not in the manifest"
                        f"{f' (and {len(unlisted) - 1} more)' if len(unlisted) > 1 else ''}; nothing was overwritten. "
                        f"Move it away, or {REPAIR.format(path=path)}.")


def store_dtype(name: str) -> torch.dtype:
    try:
        return STORE_DTYPES[name]
    except KeyError:
        raise EyasError(f"Unknown store dtype {name!r}; choose one of {', '.join(STORE_DTYPES)}.") from None


def quantize_fp8(hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-(token, layer) absmax scaling: keeps every row inside e4m3's range. Gives the same
    bits on the CPU and a GPU, so capture may quantize on its device: every step is exact or
    one IEEE rounding. (CUDA divides by a Python number as a product with its rounded
    reciprocal, which moves scales by an ulp: FP8_MAX is a tensor on the same device.)
    A NaN or inf in a row makes its scale NaN or inf."""
    h = hidden.float()  # [T, L, H]
    fp8_max = torch.full((), FP8_MAX, device=h.device)
    scale = (h.abs().amax(dim=-1) / fp8_max).clamp_min(1e-12)  # [T, L]
    return (h / scale.unsqueeze(-1)).to(torch.float8_e4m3fn), scale


def first_nonfinite(t: torch.Tensor) -> list[int] | None:
    """Index of the first NaN/inf in `t`, or None. One min/max pass decides (NaN and inf
    both reach the extremes); only a bad tensor pays for the full elementwise scan, which
    on the CPU is some 40x slower and would otherwise stall the capture loop."""
    if t.numel() == 0:
        return None
    if t.dtype == torch.float8_e4m3fn:
        t = t.float()
    lo, hi = torch.aminmax(t)
    if torch.isfinite(lo) and torch.isfinite(hi):
        return None
    return (~torch.isfinite(t)).nonzero()[0].tolist()


def dequantize(hidden: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """Stored hidden states [..., L, H] back to float32, on whichever device they are: the
    product is float32 x float32 rounded once, so the CPU and a GPU give the same bits."""
    if scale is None:
        return hidden.float()
    return hidden.to(torch.float32, copy=True).mul_(scale.unsqueeze(-1))  # in place: one float32 copy, not two
