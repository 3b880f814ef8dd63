"""Read one prompt's rows out of vLLM's hidden-state cache, on any device (no vLLM import,
so the GPU path is tested on machines without vLLM)."""

from __future__ import annotations

from typing import Any

import torch


def copy_rows(cache: torch.Tensor, block_ids: list[int], num_tokens: int) -> tuple[torch.Tensor, Any]:
    """cache [blocks, L, block_size, H] (the layout vLLM's cache-only layer writes) ->
    (rows [T, L, H] on the CPU, event). On a GPU the copy into pinned memory is
    asynchronous and `event` marks its end; on the CPU the rows are ready and event is None."""
    block_size = cache.shape[2]
    pos = torch.arange(num_tokens)
    blocks = torch.tensor(block_ids, dtype=torch.long)[pos // block_size]
    rows = cache[blocks.to(cache.device, non_blocking=True), :, (pos % block_size).to(cache.device, non_blocking=True)]
    if not rows.is_cuda:
        return rows, None  # advanced indexing already made a copy
    host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
    host.copy_(rows, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return host, event
