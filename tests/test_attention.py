"""models/attention.py: the folded math attention of few-row passes against transformers' own
sdpa (which repeats the cache per query head), and regeneration's flex decode attention over
per-row block masks against the folded math path with the same mask, in float32."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import eyas.models.attention as attention
from eyas.models.attention import (FEW_ROWS, FLEX_BLOCK, NAME, few_rows, few_rows_attention, flex_fits,
                                   folded_attention, rows_block_mask)


@pytest.mark.parametrize("heads,kv", [(9, 3), (4, 4), (8, 1)])
@pytest.mark.parametrize("q", [1, 5])
@pytest.mark.parametrize("boolean", [False, True])
def test_folded_attention_equals_transformers_sdpa(heads, kv, q, boolean):
    torch.manual_seed(0)
    B, S, d = 2, 37, 16
    query, key, value = torch.randn(B, heads, q, d), torch.randn(B, kv, S, d), torch.randn(B, kv, S, d)
    seen = torch.rand(B, 1, q, S + 3) < 0.6  # wider than the keys, as a preallocated cache's mask is
    seen[..., 0] = True  # every row sees something
    mask = seen if boolean else torch.zeros(seen.shape).masked_fill(~seen, torch.finfo(torch.float32).min)
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = False, heads // kv
    ours, _ = folded_attention(module, query, key, value, mask, scaling=0.3)
    theirs, _ = sdpa_attention_forward(module, query, key, value, mask[..., :S], scaling=0.3)
    assert ours.shape == theirs.shape == (B, q, heads, d)
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("q", [1, 8])
def test_batch_one_over_a_long_cache_sums_its_key_parts_as_one_product(q):
    """At batch 1 over a cache of whole SPLIT_KEYS parts, probs @ values runs part by part and
    sums (eval's recorded passes); the result is transformers' sdpa's, to float32 rounding."""
    torch.manual_seed(0)
    heads, kv, d, S = 9, 3, 16, 3 * attention.SPLIT_KEYS
    query, key, value = torch.randn(1, heads, q, d), torch.randn(1, kv, S, d), torch.randn(1, kv, S, d)
    seen = torch.rand(1, 1, q, S) < 0.7
    seen[..., 0] = True
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = False, heads // kv
    ours, _ = folded_attention(module, query, key, value, seen, scaling=0.3)
    theirs, _ = sdpa_attention_forward(module, query, key, value, seen, scaling=0.3)
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-5)


def test_more_rows_than_few_take_sdpa(monkeypatch):
    """So does a pass of several rows that transformers gives no mask: it means causal."""
    import eyas.models.attention as attention

    took = []
    monkeypatch.setattr(attention, "folded_attention", lambda *a, **k: took.append("folded"))
    monkeypatch.setattr(attention, "sdpa_attention_forward", lambda *a, **k: took.append("sdpa"))
    for q, mask in ((1, None), (2, None), (FEW_ROWS, True), (FEW_ROWS + 1, True)):
        mask = None if mask is None else torch.ones(1, 1, q, 3, dtype=torch.bool)
        few_rows_attention(None, torch.zeros(1, 2, q, 4), torch.zeros(1, 1, 3, 4), torch.zeros(1, 1, 3, 4), mask)
    assert took == ["folded", "sdpa", "folded", "sdpa"]  # several rows without a mask: sdpa's is_causal


def test_few_rows_swaps_an_sdpa_model_inside_the_block_only():
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=50)
    model = LlamaForCausalLM(config).eval()
    model.set_attn_implementation("sdpa")
    ids, mask = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]]), torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    with torch.no_grad():
        plain = model(ids, attention_mask=mask).logits
        with few_rows(model):
            assert model.config._attn_implementation == NAME
            swapped = model(ids, attention_mask=mask).logits  # padding: transformers builds a 4D mask
    assert model.config._attn_implementation == "sdpa"
    real = mask.bool()  # a padding query sees nothing: its output is used by nobody, and differs
    torch.testing.assert_close(swapped[real], plain[real], atol=1e-6, rtol=1e-5)
    model.set_attn_implementation("eager")  # e.g. a soft-capped family: its own attention stays
    with few_rows(model):
        assert model.config._attn_implementation == "eager"


def decode_case(starts: list[int], current: int, capacity: int, heads: int = 9, kv: int = 3, d: int = 64):
    """One query row per batch row at slot `current`, each row's tokens from its `starts` slot:
    random query, keys and values, and the bool mask [B, 1, 1, capacity] the flex path replaces."""
    torch.manual_seed(0)
    B = len(starts)
    query, key, value = torch.randn(B, heads, 1, d), torch.randn(B, kv, capacity, d), torch.randn(B, kv, capacity, d)
    slots = torch.arange(capacity)
    mask = ((slots[None] >= torch.tensor(starts)[:, None]) & (slots[None] <= current))[:, None, None]
    return query, key, value, mask


def test_rows_block_mask_reads_each_rows_own_blocks():
    """Row b reads the blocks from the one holding its first real slot to the one holding the
    slot decoded, none of its left padding's whole blocks nor the blocks not yet written."""
    capacity, current = 5 * FLEX_BLOCK + 17, 3 * FLEX_BLOCK + 5
    starts = [0, FLEX_BLOCK - 1, FLEX_BLOCK, 3 * FLEX_BLOCK + 5]
    blocks = rows_block_mask(torch.tensor(starts), torch.tensor([current]), capacity)
    dense = blocks.to_dense()[:, 0, 0]  # [B, blocks]
    expected = torch.zeros(len(starts), 6, dtype=dense.dtype)
    for b, first in enumerate(starts):
        expected[b, first // FLEX_BLOCK : current // FLEX_BLOCK + 1] = 1
    assert torch.equal(dense, expected)


@pytest.mark.parametrize("heads,kv", [(9, 3), (4, 4)])
def test_flex_decode_equals_the_folded_math_path(heads, kv):
    """The flex path (the unfused reference off CUDA) computes what the math path computes with
    the pass's bool mask: rows of every padding, the decoded slot mid-block and at a block's edge."""
    for capacity, current in ((300, 260), (2 * FLEX_BLOCK, 2 * FLEX_BLOCK - 1), (FLEX_BLOCK + 1, FLEX_BLOCK)):
        starts = [0, 7, current - 40, current]
        query, key, value, mask = decode_case(starts, current, capacity, heads, kv)
        blocks = rows_block_mask(torch.tensor(starts), torch.tensor([current]), capacity, heads // kv)
        flex, _ = few_rows_attention(None, query, key, value, mask, blocks=blocks, scaling=0.125)
        math, _ = folded_attention(None, query, key, value, mask, scaling=0.125)
        assert flex.shape == math.shape == (len(starts), 1, heads, 64)
        torch.testing.assert_close(flex, math, atol=1e-5, rtol=1e-5)


def test_a_flex_failure_is_said_once_and_takes_the_math_path(monkeypatch, capsys):
    monkeypatch.setattr(attention, "_flex_failed", [])

    def broken(*args, **kwargs):
        raise RuntimeError("no kernel for this shape\nmore detail")

    monkeypatch.setattr(attention, "flex_attention", broken)
    query, key, value, mask = decode_case([0, 3], 9, 20)
    blocks = rows_block_mask(torch.tensor([0, 3]), torch.tensor([9]), 20, 3)
    for _ in range(2):
        out, _ = few_rows_attention(None, query, key, value, mask, blocks=blocks, scaling=0.125)
        torch.testing.assert_close(out, folded_attention(None, query, key, value, mask, scaling=0.125)[0])
    err = capsys.readouterr().err
    assert err.count("flex attention failed (no kernel for this shape)") == 1 and "more detail" not in err


def test_flex_takes_equal_key_and_value_head_dims_it_is_tuned_for():
    from transformers import DeepseekV3Config

    assert flex_fits(LlamaConfig(hidden_size=576, num_attention_heads=9))  # SmolLM2: 64
    assert flex_fits(LlamaConfig(hidden_size=4096, num_attention_heads=32))  # 128
    assert not flex_fits(LlamaConfig(hidden_size=640, num_attention_heads=8))  # 80
    assert not flex_fits(DeepseekV3Config())  # MLA: keys 192, values 128
