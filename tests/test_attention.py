"""models/attention.py: the folded math attention of few-row passes against transformers' own
sdpa (which repeats the cache per query head), in float32."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from eyas.models.attention import FEW_ROWS, NAME, few_rows, few_rows_attention, folded_attention


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
