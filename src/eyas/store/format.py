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

import torch

from eyas.errors import EyasError

FORMAT = "eyas-store"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
FP8_MAX = 448.0  # largest finite float8_e4m3fn

STORE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp8": torch.float8_e4m3fn}


def shard_name(i: int) -> str:
    return f"shard-{i:05d}.safetensors"


def store_dtype(name: str) -> torch.dtype:
    try:
        return STORE_DTYPES[name]
    except KeyError:
        raise EyasError(f"Unknown store dtype {name!r}; choose one of {', '.join(STORE_DTYPES)}.") from None


def quantize_fp8(hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-(token, layer) absmax scaling: keeps every row inside e4m3's range."""
    h = hidden.float()  # [T, L, H]
    scale = (h.abs().amax(dim=-1) / FP8_MAX).clamp_min(1e-12)  # [T, L]
    return (h / scale.unsqueeze(-1)).to(torch.float8_e4m3fn), scale


def dequantize(hidden: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """Stored hidden states back to float32 [T, L, H]."""
    if scale is None:
        return hidden.float()
    return hidden.float() * scale.unsqueeze(-1)
