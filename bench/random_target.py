"""The random targets and prepared samples the GPU benches build (speed_gpu, scale_gpu, peers,
mla_gpu): Llama shapes, the seed's Kimi-K2 drafter sizes, a word-level tokenizer, and random
token samples written as eyas prepared data."""

from __future__ import annotations

import random
from pathlib import Path

import torch

SHAPES = {  # Llama-family shapes: hidden, layers, intermediate, heads, kv heads, vocab
    "8b": (4096, 32, 14336, 32, 8, 128256),
    "1b": (2048, 16, 8192, 32, 8, 128256),
    "135m": (576, 30, 1536, 9, 3, 49152),  # SmolLM2-135M's
    "tiny": (128, 8, 256, 4, 2, 4096),
}
# The seed's target, Kimi-K2 (a DeepseekV3 text model): the sizes its drafter is built from.
SEED_SHAPES = {
    "8b": dict(hidden_size=7168, intermediate_size=18432, num_attention_heads=64, num_key_value_heads=64,
               vocab_size=163840, num_hidden_layers=61),
    "tiny": dict(hidden_size=192, intermediate_size=384, num_attention_heads=4, num_key_value_heads=4,
                 vocab_size=8192, num_hidden_layers=8),
}


def word_tokenizer(vocab: int):
    """A word-level tokenizer (token i is "t{i}") whose chat template joins the turns."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t1", pad_token="t0")
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    return tokenizer


def random_target_config(shape: str):
    """The LlamaConfig of `shape` and a word-level tokenizer with a chat template."""
    from transformers import LlamaConfig

    H, L, I, nh, nkv, V = SHAPES[shape]
    config = LlamaConfig(hidden_size=H, num_hidden_layers=L, intermediate_size=I, num_attention_heads=nh,
                         num_key_value_heads=nkv, vocab_size=V, max_position_embeddings=8192, tie_word_embeddings=False)
    return config, word_tokenizer(V)


def build_target(folder: Path, shape: str, device: str):
    """A random bf16 Llama of `shape` and a word-level tokenizer with a chat template."""
    from transformers import AutoModelForCausalLM

    config, tokenizer = random_target_config(shape)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return config, tokenizer


def random_samples(tokens: int, low: int, high: int, lengths: tuple[int, int] = (256, 2048), seed: int = 0) -> list:
    """PreparedSamples of ids drawn from [low, high) until `tokens` are reached, the first fifth
    of each a prompt (not trained). A seed gives the same samples in the same order whatever
    `tokens` is: a smaller set is a prefix of a larger one."""
    from eyas.data.prepared import PreparedSample

    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    samples, total = [], 0
    while total < tokens:
        n = rng.randint(*lengths)
        mask = torch.ones(n, dtype=torch.bool)
        mask[: n // 5] = False
        samples.append(PreparedSample(torch.randint(low, high, (n,), generator=g), mask, len(samples)))
        total += n
    return samples


def build_prepared(folder: Path, model_dir: Path, config, tokenizer, tokens: int, seed: int = 0) -> list[int]:
    from eyas.data.prepared import write_prepared
    from eyas.models import model_identity

    samples = random_samples(tokens, 2, config.vocab_size, seed=seed)
    total = sum(len(s.input_ids) for s in samples)
    identity = model_identity(str(model_dir), config, tokenizer)
    write_prepared(folder, samples, [[] for _ in samples], identity, None, "random", 2048,
                   {"kept": len(samples), "tokens": total})
    return [len(s.input_ids) for s in samples]
