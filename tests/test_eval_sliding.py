"""Speculative decoding on sliding-window targets: Gemma-3's mix of sliding and full layers,
Mistral's window on every layer, Qwen2's window on its upper layers.

Against references: tree verification against transformers' full forward of each path
alone (its own sliding masks, no cache), over many steps past the window, with accepted
paths that are not a prefix of the node order; whole generations against transformers'
`generate` at temperature 0 (plain decoding, then every method against it, prompts longer
than the window); and at temperature > 0 the joint distribution of sampled tokens against
the exact one (test_eval_sampling's check)."""

from __future__ import annotations

import random

import pytest
import torch
import transformers

from eyas.draft import DraftConfig, Eagle3Drafter
from eyas.draft.build import new_drafter
from eyas.evaluate.dflash import DFlash, DFlashSession
from eyas.evaluate.drafter import DrafterSession
from eyas.evaluate.generate import generate
from eyas.evaluate.proposers import Eagle3, PromptLookup, Proposer
from eyas.evaluate.static_target import StaticTargetSession
from eyas.evaluate.target import TargetSession, attention_windows
from eyas.evaluate.tree import DraftTree
from eyas.models import load_target, model_identity
from test_eval_sampling import V, assert_sampling_keeps_the_distribution, toy_drafter
from test_eval_units import ATOL, path_to, random_tree
from tiny import build_model

WINDOW = 3
# name -> (config class, its window settings); 4 layers each
TOYS = {
    "gemma3": ("Gemma3TextConfig", dict(sliding_window=WINDOW, layer_types=[
        "sliding_attention", "sliding_attention", "full_attention", "sliding_attention"])),
    "mistral": ("MistralConfig", dict(sliding_window=WINDOW)),
    "qwen2": ("Qwen2Config", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2)),
}


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread):
    """Tiny models: see conftest's one_thread."""


def build_toy(name: str, vocab: int = 96, layers: int = 4, std: float = 0.3, **sizes):
    config_name, window = TOYS[name]
    window = dict(window, layer_types=window["layer_types"][:layers]) if "layer_types" in window else window
    kwargs = dict(vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256)
    config = getattr(transformers, config_name)(**{**kwargs, **window, **sizes})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, std)
    return model


def test_layer_windows_are_read_as_transformers_cache_reads_them():
    assert attention_windows(build_toy("gemma3").config) == {"sliding_attention": WINDOW, "full_attention": None}
    assert attention_windows(build_toy("mistral").config) == {"sliding_attention": WINDOW}
    assert attention_windows(build_toy("qwen2").config) == {"full_attention": None, "sliding_attention": WINDOW}


@pytest.mark.parametrize("name", sorted(TOYS))
@pytest.mark.parametrize("session_class", [TargetSession, StaticTargetSession])
def test_tree_verification_past_the_window_equals_decoding_each_path(name, session_class):
    """Several steps, each verifying a random tree of 20 nodes and keeping its deepest path,
    which is not a prefix of the node order; some paths are deeper than the window. The
    static session starts with a cache shorter than the prompt: it grows."""
    target = build_toy(name)
    rng = random.Random(1)
    sequence = [rng.randrange(96) for _ in range(9)]  # longer than the window
    session = TargetSession(target) if session_class is TargetSession else StaticTargetSession(target, capacity=4)
    session.prefill(torch.tensor(sequence))
    deepest = 0
    for step in range(4):
        root = rng.randrange(96)
        tree = random_tree(rng, 20, 96)
        logits, _ = session.verify(root, tree)
        with torch.no_grad():
            ref = target(torch.tensor([sequence + [root]])).logits[0, -1]
            assert torch.allclose(logits[0], ref, atol=ATOL), f"step {step}, root"
            for i in range(len(tree)):
                ids = sequence + [root] + [tree.tokens[n] for n in path_to(tree, i)]
                ref = target(torch.tensor([ids])).logits[0, -1]
                assert torch.allclose(logits[i + 1], ref, atol=ATOL), f"step {step}, node {i}"
        path = path_to(tree, max(range(len(tree)), key=lambda i: len(path_to(tree, i))))
        assert path != list(range(len(path)))
        deepest = max(deepest, len(path))
        session.commit([0] + [n + 1 for n in path])
        sequence += [root] + [tree.tokens[n] for n in path]
        assert session.length == len(sequence)
    assert deepest > WINDOW
    nxt, _ = session.verify(3, DraftTree())  # a plain step on the committed cache
    with torch.no_grad():
        assert torch.allclose(nxt[0], target(torch.tensor([sequence + [3]])).logits[0, -1], atol=ATOL)
    session.commit([0])
    if session_class is StaticTargetSession:  # every slot kept, the masks doing the windowing
        assert session.cache.capacity >= session.length == len(sequence) + 1
        return
    # The cache is transformers' own: sliding layers keep only the window's last tokens.
    for layer in session.cache.layers:
        assert layer.keys.shape[-2] == (WINDOW - 1 if layer.is_sliding else len(sequence) + 1)


class Oracle(Proposer):
    """Drafts from the known greedy answer: the next k true tokens (k cycling 0..steps, so
    steps accept all, some and none), as a chain ending in a wrong token, or as a tree where
    each true token has a wrong elder sibling (the accepted path is then never a prefix of
    the node order, so commit selects rows)."""

    def __init__(self, prompt: list[int], answer: list[int], steps: int, tree: bool):
        self.prompt, self.answer, self.steps, self.is_tree = prompt, answer, steps, tree
        self.name = "oracle-tree" if tree else "oracle-chain"
        self.calls = 0

    def propose(self, sequence: list[int], budget: int) -> DraftTree:
        true = self.answer[len(sequence) - len(self.prompt):][: min(budget, self.steps)]
        k = self.calls % (len(true) + 1)
        self.calls += 1
        wrong = [(t + 1) % 100 for t in true]
        if not self.is_tree:
            return DraftTree.chain(true[:k] + wrong[k:k + 1])
        tree, parent = DraftTree(), -1
        for i in range(k):
            tree.add(wrong[i], parent)
            parent = tree.add(true[i], parent)
        if k < len(true):
            tree.add(wrong[k], parent)
        return tree


@pytest.fixture(scope="module", params=["gemma3", "mistral"])
def tiny_sliding(request, tmp_path_factory, tiny_tokenizer_dir):
    """tests/tiny.py's Gemma-3 (8 layers: 5 sliding, 1 full, 2 sliding) and Mistral (every
    layer sliding), window 16, loaded as eyas loads targets."""
    folder = build_model(tmp_path_factory.mktemp(request.param), request.param, tokenizer_dir=tiny_tokenizer_dir)
    model, tokenizer = load_target(str(folder))
    return model, model_identity(str(folder), model.config, tokenizer)


def test_every_method_equals_transformers_generate_past_the_window(tiny_sliding):
    model, identity = tiny_sliding
    window = model.config.sliding_window
    types = getattr(model.config, "layer_types", None) or ["sliding_attention"]
    assert "sliding_attention" in types and window == 16
    n, eos = identity.num_layers, set()
    cfg = DraftConfig.for_target(model.config, identity, (1, n // 2, n - 2, n), 256)
    torch.manual_seed(0)
    drafter = Eagle3Drafter(cfg, model.get_input_embeddings().weight.detach()).eval()
    drafter.set_vocab(torch.arange(256))
    dcfg = DraftConfig.for_target(model.config, identity, (1, n // 2, n - 2, n), 256, drafter="dflash",
                                  num_hidden_layers=2, mask_token_id=3, ttt_steps=4)
    dflash = new_drafter(dcfg, model.get_input_embeddings().weight.detach()).eval()
    dflash.set_vocab(torch.arange(256))
    rng = random.Random(0)
    for length in (3 * window, 2 * window + 5):
        prompt = [rng.randrange(10, 500) for _ in range(length)]
        with torch.inference_mode():
            want = model.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False, eos_token_id=None,
                                  pad_token_id=0)[0, length:].tolist()
        assert len(want) == 40
        counts = {}
        for static in (False, True):  # the static caches start shorter than the prompt: they grow
            target = StaticTargetSession(model, cfg.aux_layer_ids, capacity=8) if static else \
                TargetSession(model, cfg.aux_layer_ids)
            how = {"capacity": 8} if static else {}
            plain = generate(target, Proposer(), prompt, 40, eos).generated_ids
            assert plain == want
            methods = [PromptLookup(5), Oracle(prompt, plain, 6, tree=False), Oracle(prompt, plain, 6, tree=True),
                       Eagle3(DrafterSession(drafter, **how), 5),
                       Eagle3(DrafterSession(drafter, **how), 4, tree=True, top_k=3, max_nodes=10),
                       DFlash(DFlashSession(dflash, **how), 3)]
            for method in methods:
                g = generate(target, method, prompt, 40, eos)
                assert g.generated_ids == plain, (method.name, length, static)
                counts[method.name, static] = g.accept_counts
                if isinstance(method, Oracle):
                    assert max(g.accept_counts) == 6 and sum(g.accept_counts) >= 20
        assert all(counts[k, False] == counts[k, True] for k, _ in counts), "both paths draft alike"


@pytest.mark.parametrize("session_class", [TargetSession, StaticTargetSession])
def test_speculative_sampling_on_a_sliding_target_preserves_its_distribution(session_class):
    """test_eval_sampling's check on a Qwen2 toy (one full layer, then two with a window of
    2, shorter than the prompt): sampled generations of 4 tokens through drafted trees,
    against the exact joint distribution, on both decoding paths."""
    target = build_toy("qwen2", vocab=V, layers=3, hidden_size=16, intermediate_size=32, num_attention_heads=2,
                       num_key_value_heads=1, sliding_window=2, max_window_layers=1)
    assert attention_windows(target.config) == {"full_attention": None, "sliding_attention": 2}
    assert_sampling_keeps_the_distribution(target, toy_drafter(target, 0.1), tree=True, seed=3,
                                           session_class=session_class)
