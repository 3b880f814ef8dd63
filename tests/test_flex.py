"""Compiled flex attention (draft/flex.py): each mask kind has its own compile cache, and
running past its recompile limit raises instead of falling back to the dense path (the
fallback that ran DFlash out of memory on an H200 after EAGLE-3 had filled a shared cache).
On the CPU flex attention compiles forward only, which is what this checks."""

from __future__ import annotations

import pytest
import torch

from eyas.draft import flex


def causal_mask(T: int):
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(lambda b, h, q, kv: kv <= q, B=None, H=None, Q_LEN=T, KV_LEN=T, device="cpu")


def test_each_mask_kind_compiles_apart_and_raises_past_its_limit(monkeypatch):
    monkeypatch.setattr(flex, "RECOMPILE_LIMIT", 1)
    first, second = flex.compiled("test-first"), flex.compiled("test-second")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 128, 16, generator=g) for _ in range(3))
    longer = [torch.randn(1, 2, 256, 16, generator=g) for _ in range(3)]
    with torch.no_grad():
        out = first(q, k, v, block_mask=causal_mask(128))
        w = (q @ k.transpose(-1, -2) / 4).masked_fill(~torch.ones(128, 128, dtype=torch.bool).tril(), float("-inf"))
        torch.testing.assert_close(out, w.softmax(-1) @ v, atol=1e-5, rtol=1e-5)
        with pytest.raises(torch._dynamo.exc.FailOnRecompileLimitHit):  # a second variant of the same kind
            first(*longer, block_mask=causal_mask(256))
        torch.testing.assert_close(second(q, k, v, block_mask=causal_mask(128)), out)  # its own cache: compiles


def test_limited_compiles_past_the_default_limit():
    """The TTT step parts (draft/model.py) run compiled under `flex.limited`: with and without
    gradients, several dtypes and a second drafter kind in one process they need more than
    Dynamo's default 8 variants, past which they would silently run eagerly (seen on an H200)."""
    compiles = []

    def count(gm, example_inputs):  # a backend that records each variant it is asked to compile
        compiles.append(1)
        return gm.forward

    variants = [(dtype, grad) for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int32)
                for grad in (False, True) if not (grad and dtype == torch.int32)]  # 9 variants
    for wrap, expected in ((lambda f: f, 8), (flex.limited, len(variants))):
        compiles.clear()
        torch._dynamo.reset()  # Dynamo keeps variants per code object: both runs start empty

        def double(x):
            return x * 2

        fn = wrap(torch.compile(double, backend=count, dynamic=True))
        for dtype, grad in variants:
            fn(torch.ones(3, dtype=dtype).requires_grad_(grad))
        assert len(compiles) == expected
