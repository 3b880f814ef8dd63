"""Eval prompts kept out of training, recorded from end to end: `prepare --exclude-prompts`
records the sets it excluded, regeneration, capture and training carry the record to the
drafter, and eval names the prompts that exclusion did not cover (tau on them may be tau on
trained text), while prompts it did cover pass unsaid."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eyas.capture.config import CaptureConfig
from eyas.capture.run import capture
from eyas.cli import main
from eyas.data.exclusion import not_excluded
from eyas.data.long_prompts import load_prompt_set
from eyas.data.prepared import PreparedData
from eyas.models import load_tokenizer
from eyas.regenerate.config import RegenerateConfig
from eyas.regenerate.run import regenerate
from eyas.store import Store
from eyas.train import TrainConfig, train
from eyas.train.checkpoint import data_of

ASKED = ["Tell me how a lighthouse keeper spent the long winter nights on the rock in 1890.",
         "Write a short poem about the sound of rain falling on an old tin roof at night."]
OTHER = "Describe in detail how a glass blower shapes a vase from molten sand in his workshop."


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread):
    """Tiny models: see conftest's one_thread."""


def _prompts(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    return path


def test_a_prompt_is_covered_only_when_every_8_words_of_it_were_excluded(tmp_path, tiny_llama_dir):
    tokenizer = load_tokenizer(str(tiny_llama_dir))
    excluded = _prompts(tmp_path / "excluded.jsonl", ASKED)
    part = " ".join(ASKED[0].split()[:9])  # 8 words in a row of ASKED[0], and nothing else: covered
    asked = load_prompt_set(str(_prompts(tmp_path / "asked.jsonl", [ASKED[1], OTHER, part])), lambda: tokenizer)
    assert not_excluded(asked, [str(excluded)], tokenizer) == [asked[1].id]
    assert not_excluded(asked, [], tokenizer) == [asked[0].id, asked[1].id, asked[2].id]
    # A long spec: the first prompts of a longer set are the shorter set's (the rule builds in order).
    assert not_excluded(load_prompt_set("long:512:3", lambda: tokenizer), ["long:512:2"], tokenizer) == ["long-512-2"]
    assert not_excluded(load_prompt_set("long:512:2", lambda: tokenizer), ["long:512:3"], tokenizer) == []
    # Prompts of a set that was excluded itself are covered without reading the sets again.
    mt_bench = load_prompt_set("mt-bench", lambda: tokenizer, 2)
    assert not_excluded(mt_bench, [str(tmp_path / "gone.jsonl"), "mt-bench"], tokenizer, "mt-bench") == []


def test_the_record_travels_from_prepare_to_eval(tmp_path, tiny_llama_dir, capsys):
    excluded = _prompts(tmp_path / "excluded.jsonl", ASKED)
    prep, regen, store = tmp_path / "prep", tmp_path / "regen", tmp_path / "store"
    with pytest.raises(SystemExit) as e:
        main(["prepare", "--model", str(tiny_llama_dir), "--data", "packaged:chitchat", "--out", str(prep),
              "--limit", "4", "--max-len", "64", "--exclude-prompts", str(excluded), "--exclude-prompts", "mt-bench"])
    assert e.value.code == 0
    recorded = [str(excluded.resolve()), "mt-bench"]
    assert PreparedData(prep).excluded_prompts == recorded
    regenerate(RegenerateConfig(model=str(tiny_llama_dir), data=str(prep), out=str(regen), max_new_tokens=4,
                                device="cpu"), progress=False)
    assert PreparedData(regen).excluded_prompts == recorded
    capture(CaptureConfig(model=str(tiny_llama_dir), data=str(regen), out=str(store), dtype="fp32"), progress=False)
    assert Store(store).manifest["excluded_prompts"] == recorded
    common = dict(steps=1, batch_tokens=128, ttt_steps=1, eval_fraction=0.0, progress=False)
    train(TrainConfig(out=str(tmp_path / "off"), store=str(store), **common))
    train(TrainConfig(out=str(tmp_path / "on"), online=True, model=str(tiny_llama_dir), data=str(regen), **common))
    for run in ("off", "on"):
        assert data_of(tmp_path / run)["excluded_prompts"] == recorded

    def evaluate(prompts: Path) -> tuple[dict, str]:
        out = tmp_path / f"{prompts.stem}.json"
        with pytest.raises(SystemExit) as e:
            main(["eval", "--model", str(tiny_llama_dir), "--draft", str(tmp_path / "off"), "--prompts", str(prompts),
                  "--max-new-tokens", "2", "--baseline", "none", "--output", str(out)])
        assert e.value.code == 0
        return json.loads(out.read_text())["kept_out_of_training"], capsys.readouterr().err

    capsys.readouterr()
    kept, err = evaluate(_prompts(tmp_path / "same.jsonl", ASKED))
    assert kept == {"checked": True, "excluded_prompts": recorded, "not_excluded": []} and "not kept out" not in err
    kept, err = evaluate(_prompts(tmp_path / "new.jsonl", [ASKED[0], OTHER]))
    assert kept["not_excluded"] == [f"{tmp_path / 'new.jsonl'}:2"]
    assert f"1 of 2 prompts ({tmp_path / 'new.jsonl'}:2) were not kept out of the drafter's training data" in err
    assert f"--exclude-prompts {tmp_path / 'new.jsonl'}" in err
    # The excluded file gone: eval says it cannot tell, and answers anyway.
    excluded.unlink()
    kept, err = evaluate(_prompts(tmp_path / "again.jsonl", ASKED))
    assert kept["checked"] is False and "cannot tell whether the drafter's training data held these prompts" in err


def test_data_prepared_before_the_record_is_said_to_be_unknown(tmp_path, tiny_llama_dir):
    from eyas.data.prepare import prepare_into

    prepare_into(str(tiny_llama_dir), "packaged:chitchat", tmp_path / "prep", 64, limit=2, workers=1, progress=False)
    assert PreparedData(tmp_path / "prep").excluded_prompts is None
    train(TrainConfig(out=str(tmp_path / "run"), online=True, model=str(tiny_llama_dir), data=str(tmp_path / "prep"),
                      steps=1, batch_tokens=128, ttt_steps=1, eval_fraction=0.0, progress=False))
    assert data_of(tmp_path / "run")["excluded_prompts"] is None
