"""Move a batch's captured states to host memory while the next batch runs on the GPU.

A synchronous `.cpu()` per sample stalls the GPU for every copy and copies through pageable
memory. Here a batch's samples are packed on the device, copied once into pinned memory on
a side stream, and collected one batch later, so the copy overlaps the next forward.
For an fp8 store the packed states are quantized on the device first (`quantize_fp8`, same
bits as on the CPU), so the host receives 1 byte a value plus a float32 scale a row, not 2
bytes a value for the writer to quantize on the CPU.
The store writer copies the collected states into its shard buffers at once, so the pinned
memory is recycled batch after batch: a capture pins only a couple of batches.
"""

from __future__ import annotations

from typing import Callable

import torch

from eyas.store.format import quantize_fp8

# Per sample: hidden [T_i, L, H] on the host, and its fp8 scale [T_i, L] float32 when the
# hidden states were quantized here (None: as captured).
Staged = tuple[torch.Tensor, torch.Tensor | None]
Collect = Callable[[], list[Staged]]  # waits for the copy; per-sample host tensors


class HostStager:
    """`start(states)` begins the copy of per-sample device tensors `[T_i, L, H]`; the
    `collect` it returns waits for that copy and gives the host tensors, in order. With
    `fp8`, states on the capture device are quantized there; states already on the host
    (vLLM's spool) are handed back as they are, and the store writer quantizes them."""

    def __init__(self, device: torch.device, fp8: bool = False):
        self.device = device
        self.fp8 = fp8
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def start(self, states: list[torch.Tensor]) -> Collect:
        if not states or states[0].device.type != self.device.type:
            return lambda: [(s.cpu(), None) for s in states]  # already on the host (vLLM spool)
        if self.stream is None:  # a CPU capture: nothing to copy
            return lambda: [quantize_fp8(s) if self.fp8 else (s, None) for s in states]
        lengths = [len(s) for s in states]
        packed = torch.cat(states)  # [ΣT, L, H] on the device, ordered after the forward
        # fp8: hidden [ΣT, L, H] float8_e4m3fn and scale [ΣT, L] float32; else the states as captured
        parts = list(quantize_fp8(packed)) if self.fp8 else [packed]
        host = [torch.empty(p.shape, dtype=p.dtype, pin_memory=True) for p in parts]
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            for h, p in zip(host, parts):
                h.copy_(p, non_blocking=True)
        for p in parts:
            p.record_stream(self.stream)  # not reused by the next forward until copied
        done = self.stream.record_event()

        def collect() -> list[Staged]:
            done.synchronize()
            hidden = host[0].split(lengths)
            scales = host[1].split(lengths) if self.fp8 else [None] * len(lengths)
            return list(zip(hidden, scales))

        return collect
