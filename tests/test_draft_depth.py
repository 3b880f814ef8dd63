"""One rule decides how many tokens a drafter drafts a step, for what `eyas eval` measures and
what `eyas export` serves: the depth it was trained to draft (its TTT steps), unless told
otherwise; eval's report says which depth it measured and why."""

from __future__ import annotations

import json

import pytest

from test_adversarial import cli, train_args
from test_store_damage import tiny_prepared, tiny_store  # noqa: F401


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread):
    """Tiny models: see conftest's one_thread."""


def test_eval_and_export_draft_the_trained_depth(tmp_path, capsys, tiny_llama_dir, tiny_store):  # noqa: F811
    from eyas.evaluate.config import EvalConfig
    from eyas.evaluate.run import evaluate
    from eyas.export.config import ExportConfig
    from eyas.export.exporter import export_drafter

    out = tmp_path / "run"
    got, _ = cli(capsys, *train_args(tiny_store, out, "--steps", "2", "--ttt-steps", "3"))
    assert got == 0

    common = dict(model=str(tiny_llama_dir), draft=str(out), limit=1, max_new_tokens=10)
    measured = evaluate(EvalConfig(output=str(tmp_path / "a.json"), **common))
    assert measured["draft_depth"]["tokens"] == measured["settings"]["steps"] == 3
    assert "trained depth" in measured["draft_depth"]["rule"]
    assert "drafting 3 tokens a step" in capsys.readouterr().out
    chain = measured["summary"]["eagle3-chain"]
    assert len(chain["acceptance"]) == 3  # positions scored: the depth drafted
    counts = [c for r in measured["records"] if r["method"] == "eagle3-chain" for c in r["accept_counts"]]
    assert counts and max(counts) <= 3
    assert chain["identical"] == chain["answers"] > 0

    summary = export_drafter(ExportConfig(ckpt=str(out), to="speculators", out=str(tmp_path / "served")))
    assert '"num_speculative_tokens": 3' in summary["serve_command"]
    config = json.loads((tmp_path / "served" / "config.json").read_text())
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3

    told = evaluate(EvalConfig(output=str(tmp_path / "b.json"), steps=5, **common))
    assert told["draft_depth"] == {"tokens": 5, "rule": "--steps"}
    summary = export_drafter(ExportConfig(ckpt=str(out), to="vllm", out=str(tmp_path / "five"),
                                          num_speculative_tokens=5))
    assert '"num_speculative_tokens": 5' in summary["serve_command"]


def test_without_a_drafter_prompt_lookup_keeps_its_length(tmp_path, tiny_llama_dir):
    from eyas.evaluate.config import LOOKUP_DEPTH, EvalConfig
    from eyas.evaluate.run import draft_depth

    assert draft_depth(EvalConfig(model=str(tiny_llama_dir))) == (LOOKUP_DEPTH, "prompt lookup's default")
