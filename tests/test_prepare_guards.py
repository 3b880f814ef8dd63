"""`eyas prepare`'s guards: exclusion of eval material from every window and in every script,
summaries that account for every record, and loss masks that train each end of turn the target
produced and no other (templates whose generation prompt adds text, answers cut by a budget).
SmolLM2's tokenizer only: no weights are loaded."""

from __future__ import annotations

import json
import re

import pytest
from transformers import AutoTokenizer

from eyas.data.config import PrepareConfig
from eyas.data.prepare import EXCLUDED, UNANSWERED, format_summary, prepare
from eyas.data.prepared import PreparedData
from eyas.data.sources import normalize
from eyas.data.synthetic import contaminated, ngram_set
from eyas.data.template import tokenize_conversation
from eyas.errors import EyasError
from eyas.models import resolve_model
from tiny import LLAMA3

SMOLLM2 = "packaged:smollm2-135m"
# The generation prompt opens a think block the rendered turn does not have (QwQ, DeepSeek-R1-Distill).
R1_LIKE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n<think>\\n' }}{%- endif -%}"
)
TWO_TURNS = [
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Spain?"},
    {"role": "assistant", "content": "Madrid."},
]


def _jsonl(path, rows: list[dict]):
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


def _prepare(data, out, **options) -> dict:
    return prepare(PrepareConfig(model=SMOLLM2, data=[str(data)], out=str(out), workers=1, **options),
                   progress=False)


def _trained_runs(tokenizer, ids, mask) -> list[str]:
    """The decoded text of each maximal run of trained tokens."""
    runs: list[list[int]] = []
    for i in range(len(ids)):
        if mask[i] and (i == 0 or not mask[i - 1]):
            runs.append([])
        if mask[i]:
            runs[-1].append(int(ids[i]))
    return [tokenizer.decode(r) for r in runs]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(resolve_model(SMOLLM2))


def _pair(k: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Tell me one short fact about the number {k} please."},
            {"role": "assistant", "content": f"The number {k} comes after {k - 1} when counting."}]


def test_an_excluded_conversation_loses_every_window(tmp_path):
    """A long eval prompt holds later turns of a conversation, answers included: the record is
    excluded whole, before --window cuts it (counted once, as one record), whichever of its
    messages the prompt quotes; other records keep their windows."""
    quoted_user = [*_pair(1), *_pair(2), {"role": "user", "content": "Which river flows through the old town of "
                                          "Heidelberg in the south west of Germany?"},
                   {"role": "assistant", "content": "The Neckar."}]
    quoted_answer = [*_pair(3), {"role": "user", "content": "Why?"},
                     {"role": "assistant", "content": "Because the migrating swallows return to the same barn "
                                                      "every spring, guided by the stars and the sun."}]
    clean = [*_pair(4), *_pair(5)]
    data = _jsonl(tmp_path / "d.jsonl", [{"messages": m} for m in (quoted_user, quoted_answer, clean)])
    prompts = _jsonl(tmp_path / "eval.jsonl", [
        {"prompt": "Which river flows through the old town of Heidelberg in the south west of Germany? Be brief."},
        {"prompt": "Is it true that the migrating swallows return to the same barn every spring?"},
    ])
    summary = _prepare(data, tmp_path / "out", window=1, exclude_prompts=[str(prompts)])
    assert summary["dropped"] == {EXCLUDED: 2} and summary["records_read"] == 3
    assert PreparedData(tmp_path / "out").conversations() == [clean[:2], clean[2:]]


def test_exclusion_reads_every_script(tmp_path, capsys):
    """Exact copies of Russian and Chinese eval prompts are excluded like English ones (Unicode
    words; 16 characters in a row for scripts without spaces); a prompt too short to match
    anything is named in a one-line warning."""
    ru = "Объясните, пожалуйста, почему небо голубое и как это связано с рассеянием Рэлея в атмосфере Земли"
    zh = "请详细解释为什么天空是蓝色的以及这与地球大气中的瑞利散射有什么关系"
    en = "Please explain in detail why the sky is blue and how Rayleigh scattering works"
    other_zh = "请给我讲一个关于一只勇敢的小猫在森林里冒险的故事"
    prompts = _jsonl(tmp_path / "eval.jsonl", [{"prompt": p} for p in (ru, zh, en, "你好吗")])
    data = _jsonl(tmp_path / "d.jsonl", [
        {"messages": [{"role": "user", "content": p}, {"role": "assistant", "content": "An answer."}]}
        for p in (ru, "前言：" + zh + "。谢谢！", en, other_zh)])
    summary = _prepare(data, tmp_path / "out", exclude_prompts=[str(prompts)])
    assert summary["dropped"] == {EXCLUDED: 3} and summary["kept"] == 1
    assert PreparedData(tmp_path / "out").conversations()[0][0]["content"] == other_zh
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "1 prompt(s)" in warnings[0] and "eval.jsonl:4" in warnings[0]
    assert not contaminated(zh[:15], [zh]) and contaminated(zh[:16], [zh])


def test_english_words_are_unchanged():
    """On ASCII text the units are the lowercased runs of letters and digits, apostrophes dropped."""
    text = "Don't stop_me now: it's 2024, and the 8-word rule's grams stay as they were!"
    words = ["dont", "stop", "me", "now", "its", "2024", "and", "the", "8", "word", "rules", "grams", "stay", "as",
             "they", "were"]
    assert ngram_set([text]) == frozenset(tuple(words[i:i + 8]) for i in range(len(words) - 7))


def test_a_template_whose_generation_prompt_adds_text_trains_the_end_of_turn(tmp_path, tokenizer):
    """With a generation prompt that is no prefix of the rendered turn, each answer is trained
    with its <|im_end|>, as with the tokenizer's own template (unchanged), a first assistant turn
    included; so through prepare with --chat-template."""
    expected = ["Paris.<|im_end|>\n", "Madrid.<|im_end|>\n"]
    own = tokenize_conversation(tokenizer, TWO_TURNS, max_len=256)
    assert _trained_runs(tokenizer, *own[:2]) == expected
    template = tokenizer.chat_template
    try:
        tokenizer.chat_template = R1_LIKE
        assert _trained_runs(tokenizer, *tokenize_conversation(tokenizer, TWO_TURNS, max_len=256)[:2]) == expected
        opening = [{"role": "assistant", "content": "Welcome!"}, *TWO_TURNS]
        assert _trained_runs(tokenizer, *tokenize_conversation(tokenizer, opening, max_len=256)[:2]) == [
            "Welcome!<|im_end|>\n", *expected]
    finally:
        tokenizer.chat_template = template
    data = _jsonl(tmp_path / "d.jsonl", [{"messages": TWO_TURNS}])
    (tmp_path / "r1.jinja").write_text(R1_LIKE)
    r1 = _prepare(data, tmp_path / "r1", chat_template=str(tmp_path / "r1.jinja"))
    assert r1["trained_tokens"] == _prepare(data, tmp_path / "own")["trained_tokens"] == int(own[1].sum())


def test_window_accounts_for_every_record(tmp_path):
    """A record whose assistant turns all come before its first user turn has no window: it is
    counted as dropped, and --strict refuses it."""
    data = _jsonl(tmp_path / "d.jsonl", [
        {"messages": [{"role": "assistant", "content": "Welcome! Ask me anything."},
                      {"role": "user", "content": "unanswered question"}]},
        {"messages": [{"role": "system", "content": "sys"}, {"role": "assistant", "content": "Greeting."},
                      {"role": "user", "content": "bye"}]},
        {"messages": TWO_TURNS},
    ])
    summary = _prepare(data, tmp_path / "out", window=1)
    assert summary["records_read"] == 3 and summary["kept"] == 2 and summary["dropped"] == {UNANSWERED: 2}
    with pytest.raises(EyasError, match=f"record 0 of .*: {re.escape(UNANSWERED)}"):
        _prepare(data, tmp_path / "strict", window=1, strict=True)


def test_packed_summary_counts_records_and_samples(tmp_path):
    """--pack: the summary says how many records were kept and how many samples they fill."""
    data = _jsonl(tmp_path / "d.jsonl", [{"messages": _pair(k)} for k in range(4)]
                  + [{"messages": [{"role": "user", "content": "Hi"}]}])
    summary = _prepare(data, tmp_path / "out", pack=True, max_len=120)
    assert summary["kept"] == 2 and summary["packed_from"] == 4
    assert format_summary(summary, "o").startswith("kept 4 of 5 records, packed into 2 samples -> o")
    summary = _prepare(data, tmp_path / "w", pack=True, window=1, max_len=120)
    assert format_summary(summary, "w").startswith("kept 4 windows of 1 user turns from 5 records, packed into 2 "
                                                   "samples -> w")


def test_a_cut_answer_trains_its_content_not_its_end_of_turn(tmp_path, tokenizer, tiny_tokenizer_dir):
    """regenerate marks an answer that hit its token budget `"cut": true`: its content is trained
    and its <|im_end|> is not (the target never chose to stop there); unmarked answers, and
    `"cut": false`, keep theirs. A template that trims messages trains the content up to its
    last word."""
    cut = {"role": "assistant", "content": "Madrid is the capital, and its", "cut": True}
    data = _jsonl(tmp_path / "d.jsonl", [
        {"messages": [*TWO_TURNS[:3], cut]},
        {"messages": [TWO_TURNS[0], {**TWO_TURNS[1], "cut": False}]},
    ])
    assert normalize({"messages": [TWO_TURNS[0], cut]})[-1] == cut
    summary = _prepare(data, tmp_path / "out")
    assert summary["kept"] == 2 and summary["dropped"] == {}
    prepared = PreparedData(tmp_path / "out")
    assert prepared.conversations()[0][-1] == cut
    runs = [_trained_runs(tokenizer, s.input_ids, s.loss_mask) for s in (prepared[0], prepared[1])]
    assert runs == [["Paris.<|im_end|>\n", "Madrid is the capital, and its"], ["Paris.<|im_end|>\n"]]
    assert "<|im_end|>" in tokenizer.decode(prepared[0].input_ids[-2:])  # rendered, only not trained
    llama = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)  # a template that trims messages: a cut
    llama.chat_template = LLAMA3  # answer's trailing space is rendered away
    ids, mask, _ = tokenize_conversation(llama, [*TWO_TURNS[:3], {**cut, "content": cut["content"] + " "}], max_len=256)
    assert _trained_runs(llama, ids, mask) == ["Paris.<|eot_id|>", "Madrid is the capital, and its"]
