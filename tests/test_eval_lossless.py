"""Losslessness on the real SmolLM2: at temperature 0, speculative decoding (chain and tree,
with a trained and an untrained drafter, and prompt lookup) emits exactly the tokens of
transformers' own greedy `generate`, for an answer that ends with EOS and one cut by the
length limit."""

from __future__ import annotations

import json

import pytest
import torch

from eyas.draft import DraftConfig, Eagle3Drafter, save_drafter
from eyas.evaluate.drafter import DrafterSession
from eyas.evaluate.generate import generate
from eyas.prompts import render
from eyas.evaluate.proposers import Eagle3, PromptLookup, Proposer
from eyas.evaluate.run import load_checked_drafter
from eyas.evaluate.static_target import StaticTargetSession
from eyas.evaluate.target import TargetSession
from eyas.models import load_target, model_identity, resolve_layer_ids
from eyas.models.eos import eos_ids

SMOLLM2 = "packaged:smollm2-135m"
MAX_NEW = 32
PROMPTS = {
    "eos": "What is the capital of France? Answer in one short sentence.",
    "length": "Write a long story about a dragon who loves tea.",
}


@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    model, tokenizer = load_target(SMOLLM2, dtype="float32")
    return model, tokenizer, model_identity(SMOLLM2, model.config, tokenizer)


@pytest.fixture(scope="module")
def references(smollm2):
    """Greedy answers from transformers' generate: the ground truth."""
    model, tokenizer, _ = smollm2
    eos = set(eos_ids(model.generation_config, tokenizer))
    out = {}
    for name, text in PROMPTS.items():
        ids = render(tokenizer, [{"role": "user", "content": text}])
        with torch.inference_mode():
            gen = model.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW, do_sample=False,
                                 eos_token_id=sorted(eos), pad_token_id=tokenizer.pad_token_id or 0)
        out[name] = (ids, gen[0, len(ids):].tolist())
    assert out["eos"][1][-1] in eos and len(out["eos"][1]) < MAX_NEW
    assert len(out["length"][1]) == MAX_NEW and not eos & set(out["length"][1])
    return out


@pytest.fixture(scope="module")
def drafters(smollm2, references, tmp_path_factory):
    """An untrained (random) drafter, and one trained briefly on SmolLM2's own answers to
    the test prompts, so that most of its drafts are accepted and long accepted paths,
    partial acceptance and drafted end tokens all occur."""
    from eyas.capture.run import capture
    from eyas.capture.config import CaptureConfig
    from eyas.data.prepare import prepare
    from eyas.data.config import PrepareConfig
    from eyas.train import TrainConfig, train

    model, tokenizer, identity = smollm2
    root = tmp_path_factory.mktemp("drafters")
    untrained = root / "untrained"
    cfg = DraftConfig.for_target(model.config, identity, resolve_layer_ids("auto", identity.num_layers), 4096)
    torch.manual_seed(0)
    drafter = Eagle3Drafter(cfg)
    drafter.set_vocab(torch.arange(4096))
    save_drafter(drafter, untrained)

    answers = root / "answers.jsonl"
    answers.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": PROMPTS[name]},
        {"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=True)},
    ]}) + "\n" for name, (_, ids) in references.items()))
    prepare(PrepareConfig(model=SMOLLM2, data=[str(answers)], out=str(root / "prepared"), max_len=256), progress=False)
    capture(CaptureConfig(model=SMOLLM2, data=str(root / "prepared"), out=str(root / "store"), dtype="fp32"),
            progress=False)
    trained = root / "trained"
    trained.mkdir()
    train(TrainConfig(out=str(trained), store=str(root / "store"), steps=30, lr=3e-3, warmup=0, ttt_steps=3,
                      batch_tokens=512, draft_vocab=4096, eval_fraction=0, device="cpu", progress=False))
    return {"untrained": untrained, "trained": trained}


@pytest.mark.parametrize("which", ["untrained", "trained"])
@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_speculative_greedy_equals_greedy(smollm2, references, drafters, which, tree):
    """On both decoding paths (transformers' growing cache, and the static one that CUDA graphs
    replay, whose caches here start smaller than the prompts and grow): the same tokens as
    `generate`, and the same drafts accepted at every step."""
    model, tokenizer, identity = smollm2
    drafter = load_checked_drafter(str(drafters[which]), model, identity)
    accepted = 0
    for name, (ids, expected) in references.items():
        counts = []
        for target, session in ((TargetSession(model, drafter.config.aux_layer_ids), DrafterSession(drafter)),
                                (StaticTargetSession(model, drafter.config.aux_layer_ids, capacity=16),
                                 DrafterSession(drafter, capacity=16))):
            proposer = Eagle3(session, steps=5, tree=tree, top_k=4, max_nodes=12)
            g = generate(target, proposer, ids, MAX_NEW, set(eos_ids(model.generation_config, tokenizer)))
            target.close()
            assert g.generated_ids == expected, (name, type(target).__name__)
            if name == "length":  # every step emits its accepted tokens plus one of the target's
                assert len(g.generated_ids) == 1 + sum(c + 1 for c in g.accept_counts)
            counts.append(g.accept_counts)
        assert counts[0] == counts[1], name
        assert target.cache.capacity >= len(ids) + MAX_NEW > 16 and session.cache.capacity > 16
        accepted += sum(counts[0])
    if which == "trained":
        assert accepted >= MAX_NEW // 2, "the trained drafter should get most drafts accepted"


@pytest.mark.parametrize("session", [TargetSession, StaticTargetSession])
def test_prompt_lookup_and_plain_greedy_equal_greedy(smollm2, references, session):
    model, tokenizer, _ = smollm2
    target = session(model)
    for name, (ids, expected) in references.items():
        for proposer in (Proposer(), PromptLookup(5)):
            g = generate(target, proposer, ids, MAX_NEW, set(eos_ids(model.generation_config, tokenizer)))
            assert g.generated_ids == expected, (name, proposer.name)


def test_dflash_and_peagle_blocks_equal_greedy_on_both_paths(smollm2, references):
    """Random DFlash and P-EAGLE drafters on SmolLM2: the static path (caches shorter than the
    prompts, so they grow) gives `generate`'s tokens and drafts exactly as the eager path."""
    from eyas.draft.build import new_drafter
    from eyas.evaluate.dflash import DFlash, DFlashSession
    from eyas.evaluate.peagle import PEagle

    model, tokenizer, identity = smollm2
    eos = set(eos_ids(model.generation_config, tokenizer))
    layers = resolve_layer_ids("auto", identity.num_layers)
    for kind, extra in (("dflash", dict(num_hidden_layers=2, ttt_steps=4)), ("peagle", dict(ttt_steps=4))):
        cfg = DraftConfig.for_target(model.config, identity, layers, 4096, drafter=kind, mask_token_id=0, **extra)
        torch.manual_seed(0)
        drafter = new_drafter(cfg, model.get_input_embeddings().weight.detach()).eval()
        drafter.set_vocab(torch.arange(4096))
        for name, (ids, expected) in references.items():
            counts = []
            for static in (False, True):
                how = {"capacity": 16} if static else {}
                target = StaticTargetSession(model, cfg.aux_layer_ids, **how) if static else \
                    TargetSession(model, cfg.aux_layer_ids)
                proposer = DFlash(DFlashSession(drafter, **how), 4) if kind == "dflash" else \
                    PEagle(DrafterSession(drafter, **how), 4)
                g = generate(target, proposer, ids, MAX_NEW, eos)
                target.close()
                assert g.generated_ids == expected, (kind, name, static)
                counts.append(g.accept_counts)
            assert counts[0] == counts[1], (kind, name)
