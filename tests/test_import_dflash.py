"""`eyas import` takes a DFlash drafter as speculators 0.9.0's trainer saves it: config.json
field for field as its `save_pretrained` writes it (read from a save by its own code,
bench/peer_check.py), weights under the names eyas's DFlash drafter has too, in bf16.

The folder is written here from an eyas DFlash drafter of the tiny target, so the import must
give back that drafter: the same tensors and the same forward, with the peer's sliding-window
layers (causal within the block unless `sliding_window_non_causal`) as its `causal_layers`.
bench/peer_check.py proves the same against the peer's own forward (needs speculators).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoConfig

from eyas.draft import DraftConfig, load_config, load_drafter
from eyas.draft.build import new_drafter
from eyas.draft.checkpoint import drafter_state
from eyas.errors import EyasError
from eyas.export import import_drafter
from eyas.models import load_tokenizer, model_identity
from eyas.models.target_head import load_target_head

AUX = [2, 4, 5]
BLOCK = 4
DRAFT_VOCAB = 96
MASK = 0  # the peer's fallback for a tokenizer without a mask token: its pad token
SLIDING, FULL = "sliding_attention", "full_attention"


def peer_config(target_dir: Path, draft_vocab: int, layer_types: list[str], non_causal: bool) -> dict:
    """config.json as speculators' DFlash `save_pretrained` writes it for the target."""
    t = json.loads((target_dir / "config.json").read_text())
    layer = {
        "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": None, "eos_token_id": None,
        "head_dim": t["head_dim"], "hidden_act": "silu", "hidden_size": t["hidden_size"], "initializer_range": 0.02,
        "intermediate_size": t["intermediate_size"], "layer_types": layer_types,
        "max_position_embeddings": t["max_position_embeddings"], "max_window_layers": 28, "model_type": "qwen3",
        "num_attention_heads": t["num_attention_heads"], "num_hidden_layers": len(layer_types),
        "num_key_value_heads": t["num_key_value_heads"], "pad_token_id": None, "rms_norm_eps": t["rms_norm_eps"],
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}, "sliding_window": 2048,
        "tie_word_embeddings": False, "use_cache": True, "use_sliding_window": SLIDING in layer_types,
        "vocab_size": t["vocab_size"],
    }
    return {
        "architectures": ["DFlashDraftModel"], "auto_map": {"": "config.DFlashSpeculatorConfig"},
        "aux_hidden_state_layer_ids": AUX, "block_size": BLOCK, "draft_vocab_size": draft_vocab, "dtype": "bfloat16",
        "mask_token_id": MASK, "sample_from_anchor": False, "sliding_window_non_causal": non_causal,
        "speculators_config": {
            "algorithm": "dflash", "default_proposal_method": "greedy",
            "proposal_methods": [{"accept_tolerance": 0.0, "proposal_type": "greedy", "speculative_tokens": BLOCK - 1,
                                  "verifier_accept_k": 1}],
            "verifier": {"architectures": t["architectures"], "name_or_path": str(target_dir)}},
        "speculators_model_type": "dflash", "speculators_version": "0.9.0", "target_hidden_size": None,
        "tie_word_embeddings": False, "transformer_layer_config": layer, "transformers_version": "5.19.0",
    }


def eyas_drafter(target_dir: Path, draft_vocab: int, layers: int, causal_layers: tuple[int, ...]):
    """A random eyas DFlash drafter for the target, its weights rounded to bf16 (as the peer saves them)."""
    config = AutoConfig.from_pretrained(target_dir)
    identity = model_identity(str(target_dir), config, load_tokenizer(str(target_dir)), target_dir)
    cfg = DraftConfig.for_target(config, identity, (*AUX, config.num_hidden_layers), draft_vocab, drafter="dflash",
                                 num_hidden_layers=layers, mask_token_id=MASK, ttt_steps=BLOCK - 1,
                                 causal_layers=causal_layers)
    head = load_target_head(target_dir)
    model = new_drafter(cfg, head.embed_weight)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:  # norms around 1, matrices scaled by fan-in: every term matters
                p.copy_((1 + 0.3 * torch.randn(p.shape, generator=g) if p.dim() == 1
                         else torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5).bfloat16())
        if draft_vocab == cfg.vocab_size:  # the peer's full-vocabulary drafter drafts with the target's lm_head
            model.lm_head.weight.copy_(head.lm_head_weight)
        model.set_vocab(torch.randperm(cfg.vocab_size, generator=g)[:draft_vocab].sort().values)
    return model, head


def write_peer_folder(out: Path, config: dict, model) -> Path:
    """The peer's checkpoint folder: a full-vocabulary drafter saves no lm_head, d2t or t2d."""
    state = drafter_state(model)
    if config["draft_vocab_size"] == config["transformer_layer_config"]["vocab_size"]:
        state = {k: v for k, v in state.items() if k not in ("lm_head.weight", "d2t", "t2d")}
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.bfloat16() if v.is_floating_point() else v for k, v in state.items()}, out / "model.safetensors")
    return out


def assert_same_drafter(model, folder: Path, embed: torch.Tensor) -> None:
    """Every tensor and the forward at every row (all block slots) equal."""
    back = load_drafter(folder, embed)
    mine, theirs = drafter_state(model), drafter_state(back)
    assert mine.keys() == theirs.keys()
    for name in mine:
        torch.testing.assert_close(theirs[name], mine[name].to(theirs[name].dtype), rtol=0, atol=0, msg=name)
    g = torch.Generator().manual_seed(1)
    cfg = model.config
    ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=g)
    aux = torch.randn(2, 24, len(AUX), cfg.hidden_size, generator=g)
    with torch.no_grad():
        for a, b in zip(model.forward_ttt(ids, aux), back.forward_ttt(ids, aux)):
            torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("layer_types, non_causal, causal", [
    ([SLIDING, SLIDING], False, (0, 1)),  # the peer's defaults: every layer sliding, blocks causal there
    ([SLIDING, FULL], False, (0,)),  # --full-attention-indices 1
    ([SLIDING, SLIDING], True, ()),  # --sliding-window-non-causal
    ([FULL, FULL], False, ()),
])
def test_a_peer_dflash_folder_imports_as_the_drafter_it_holds(tiny_llama_dir, tmp_path, layer_types, non_causal,
                                                              causal):
    model, head = eyas_drafter(tiny_llama_dir, DRAFT_VOCAB, len(layer_types), causal)
    folder = write_peer_folder(tmp_path / "peer", peer_config(tiny_llama_dir, DRAFT_VOCAB, layer_types, non_causal),
                               model)
    summary = import_drafter(folder, tmp_path / "back")  # the verifier is named in the folder
    assert summary["layout"] == "speculators DFlash" and summary["drafter"] == "dflash"
    assert summary["depth"] == BLOCK - 1 and summary["causal_layers"] == list(causal)
    assert ("sliding_window" in summary) == (SLIDING in layer_types)
    cfg = load_config(tmp_path / "back")
    assert (cfg.drafter, cfg.ttt_steps, cfg.num_hidden_layers, cfg.mask_token_id) == ("dflash", BLOCK - 1,
                                                                                      len(layer_types), MASK)
    assert cfg.aux_layer_ids == tuple(AUX) and cfg.causal_layers == causal and cfg.draft_vocab_size == DRAFT_VOCAB
    assert_same_drafter(model, tmp_path / "back", head.embed_weight)


def test_a_full_vocabulary_drafter_takes_the_targets_lm_head(tiny_llama_dir, tmp_path):
    """The peer saves no lm_head, d2t or t2d when the draft vocabulary is the target's; its layer
    types left to transformers' Qwen3 defaults (use_sliding_window, max_window_layers) as it reads them."""
    V = json.loads((tiny_llama_dir / "config.json").read_text())["vocab_size"]
    model, head = eyas_drafter(tiny_llama_dir, V, 2, (1,))
    config = peer_config(tiny_llama_dir, V, [SLIDING, SLIDING], False)
    layer = config["transformer_layer_config"]
    del layer["layer_types"]
    layer["max_window_layers"] = 1  # layers 1.. slide
    summary = import_drafter(write_peer_folder(tmp_path / "peer", config, model), tmp_path / "back",
                             target=str(tiny_llama_dir))
    assert "target's" in summary["lm_head"] and summary["causal_layers"] == [1]
    assert_same_drafter(model, tmp_path / "back", head.embed_weight)
    assert torch.equal(load_drafter(tmp_path / "back").lm_head.weight, head.lm_head_weight)


def _edit(config: dict, path: str, value) -> None:
    *parents, key = path.split(".")
    d = config
    for p in parents:
        d = d[p]
    d[key] = value


@pytest.mark.parametrize("path, value, message", [
    ("sample_from_anchor", True, "sample_from_anchor is true"),
    ("mask_token_id", None, "has no `mask_token_id`"),
    ("block_size", 1, "block_size is 1"),
    ("transformer_layer_config.vocab_size", 1000, "vocabulary 1000"),
    ("transformer_layer_config.hidden_size", 128, "width 128"),
    ("transformer_layer_config.attention_bias", True, "attention_bias is set"),
    ("aux_hidden_state_layer_ids", [5, 2, 4], "aux_hidden_state_layer_ids .* ascending"),
    ("speculators_model_type", "dflash2", "speculators_model_type is 'dflash2'"),
])
def test_what_eyas_cannot_run_is_refused_in_one_line(tiny_llama_dir, tmp_path, path, value, message):
    model, _ = eyas_drafter(tiny_llama_dir, DRAFT_VOCAB, 2, ())
    config = peer_config(tiny_llama_dir, DRAFT_VOCAB, [FULL, FULL], False)
    _edit(config, path, value)
    folder = write_peer_folder(tmp_path / "peer", config, model)
    with pytest.raises(EyasError, match=message) as e:
        import_drafter(folder, tmp_path / "back")
    assert "\n" not in str(e.value)
    assert not (tmp_path / "back").exists()
