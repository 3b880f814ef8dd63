"""Which device a stage runs on, decided in one place for every stage.

`--device auto`, every stage's default, is CUDA when a GPU is visible and the CPU otherwise.
Under torchrun each process takes its own LOCAL_RANK's GPU, whatever index was named.
torch is imported inside the functions: the CLI's parser uses only the option below.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from eyas.errors import EyasError

if TYPE_CHECKING:
    import argparse

    import torch

AUTO = "auto"
DEVICE_HELP = "auto (default): CUDA when a GPU is visible, else the CPU; or cpu, cuda, cuda:I"
TORCHRUN_NOTE = "under torchrun each process takes its LOCAL_RANK's GPU"


def add_device_argument(p: argparse.ArgumentParser | argparse._ArgumentGroup, note: str = "") -> None:
    """Every stage's `--device`: same name, default and help (`note` says what it applies to)."""
    p.add_argument("--device", default=AUTO, help=DEVICE_HELP + (f"; {note}" if note else ""))


def resolve_device(name: str | None = AUTO) -> torch.device:
    """`name` (auto, cpu, cuda, cuda:I; None means auto) as the device this process uses."""
    import torch

    if name in (None, AUTO):
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise EyasError(f"--device {name}: not a device; use auto, cpu, cuda or cuda:I.") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise EyasError(f"--device {name}: no CUDA device is visible (--device auto uses the CPU then).")
        world, local_rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("LOCAL_RANK", "0"))
        dev = torch.device("cuda", local_rank if world > 1 else (dev.index or 0))
        torch.cuda.set_device(dev)
    return dev


def default_model_dtype(device_type: str) -> str:
    """The dtype a target runs in when none is given: float32 on the CPU, bf16 on a GPU."""
    return "float32" if device_type == "cpu" else "bf16"


def synchronize(device: torch.device) -> None:
    """Wait for `device`'s queued work (a no-op off CUDA): timings that must not run ahead."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
