"""Greedy decoding at volume: transformers' own model, eyas's cache and loop.

Prompts are sorted by length into large left-padded batches. Each batch is a prefill and
then one forward per new token over a `SlotCache` sized for the batch, so the cache never grows
and nothing is re-padded. A boolean 4D mask (which transformers passes through as it is) marks
each row's padding.

The prefill runs a few rows of like length at a time (`PREFILL_TOKENS`), each part padded only
to its own longest prompt: padded to the batch's longest, most of a batch's prefill computed
padding. Decoding computes all live rows at once. On a GPU each decode step is one CUDA graph
replay (models/graphs.py), recorded per (rows, slots read): a forward of a small target is
hundreds of kernels, and launching them one by one from Python cost as much as running them.

Decode attention, on CUDA for targets `attention.flex_fits` takes, is flex attention over a
block mask per row (`attention.rows_block_mask`): each row reads its own slots, not the batch's
padding nor the slots not yet written, and a graph is recorded once per row count. Otherwise it
is models/attention.py's math path for few query rows (the query heads that share a KV head
folded into the query axis) over the slots written so far, rounded up to KV_ALIGN.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch

from eyas.device import synchronize
from eyas.errors import EyasError
from eyas.models import attention
from eyas.models.eos import cut_at_stop
from eyas.models.graphs import Recorder
from eyas.models.slots import SlotCache

# `StaticGreedy` rounds its cache reads up to a multiple of this many slots by default (the
# extra slots are masked). Cut at the exact written length, the cache slice and its mask lose
# the alignment sdpa's kernels want, and on an H200 a decode step took 110 ms instead of the
# 46 ms of reading the whole cache (bench/speed_probe.py --parts decode). On a GPU it is also
# how often a new decode graph is recorded: every KV_ALIGN steps.
KV_ALIGN = 64
# Prompt tokens (rows x the part's longest prompt) a prefill part computes at most: enough
# rows that one forward fills the GPU, few enough that a part's prompts are of like length.
PREFILL_TOKENS = 1 << 16


def supports_static(model) -> bool:
    """Full-attention decoders only: a sliding-window layer needs a mask this loop does not build.
    Nor a model that soft-caps its attention scores (Gemma-2's `attn_logit_softcapping`): this
    loop's attention would drop the cap, so such a model decodes with `model.generate` and its own
    (eager, see eyas.models.load) attention."""
    config = model.config.get_text_config(decoder=True)
    types = getattr(config, "layer_types", None) or []
    return (not getattr(config, "sliding_window", None) and all(t == "full_attention" for t in types)
            and getattr(config, "attn_logit_softcapping", None) is None)


class StaticGreedy:
    """Greedy continuations of many prompts; equal, token for token, to `model.generate`
    with do_sample=False (tests/test_regenerate.py checks it on the real SmolLM2).

    Each forward reads the cache slots written so far, rounded up to a multiple of `kv_align`
    (KV_ALIGN unless given; one at least as long as the cache reads all of it). `graphs`
    (default: on CUDA) records each decode step's shapes as a CUDA graph; a target whose step
    cannot be recorded is said in one line and decodes eagerly. `flex` (default: on CUDA)
    decodes with flex attention where the target's head dims allow; `prefill_tokens` bounds a
    prefill part (one part per batch: the batch padded whole, as before parts)."""

    def __init__(self, model, pad_id: int, stops: list[int], cache_tokens: int, max_rows: int = 4096,
                 kv_align: int | None = None, graphs: bool | None = None, flex: bool | None = None,
                 prefill_tokens: int = PREFILL_TOKENS):
        if not supports_static(model):
            raise EyasError(f"{type(model).__name__} has sliding-window layers or soft-capped attention scores, which "
                            f"this greedy loop would not compute; decode it with model.generate (HFGenerator does).")
        attention.register()
        model.set_attn_implementation(attention.NAME)
        self.model, self.pad, self.stops = model, pad_id, stops
        self.cache_tokens, self.max_rows, self.prefill_tokens = cache_tokens, max_rows, prefill_tokens
        self.kv_align = kv_align or KV_ALIGN
        self.device = next(model.parameters()).device
        self.graphs = Recorder(self.device, graphs is not False, f"{type(model).__name__}'s decode step")
        # Flex decode attention: by default on CUDA, where it compiles to one kernel (off it,
        # flex is an unfused reference that tests run).
        self.flex = (self.device.type == "cuda" if flex is None else flex) and attention.flex_fits(model.config)
        heads, kv_heads, _, _ = attention.kv_layout(model.config)
        self.group = heads // kv_heads  # query heads per KV head: flex's query rows per batch row
        # Where the time goes, summed over batches: prefill and decode seconds, and decode's
        # row-steps computed against those that produced a kept token (rows that stopped ride
        # along until a quarter of the batch has stopped; then the batch is compacted).
        self.stats = {"batches": 0, "prefill_s": 0.0, "decode_s": 0.0, "row_steps": 0, "kept_tokens": 0,
                      "compactions": 0}

    def generate(self, prompts: list[list[int]], budgets: list[int]) -> list[list[int]]:
        """Each prompt's continuation: at most its budget of tokens, cut before the first stop id."""
        order = sorted(range(len(prompts)), key=lambda i: (len(prompts[i]), budgets[i]))
        out: list[list[int]] = [[] for _ in prompts]
        for rows in self._batches(order, prompts, budgets):
            for i, ids in zip(rows, self._batch([prompts[i] for i in rows], [budgets[i] for i in rows])):
                out[i] = ids
        return out

    def _batches(self, order: list[int], prompts: list[list[int]], budgets: list[int]) -> Iterator[list[int]]:
        """Consecutive runs of the length order whose rows x (longest prompt + largest budget)
        fit `cache_tokens` cache slots."""
        rows: list[int] = []
        width = 0
        for i in order:
            w = max(width, len(prompts[i]) + budgets[i])
            if rows and (len(rows) >= self.max_rows or (len(rows) + 1) * w > self.cache_tokens):
                yield rows
                rows, w = [], len(prompts[i]) + budgets[i]
            rows.append(i)
            width = w
        if rows:
            yield rows

    def _slots(self, written: int, capacity: int) -> int:
        """The cache slots a forward reads when `written` are written: rounded up to kv_align,
        at most the cache's `capacity`."""
        return min(self.kv_align * -(-written // self.kv_align), capacity)

    def _parts(self, lengths: list[int]) -> Iterator[tuple[int, int, int]]:
        """(r0, r1, longest): consecutive row ranges of a batch (its prompts sorted by length),
        each a prefill part of at most `prefill_tokens` padded prompt tokens, one row at least."""
        r0, longest = 0, 0
        for r, n in enumerate(lengths):
            if r > r0 and (r + 1 - r0) * max(longest, n) > self.prefill_tokens:
                yield r0, r, longest
                r0, longest = r, 0
            longest = max(longest, n)
        if lengths:
            yield r0, len(lengths), longest

    def _prefill(self, cache: SlotCache, ids: torch.Tensor, real: torch.Tensor, lengths: torch.Tensor, rows: slice,
                 longest: int) -> torch.Tensor:
        """Prefill the batch rows `rows` (prompts of at most `longest` tokens) into their cache
        rows, reading keys only from their part's padding on (aligned down to KV_ALIGN); in
        chunks of prompt positions, so that a part's activations (and sdpa's scores, if it falls
        back to its math kernel) stay a fraction of its cache. -> the rows' first new tokens [r]."""
        T, L, dev = ids.shape[1], real.shape[1], ids.device
        slots = torch.arange(L, device=dev)
        start = (T - longest) // self.kv_align * self.kv_align
        n = rows.stop - rows.start
        chunk = max(1, self.cache_tokens // (4 * n))
        for c0 in range(T - longest, T, chunk):
            q = slots[c0 : min(c0 + chunk, T)]  # [c]
            width = self._slots(min(c0 + chunk, T), L)
            keys = slots[start:width]
            # A padding query sees only itself, so no row is fully masked (sdpa would give NaN).
            mask = ((real[rows, None, start:width] & (keys[None, :] <= q[:, None])[None])
                    | (keys[None, None] == q[None, :, None]))  # [r, c, width - start]
            cache.aim(q, width, start, rows)
            logits = self.model(input_ids=ids[rows, q], attention_mask=mask[:, None],
                                position_ids=(q[None] - (T - lengths[rows])[:, None]).clamp_min(0),
                                past_key_values=cache, cache_position=q, use_cache=True, logits_to_keep=1).logits
        return logits[:, -1].argmax(-1)

    @torch.inference_mode()
    def _batch(self, prompts: list[list[int]], budgets: list[int]) -> list[list[int]]:
        dev = self.device
        started = time.monotonic()
        B, T, N = len(prompts), max(map(len, prompts)), max(budgets)
        L = T + N
        ids = torch.full((B, T), self.pad, dtype=torch.long)  # [B, T], left-padded
        for b, p in enumerate(prompts):
            ids[b, T - len(p):] = torch.tensor(p)
        lengths = torch.tensor([len(p) for p in prompts], device=dev)
        slots = torch.arange(L, device=dev)
        real = slots[None] >= (T - lengths)[:, None]  # [B, L]: every slot but the row's left padding
        cache = SlotCache(L, B)
        self.graphs.drop()  # the last batch's graphs read its cache
        ids = ids.to(dev)
        token = torch.empty(B, dtype=torch.long, device=dev)  # [B]: each row's first answer token
        for r0, r1, longest in self._parts([len(p) for p in prompts]):
            token[r0:r1] = self._prefill(cache, ids, real, lengths, slice(r0, r1), longest)
        synchronize(dev)
        prefilled = time.monotonic()
        stops = torch.tensor(self.stops, device=dev)
        budget = torch.tensor(budgets, device=dev)
        rows = torch.arange(B, device=dev)  # [b]: the batch row each live row came from
        generated = torch.full((B, N), self.pad, dtype=torch.long, device=dev)
        done = torch.zeros(B, dtype=torch.bool, device=dev)
        step = torch.zeros(1, dtype=torch.long, device=dev)  # the step decoding, on the device: a graph reads it

        def decode(inputs: dict[str, torch.Tensor]) -> torch.Tensor:
            """The next token [b] after `token` [b] at step `step` [1], reading `width` slots."""
            slot = T + inputs["step"]  # [1]
            cache.aim(slot, width)
            mask = (real[:, :width] & (slots[None, :width] <= slot))[:, None, None]  # [b, 1, 1, width]
            blocks = {"blocks": attention.rows_block_mask(T - lengths, slot, L, self.group)} if self.flex else {}
            return self.model(input_ids=inputs["token"][:, None], attention_mask=mask,
                              position_ids=(lengths + inputs["step"])[:, None], past_key_values=cache,
                              cache_position=slot, use_cache=True, **blocks).logits[:, -1].argmax(-1)

        row_steps = 0
        for s in range(N):
            generated[rows, s] = token
            done |= torch.isin(token, stops) | (budget <= s + 1)
            row_steps += len(rows)
            if s + 1 == N:
                break
            # Checking on the host costs a sync: every 8 steps lets the host run ahead of the GPU.
            if s % 8 == 7:
                live = int((~done).sum())
                if live == 0:
                    generated = generated[:, : s + 1]
                    break
                if live <= 3 * len(rows) // 4 and N - s > 16:
                    # A quarter of the rows have stopped: drop them (a copy of the cache costs
                    # about two steps), so the rest decode at their own batch size instead of
                    # carrying finished rows to the batch's end.
                    keep = (~done).nonzero().squeeze(1)  # [live]
                    rows, real, lengths, budget, done, token = (t[keep] for t in (rows, real, lengths, budget, done,
                                                                                  token))
                    cache.keep_rows(keep)
                    self.graphs.drop()
                    self.stats["compactions"] += 1
            width = L if self.flex else self._slots(T + s + 1, L)  # flex reads each row's own blocks
            inputs = {"token": token, "step": step}
            token = self.graphs.run((len(rows), width), inputs, decode)
            token = decode(inputs) if token is None else token
            step += 1
        out = [cut_at_stop(g[:n], self.stops) for g, n in zip(generated.tolist(), budgets)]
        st = self.stats
        st["batches"] += 1
        st["prefill_s"] += prefilled - started
        st["decode_s"] += time.monotonic() - prefilled
        st["row_steps"] += row_steps
        st["kept_tokens"] += sum(map(len, out))
        return out
