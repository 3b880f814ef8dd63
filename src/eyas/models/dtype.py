"""Which dtype a target runs in, stated once for every stage's --model-dtype; no torch, so the
vLLM adapter and the CLI read it without loading torch."""

from __future__ import annotations

# What vLLM runs a target in when --model-dtype is not given: the checkpoint's own dtype.
ENGINE_DTYPE = "auto"


def model_dtype(asked: str | None, device_type: str | None) -> str:
    """The dtype a target runs in (every stage's --model-dtype): as asked, else the checkpoint's
    own where vLLM places the model (`device_type` None), else float32 on the CPU and bf16 on a GPU."""
    if asked:
        return asked
    if device_type is None:
        return ENGINE_DTYPE
    return "float32" if device_type == "cpu" else "bf16"
