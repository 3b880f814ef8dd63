"""The target during speculative decoding on a preallocated cache, each verification shape a
CUDA graph: `TargetSession`'s interface and answers, at the GPU's speed.

`TargetSession` (target.py) grows transformers' `DynamicCache` by concatenation and builds
its masks in Python every step; at batch 1 a forward of a small target is then mostly
launch overhead (16 ms a token for SmolLM2 on an H200, bench/README.md). Here:

- every layer's keys and values live in one buffer [1, nKV, capacity, d] (`SlotCache`), slot
  = position for committed tokens; a pass writes its rows at the slots after the committed
  ones and attends over the whole buffer through a 4D mask, which transformers passes through
  as it is; a pass of few rows attends on the math path (models/attention.py). Sliding-window layers keep every slot too; their mask hides what lies outside
  the window (key position > query position - window, transformers' rule).
- `commit` moves the accepted rows of a tree to the slots after the committed ones (a chain's
  are already there); rejected rows stay behind as garbage no mask ever shows.
- on CUDA, a pass of q rows replays the graph recorded for the next power of two of rows
  (padding rows see only themselves and nobody sees them) and of slots read (`read_width`); the
  prefill and passes over `GRAPH_ROWS` rows run eagerly, as everything does on the CPU.
- the cache grows (doubling, recording the graphs again) when a sequence outgrows it.
"""

from __future__ import annotations

import inspect

import torch

from eyas.models.attention import few_rows
from eyas.models.slots import SlotCache
from eyas.evaluate.target import attention_windows
from eyas.evaluate.tree import DraftTree
from eyas.models.graphs import Recorder, bucket
from eyas.models.states import hook_layer_inputs

GRAPH_ROWS = 128  # the widest verification pass recorded as a graph (a tree of 127 drafted nodes)
WIDTH_MIN = 256  # the fewest slots a recorded pass reads (`read_width`)
PREFILL_CHUNK = 1024  # prompt rows per eager prefill pass: its mask [rows, capacity] stays small


def read_width(slots: int, capacity: int) -> int:
    """The slots a recorded pass reads when its rows end at slot `slots`: the next power of two
    from WIDTH_MIN up, at most the capacity. A pass's attention costs what it reads, so a short
    sequence does not pay for the whole cache (a long-prompt run's capacity made every MT-bench
    step 10 ms against 5 at 2,304 slots on an H200), and a sequence records at most
    log2(capacity / WIDTH_MIN) + 1 graphs per row count."""
    return min(capacity, max(WIDTH_MIN, 1 << max(slots - 1, 0).bit_length()))


class StaticTargetSession:
    """One sequence at a time (batch 1): `prefill`, then `verify` / `commit` per step, as
    `TargetSession`; `graphs` (default: on CUDA) records verification passes as CUDA graphs."""

    def __init__(self, model, aux_layer_ids: tuple[int, ...] = (), capacity: int = 2048, graphs: bool | None = None):
        self.model = model
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.aux_layer_ids = tuple(aux_layer_ids)
        self.capture_aux = False
        self._aux: list[torch.Tensor | None] = [None] * len(self.aux_layer_ids)
        self._handles = hook_layer_inputs(model, self.aux_layer_ids, self._keep)
        self.windows = attention_windows(model.config)
        self.graphs = Recorder(self.device, graphs is not False, f"{type(model).__name__}'s forward")
        self.cache = SlotCache(capacity)
        self._keeps_logits = "logits_to_keep" in inspect.signature(model.forward).parameters
        self.length = 0
        self.eager_passes = 0

    def _keep(self, slot: int, hidden: torch.Tensor) -> None:
        self._aux[slot] = hidden  # [1, q, H]

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self.graphs.drop()

    def _take_aux(self) -> torch.Tensor | None:
        """The hooks' states of the last forward, [q, L, H] (None without aux layers)."""
        aux = torch.stack([a[0] for a in self._aux], dim=1) if self.aux_layer_ids and self._aux[0] is not None else None
        self._aux = [None] * len(self.aux_layer_ids)
        return aux

    def _reserve(self, rows: int) -> None:
        """Room for `rows` more slots after the committed ones."""
        if self.cache.reserve(self.length + rows):
            self.graphs.drop()

    def _masks(self, positions: torch.Tensor, ancestors: torch.Tensor, start: torch.Tensor, C: int
               ) -> dict[str, torch.Tensor]:
        """Per layer kind, the additive mask [1, 1, q, C] over the first C slots of rows at
        `positions` [q] written at the slots from `start` [1] on: row r sees the slots before
        `start`, the rows `ancestors` [q, q] (bool) gives it, and a sliding layer only keys within
        its window. Built on the device from these small tensors, so that a recorded pass builds
        its own masks and a step copies in only its rows."""
        q = len(positions)
        key = torch.arange(C, device=self.device)  # [C]
        slots = start + torch.arange(q, device=self.device)  # [q]
        visible = (key < start).expand(q, C).clone()  # [q, C]
        visible[:, slots] = ancestors
        key_pos = key.clone()
        key_pos[slots] = positions
        out = {}
        for kind, window in self.windows.items():
            seen = visible if window is None else visible & (positions[:, None] - key_pos[None, :] < window)
            mask = torch.zeros(q, C, dtype=self.dtype, device=self.device).masked_fill_(~seen, torch.finfo(self.dtype).min)
            out[kind] = mask[None, None]
        return out

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, ancestors: torch.Tensor, start: torch.Tensor,
                 width: int, **extra):
        """ids, positions [q], ancestors [q, q], start [1] (device) -> logits [1, q, V], aux: the rows
        written at the slots from `start` on, reading the first `width` slots."""
        masks = self._masks(positions, ancestors, start, width)
        self.cache.aim(start + torch.arange(len(ids), device=self.device), width)
        with few_rows(self.model):
            out = self.model(input_ids=ids[None], position_ids=positions[None], past_key_values=self.cache,
                             use_cache=True, attention_mask=next(iter(masks.values())) if len(masks) == 1 else masks,
                             **extra)
        return out.logits, self._take_aux()

    def _pass(self, ids: torch.Tensor, positions: torch.Tensor, ancestors: torch.Tensor, last_only: bool = False):
        """Rows ids, positions [q], ancestors [q, q] (host tensors) at the slots after the committed
        ones -> logits [q, V] (or with `last_only` [1, V]) float32 and aux [q, L, H] or None.
        On CUDA a pass of up to GRAPH_ROWS rows replays the graph of the next power of two rows:
        padding rows sit after the real ones, see only themselves and are seen by none."""
        q = len(ids)
        rows = bucket(q, GRAPH_ROWS) if self.graphs.enabled and not last_only else None
        self._reserve(rows or q)
        start = torch.tensor([self.length])
        if rows:
            pad = rows - q
            full = torch.eye(rows, dtype=torch.bool)
            full[:q, :q] = ancestors
            inputs = {"ids": torch.cat([ids, ids.new_zeros(pad)]), "positions": torch.cat([positions, positions[-1:].expand(pad)]),
                      "ancestors": full, "start": start}
            width = read_width(self.length + rows, self.cache.capacity)
            out = self.graphs.run((rows, width), inputs, lambda s: self._forward(
                s["ids"], s["positions"], s["ancestors"], s["start"], width))
            if out is not None:
                logits, aux = out
                return (logits[0, :q].to(torch.float32, copy=True),
                        aux[:q].clone() if aux is not None and self.capture_aux else None)
        extra = {"logits_to_keep": 1} if last_only and self._keeps_logits else {}
        dev = self.device
        logits, aux = self._forward(ids.to(dev), positions.to(dev), ancestors.to(dev), start.to(dev), self.length + q,
                                    **extra)
        self.eager_passes += 1
        return logits[0].float(), aux if self.capture_aux else None

    @torch.inference_mode()
    def prefill(self, prompt_ids: torch.Tensor):
        """prompt_ids [T] -> logits of the last position [V], aux states [T, L, H] or None."""
        T = len(prompt_ids)
        self.length = 0
        self._reserve(T)
        ids = prompt_ids.cpu()
        auxes = []
        for c0 in range(0, T, PREFILL_CHUNK):
            chunk = ids[c0:c0 + PREFILL_CHUNK]
            n = len(chunk)
            causal = torch.ones(n, n, dtype=torch.bool).tril()
            logits, aux = self._pass(chunk, torch.arange(c0, c0 + n), causal, last_only=True)
            auxes.append(aux)
            self.length = self.cache.seen = c0 + n
        aux = torch.cat(auxes) if self.capture_aux and self.aux_layer_ids else None
        return logits[-1], aux

    @torch.inference_mode()
    def verify(self, root: int, tree: DraftTree):
        """The root token and every drafted node in one pass -> logits [M + 1, V] (row 0: after
        the root, row i + 1: after node i) and aux [M + 1, L, H]; the rows stay in the cache
        until `commit` keeps the accepted ones."""
        ids = torch.tensor([root, *tree.tokens], dtype=torch.long)
        positions = self.length + torch.tensor([0, *tree.depths()], dtype=torch.long)
        return self._pass(ids, positions, tree.ancestor_mask())

    @torch.inference_mode()
    def commit(self, rows: list[int]) -> None:
        """Keep the verified rows `rows` (0 = the root, then the accepted nodes, in path order)."""
        if rows != list(range(len(rows))):  # a chain's rows are already where they belong
            self.cache.gather(self.length, self.length + torch.tensor(rows, device=self.device))
        self.length += len(rows)
        self.cache.seen = self.length

