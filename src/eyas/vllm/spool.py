"""The hand-off between eyas's connector (inside a vLLM worker) and the capture client.

One safetensors file per request in a spool folder: `hidden [T, L, H]` (the engine's
dtype), `token_ids [T]` (the prompt as the engine saw it) and the layer ids in the
metadata. The connector writes a temp name and renames it, so a file that exists is
complete. Nothing here imports vLLM: the endpoint client runs without it.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from eyas.errors import EyasError

FORMAT = "eyas-vllm-hidden-1"
# kv_transfer_params keys: the client names the file, the engine answers with its path or an error.
PARAM_KEY, PARAM_FILE, PARAM_ERROR = "eyas_key", "eyas_file", "eyas_error"
SUFFIX = ".safetensors"
# A key names one request's file; the client chooses it, so it must not be able to escape the folder.
KEY = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")


def spool_file(spool: str | Path, key: str) -> Path:
    if not KEY.fullmatch(key):
        raise ValueError(f"invalid spool key {key!r}")
    return Path(spool) / f"{key}{SUFFIX}"


def write_hidden(path: Path, hidden: torch.Tensor, token_ids: torch.Tensor, layer_ids: list[int]) -> None:
    """hidden [T, L, H] on the CPU, token_ids [T]; temp file then rename."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    save_file({"hidden": hidden.contiguous(), "token_ids": token_ids.to(torch.int64)}, str(tmp),
              metadata={"format": FORMAT, "layer_ids": ",".join(map(str, layer_ids))})
    os.replace(tmp, path)


def error_file(path: Path) -> Path:
    return path.with_name(path.name + ".error")


def write_error(path: Path, message: str) -> None:
    """Tell the waiting client that `path` will never be written, and why."""
    error_file(path).write_text(message)


def read_hidden(path: Path) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]:
    """-> (hidden [T, L, H], token_ids [T] int64, layer ids) from a complete spool file."""
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("format") != FORMAT:
                raise EyasError(f"{path} is not an eyas hidden-state file (format {meta.get('format')!r}).")
            layer_ids = tuple(int(x) for x in meta["layer_ids"].split(","))
            return f.get_tensor("hidden"), f.get_tensor("token_ids"), layer_ids
    except (SafetensorError, KeyError, ValueError) as e:
        raise EyasError(f"{path} is unreadable: {e}") from None


def wait_for(path: Path, timeout: float) -> str | None:
    """Poll until the connector has written `path` (None) or its error file (the message);
    raise `TimeoutError` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    delay = 0.001
    while not path.exists():
        if error_file(path).exists():
            return error_file(path).read_text()
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout:.0f} s")
        time.sleep(delay)
        delay = min(delay * 2, 0.05)
    return None
