"""Data parallelism through torchrun's own environment: DDP (gloo on CPU, NCCL on GPU), or
FSDP2 (`fully_shard`) for a head too big for one GPU. Nothing home-made: one process per
device, torch's process group, torch's wrappers and torch's state-dict helpers."""

from __future__ import annotations

import contextlib
import os
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from eyas.device import resolve_device
from eyas.device_flag import AUTO
from eyas.errors import EyasError


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    fsdp: bool = False

    @property
    def enabled(self) -> bool:
        return self.world > 1

    @property
    def main(self) -> bool:
        return self.rank == 0


def init(device: str | None, fsdp: bool) -> tuple[Dist, torch.device]:
    """Join torchrun's process group when WORLD_SIZE > 1; pick this process's device
    (`eyas.device.resolve_device`: under torchrun, the local rank's GPU)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    dev = resolve_device(device)
    if world > 1 and dev.type == "cpu" and rank == 0:
        why = "no CUDA device is visible" if device in (None, AUTO) else f"--device {device}"
        print(f"eyas: {world} torchrun processes on the CPU ({why}): gloo, every process sharing this "
              f"machine's cores", file=sys.stderr, flush=True)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if dev.type == "cuda" else "gloo", device_id=dev if dev.type == "cuda" else None)
    return Dist(rank=rank, world=world, local_rank=local_rank, fsdp=fsdp), dev


def wrap(module: nn.Module, d: Dist, device: torch.device) -> nn.Module:
    """DDP, or FSDP2: weights, gradients and optimizer state sharded across the processes and
    gathered once per forward (the drafter calls its layer piecewise during TTT, so it is one
    group). The frozen target embeddings stay whole on every device: never updated, they
    need no sharded optimizer state, and re-gathering them each TTT step would cost more."""
    if d.fsdp:
        if not d.enabled:
            raise EyasError("--fsdp shards across processes: start with torchrun --nproc-per-node N (N > 1).")
        mesh = init_device_mesh(device.type, (d.world,))
        fully_shard(module, mesh=mesh, ignored_params={module.embed_tokens.weight})
        return module
    if d.enabled:
        # The buffers (d2t, t2d) never change: no broadcast per forward.
        return DistributedDataParallel(module, device_ids=[device.index] if device.type == "cuda" else None,
                                       broadcast_buffers=False)
    return module


def no_sync(module: nn.Module, last: bool):
    """Skip the gradient all-reduce on every micro-batch of a step but the last."""
    if last:
        return contextlib.nullcontext()
    if hasattr(module, "no_sync"):  # DDP
        return module.no_sync()
    if hasattr(module, "set_requires_gradient_sync"):  # FSDP2
        return _fsdp_no_sync(module)
    return contextlib.nullcontext()


@contextlib.contextmanager
def _fsdp_no_sync(module):
    module.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)


def all_reduce(t: torch.Tensor, d: Dist, op: str = "sum") -> torch.Tensor:
    """Sum (or "max") over processes, in place; returns t."""
    if d.enabled:
        dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op])
    return t


def max_over_processes(value: float, d: Dist, device: torch.device) -> float:
    """The largest of each process's `value`; in one process the value itself, with no trip
    through the device (a per-step read there would wait for the step's queued work)."""
    if not d.enabled:
        return value
    t = torch.tensor([value], device=device, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def barrier(d: Dist) -> None:
    if d.enabled:
        dist.barrier()


# gloo's process group joins its worker threads in its destructor without releasing the GIL
# (pytorch#56297, #75097). A worker still dropping a finished collective's tensors, which Python
# owns, waits for the GIL there, and the process hangs at exit: a CPU torchrun test hung 30
# minutes so. Sleeping releases the GIL, so the workers finish before the group is destroyed.
GLOO_SETTLE_S = 0.2


def shutdown(d: Dist) -> None:
    if d.enabled and dist.is_initialized():
        if dist.get_backend() == "gloo":
            time.sleep(GLOO_SETTLE_S)
        dist.destroy_process_group()
