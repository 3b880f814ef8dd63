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
from eyas.evaluate.prompts import render
from eyas.evaluate.proposers import Eagle3, PromptLookup
from eyas.evaluate.run import load_checked_drafter
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
    model, tokenizer, identity = smollm2
    drafter = load_checked_drafter(str(drafters[which]), model, identity)
    target = TargetSession(model, drafter.config.aux_layer_ids)
    proposer = Eagle3(DrafterSession(drafter), steps=5, tree=tree, top_k=4, max_nodes=12)
    accepted = 0
    for name, (ids, expected) in references.items():
        g = generate(target, proposer, ids, MAX_NEW, set(eos_ids(model.generation_config, tokenizer)))
        assert g.generated_ids == expected, name
        if name == "length":  # every step emits its accepted tokens plus one of the target's
            assert len(g.generated_ids) == 1 + sum(c + 1 for c in g.accept_counts)
        accepted += sum(g.accept_counts)
    if which == "trained":
        assert accepted >= MAX_NEW // 2, "the trained drafter should get most drafts accepted"


def test_prompt_lookup_greedy_equals_greedy(smollm2, references):
    model, tokenizer, _ = smollm2
    target = TargetSession(model)
    for name, (ids, expected) in references.items():
        g = generate(target, PromptLookup(5), ids, MAX_NEW, set(eos_ids(model.generation_config, tokenizer)))
        assert g.generated_ids == expected, name
