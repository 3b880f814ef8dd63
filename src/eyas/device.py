"""Which device a stage runs on, decided in one place for every stage.

`--device auto`, every stage's default (eyas.device_flag), is CUDA when a GPU is visible and
the CPU otherwise. Under torchrun each process takes its own LOCAL_RANK's GPU, whatever index
was named.
"""

from __future__ import annotations

import os

import torch

from eyas.device_flag import AUTO
from eyas.errors import EyasError

GIB = 1 << 30


def resolve_device(name: str | None = AUTO) -> torch.device:
    """`name` (auto, cpu, cuda, cuda:I; None means auto) as the device this process uses, checked
    by `parse_device`; under torchrun a GPU is the local rank's."""
    dev = parse_device(name)
    if dev.type == "cuda":
        world, local_rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("LOCAL_RANK", "0"))
        dev = torch.device("cuda", local_rank if world > 1 else (dev.index or 0))
        torch.cuda.set_device(dev)
    return dev


def synchronize(device: torch.device) -> None:
    """Wait for `device`'s queued work (a no-op off CUDA): timings that must not run ahead."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def parse_device(name: str | None, option: str = "--device") -> torch.device:
    """`name` as a device that exists here, checked before any work: `auto` (or None) is the
    first GPU when one is visible, else the CPU. torch parses the name; a device it knows but
    this machine lacks (a GPU index past the last, `cuda` without a GPU, `mps` off a Mac) is
    refused in one line, as is a name torch does not know (`tpu`, `gpu0`)."""
    if name is None or name == AUTO:
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
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device.index or 0).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def free_bytes(device: torch.device) -> int:
    """The memory `device` has free now: a GPU's free memory plus what torch's cache holds
    unused; the host's available memory (free plus reclaimable caches, MemAvailable), or all
    of it where the system does not say."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return memory_bytes(device)


def check_fits(nbytes: int, device: torch.device, what: str, fix: str) -> None:
    """Refuse, before allocating, what cannot fit in `device`'s memory even if it had all of it."""
    have = memory_bytes(device)
    if nbytes > have:
        raise EyasError(f"{what} needs about {nbytes / GIB:,.1f} GiB, more than the {have / GIB:,.1f} GiB of "
                        f"{device}; {fix}.")
