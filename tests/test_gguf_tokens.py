"""A GGUF's special tokens are the ones the file names, whatever transformers makes of them:
transformers 5.17 reads the packaged SmolLM2's EOS as <|im_start|> and no pad token, 5.19 as the
file says (<|im_end|> for both), and the converted folder is the target's identity, so artifacts
made on one stack were refused on the other (and 5.17's EOS is the wrong token)."""

from __future__ import annotations

import types

import pytest
from transformers import AutoConfig, AutoTokenizer

import eyas.models.resolve as resolve
from eyas.models import model_identity, resolve_model

pytestmark = pytest.mark.slow  # converts the real SmolLM2 GGUF


def test_a_gguf_converts_to_the_special_tokens_it_names(tmp_path, monkeypatch):
    folder = resolve_model("packaged:smollm2-135m")  # the suite's cache, converted as this stack reads it
    real = AutoTokenizer.from_pretrained

    def as_517_reads_it(*args, **kwargs):
        tokenizer = real(*args, **kwargs)
        tokenizer.eos_token, tokenizer.pad_token = "<|im_start|>", None
        return tokenizer

    monkeypatch.setattr(resolve, "AutoTokenizer", types.SimpleNamespace(from_pretrained=as_517_reads_it))
    monkeypatch.setenv("EYAS_CACHE", str(tmp_path / "cache"))
    misread = resolve_model("packaged:smollm2-135m")
    assert str(tmp_path) in misread  # converted anew, under the misreading
    got = AutoTokenizer.from_pretrained(misread)
    assert (got.bos_token, got.eos_token, got.pad_token, got.unk_token) == (
        "<|im_start|>", "<|im_end|>", "<|im_end|>", "<|endoftext|>")
    ids = [model_identity("packaged:smollm2-135m", AutoConfig.from_pretrained(f), AutoTokenizer.from_pretrained(f), f)
           for f in (folder, misread)]
    assert ids[0] == ids[1] and ids[0].tokenizer_hash == ids[1].tokenizer_hash
