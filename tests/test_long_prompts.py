"""Long-context prompts (`--prompts long`): built by a deterministic rule from the packaged
ShareGPT, each within its length and near it, never reusing a conversation or quoting MT-bench;
`eyas prepare --exclude-prompts` keeps their material out of training; eval reports tau by
context length and refuses a prompt whose answer would run past the target's positions."""

from __future__ import annotations

import json

import pytest

from eyas.cli import main
from eyas.data.long_prompts import load_prompt_set, parse_long
from eyas.data.prepared import PreparedData
from eyas.data.synthetic import contaminated, ngram_set
from eyas.errors import EyasError
from eyas.prompts import render
from eyas.models import load_tokenizer
from eyas.prompts import mt_bench_turns


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread):
    """Tiny models: see conftest's one_thread."""


def _length(tokenizer, prompt) -> int:
    return len(render(tokenizer, [*prompt.history, {"role": "user", "content": prompt.turns[0]}]))


def _texts(prompt) -> list[str]:
    return [*prompt.turns, *(m["content"] for m in prompt.history)]


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_dir):
    return load_tokenizer(str(smollm2_dir))


def test_default_set_on_smollm2_fits_each_length_closely_and_uses_each_conversation_once(smollm2_tokenizer):
    prompts = load_prompt_set("long", lambda: smollm2_tokenizer)
    assert [p.category for p in prompts] == [f"ctx {n}" for n in (8192, 32768, 65536) for _ in range(4)]
    assert len({p.id for p in prompts}) == 12
    for p in prompts:
        length = int(p.category.split()[1])
        n = _length(smollm2_tokenizer, p)
        assert 0.95 * length <= n <= length, (p.id, n)  # the rule fills 95% unless 8 conversations in a row do not fit
        roles = [m["role"] for m in p.history]
        assert roles == ["user", "assistant"] * (len(roles) // 2) and roles  # whole exchanges, ending answered
    # No conversation serves two prompts: the questions are distinct and quoted nowhere else, and
    # no long user turn (one conversation's own text; short ones such as "continue" recur across
    # conversations) appears in two prompts.
    questions = [p.turns[0] for p in prompts]
    assert len(set(questions)) == 12
    assert not set(questions) & {m["content"] for p in prompts for m in p.history}
    owners: dict[str, set[str]] = {}
    for p in prompts:
        for m in p.history:
            if m["role"] == "user" and len(m["content"]) > 200:
                owners.setdefault(m["content"], set()).add(p.id)
    assert len(owners) > 100 and all(len(ids) == 1 for ids in owners.values())
    # Deterministic: the same spec gives the same prompts, and a prefix of lengths the same first prompts.
    again = load_prompt_set("long", lambda: smollm2_tokenizer)
    assert [(p.turns, p.history) for p in again] == [(p.turns, p.history) for p in prompts]
    first = load_prompt_set("long:8192:2", lambda: smollm2_tokenizer)
    assert [(p.turns, p.history) for p in first] == [(p.turns, p.history) for p in prompts[:2]]
    grams = ngram_set(mt_bench_turns())
    assert not any(contaminated(m["content"], grams) for p in prompts for m in p.history if m["role"] == "user")
    assert not any(contaminated(p.turns[0], grams) for p in prompts)


@pytest.mark.parametrize("spec, words", [
    ("long:abc", "not a whole number"), ("long:100", "leaves no room"), ("long:8k:0", "not a positive"),
    ("long:8k:2:3", "expected long"), ("long:", "expected long"),
])
def test_bad_specs_are_refused_in_one_line(spec, words):
    with pytest.raises(EyasError, match=words) as e:
        parse_long(spec)
    assert "\n" not in str(e.value)


def test_spec_forms():
    assert parse_long("mt-bench") is None and parse_long("longer.jsonl") is None
    assert parse_long("long") == ((8192, 32768, 65536), 4)
    assert parse_long("long:8k,2048:3") == ((8192, 2048), 3)


def _run(args: list[str]) -> int:
    with pytest.raises(SystemExit) as e:
        main(args)
    return e.value.code


def test_prepare_excludes_the_long_prompts_material(tmp_path, tiny_llama_dir, tiny_tokenizer_dir):
    """The conversations the long prompts are made of are dropped from training data that
    holds them, and only those: the same data without the exclusion keeps them."""
    spec = "long:512,1024:2"
    prompts = load_prompt_set(spec, lambda: load_tokenizer(str(tiny_llama_dir)))
    used = {t for p in prompts for t in _texts(p)}
    common = ["prepare", "--model", str(tiny_llama_dir), "--data", "packaged:sharegpt", "--max-len", "256",
              "--limit", "60", "--workers", "1"]
    assert _run([*common, "--out", str(tmp_path / "all")]) == 0
    assert _run([*common, "--out", str(tmp_path / "kept"), "--exclude-prompts", spec]) == 0

    def user_turns(folder):
        data = PreparedData(folder)
        return [m["content"] for conv in data.conversations() for m in conv if m["role"] == "user"]

    everything, kept = user_turns(tmp_path / "all"), user_turns(tmp_path / "kept")
    assert any(t in used for t in everything)  # the first records are the long prompts' material
    assert not any(t in used for t in kept)
    summary = PreparedData(tmp_path / "kept").meta["summary"]
    assert summary["dropped"], summary


def test_eval_reports_tau_by_context_length_and_refuses_what_does_not_fit(tmp_path, tiny_llama_dir, capsys):
    out = tmp_path / "r.json"
    args = ["eval", "--model", str(tiny_llama_dir), "--prompts", "long:256,512:1", "--max-new-tokens", "8",
            "--output", str(out)]
    assert _run(args) == 0
    results = json.loads(out.read_text())
    assert set(results["tau_by"]["category"]["prompt-lookup"]) == {"ctx 256", "ctx 512"}
    for r in results["records"]:
        length = int(r["category"].split()[1])
        assert length * 0.5 < len(r["prompt_ids"]) <= length
    assert "tau by category" in capsys.readouterr().out
    # The tiny target has 1,024 positions: a prompt of up to 1,024 tokens and a 64-token answer do not fit.
    assert _run([*args[:4], "long:1024:1", "--max-new-tokens", "64", "--output", str(tmp_path / "no.json")]) == 2
    err = capsys.readouterr().err
    assert "positions, more than the 1024" in err and "long:960" in err
    assert not (tmp_path / "no.json").exists()
