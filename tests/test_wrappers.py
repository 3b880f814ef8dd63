"""Targets as users bring them: multimodal wrappers (`*ForConditionalGeneration` nesting a
`text_config`) run through prepare, capture (transformers backend), train, eval and export
like plain models, on text alone, with the text config's sizes. Families: Gemma-3, Qwen2.5-VL
and Kimi-K2.5 (a DeepseekV3 text model with MLA head size 576 inside the wrapper).

Numerics: float32 on both sides, the reference being transformers' own batch-1
`output_hidden_states` forward of the wrapper; tolerance as in test_capture (1e-4)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

from eyas.capture.hf import HFCapturer
from eyas.capture.run import capture
from eyas.capture.config import CaptureConfig
from eyas.cli import main
from eyas.data.prepare import prepare
from eyas.data.config import PrepareConfig
from eyas.models import decoder_parts
from eyas.models.target_head import load_target_head
from eyas.train import TrainConfig, train
from test_capture import ATOL, RTOL, _samples, reference_states
from tiny import MEDIA_VOCAB, WRAPPERS, build_model


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread):
    """Tiny models: see conftest's one_thread."""


@pytest.fixture(scope="module")
def wrapper_dirs(tmp_path_factory, tiny_tokenizer_dir) -> dict[str, Path]:
    return {f: build_model(tmp_path_factory.mktemp(f), f, tokenizer_dir=tiny_tokenizer_dir) for f in WRAPPERS}


@pytest.mark.parametrize("family", sorted(WRAPPERS))
def test_wrapper_capture_matches_transformers_and_finds_the_text_parts(wrapper_dirs, family):
    capturer = HFCapturer(str(wrapper_dirs[family]), layers="auto")
    model, text = capturer.model, capturer.model.config.get_text_config()
    assert text is not model.config  # a real wrapper
    assert capturer.layer_ids == (2, 4, 5, 8) and capturer.hidden_size == text.hidden_size == 64
    parts = decoder_parts(model)
    assert parts.layers is model.get_decoder().layers  # the text decoder's, not the vision tower's
    samples = _samples([19, 7], text.vocab_size - MEDIA_VOCAB)  # below the image/video token ids
    for sample, got in zip(samples, capturer.capture(samples)):
        want = reference_states(model, sample.input_ids, capturer.layer_ids)
        torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
    # Training's target head: the wrapper's own embeddings, final norm and lm_head.
    head = load_target_head(wrapper_dirs[family])
    torch.testing.assert_close(head.embed_weight, model.get_input_embeddings().weight)
    torch.testing.assert_close(head.lm_head_weight, model.get_output_embeddings().weight)
    x = torch.randn(3, 64)
    torch.testing.assert_close(head.norm(x), parts.norm(x))


# What the drafter's rope follows, per family (recorded in the checkpoint as rope_source).
ROPE = {
    "gemma3_mm": (1_000_000.0, "full_attention layers"),  # not the sliding layers' 10000
    "qwen2_5_vl": (20_000.0, "M-RoPE as plain 1-D rope"),
    "kimi_k25": (50_000.0, "rope_parameters"),
}


@pytest.mark.parametrize("family", sorted(WRAPPERS))
def test_wrapper_prepare_capture_train_eval_export(wrapper_dirs, family, tmp_path):
    model = str(wrapper_dirs[family])
    prepare(PrepareConfig(model=model, data=["packaged:chitchat"], out=str(tmp_path / "prep"), max_len=48, limit=4),
            progress=False)
    capture(CaptureConfig(model=model, data=str(tmp_path / "prep"), out=str(tmp_path / "store"), dtype="fp32"),
            progress=False)
    train(TrainConfig(out=str(tmp_path / "draft"), store=str(tmp_path / "store"), steps=1, batch_tokens=96,
                      ttt_steps=2, draft_vocab=64, eval_fraction=0.0, progress=False))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "hello there, how are you?"}) + "\n")
    with pytest.raises(SystemExit) as e:
        main(["eval", "--model", model, "--draft", str(tmp_path / "draft"), "--prompts", str(prompts),
              "--max-new-tokens", "6", "--baseline", "none", "--output", str(tmp_path / "eval.json")])
    assert e.value.code == 0
    assert json.loads((tmp_path / "eval.json").read_text())["records"]
    # SGLang's folder holds every field vLLM's does; vLLM itself serves only Kimi-K2.5's layout
    # here (test_vllm_preflight: Gemma-3 has no EAGLE-3 support in vLLM 0.32, and its and
    # Qwen2.5-VL's vLLM classes need torchvision), so only Kimi is exported --to vllm too.
    fmt = "vllm" if family == "kimi_k25" else "sglang"
    with pytest.raises(SystemExit) as e:
        main(["export", str(tmp_path / "draft"), "--to", fmt, "--out", str(tmp_path / fmt)])
    assert e.value.code == 0
    exported = json.loads((tmp_path / fmt / "config.json").read_text())
    text = AutoConfig.from_pretrained(model).get_text_config()
    assert exported["hidden_size"] == exported["target_hidden_size"] == text.hidden_size
    assert exported["num_attention_heads"] == text.num_attention_heads and exported["vocab_size"] == text.vocab_size
    assert exported["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    theta, source = ROPE[family]
    assert exported["rope_theta"] == theta and source in exported["eyas"]["rope_source"]
