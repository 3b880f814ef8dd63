"""Flex attention compiled for training, one compile cache per mask kind.

Dynamo keeps its compiled variants per code object, at most `recompile_limit` of them (8 by
default), and past that runs the function eagerly, where flex attention materialises the
dense scores (`sdpa_dense`, `sdpa_dense_backward`): on a GPU, out of memory at training
sizes. A mask kind recompiles a few times on its own (the first call static, then dynamic;
with and without gradients; lengths of one block), and EAGLE-3's TTT and DFlash's block
attention once shared one compiled `flex_attention`: trained one after the other in one
process (bench/parallel_gpu.py), the second kind found the cache full and ran dense. So each
kind compiles its own copy of the call (its own code object, hence its own cache and its own
automatic-dynamic record), under a higher limit, with `fullgraph` so that running out or a
graph break raises instead of silently running the dense path.
"""

from __future__ import annotations

import functools
import types
from typing import Callable

import torch
from torch.nn.attention.flex_attention import flex_attention

RECOMPILE_LIMIT = 64  # compiled variants per kind before a call raises


def _attend(q, k, v, block_mask, scale, enable_gqa, return_aux):
    return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa, return_aux=return_aux)


@functools.cache
def compiled(kind: str) -> Callable[..., torch.Tensor]:
    """`flex_attention(q, k, v, block_mask=, scale=, enable_gqa=, return_aux=)` compiled (dynamic shapes) for the masks of
    one `kind`, apart from every other kind's."""
    name = "flex_" + "".join(c if c.isalnum() else "_" for c in kind)
    code = _attend.__code__.replace(co_name=name, co_qualname=name)
    fn = limited(torch.compile(types.FunctionType(code, _attend.__globals__, name), dynamic=True, fullgraph=True))

    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask=None, scale: float | None = None,
             enable_gqa: bool = False, return_aux=None):
        return fn(q, k, v, block_mask, scale, enable_gqa, return_aux)

    return call


def limited(fn: Callable) -> Callable:
    """A compiled `fn` called under RECOMPILE_LIMIT. The step parts around attention (draft/model.py)
    and the step loss (train/objective.py) need it too: with and without gradients, then a second
    drafter kind in the same process (bench/parallel_gpu.py trains EAGLE-3, then P-EAGLE), the step
    parts passed the default 8 variants on an H200 and ran eagerly from then on."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
            return fn(*args, **kwargs)

    return call
