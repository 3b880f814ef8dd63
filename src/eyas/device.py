"""Small device helpers shared by the stages."""

from __future__ import annotations

import torch


def synchronize(device: torch.device) -> None:
    """Wait for `device`'s queued work (a no-op off CUDA): timings that must not run ahead."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
