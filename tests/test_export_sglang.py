"""The SGLang export checked rule by rule against SGLang's own loader (SGLang itself does not
run on these machines). Every rule below was read from sgl-project/sglang:

- python/sglang/srt/models/llama_eagle3.py (commits 03d5a777 and d737979c):
  `EntryClass = [LlamaForCausalLMEagle3]`; one decoder layer (`num_hidden_layers != 1` raises);
  `fc = Linear(target_hidden_size * 3, hidden_size)`; `lm_head` of `draft_vocab_size` rows unless
  `tie_word_embeddings` (then it *is* the embedding) or `draft_vocab_size` is None (then it is
  loaded from the target); `load_weights` turns `d2t` into `hot_token_id = d2t + arange`, skips
  `t2d`, maps `.q_proj/.k_proj/.v_proj` onto `.qkv_proj` shards q/k/v and `.gate_proj/.up_proj`
  onto `.gate_up_proj` shards 0/1, prefixes `model.` when the name is not a parameter itself,
  and silently drops any weight it cannot place;
  the first layer keeps the un-normed hidden state as its residual (no `norm_before_residual`).
- python/sglang/srt/models/llama.py `set_eagle3_layers_to_capture`: `layers_to_capture =
  [val + 1 for val in layer_ids]`, and `LlamaModel.forward` captures `hidden_states + residual`
  *before* layer i, so SGLang's id j means the output of layer j (eyas's id j + 1).
- python/sglang/srt/model_executor/model_runner.py: the ids come only from
  `hf_config.eagle_config["eagle_aux_hidden_state_layer_ids"]`.
- python/sglang/srt/models/llama.py `LlamaMLP`: anything but `hidden_act == "silu"` raises.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from eyas.draft import load_drafter
from eyas.export import export_drafter
from eyas.export.config import ExportConfig
from test_export import make_drafter

STACKED = [(".qkv_proj", ".q_proj", "q"), (".qkv_proj", ".k_proj", "k"), (".qkv_proj", ".v_proj", "v"),
           (".gate_up_proj", ".gate_proj", 0), (".gate_up_proj", ".up_proj", 1)]


def sglang_parameters(config: dict) -> dict[str, dict]:
    """SGLang's LlamaForCausalLMEagle3 parameters: name -> {shard id: shape}, from its module tree."""
    H, I = config["hidden_size"], config["intermediate_size"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    d = config.get("head_dim") or H // heads
    hin = config.get("target_hidden_size", H)
    layer = "model.midlayer."
    return {
        "model.embed_tokens.weight": {None: (config["vocab_size"], H)},  # set from the target, never loaded
        "model.fc.weight": {None: (H, 3 * hin)},
        layer + "self_attn.qkv_proj.weight": {"q": (heads * d, 2 * H), "k": (kv * d, 2 * H), "v": (kv * d, 2 * H)},
        layer + "self_attn.o_proj.weight": {None: (H, heads * d)},
        layer + "mlp.gate_up_proj.weight": {0: (I, H), 1: (I, H)},
        layer + "mlp.down_proj.weight": {None: (H, I)},
        layer + "input_layernorm.weight": {None: (H,)},
        layer + "hidden_norm.weight": {None: (H,)},
        layer + "post_attention_layernorm.weight": {None: (H,)},
        "model.norm.weight": {None: (H,)},
        "lm_head.weight": {None: (config["draft_vocab_size"], H)},
    }


def sglang_load(folder: Path) -> dict:
    """SGLang's `load_weights` loop, replayed on names and shapes: what lands where, and what
    SGLang would have dropped without a word."""
    config = json.loads((folder / "config.json").read_text())
    params = sglang_parameters(config)
    loaded: dict[str, dict] = {}
    dropped, hot_token_id = [], None
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        for name in f.keys():
            tensor = f.get_tensor(name)
            if "d2t" in name:
                hot_token_id = tensor + torch.arange(tensor.shape[0])
                continue
            if "t2d" in name:
                continue
            for param_name, weight_name, shard in STACKED:
                if weight_name in name:
                    name = name.replace(weight_name, param_name)
                    break
            else:
                shard = None
            target = name if name in params else f"model.{name}"
            if target in params and shard in params[target]:
                loaded.setdefault(target, {})[shard] = tuple(tensor.shape)
            else:
                dropped.append(name)
    return {"config": config, "params": params, "loaded": loaded, "dropped": dropped, "hot_token_id": hot_token_id}


def test_sglang_loader_places_every_weight(tiny_llama_dir, tmp_path):
    ckpt = make_drafter(tiny_llama_dir, tmp_path / "ckpt", aux=(1, 4, 6))
    export_drafter(ExportConfig(ckpt=str(ckpt), to="sglang", out=str(tmp_path / "sglang")))
    r = sglang_load(tmp_path / "sglang")
    config = r["config"]

    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["num_hidden_layers"] == 1 and config["tie_word_embeddings"] is False
    assert config["draft_vocab_size"] is not None and config["hidden_act"] == "silu"
    assert r["dropped"] == []
    expected = {name: shards for name, shards in r["params"].items() if name != "model.embed_tokens.weight"}
    assert r["loaded"] == expected  # every parameter, every shard, every shape

    drafter = load_drafter(ckpt)
    assert torch.equal(r["hot_token_id"], drafter.draft_to_target(torch.arange(drafter.config.draft_vocab_size)))

    sglang_ids = config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    layers_to_capture = [val + 1 for val in sglang_ids]  # llama.py: captured before layer val + 1
    assert layers_to_capture == list(drafter.config.aux_layer_ids) == [1, 4, 6]
    assert config["eagle_config"].get("use_aux_hidden_state", True) is True
