"""`eyas import` takes a drafter as speculators 0.9.0's trainer saves it (its `save_pretrained`:
architectures `Eagle3DraftModel`, the layer config nested with a 2048-token sliding window, its
eagle3 defaults norm_before_fc + norm_output + norm_before_residual on, weights `layers.0.*`,
`input_norm.weight`, and a copy of the target's embeddings), gives the logits of a plain
float32 reference of the peer's step, and decodes losslessly on the real SmolLM2.

The folder is written here field for field as the peer writes it (read from a save by its
own code); bench/peers.py imports drafters the peer trained and compares the peer's own
forward with eyas's on the same inputs."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from eyas.draft import load_config, load_drafter
from eyas.export import import_drafter

DRAFT_VOCAB = 96


def peer_saved_drafter(target_dir: Path, out: Path, draft_vocab: int = DRAFT_VOCAB, seed: int = 0) -> Path:
    """A random eagle3 drafter in the layout speculators' `save_pretrained` writes."""
    target = json.loads((target_dir / "config.json").read_text())
    H, V, N = target["hidden_size"], target["vocab_size"], target["num_hidden_layers"]
    heads, kv = target["num_attention_heads"], target["num_key_value_heads"]
    d = target.get("head_dim") or H // heads
    I = target["intermediate_size"]
    layer = {
        "attention_bias": False, "attention_dropout": 0.0, "head_dim": d, "hidden_act": "silu", "hidden_size": H,
        "initializer_range": 0.02, "intermediate_size": I, "layer_types": ["sliding_attention"],
        "max_position_embeddings": target["max_position_embeddings"], "mlp_bias": False, "model_type": "llama",
        "num_attention_heads": heads, "num_hidden_layers": 1, "num_key_value_heads": kv, "pretraining_tp": 1,
        "rms_norm_eps": target["rms_norm_eps"],
        "rope_parameters": {"rope_theta": target.get("rope_theta") or target["rope_parameters"]["rope_theta"],
                            "rope_type": "default"},
        "sliding_window": 2048, "tie_word_embeddings": False, "use_cache": True, "use_sliding_window": True,
        "vocab_size": V,
    }
    aux = [2, N // 2, N - 3]
    config = {
        "architectures": ["Eagle3DraftModel"], "auto_map": {"": "config.Eagle3SpeculatorConfig"},
        "draft_vocab_size": draft_vocab, "dtype": "float32", "eagle_aux_hidden_state_layer_ids": aux,
        "embed_requires_grad": False, "fc_norm": False, "norm_before_fc": True, "norm_before_residual": True,
        "norm_output": True,
        "speculators_config": {
            "algorithm": "eagle3", "default_proposal_method": "greedy",
            "proposal_methods": [{"accept_tolerance": 0.0, "proposal_type": "greedy", "speculative_tokens": 3,
                                  "verifier_accept_k": 1}],
            "verifier": {"architectures": target["architectures"], "name_or_path": str(target_dir)}},
        "speculators_model_type": "eagle3", "speculators_version": "0.9.0", "target_hidden_size": None,
        "tie_word_embeddings": False, "transformer_layer_config": layer,
    }
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, around=0.0, scale=0.3):
        return torch.randn(*shape, generator=g) * scale + around

    p = "layers.0."
    tensors = {
        "fc.weight": rand(H, 3 * H, scale=0.3 / (3 * H) ** 0.5), "input_norm.weight": rand(3 * H, around=1.0),
        p + "hidden_norm.weight": rand(H, around=1.0), p + "input_layernorm.weight": rand(H, around=1.0),
        p + "post_attention_layernorm.weight": rand(H, around=1.0),
        p + "self_attn.q_proj.weight": rand(heads * d, 2 * H, scale=1 / H ** 0.5),
        p + "self_attn.k_proj.weight": rand(kv * d, 2 * H, scale=1 / H ** 0.5),
        p + "self_attn.v_proj.weight": rand(kv * d, 2 * H, scale=1 / H ** 0.5),
        p + "self_attn.o_proj.weight": rand(H, heads * d, scale=1 / H ** 0.5),
        p + "mlp.gate_proj.weight": rand(I, H, scale=1 / H ** 0.5), p + "mlp.up_proj.weight": rand(I, H, scale=1 / H ** 0.5),
        p + "mlp.down_proj.weight": rand(H, I, scale=1 / I ** 0.5),
        "norm.weight": rand(H, around=1.0), "lm_head.weight": rand(draft_vocab, H, scale=1 / H ** 0.5),
    }
    draft_to_target = torch.randperm(V, generator=g)[:draft_vocab].sort().values
    tensors["d2t"] = draft_to_target - torch.arange(draft_vocab)
    tensors["t2d"] = torch.zeros(V, dtype=torch.bool)
    tensors["t2d"][draft_to_target] = True
    embed = next(v for k, v in load_file(next(target_dir.glob("*.safetensors"))).items() if "embed_tokens" in k)
    tensors["embed_tokens.weight"] = embed.float()
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous() for k, v in tensors.items()}, out / "model.safetensors")
    return out


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def peer_step0_reference(folder: Path, token: torch.Tensor, aux: torch.Tensor, input_norm: bool = True) -> torch.Tensor:
    """The peer's first TTT step at a sample's first position, plainly in float32 from its own
    tensors: one key, so attention returns v; input_norm over the concatenated aux states, the
    residual after hidden_norm (norm_before_residual). token [B], aux [B, 3, H] -> logits [B, Vd]."""
    t = load_file(folder / "model.safetensors")
    cfg = json.loads((folder / "config.json").read_text())["transformer_layer_config"]
    eps, p = cfg["rms_norm_eps"], "layers.0."
    rep = cfg["num_attention_heads"] // cfg["num_key_value_heads"]
    flat = aux.flatten(1)
    h = (_rms(flat, t["input_norm.weight"], eps) if input_norm else flat) @ t["fc.weight"].T
    h = _rms(h, t[p + "hidden_norm.weight"], eps)
    x = torch.cat([_rms(t["embed_tokens.weight"][token], t[p + "input_layernorm.weight"], eps), h], -1)
    v = (x @ t[p + "self_attn.v_proj.weight"].T).unflatten(-1, (cfg["num_key_value_heads"], cfg["head_dim"]))
    out = h + v.repeat_interleave(rep, dim=1).flatten(1) @ t[p + "self_attn.o_proj.weight"].T
    m = _rms(out, t[p + "post_attention_layernorm.weight"], eps)
    out = out + (F.silu(m @ t[p + "mlp.gate_proj.weight"].T) * (m @ t[p + "mlp.up_proj.weight"].T)) @ t[
        p + "mlp.down_proj.weight"].T
    return _rms(out, t["norm.weight"], eps) @ t["lm_head.weight"].T


def test_import_of_a_peer_saved_drafter_gives_the_peers_logits(tiny_llama_dir, tmp_path):
    folder = peer_saved_drafter(tiny_llama_dir, tmp_path / "peer")
    summary = import_drafter(folder, tmp_path / "back")  # the verifier is named in the folder
    assert summary["layout"] == "speculators" and "dropped" in summary["embed_tokens"]
    assert "2048 tokens in training, not applied" in summary["sliding_window"]
    cfg = load_config(tmp_path / "back")
    assert cfg.norm_before_fc and cfg.norm_output and cfg.norm_before_residual and not cfg.fc_norm
    embed = load_file(folder / "model.safetensors")["embed_tokens.weight"]
    model = load_drafter(tmp_path / "back", embed)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (4, 2), generator=g)
    aux = torch.randn(4, 2, 3, cfg.hidden_size, generator=g) * 4
    with torch.no_grad():
        ours = model.forward_ttt(ids, aux, 1)[0][:, 0]  # step 0, position 0: reads token 1 and aux state 0
    torch.testing.assert_close(ours, peer_step0_reference(folder, ids[:, 1], aux[:, 0]), rtol=1e-4, atol=1e-4)
    # The option matters: without input_norm the same weights give other logits.
    assert not torch.allclose(ours, peer_step0_reference(folder, ids[:, 1], aux[:, 0], input_norm=False), atol=1e-2)


def test_a_peer_saved_drafter_decodes_losslessly(smollm2_dir, tmp_path):
    """Chain and tree, against transformers' own greedy generate."""
    from eyas.evaluate.drafter import DrafterSession
    from eyas.evaluate.generate import generate
    from eyas.prompts import render
    from eyas.evaluate.proposers import Eagle3
    from eyas.evaluate.run import load_checked_drafter
    from eyas.models.eos import eos_ids
    from eyas.evaluate.target import TargetSession
    from eyas.models import load_target, model_identity

    model, tokenizer = load_target("packaged:smollm2-135m", dtype="float32")
    identity = model_identity("packaged:smollm2-135m", model.config, tokenizer)
    folder = peer_saved_drafter(smollm2_dir, tmp_path / "peer", draft_vocab=4096)
    import_drafter(folder, tmp_path / "back", target="packaged:smollm2-135m")
    drafter = load_checked_drafter(str(tmp_path / "back"), model, identity)
    eos = set(eos_ids(model.generation_config, tokenizer))
    ids = render(tokenizer, [{"role": "user", "content": "Name three colours of the rainbow."}])
    with torch.inference_mode():
        expected = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, eos_token_id=sorted(eos),
                                  pad_token_id=0)[0, len(ids):].tolist()
    target = TargetSession(model, drafter.config.aux_layer_ids)
    for tree in (False, True):
        proposer = Eagle3(DrafterSession(drafter), steps=5, tree=tree, top_k=4, max_nodes=12)
        assert generate(target, proposer, ids, 24, eos).generated_ids == expected, f"tree={tree}"
