"""The on-disk layout, in one place.

store/
  manifest.json              eyas version, target identity, layer ids, dtype, shards
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
from typing import BinaryIO, Iterable

import torch

from eyas.errors import EyasError

FORMAT = "eyas-store"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
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
