"""The target's attention on eyas's preallocated caches (models/slots.py), for regenerate's
greedy loop and eval's static passes.

A decode or verification pass has a few query rows against a cache of hundreds to thousands
of slots. Given a mask, torch's sdpa runs that on the memory-efficient kernel, which tiles
queries 64 rows at a time and walks the keys of a (row tile, head) in one thread block: at
batch 1 that is a handful of blocks on a GPU of 132 multiprocessors, each walking the whole
cache. On an H200 it was 7.7 of a SmolLM2 decode step's 10.1 ms of GPU time, against 2.6 ms
for the whole step of the eager path, whose sdpa took the math kernel (bench/README.md).

So passes of up to `FEW_ROWS` query rows take the math path: two matrix products and a
softmax, computed as transformers' eager attention computes them (softmax in float32), with
the query heads that share a KV head folded into the query axis ([B, nKV, group * q, d]
against the cache's own [B, nKV, S, d]) rather than the cache repeated per query head, as
transformers does whenever a mask is given. Longer passes (prefill) keep transformers' sdpa.
Only targets that run sdpa use it (`swappable`): a family whose attention computes more
(Gemma-2's soft-capped scores, which eyas runs eagerly) keeps its own.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "eyas_few_rows"
FEW_ROWS = 128  # query rows up to which a pass takes the math path: eval's widest recorded pass


def folded_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                     **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: query [B, nH, q, d], key/value [B, nKV, S, d],
    mask [B, 1, q, >=S] (additive, or bool where True attends) -> output [B, q, nH, dv]."""
    B, n_heads, q, d = query.shape
    n_kv, S = key.shape[1], key.shape[2]
    group = n_heads // n_kv
    scale = d**-0.5 if scaling is None else scaling
    folded = query.reshape(B, n_kv, group * q, d)  # head h reads KV head h // group, as repeat_kv pairs them
    scores = torch.matmul(folded, key.transpose(2, 3)).view(B, n_kv, group, q, S) * scale
    if attention_mask is not None:
        mask = attention_mask[:, :, None, :, :S]  # [B, 1, 1, q, S]
        scores = (scores.masked_fill(~mask, torch.finfo(scores.dtype).min) if mask.dtype == torch.bool
                  else scores + mask)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)  # [B, nKV, group, q, S]
    out = torch.matmul(probs.view(B, n_kv, group * q, S), value)  # [B, nKV, group * q, dv]
    return out.view(B, n_heads, q, -1).transpose(1, 2).contiguous(), None


def few_rows_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: torch.Tensor | None, **kwargs):
    """The folded math path for up to FEW_ROWS query rows; transformers' sdpa for more, and for
    several rows without a mask (transformers then leaves causality to sdpa's `is_causal`)."""
    if query.shape[2] == 1 or (query.shape[2] <= FEW_ROWS and attention_mask is not None):
        return folded_attention(module, query, key, value, attention_mask, **kwargs)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


@functools.cache
def register() -> None:
    """Make NAME an attention implementation transformers knows (once per process)."""
    AttentionInterface.register(NAME, few_rows_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)


def swappable(model) -> bool:
    """Whether `model` runs transformers' sdpa, which `few_rows_attention` computes the same way."""
    return model.config._attn_implementation in ("sdpa", NAME)


@contextmanager
def few_rows(model) -> Iterator[None]:
    """`model`'s attention is `few_rows_attention` inside the block (if it runs sdpa):
    the attention function is looked up by name at every forward, so a pass recorded as a CUDA
    graph keeps the kernels it was recorded with."""
    if not swappable(model):
        yield
        return
    register()
    before = model.config._attn_implementation
    model.config._attn_implementation = NAME
    try:
        yield
    finally:
        model.config._attn_implementation = before
