"""Seconds per part of a loop (a training step, a decoding step), summed over the calls it is
given to: for benchmarks (bench/speed_gpu.py, bench/parallel_gpu.py). Each part runs with the
device synchronised before and after it, so parts never overlap as they do in a plain run and
their sum exceeds its time. Code given no timer pays nothing for it."""

from __future__ import annotations

import contextlib
import time
from typing import Iterator

import torch

from eyas.device import synchronize


class StepTimer:
    """train_step's parts: weights, load, labels, forward, backward (per micro-batch), clip,
    checks (the step's one read of its flags), optimizer and weight_check; a decoding step's:
    draft (propose and the drafter's update) and verify."""

    def __init__(self, device: torch.device):
        self.device = device
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def part(self, name: str) -> Iterator[None]:
        synchronize(self.device)
        start = time.perf_counter()
        try:
            yield
        finally:
            synchronize(self.device)
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start


def timed(timer: StepTimer | None, name: str):
    """`timer.part(name)`, or nothing without a timer."""
    return timer.part(name) if timer is not None else contextlib.nullcontext()
