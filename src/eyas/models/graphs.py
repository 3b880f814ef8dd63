"""CUDA graphs for decoding: a forward of fixed shapes recorded once and replayed per step.

Decoding a small model at batch 1 is bound by kernel launches, not by the GPU: a forward is
hundreds of small kernels, each launched from Python. A CUDA graph replays them all with one
launch (gpt-fast's `reduce-overhead`, vLLM's and SGLang's decode graphs). A graph reads and
writes fixed addresses, so the caller keeps its inputs in static buffers, copies each step's
values into them, replays, and copies the outputs out before the next replay overwrites them.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


def capture(fn: Callable[[], T], pool=None) -> tuple[torch.cuda.CUDAGraph, T]:
    """Record `fn` (which reads and writes only tensors that outlive the graph) as a CUDA graph.

    One eager call on a side stream first: kernels are chosen and lazily allocated buffers
    (caches, workspaces) are created outside the recording, as torch's graph docs require.
    Returns the graph and `fn`'s outputs, the tensors each replay rewrites. Graphs given the
    same `pool` share memory: replay them one at a time, copying outputs out in between."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    return graph, out


def bucket(n: int, largest: int) -> int | None:
    """The recorded row count a pass of `n` rows is padded to: the next power of two, or None
    above `largest` (such a pass runs eagerly)."""
    size = 1 << max(0, n - 1).bit_length()
    return size if size <= largest else None


class Recorder:
    """Graphs of one session, keyed by the shapes they were recorded for, sharing one memory
    pool. `run(key, inputs, fn)` records `fn(static)` at the key's first use (`static`: device
    copies of `inputs`, which may be host tensors, that the graph reads), and at every use
    copies `inputs` in and replays, returning
    the graph's own output tensors: copy them out before the next replay. Off the GPU, when
    disabled, or once a recording failed (said in one line, then eager for good), it returns
    None and the caller runs `fn` eagerly. So `fn` must return tensors, never None, even when
    only its writes matter: else a replay would read as "not replayed" and run `fn` again."""

    def __init__(self, device: torch.device, enabled: bool, what: str):
        self.enabled = enabled and device.type == "cuda"
        self.device = device
        self.what = what
        self.graphs: dict = {}
        self.pool = None
        self.replays = 0

    def drop(self) -> None:
        """Forget every graph: the buffers they read were replaced (a cache grew)."""
        self.graphs, self.pool = {}, None

    def run(self, key, inputs: dict[str, torch.Tensor], fn: Callable[[dict[str, torch.Tensor]], T]) -> T | None:
        if not self.enabled:
            return None
        entry = self.graphs.get(key)
        if entry is None:
            static = {name: t.to(self.device, copy=True) for name, t in inputs.items()}
            try:
                self.pool = self.pool or torch.cuda.graph_pool_handle()
                graph, out = capture(lambda: fn(static), self.pool)
            except Exception as e:  # noqa: BLE001 -- any failure to record leaves the eager path, which is exact
                print(f"eyas: {self.what} cannot be recorded as a CUDA graph ({str(e).splitlines()[0][:160]}); it "
                      f"runs eagerly.", file=sys.stderr, flush=True)
                self.enabled = False
                self.drop()
                return None
            if out is None:  # a caller's bug: every replay would be taken for "not replayed" and run again
                raise TypeError(f"{self.what}: the pass recorded for {key!r} returns None; return its output tensors.")
            entry = self.graphs[key] = (static, graph, out)
        static, graph, out = entry
        for name, t in inputs.items():
            static[name].copy_(t)
        graph.replay()
        self.replays += 1
        return out
