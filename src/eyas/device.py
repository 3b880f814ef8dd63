"""Which device a stage runs on, decided in one place for every stage.

`--device auto`, every stage's default, is CUDA when a GPU is visible and the CPU otherwise.
Under torchrun each process takes its own LOCAL_RANK's GPU, whatever index was named.
torch is imported inside the functions: the CLI's parser uses only the names below
(eyas.options device_option).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from eyas.errors import EyasError

if TYPE_CHECKING:
    import torch

AUTO = "auto"
DEVICE_HELP = "auto (default): CUDA when a GPU is visible, else the CPU; or cpu, cuda, cuda:I"
TORCHRUN_NOTE = "under torchrun each process takes its LOCAL_RANK's GPU"
GIB = 1 << 30


def resolve_device(name: str | None = AUTO) -> torch.device:
    """`name` (auto, cpu, cuda, cuda:I; None means auto) as the device this process uses, checked
    by `parse_device`; under torchrun a GPU is the local rank's."""
    import torch

    dev = parse_device(name)
    if dev.type == "cuda":
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


def parse_device(name: str | None, option: str = "--device") -> torch.device:
    """`name` as a device that exists here, checked before any work: `auto` (or None) is the
    first GPU when one is visible, else the CPU. torch parses the name; a device it knows but
    this machine lacks (a GPU index past the last, `cuda` without a GPU, `mps` off a Mac) is
    refused in one line, as is a name torch does not know (`tpu`, `gpu0`)."""
    import torch

    if name is None or name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError, TypeError):
        raise EyasError(f"{option} {name!r} is not a device name; use cpu, cuda, cuda:N or auto.") from None
    if device.type == "cpu":
        return device
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise EyasError(f"{option} {name}: no CUDA device is visible here; use cpu or auto.")
        if device.index is not None and device.index >= count:
            raise EyasError(f"{option} {name}: this machine has {count} CUDA device(s), cuda:0..cuda:{count - 1}.")
        return device
    if device.type == "mps" and torch.backends.mps.is_available():
        raise EyasError(f"{option} {name}: eyas runs on cpu or cuda; mps is not supported.")
    raise EyasError(f"{option} {name}: no {device.type} device here; eyas runs on cpu, cuda, cuda:N or auto.")


def memory_bytes(device: torch.device) -> int:
    """All the memory of `device`: a GPU's total, or the machine's physical memory."""
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_properties(device.index or 0).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_fits(nbytes: int, device: torch.device, what: str, fix: str) -> None:
    """Refuse, before allocating, what cannot fit in `device`'s memory even if it had all of it."""
    have = memory_bytes(device)
    if nbytes > have:
        raise EyasError(f"{what} needs about {nbytes / GIB:,.1f} GiB, more than the {have / GIB:,.1f} GiB of "
                        f"{device}; {fix}.")
