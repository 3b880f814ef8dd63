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
transformers does whenever a mask is given; at batch 1 the product with the values runs over
parts of the cache side by side (`_weighted_values`). Longer passes (prefill) keep
transformers' sdpa.
Only targets that run sdpa use it (`swappable`): a family whose attention computes more
(Gemma-2's soft-capped scores, which eyas runs eagerly) keeps its own.

Regeneration decodes thousands of left-padded rows at once, and there the math path reads
every row's whole cache, the batch's padding included, at about 30% of the bandwidth that read
needs (bench/README.md). Given a `rows_block_mask` (the `blocks` keyword of the forward), a
pass runs flex attention instead: each row reads only the KV blocks between its first real
slot and the slot it decodes, in one fused kernel (compiled on CUDA), with the query heads
that share a KV head folded into the query axis as on the math path.
"""

from __future__ import annotations

import functools
import inspect
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "eyas_few_rows"
FEW_ROWS = 128  # query rows up to which a pass takes the math path: eval's widest recorded pass
FLEX_BLOCK = 128  # KV slots per block of a `rows_block_mask`: flex attention's default block
FLEX_HEAD_DIMS = (64, 128)  # head dims the flex path takes (keys and values alike); others keep the math path
SPLIT_KEYS = 256  # keys per part of a batch-1 pass's probs @ values (`_weighted_values`): the cache's ALIGN


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
    out = _weighted_values(probs.view(B, n_kv, group * q, S), value)  # [B, nKV, group * q, dv]
    return out.view(B, n_heads, q, -1).transpose(1, 2).contiguous(), None


def _weighted_values(probs: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """probs [B, nKV, r, S] @ value [B, nKV, S, dv] -> [B, nKV, r, dv]. At batch 1 with a few
    rows cuBLAS runs this product in a handful of thread blocks, each walking all S keys: 2.3
    of a SmolLM2 decode step's 4.7 ms of GPU time on an H200 at 2,304 slots, float32
    (bench/results/decode_gpu_profile_chain_h200.json). Cut into parts of SPLIT_KEYS keys, the
    parts are one batched product side by side, then a sum."""
    B, n_kv, r, S = probs.shape
    if B > 1 or S % SPLIT_KEYS or S < 2 * SPLIT_KEYS:  # a batch has blocks enough; a short or ragged read gains nothing
        return torch.matmul(probs, value)
    parts = S // SPLIT_KEYS
    split = probs.reshape(B, n_kv, r, parts, SPLIT_KEYS).transpose(2, 3)  # [B, nKV, parts, r, SPLIT_KEYS]
    return torch.matmul(split, value.reshape(B, n_kv, parts, SPLIT_KEYS, -1)).sum(2)


def rows_block_mask(starts: torch.Tensor, current: torch.Tensor, capacity: int, queries: int = 1) -> BlockMask:
    """`queries` query rows per batch row (the query heads sharing a KV head, folded as rows; see
    `_flex`), all at slot `current` [1] of a cache of `capacity` slots, where row b's
    tokens start at slot `starts` [b] (its left padding before): the row reads the blocks from
    the one holding `starts[b]` to the one holding `current`, masked inside them to
    starts[b] <= slot <= current. Built from tensors alone (no host sync), so a CUDA graph
    recording a decode step records this too, and each replay follows its own `current`."""
    blocks = -(-capacity // FLEX_BLOCK)
    first = starts // FLEX_BLOCK  # [b]
    count = (current // FLEX_BLOCK - first + 1).to(torch.int32)  # [b]
    order = (first[:, None] + torch.arange(blocks, device=starts.device)).clamp(max=blocks - 1)  # [b, blocks]

    def visible(b, h, q, kv):
        return (kv >= starts[b]) & (kv <= current[0])

    extra = {"compute_q_blocks": False} if "compute_q_blocks" in _FROM_KV_BLOCKS else {}
    return BlockMask.from_kv_blocks(count[:, None, None], order.to(torch.int32)[:, None, None], BLOCK_SIZE=FLEX_BLOCK,
                                    mask_mod=visible, seq_lengths=(queries, capacity), **extra)


_FROM_KV_BLOCKS = inspect.signature(BlockMask.from_kv_blocks).parameters


def kv_layout(config) -> tuple[int, int, int, int]:
    """(query heads, KV heads, key dim, value dim) of a decoder's attention, as its cache holds
    them: an MLA model caches full keys (nope + rope dims) and its own value dim."""
    text = config.get_text_config(decoder=True)
    heads = text.num_attention_heads
    head = getattr(text, "head_dim", None) or text.hidden_size // heads
    k_dim = (getattr(text, "qk_nope_head_dim", 0) or 0) + (getattr(text, "qk_rope_head_dim", 0) or 0) or head
    return heads, getattr(text, "num_key_value_heads", None) or heads, k_dim, getattr(text, "v_head_dim", None) or head


def flex_fits(config) -> bool:
    """Whether a decoder's attention takes the flex path: equal key and value head dims of a size
    its kernels are tuned for (an MLA target's 192/128 keeps the math path)."""
    _, _, k_dim, v_dim = kv_layout(config)
    return k_dim == v_dim and k_dim in FLEX_HEAD_DIMS


_flex_failed: list[str] = []  # the first failure's message: every later pass takes the math path


@functools.cache
def _compiled_flex():
    return torch.compile(flex_attention)


def _flex(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, blocks: BlockMask,
          scaling: float | None) -> torch.Tensor | None:
    """query [B, nH, 1, d], key/value [B, nKV, S, d] -> [B, 1, nH, d]; None once flex failed (said
    in one line): the caller then takes the exact math path with the pass's mask.

    The query heads that share a KV head are folded into the query axis, as `folded_attention`
    does: flex's decoding kernel (a split over the keys, for few query rows) takes grouped heads
    only in power-of-two groups, and SmolLM2's 9 over 3 fell to its general kernel, whose
    128-row query tiles made a 2,048-row decode step 57.6 ms of attention on an H200."""
    if _flex_failed:
        return None
    B, n_heads, q, d = query.shape
    n_kv = key.shape[1]
    folded = query.reshape(B, n_kv, n_heads // n_kv * q, d)  # head h reads KV head h // group
    run = _compiled_flex() if query.is_cuda else flex_attention  # off CUDA: the unfused reference (tests)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            out = run(folded, key, value, block_mask=blocks, scale=scaling).view(B, n_heads, q, -1)
    except Exception as e:  # noqa: BLE001 -- a kernel that cannot compile leaves the math path, which is exact
        _flex_failed.append(str(e).splitlines()[0][:160] if str(e) else type(e).__name__)
        print(f"eyas: flex attention failed ({_flex_failed[0]}); decoding reads the cache on the math path.",
              file=sys.stderr, flush=True)
        return None
    return out.transpose(1, 2).contiguous()


def few_rows_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: torch.Tensor | None, blocks: BlockMask | None = None, **kwargs):
    """Flex attention where the forward was given `blocks` (a `rows_block_mask`); else the folded
    math path for up to FEW_ROWS query rows; transformers' sdpa for more, and for several rows
    without a mask (transformers then leaves causality to sdpa's `is_causal`)."""
    if blocks is not None and (out := _flex(query, key, value, blocks, kwargs.get("scaling"))) is not None:
        return out, None
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
