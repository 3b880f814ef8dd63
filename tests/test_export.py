"""eyas export / eyas import on a tiny random target: every format round-trips exactly, the
foreign layouts are read the way their projects write them, and whatever eyas cannot serve
or score faithfully is refused with the field that says why."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from eyas.draft import DraftConfig, Eagle3Drafter, load_config, load_drafter, save_drafter
from eyas.errors import EyasError
from eyas.export import LAYOUTS, export_drafter, import_drafter
from eyas.export.config import ExportConfig
from eyas.vllm.serve import serve_launcher

FORMATS = sorted(LAYOUTS)
DRAFT_VOCAB = 96


def make_drafter(target_dir: Path, out: Path, *, aux: tuple[int, ...] = (2, 4, 5), seed: int = 0,
                 draft_vocab: int = DRAFT_VOCAB, **overrides) -> Path:
    """A random drafter for the tiny target; every weight random (norms too), so a misplaced
    tensor changes the logits."""
    from transformers import AutoConfig

    from eyas.models import load_tokenizer, model_identity

    config = AutoConfig.from_pretrained(target_dir)
    identity = model_identity(str(target_dir), config, load_tokenizer(str(target_dir)))
    cfg = DraftConfig.for_target(config, identity, (*aux, config.num_hidden_layers), draft_vocab, **overrides)
    g = torch.Generator().manual_seed(seed)
    model = Eagle3Drafter(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.startswith("embed_tokens"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3 + (1.0 if p.dim() == 1 else 0.0))
    model.set_vocab(torch.randperm(cfg.vocab_size, generator=g)[:draft_vocab].sort().values)
    save_drafter(model, out)
    return out


def target_embeddings(target_dir: Path) -> torch.Tensor:
    with safe_open(str(target_dir / "model.safetensors"), framework="pt") as f:
        return f.get_tensor("model.embed_tokens.weight").float()


def ttt_logits(ckpt: Path, embed: torch.Tensor, steps: int = 3) -> torch.Tensor:
    """All TTT steps' logits [steps, B, T, Vd] on fixed random inputs."""
    model = load_drafter(ckpt, embed)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=g)
    aux = torch.randn(2, 12, len(model.config.aux_layer_ids), model.config.hidden_size, generator=g)
    with torch.no_grad():
        return torch.stack(model.forward_ttt(ids, aux, steps))


def saved(ckpt: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(ckpt / "model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


@pytest.fixture(scope="module")
def drafter(tmp_path_factory, tiny_llama_dir) -> Path:
    return make_drafter(tiny_llama_dir, tmp_path_factory.mktemp("drafter"))


@pytest.fixture(scope="module")
def embed(tiny_llama_dir) -> torch.Tensor:
    return target_embeddings(tiny_llama_dir)


# --- round trips ------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", FORMATS)
def test_export_then_import_gives_identical_weights_config_and_logits(fmt, drafter, embed, tmp_path):
    export_drafter(ExportConfig(ckpt=str(drafter), to=fmt, out=str(tmp_path / "exported")))
    import_drafter(tmp_path / "exported", tmp_path / "back")
    before, after = saved(drafter), saved(tmp_path / "back")
    assert before.keys() == after.keys()
    for name in before:
        assert before[name].dtype == after[name].dtype and torch.equal(before[name], after[name]), name
    assert json.loads((tmp_path / "back/config.json").read_text()) == json.loads((drafter / "config.json").read_text())
    assert torch.equal(ttt_logits(tmp_path / "back", embed), ttt_logits(drafter, embed))


def test_round_trip_of_a_full_vocabulary_drafter(tiny_llama_dir, tmp_path, embed):
    """Without a reduced vocabulary vLLM has no d2t table, so the vllm layouts write none."""
    vocab = json.loads((tiny_llama_dir / "config.json").read_text())["vocab_size"]
    ckpt = make_drafter(tiny_llama_dir, tmp_path / "full", draft_vocab=vocab)
    for fmt in FORMATS:
        export_drafter(ExportConfig(ckpt=str(ckpt), to=fmt, out=str(tmp_path / fmt)))
        assert ("d2t" in saved(tmp_path / fmt)) == LAYOUTS[fmt].full_vocab_mapping
        import_drafter(tmp_path / fmt, tmp_path / f"{fmt}-back")
        assert torch.equal(ttt_logits(tmp_path / f"{fmt}-back", embed), ttt_logits(ckpt, embed))


def test_export_casts_floating_weights_only(drafter, tmp_path):
    export_drafter(ExportConfig(ckpt=str(drafter), to="vllm", out=str(tmp_path / "bf16"), dtype="bf16"))
    tensors = saved(tmp_path / "bf16")
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert all(t.dtype == torch.bfloat16 for k, t in tensors.items() if k not in ("d2t", "t2d"))
    import_drafter(tmp_path / "bf16", tmp_path / "back")
    original = saved(drafter)
    for name, t in saved(tmp_path / "back").items():
        expected = original[name].to(torch.bfloat16) if original[name].is_floating_point() else original[name]
        assert torch.equal(t, expected), name


@pytest.fixture(scope="module")
def drafter31(tmp_path_factory, tiny_llama_dir) -> Path:
    """A drafter with both EAGLE 3.1 options; its fc_norm weights are random around 1."""
    return make_drafter(tiny_llama_dir, tmp_path_factory.mktemp("drafter31"), seed=5, fc_norm=True, norm_output=True)


def test_eagle31_options_change_the_logits(drafter31, embed, tmp_path):
    """Otherwise the round trips below could not tell a dropped option from a kept one."""
    config = json.loads((drafter31 / "config.json").read_text())
    for option in ("fc_norm", "norm_output"):
        off = tmp_path / option
        off.mkdir()
        edited = {**config, option: False, "eyas": {**config["eyas"], option: False}}
        (off / "config.json").write_text(json.dumps(edited))
        kept = {k: v for k, v in saved(drafter31).items() if option != "fc_norm" or not k.startswith("fc_norm.")}
        save_file(kept, off / "model.safetensors")
        assert not torch.allclose(ttt_logits(off, embed), ttt_logits(drafter31, embed), atol=1e-3), option


@pytest.mark.parametrize("fmt", ["vllm", "speculators"])
def test_eagle31_options_round_trip_through_the_vllm_layouts(fmt, drafter31, tiny_llama_dir, embed, tmp_path):
    export_drafter(ExportConfig(ckpt=str(drafter31), to=fmt, out=str(tmp_path / fmt)))
    config = json.loads((tmp_path / fmt / "config.json").read_text())
    assert config["fc_norm"] is True and config["norm_output"] is True and not config.get("norm_before_fc")
    tensors = saved(tmp_path / fmt)
    # vLLM's loader prefixes `model.` itself: the file holds exactly fc_norm.{i}.weight, one per aux state.
    assert sorted(k for k in tensors if "fc_norm" in k) == [f"fc_norm.{i}.weight" for i in range(3)]
    assert all(torch.equal(tensors[f"fc_norm.{i}.weight"], saved(drafter31)[f"fc_norm.{i}.weight"]) for i in range(3))
    import_drafter(tmp_path / fmt, tmp_path / "back")
    before, after = saved(drafter31), saved(tmp_path / "back")
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert load_config(tmp_path / "back") == load_config(drafter31)
    assert torch.equal(ttt_logits(tmp_path / "back", embed), ttt_logits(drafter31, embed))
    # The same folder without eyas's own record: read as a foreign drafter from the engine fields alone.
    edit(tmp_path / fmt, lambda c: c.pop("eyas"))
    import_drafter(tmp_path / fmt, tmp_path / "foreign", target=str(tiny_llama_dir))
    cfg = load_config(tmp_path / "foreign")
    assert cfg.fc_norm and cfg.norm_output
    assert torch.equal(ttt_logits(tmp_path / "foreign", embed), ttt_logits(drafter31, embed))


def test_import_refuses_an_export_whose_option_was_edited(drafter31, tmp_path):
    export_drafter(ExportConfig(ckpt=str(drafter31), to="vllm", out=str(tmp_path / "vllm")))
    edit(tmp_path / "vllm", lambda c: c.update(norm_output=False))
    with pytest.raises(EyasError, match="norm_output False disagrees with its eyas block"):
        import_drafter(tmp_path / "vllm", tmp_path / "back")


# --- what each layout writes -----------------------------------------------------------------

def test_layer_ids_follow_each_engines_convention(drafter, tmp_path):
    for fmt in FORMATS:
        export_drafter(ExportConfig(ckpt=str(drafter), to=fmt, out=str(tmp_path / fmt)))
    vllm = json.loads((tmp_path / "vllm/config.json").read_text())
    sglang = json.loads((tmp_path / "sglang/config.json").read_text())
    spec = json.loads((tmp_path / "speculators/config.json").read_text())
    assert vllm["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]  # input of layer k, as eyas counts
    assert spec["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert sglang["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]  # output of layer k
    assert spec["norm_before_residual"] is False  # vLLM's speculators reader would assume true
    assert {k.split(".")[0] for k in saved(tmp_path / "speculators")} >= {"layers", "fc", "norm", "lm_head", "d2t"}
    assert not any(k.startswith("midlayer.") for k in saved(tmp_path / "speculators"))
    assert not any(k.startswith("embed_tokens") for fmt in FORMATS for k in saved(tmp_path / fmt))


def test_sglang_export_refuses_what_sglang_does_not_implement(tiny_llama_dir, tmp_path):
    four = make_drafter(tiny_llama_dir, tmp_path / "four", aux=(1, 2, 4, 5))
    with pytest.raises(EyasError, match="exactly three aux layers"):
        export_drafter(ExportConfig(ckpt=str(four), to="sglang", out=str(tmp_path / "out1")))
    export_drafter(ExportConfig(ckpt=str(four), to="vllm",
                                out=str(tmp_path / "out2")))  # vLLM sizes fc from num_aux_hidden_states
    assert json.loads((tmp_path / "out2/config.json").read_text())["num_aux_hidden_states"] == 4
    nbr = make_drafter(tiny_llama_dir, tmp_path / "nbr", norm_before_residual=True)
    with pytest.raises(EyasError, match="norm_before_residual"):
        export_drafter(ExportConfig(ckpt=str(nbr), to="sglang", out=str(tmp_path / "out3")))
    for option in ("fc_norm", "norm_output"):
        ckpt = make_drafter(tiny_llama_dir, tmp_path / option, **{option: True})
        with pytest.raises(EyasError, match=f"trained with {option}=true .* export it --to vllm"):
            export_drafter(ExportConfig(ckpt=str(ckpt), to="sglang", out=str(tmp_path / f"{option}-sglang")))
        assert not (tmp_path / f"{option}-sglang").exists()


def test_export_refuses_bad_requests(drafter, tmp_path, tiny_tokenizer_dir):
    from tiny import build_model

    with pytest.raises(EyasError, match="--to must be one of sglang, speculators, vllm"):
        export_drafter(ExportConfig(ckpt=str(drafter), to="tensorrt", out=str(tmp_path / "x")))
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy/notes.txt").write_text("mine")
    with pytest.raises(EyasError, match="--force"):
        export_drafter(ExportConfig(ckpt=str(drafter), to="vllm", out=str(tmp_path / "busy")))
    with pytest.raises(EyasError, match="is the input the checkpoint"):
        export_drafter(ExportConfig(ckpt=str(drafter), to="vllm", out=str(drafter), force=True))
    other = build_model(tmp_path / "other", "llama", layers=6, tokenizer_dir=tiny_tokenizer_dir)
    with pytest.raises(EyasError, match="configs differ"):
        export_drafter(ExportConfig(ckpt=str(drafter), to="vllm", out=str(tmp_path / "y"), target=str(other)))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((drafter / "config.json").read_text())
    save_file({k: v for k, v in saved(drafter).items() if k != "fc.weight"}, broken / "model.safetensors")
    with pytest.raises(EyasError, match=r"missing \['fc.weight'\]"):
        export_drafter(ExportConfig(ckpt=str(broken), to="vllm", out=str(tmp_path / "z")))


# --- foreign layouts, written the way their projects write them ------------------------------

def llama_fields(cfg: DraftConfig) -> dict:
    return {"hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
            "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
            "head_dim": cfg.head_dim, "num_hidden_layers": 1, "hidden_act": "silu", "rms_norm_eps": cfg.rms_norm_eps,
            "rope_theta": cfg.rope_parameters["rope_theta"], "rope_scaling": None,
            "max_position_embeddings": cfg.max_position_embeddings, "vocab_size": cfg.vocab_size,
            "tie_word_embeddings": False, "model_type": "llama"}


def official_eagle3(ckpt: Path, out: Path, embed: torch.Tensor) -> Path:
    """SafeAILab/EAGLE's traineagle3 layout: LlamaForCausalLM config with draft_vocab_size, no
    layer ids, a pytorch_model.bin that also carries the target's embeddings (in fp16)."""
    cfg = load_config(ckpt)
    out.mkdir()
    (out / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], **llama_fields(cfg),
                                                 "draft_vocab_size": cfg.draft_vocab_size, "torch_dtype": "float16"}))
    torch.save({**saved(ckpt), "embed_tokens.weight": embed.half()}, out / "pytorch_model.bin")
    return out


def specforge(ckpt: Path, out: Path) -> Path:
    """SpecForge's export for SGLang: LlamaForCausalLMEagle3, ids in eagle_config as outputs of layers."""
    cfg = load_config(ckpt)
    out.mkdir()
    (out / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLMEagle3"], **llama_fields(cfg), "draft_vocab_size": cfg.draft_vocab_size,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [k - 1 for k in cfg.aux_layer_ids],
                         "use_aux_hidden_state": True}}))
    save_file(saved(ckpt), out / "model.safetensors")
    return out


def speculators(ckpt: Path, out: Path, verifier: str, embed: torch.Tensor) -> Path:
    """vllm-project/speculators' Eagle3Speculator: layer config nested, weights under layers.0.,
    sharded with an index, the verifier named in speculators_config."""
    cfg = load_config(ckpt)
    out.mkdir()
    (out / "config.json").write_text(json.dumps({
        "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
        "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                               "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                               "verifier": {"name_or_path": verifier, "architectures": ["LlamaForCausalLM"]}},
        "transformer_layer_config": llama_fields(cfg), "draft_vocab_size": cfg.draft_vocab_size,
        "norm_before_residual": cfg.norm_before_residual, "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
        "target_hidden_size": None}))
    tensors = {k.replace("midlayer.", "layers.0."): v for k, v in saved(ckpt).items()}
    tensors["embed_tokens.weight"] = embed
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, out / shard)
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: shard for shard, keys in shards.items() for k in keys}}))
    return out


def test_import_official_eagle3_layout(drafter, tiny_llama_dir, embed, tmp_path):
    folder = official_eagle3(drafter, tmp_path / "eagle3", embed)
    summary = import_drafter(folder, tmp_path / "back", target=str(tiny_llama_dir))
    cfg = load_config(tmp_path / "back")
    assert cfg.aux_layer_ids == (2, 4, 5) and cfg.label_layer_id == 8  # both engines' default for 8 layers
    assert "dropped" in summary["embed_tokens"]
    assert cfg.identity == load_config(drafter).identity
    assert torch.equal(ttt_logits(tmp_path / "back", embed), ttt_logits(drafter, embed))


def test_import_specforge_layout_shifts_sglang_ids(tiny_llama_dir, embed, tmp_path):
    ckpt = make_drafter(tiny_llama_dir, tmp_path / "ckpt", aux=(1, 3, 6), seed=3)
    summary = import_drafter(specforge(ckpt, tmp_path / "specforge"), tmp_path / "back", target=str(tiny_llama_dir))
    assert summary["aux_layer_ids"] == [1, 3, 6]
    assert torch.equal(ttt_logits(tmp_path / "back", embed), ttt_logits(ckpt, embed))


def test_import_speculators_layout_finds_its_verifier(tiny_llama_dir, embed, tmp_path):
    ckpt = make_drafter(tiny_llama_dir, tmp_path / "ckpt", seed=4, norm_before_residual=True)
    folder = speculators(ckpt, tmp_path / "spec", str(tiny_llama_dir), embed)
    import_drafter(folder, tmp_path / "back")  # no --target: the verifier is named in the folder
    cfg = load_config(tmp_path / "back")
    assert cfg.norm_before_residual and cfg.aux_layer_ids == (2, 4, 5)
    assert torch.equal(ttt_logits(tmp_path / "back", embed), ttt_logits(ckpt, embed))


def edit(folder: Path, change) -> Path:
    config = json.loads((folder / "config.json").read_text())
    change(config)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


REFUSALS = {
    "speculators without norm_before_residual": ("spec", lambda c: c.pop("norm_before_residual"), "norm_before_residual"),
    "fc_norm without its weights": ("specforge", lambda c: c.update(fc_norm=True), r"missing \['fc_norm.0.weight'"),
    "one norm before fc without its weight": ("spec", lambda c: c.update(norm_before_fc=True),
                                              r"missing \['input_norm.weight'"),
    "both norms before fc": ("spec", lambda c: c.update(norm_before_fc=True, fc_norm=True), "one or the other"),
    "no architectures": ("specforge", lambda c: c.pop("architectures"), "`architectures`"),
    "not a Llama EAGLE-3 head": ("specforge", lambda c: c.update(architectures=["Qwen3ForCausalLM"]), "architectures"),
    "two decoder layers": ("specforge", lambda c: c.update(num_hidden_layers=2), "num_hidden_layers"),
    "a Qwen3 decoder layer": ("spec", lambda c: c["transformer_layer_config"].update(model_type="qwen3"), "model_type"),
    "no hidden_size": ("spec", lambda c: c["transformer_layer_config"].pop("hidden_size"), "`hidden_size`"),
    "not EAGLE-3 or DFlash": ("spec", lambda c: c.update(speculators_model_type="mtp"), "'eagle3' and 'dflash'"),
    "ids that disagree": ("specforge", lambda c: c.update(eagle_aux_hidden_state_layer_ids=[2, 4, 6]),
                          "name different layers"),
    "ids past the last layer": ("specforge", lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[1, 3, 8]),
                                "do not exist"),
    "another target's vocabulary": ("specforge", lambda c: c.update(vocab_size=1000), "vocabulary"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_import_refuses_what_it_does_not_understand(case, drafter, tiny_llama_dir, embed, tmp_path):
    kind, change, message = REFUSALS[case]
    folder = specforge(drafter, tmp_path / "in") if kind == "specforge" else \
        speculators(drafter, tmp_path / "in", str(tiny_llama_dir), embed)
    with pytest.raises(EyasError, match=message):
        import_drafter(edit(folder, change), tmp_path / "out", target=str(tiny_llama_dir))
    assert not (tmp_path / "out").exists()


def test_import_refuses_bad_weights(drafter, tiny_llama_dir, embed, tmp_path):
    target = str(tiny_llama_dir)
    folder = specforge(drafter, tmp_path / "no-d2t")
    save_file({k: v for k, v in saved(drafter).items() if k != "d2t"}, folder / "model.safetensors")
    with pytest.raises(EyasError, match="no d2t"):
        import_drafter(folder, tmp_path / "o1", target=target)
    folder = specforge(drafter, tmp_path / "extra")
    save_file({**saved(drafter), "midlayer.self_attn.q_norm.weight": torch.ones(4)}, folder / "model.safetensors")
    with pytest.raises(EyasError, match=r"unexpected \['midlayer.self_attn.q_norm.weight'\]"):
        import_drafter(folder, tmp_path / "o2", target=target)
    folder = specforge(drafter, tmp_path / "bad-t2d")
    tensors = saved(drafter)
    save_file({**tensors, "t2d": ~tensors["t2d"]}, folder / "model.safetensors")
    with pytest.raises(EyasError, match="t2d"):
        import_drafter(folder, tmp_path / "o3", target=target)
    folder = official_eagle3(drafter, tmp_path / "own-embed", embed * 1.5)
    with pytest.raises(EyasError, match="embed_tokens differ"):
        import_drafter(folder, tmp_path / "o4", target=target)
    with pytest.raises(EyasError, match="--target"):
        import_drafter(specforge(drafter, tmp_path / "anonymous"), tmp_path / "o5")


def test_import_refuses_an_edited_eyas_export(drafter, tmp_path):
    export_drafter(ExportConfig(ckpt=str(drafter), to="sglang", out=str(tmp_path / "sglang")))
    edit(tmp_path / "sglang", lambda c: c.update(eagle_aux_hidden_state_layer_ids=[1, 3, 4],
                                                 eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 2, 3]}))
    with pytest.raises(EyasError, match="disagrees with its eyas block"):
        import_drafter(tmp_path / "sglang", tmp_path / "back")


# --- the command line -------------------------------------------------------------------------

def run_cli(*argv: str) -> int:
    from eyas.cli import main

    with pytest.raises(SystemExit) as exit_:
        main([str(a) for a in argv])
    return exit_.value.code


def test_cli_export_prints_the_serve_command(drafter, tiny_llama_dir, tmp_path, capsys):
    assert run_cli("export", drafter, "--to", "sglang", "--out", tmp_path / "sglang") == 0
    out = capsys.readouterr().out
    assert "output of layer k): [1, 3, 4]" in out
    from eyas.draft import load_config

    depth = load_config(str(drafter)).ttt_steps  # by default the depth it was trained to draft
    assert (f"python -m sglang.launch_server --model-path {tiny_llama_dir} --speculative-algorithm EAGLE3 "
            f"--speculative-draft-model-path {tmp_path / 'sglang'} --speculative-num-steps {depth} "
            f"--speculative-eagle-topk 1 --speculative-num-draft-tokens {depth + 1}") in out

    assert run_cli("export", drafter, "--to", "vllm", "--out", tmp_path / "later", "--serve-command",
                   "--num-speculative-tokens", "5") == 0
    line = capsys.readouterr().out.strip()
    assert not (tmp_path / "later").exists()
    assert line.startswith(shlex.join(serve_launcher(str(tiny_llama_dir))) + " --speculative-config ")
    spec = json.loads(line.split("--speculative-config ", 1)[1].strip("'"))
    assert spec == {"method": "eagle3", "model": str(tmp_path / "later"), "num_speculative_tokens": 5}


def test_cli_import_and_errors(drafter, tmp_path, capsys):
    assert run_cli("export", drafter, "--to", "speculators", "--out", tmp_path / "spec") == 0
    assert run_cli("import", tmp_path / "spec", "--out", tmp_path / "back") == 0
    assert "aux layer ids [2, 4, 5]" in capsys.readouterr().out
    assert run_cli("import", tmp_path / "spec", "--out", tmp_path / "back") == 2
    assert "eyas import: error:" in capsys.readouterr().err
    assert run_cli("import", tmp_path / "nowhere", "--out", tmp_path / "x") == 2
    assert "no config.json" in capsys.readouterr().err


# --- --force replaces only what eyas wrote (issue 13) --------------------------------------------

def test_force_replaces_only_the_files_eyas_wrote(drafter, tmp_path):
    out = tmp_path / "out"
    export_drafter(ExportConfig(ckpt=str(drafter), to="vllm", out=str(out)))
    assert json.loads((out / "eyas-export.json").read_text())["files"] == ["config.json", "model.safetensors"]
    (out / "README.md").write_text("notes")
    first = (out / "model.safetensors").read_bytes()
    export_drafter(ExportConfig(ckpt=str(drafter), to="vllm", out=str(out), dtype="bf16",
                                force=True))  # over its own export: allowed
    assert (out / "README.md").read_text() == "notes" and (out / "model.safetensors").read_bytes() != first
    assert sorted(p.name for p in out.iterdir()) == [".eyas-lock", "README.md", "config.json", "eyas-export.json",
                                                     "model.safetensors"]


@pytest.mark.parametrize("foreign", ["pytorch_model.bin", "model-00001-of-00002.safetensors",
                                     "model.safetensors.index.json"])
def test_force_refuses_foreign_weights_that_would_sit_beside_the_new_ones(drafter, tmp_path, foreign):
    out = tmp_path / "out"
    export_drafter(ExportConfig(ckpt=str(drafter), to="vllm", out=str(out)))
    (out / foreign).write_bytes(b"someone else's weights")
    with pytest.raises(EyasError, match=f"weight files eyas did not write \\({foreign}\\)"):
        export_drafter(ExportConfig(ckpt=str(drafter), to="vllm", out=str(out), force=True))
    assert (out / foreign).read_bytes() == b"someone else's weights"  # nothing deleted


def test_force_refuses_to_overwrite_a_drafter_eyas_did_not_write(drafter, tmp_path):
    out = tmp_path / "theirs"
    out.mkdir()
    (out / "config.json").write_text("{}")
    with pytest.raises(EyasError, match="holds config.json, which eyas did not write"):
        export_drafter(ExportConfig(ckpt=str(drafter), to="vllm", out=str(out), force=True))
    assert (out / "config.json").read_text() == "{}"
