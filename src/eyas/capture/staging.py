"""Move a batch's captured states to host memory while the next batch runs on the GPU.

A synchronous `.cpu()` per sample stalls the GPU for every copy and copies through pageable
memory. Here a batch's samples are packed on the device, copied once into pinned memory on
a side stream, and collected one batch later, so the copy overlaps the next forward.
The store writer copies the collected states into its shard buffers at once, so the pinned
memory is recycled batch after batch: a capture pins only a couple of batches.
"""

from __future__ import annotations

from typing import Callable

import torch

Collect = Callable[[], list[torch.Tensor]]  # waits for the copy; per-sample host tensors


class HostStager:
    """`start(states)` begins the copy of per-sample device tensors `[T_i, L, H]`; the
    `collect` it returns waits for that copy and gives the host tensors, in order."""

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def start(self, states: list[torch.Tensor]) -> Collect:
        if self.stream is None or not states or states[0].device.type != "cuda":
            return lambda: [s.cpu() for s in states]  # already on the host (CPU, vLLM spool)
        lengths = [len(s) for s in states]
        packed = torch.cat(states)  # [ΣT, L, H] on the device, ordered after the forward
        host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            host.copy_(packed, non_blocking=True)
        packed.record_stream(self.stream)  # not reused by the next forward until copied
        done = self.stream.record_event()

        def collect() -> list[torch.Tensor]:
            done.synchronize()
            return list(host.split(lengths))

        return collect
