"""An EAGLE-3 drafter of several layers (`eyas train --draft-layers N`): the first reads
[token embedding, hidden state] as EAGLE-3's one layer does, the others are plain pre-norm
Llama layers after it, as vLLM's llama_eagle3 builds them. Its training-time test equals a
hand-written reference one pair at a time, it trains, decodes losslessly, and exports to
vLLM's layout (names and config) while the layouts that read one layer refuse it."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from eyas.errors import EyasError
from test_adversarial import cli, train_args
from test_store_damage import tiny_prepared, tiny_store  # noqa: F401
from test_ttt import K, VD, check_against_reference, fuse, make_setup, reference_loss, rope


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread):
    """Tiny models: see conftest's one_thread."""


def _heads(a, x: torch.Tensor, pos: int):
    """An attention's per-head query, key and value [nH, d] for one input x at `pos`."""
    nH, nKV, d = a.n_heads, a.n_kv, a.head_dim
    q = rope((x @ a.q_proj.weight.T).view(nH, d), pos)
    k = rope((x @ a.k_proj.weight.T).view(nKV, d), pos).repeat_interleave(nH // nKV, 0)
    v = (x @ a.v_proj.weight.T).view(nKV, d).repeat_interleave(nH // nKV, 0)
    return q, k, v


def _mlp(layer, h: torch.Tensor) -> torch.Tensor:
    z = layer.post_attention_layernorm(h)
    return layer.mlp.down_proj(F.silu(layer.mlp.gate_proj(z)) * layer.mlp.up_proj(z))


def reference_stack(m, input_ids, hidden, labels, decay: float):
    """Logits [K][B, T, Vd] and the loss, one pair at a time: at step k and position i, every
    layer attends to its own step-0 keys at positions <= i and its own keys of steps 1..k at
    position i; layer 0's input is [input_layernorm(embed), hidden_norm(h)] with h as residual,
    layer l's is input_layernorm of the residual stream; the last layer's output, normed, gives
    the logits and (pre-norm, or normed with norm_output) the next step's hidden."""
    layers = [m.midlayer, *m.stack]
    B, T = input_ids.shape
    logits = [torch.zeros(B, T, VD) for _ in range(K)]
    for b in range(B):
        h_prev = [fuse(m, hidden[b, i, :3]) for i in range(T)]
        keys, values = {}, {}  # (layer, step, position) -> [nH, d]
        for k in range(K):
            n = T - 1 - k
            stream = {}
            for i in range(n):
                e = m.embed_tokens.weight[input_ids[b, i + 1 + k]]
                stream[i] = (torch.cat([m.midlayer.input_layernorm(e), m.midlayer.hidden_norm(h_prev[i])]), h_prev[i])
            for li, layer in enumerate(layers):
                a = layer.self_attn
                queries = {}
                for i in range(n):
                    x = stream[i][0] if li == 0 else layer.input_layernorm(stream[i])
                    queries[i], keys[li, k, i], values[li, k, i] = _heads(a, x, i + k)
                out = {}
                for i in range(n):
                    seen = [(0, p) for p in range(i + 1)] + [(j, i) for j in range(1, k + 1)]
                    heads = []
                    for h in range(a.n_heads):
                        w = (torch.stack([queries[i][h] @ keys[li, s, p][h] for s, p in seen]) / math.sqrt(a.head_dim)
                             ).softmax(0)
                        heads.append(sum(w[t] * values[li, s, p][h] for t, (s, p) in enumerate(seen)))
                    residual = stream[i][1] if li == 0 else stream[i]
                    h_out = a.o_proj(torch.cat(heads)) + residual
                    out[i] = h_out + _mlp(layer, h_out)
                stream = out
            h_prev = {i: m.norm(stream[i]) if m.config.norm_output else stream[i] for i in range(n)}
            for i in range(n):
                logits[k][b, i] = m.lm_head(m.norm(stream[i]))
    return logits, reference_loss(logits, labels, decay)


@pytest.mark.parametrize("options", [{"num_hidden_layers": 2}, {"num_hidden_layers": 3, "norm_output": True,
                                                                   "fc_norm": True}])
def test_stacked_layers_match_the_reference_values_and_gradients(options):
    drafter, head, draft_ids, input_ids, hidden, loss_mask = make_setup(**options)
    assert len(drafter.stack) == options["num_hidden_layers"] - 1
    loss, _ = check_against_reference(drafter, head, draft_ids, input_ids, hidden, loss_mask, reference_stack)
    assert loss.item() > 0


def test_a_stacked_drafter_trains_exports_to_vllm_and_is_refused_where_one_layer_is_read(
        tmp_path, capsys, tiny_llama_dir, tiny_store):  # noqa: F811
    from eyas.draft.checkpoint import load_drafter
    from eyas.evaluate.config import EvalConfig
    from eyas.evaluate.run import evaluate
    from eyas.export.config import ExportConfig
    from eyas.export.exporter import export_drafter

    out = tmp_path / "run"
    got, _ = cli(capsys, *train_args(tiny_store, out, "--steps", "3", "--ttt-steps", "2", "--draft-layers", "2",
                                     "--lr", "1e-2"))
    assert got == 0
    drafter = load_drafter(out)
    assert drafter.config.num_hidden_layers == 2 and len(drafter.stack) == 1
    saved = load_file(out / "model.safetensors")
    assert any(n.startswith("stack.0.self_attn.q_proj") for n in saved)

    results = evaluate(EvalConfig(model=str(tiny_llama_dir), draft=str(out), limit=2, max_new_tokens=12,
                                  output=str(tmp_path / "eval.json"), plot=str(tmp_path / "eval.png")))
    chain = results["summary"]["eagle3-chain"]
    assert chain["identical"] == chain["answers"] > 0

    export_drafter(ExportConfig(ckpt=str(out), to="vllm", out=str(tmp_path / "vllm")))
    config = json.loads((tmp_path / "vllm" / "config.json").read_text())
    assert config["num_hidden_layers"] == 2 and config["architectures"] == ["LlamaForCausalLMEagle3"]
    names = set(load_file(tmp_path / "vllm" / "model.safetensors"))
    hidden_size = drafter.config.hidden_size
    assert "midlayer.self_attn.q_proj.weight" in names and "layers.1.self_attn.q_proj.weight" in names
    assert not any(n.startswith("stack.") for n in names)
    layer1 = load_file(tmp_path / "vllm" / "model.safetensors")["layers.1.self_attn.q_proj.weight"]
    assert layer1.shape[1] == hidden_size  # layers after the first read H, as vLLM builds them
    for fmt, engine in (("sglang", "SGLang's EAGLE-3 head"), ("speculators", "The speculators format")):
        with pytest.raises(EyasError, match=f"{engine}.* reads one EAGLE-3 layer; this drafter has 2"):
            export_drafter(ExportConfig(ckpt=str(out), to=fmt, out=str(tmp_path / fmt)))
        assert not (tmp_path / fmt).exists()


def test_draft_layers_is_refused_where_a_kind_has_one_layer(tmp_path):
    from eyas.train.config import TrainConfig

    with pytest.raises(EyasError, match="--draft-layers is for --drafter eagle3 or dflash, not peagle"):
        TrainConfig(store="s", out="o", drafter="peagle", draft_layers=2)
    with pytest.raises(EyasError, match="An MLA EAGLE-3 drafter has one layer"):
        make_setup(num_hidden_layers=2, attention="mla", mla={"q_lora_rank": None, "kv_lora_rank": 8,
                                                              "qk_nope_head_dim": 8, "qk_rope_head_dim": 8,
                                                              "v_head_dim": 8})
