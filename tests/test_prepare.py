"""`eyas prepare`: sources, loss masks from chat templates, bad records, summaries."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoTokenizer

from eyas.cli import main
from eyas.data.prepare import format_summary, prepare
from eyas.data.config import PrepareConfig
from eyas.data.prepared import PreparedData
from eyas.data.sources import TruncatedTail, iter_records
from eyas.data.template import tokenize_conversation
from eyas.errors import EyasError
from tiny import CHATML, GEMMA, LLAMA3

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris is the capital."},
    {"role": "user", "content": "And of Italy?"},
    {"role": "assistant", "content": "Rome, of course."},
]

# Per template: the conversation as (text, trained?) pieces, written out by hand.
EXPECTED_PIECES = {
    "chatml": [
        ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
         "<|im_start|>assistant\n", False),
        ("Paris is the capital.<|im_end|>\n", True),
        ("<|im_start|>user\nAnd of Italy?<|im_end|>\n<|im_start|>assistant\n", False),
        ("Rome, of course.<|im_end|>\n", True),
    ],
    "llama3": [
        ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|><|start_header_id|>user"
         "<|end_header_id|>\n\nWhat is the capital of France?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n", False),
        ("Paris is the capital.<|eot_id|>", True),
        ("<|start_header_id|>user<|end_header_id|>\n\nAnd of Italy?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n", False),
        ("Rome, of course.<|eot_id|>", True),
    ],
    "gemma": [
        ("<bos><start_of_turn>system\nBe brief.<end_of_turn>\n<start_of_turn>user\nWhat is the capital of France?"
         "<end_of_turn>\n<start_of_turn>model\n", False),
        ("Paris is the capital.<end_of_turn>\n", True),
        ("<start_of_turn>user\nAnd of Italy?<end_of_turn>\n<start_of_turn>model\n", False),
        ("Rome, of course.<end_of_turn>\n", True),
    ],
}
TEMPLATES = {"chatml": CHATML, "llama3": LLAMA3, "gemma": GEMMA}


@pytest.mark.parametrize("family", sorted(TEMPLATES))
def test_mask_covers_exactly_the_assistant_turns(tiny_tokenizer_dir, family):
    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    tokenizer.chat_template = TEMPLATES[family]
    ids, mask, truncated = tokenize_conversation(tokenizer, CONVERSATION, max_len=4096)
    # Reference: tokenize each hand-written piece on its own and label it.
    ref_ids, ref_mask = [], []
    for text, trained in EXPECTED_PIECES[family]:
        piece = tokenizer(text, add_special_tokens=False)["input_ids"]
        ref_ids += piece
        ref_mask += [trained] * len(piece)
    assert not truncated
    assert ids.tolist() == ref_ids
    assert mask.tolist() == ref_mask


def test_mask_on_real_smollm2_template(smollm2_dir):
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    ids, mask, _ = tokenize_conversation(tokenizer, CONVERSATION[1:], max_len=4096)
    runs = []  # decoded text of each maximal run of trained tokens
    for i in range(len(ids)):
        if mask[i] and (i == 0 or not mask[i - 1]):
            runs.append([])
        if mask[i]:
            runs[-1].append(int(ids[i]))
    assert [tokenizer.decode(r) for r in runs] == ["Paris is the capital.<|im_end|>\n", "Rome, of course.<|im_end|>\n"]
    assert "You are a helpful AI assistant" in tokenizer.decode(ids[~mask])  # the default system prompt is not trained


def _write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


GOOD_OPENAI = {"messages": [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello! How can I help?"}]}
GOOD_SHAREGPT = {"conversations": [{"from": "human", "value": "Name a fruit"}, {"from": "gpt", "value": "An apple."}]}


def test_bad_records_are_counted_by_reason_and_strict_names_the_record(tmp_path, tiny_llama_dir):
    data = _write_jsonl(tmp_path / "mixed.jsonl", [
        GOOD_OPENAI,
        "{not json",
        {"messages": [{"role": "user", "content": "only a question"}]},
        {"conversations": [{"from": "alien", "value": "x"}, {"from": "gpt", "value": "y"}]},
        {"messages": [{"role": "user", "content": "   "}, {"role": "assistant", "content": "y"}]},
        {"text": "no conversation"},
        GOOD_SHAREGPT,
    ])
    summary = prepare(PrepareConfig(model=str(tiny_llama_dir), data=[str(data)], out=str(tmp_path / "out")),
                      progress=False)
    assert summary["kept"] == 2 and summary["records_read"] == 7
    assert summary["dropped"] == {
        "invalid JSON (Expecting property name enclosed in double quotes)": 1, "no assistant turn": 1,
        "unknown role 'alien'": 1, "empty message": 1, "no conversations/messages field": 1,
    }
    prepared = PreparedData(tmp_path / "out")
    assert [s.source_index for s in prepared] == [0, 6]
    assert prepared.conversations()[1][1] == {"role": "assistant", "content": "An apple."}
    with pytest.raises(EyasError, match="record 1 of .*invalid JSON"):
        prepare(PrepareConfig(model=str(tiny_llama_dir), data=[str(data)], out=str(tmp_path / "strict"), strict=True),
                progress=False)


def test_over_long_samples_are_truncated_or_dropped(tmp_path, tiny_llama_dir):
    long_answer = {"messages": [{"role": "user", "content": "Tell me a story"},
                                {"role": "assistant", "content": "Once upon a time " * 50}]}
    long_question = {"messages": [{"role": "user", "content": "why " * 200}, {"role": "assistant", "content": "ok"}]}
    data = _write_jsonl(tmp_path / "long.jsonl", [long_answer, long_question])
    summary = prepare(PrepareConfig(model=str(tiny_llama_dir), data=[str(data)], out=str(tmp_path / "out"),
                                    max_len=32), progress=False)
    assert summary["kept"] == 1 and summary["truncated"] == 1
    assert summary["dropped"] == {"no assistant token within --max-len": 1}
    sample = PreparedData(tmp_path / "out")[0]
    assert len(sample.input_ids) == 32 and sample.loss_mask[-1]


def test_empty_dataset_and_non_chat_tokenizer_are_clear_errors(tmp_path, tiny_llama_dir):
    empty = _write_jsonl(tmp_path / "empty.jsonl", [])
    with pytest.raises(EyasError, match="No usable conversation.*source is empty"):
        prepare(PrepareConfig(model=str(tiny_llama_dir), data=[str(empty)], out=str(tmp_path / "out")), progress=False)
    plain = tmp_path / "plain"
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    tokenizer.chat_template = None
    tokenizer.save_pretrained(plain)
    (plain / "config.json").write_text((tiny_llama_dir / "config.json").read_text())
    good = _write_jsonl(tmp_path / "good.jsonl", [GOOD_OPENAI])
    with pytest.raises(EyasError, match="no chat template"):
        prepare(PrepareConfig(model=str(plain), data=[str(good)], out=str(tmp_path / "out2")), progress=False)
    with pytest.raises(EyasError, match="does not exist"):
        prepare(PrepareConfig(model=str(tiny_llama_dir), data=[str(tmp_path / "missing.jsonl")],
                              out=str(tmp_path / "out3")), progress=False)


def test_packaged_sharegpt_recovers_every_complete_record():
    *records, tail = iter_records("packaged:sharegpt")
    assert len(records) == 17671  # the file is cut off inside record 17,672, reported as such:
    assert isinstance(tail, TruncatedTail) and tail.records == 1 and tail.nbytes > 0
    assert all(isinstance(r, dict) and "conversations" in r for r in records[:100])


def test_packaged_chitchat_alternates_speakers(tmp_path, tiny_llama_dir):
    summary = prepare(PrepareConfig(model=str(tiny_llama_dir), data=["packaged:chitchat"], out=str(tmp_path / "out"),
                                    limit=5), progress=False)
    assert summary["kept"] == 5
    roles = [m["role"] for m in PreparedData(tmp_path / "out").conversations()[0]]
    assert roles[:4] == ["user", "assistant", "user", "assistant"]


def test_cli_summary_and_show(tmp_path, tiny_llama_dir, capsys):
    data = _write_jsonl(tmp_path / "d.jsonl", [GOOD_OPENAI, {"messages": []}])
    with pytest.raises(SystemExit) as exit_:
        main(["prepare", "--model", str(tiny_llama_dir), "--data", str(data), "--out", str(tmp_path / "p")])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "kept 1 of 2 records" in out and "1 no assistant turn" in out
    with pytest.raises(SystemExit):
        main(["prepare", "--show", "0", str(tmp_path / "p")])
    shown = capsys.readouterr().out
    assert "[[Hello! How can I help?<|im_end|>\n]]" in shown
    assert "Hi there" in shown and "[[Hi there" not in shown
    with pytest.raises(SystemExit) as exit_:
        main(["prepare", "--show", "5", str(tmp_path / "p")])
    assert exit_.value.code == 2 and "samples 0..0" in capsys.readouterr().err


def test_prepared_samples_round_trip(smollm2_prepared):
    data = PreparedData(smollm2_prepared)
    assert len(data) == 16
    summary = data.meta["summary"]
    assert summary["tokens"] == sum(len(s.input_ids) for s in data)
    assert summary["trained_tokens"] == sum(int(s.loss_mask.sum()) for s in data)
    assert all(len(s.input_ids) <= 256 and s.loss_mask.any() for s in data)
    assert data[0].input_ids.dtype == torch.int64


# --- any turn order (issue 13) ------------------------------------------------------------------

SYSTEM_CHATML = (  # SmolLM2's way: a system prompt the template injects when the conversation has none
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CLOSING = {"chatml": "<|im_end|>\n", "system-chatml": "<|im_end|>\n", "llama3": "<|eot_id|>", "gemma": "<end_of_turn>\n"}
TURN_ORDERS = {
    "assistant first": [("assistant", "Hello there."), ("user", "Hi"), ("assistant", "Hi")],
    "consecutive assistant turns": [("user", "ok"), ("assistant", "ok"), ("assistant", "And one more thing.")],
    "only an assistant turn": [("assistant", "Just this.")],
}


@pytest.mark.parametrize("order", sorted(TURN_ORDERS))
@pytest.mark.parametrize("family", sorted(CLOSING))
def test_only_assistant_content_and_end_of_turn_are_trained_in_any_turn_order(tiny_tokenizer_dir, family, order):
    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    tokenizer.chat_template = {**TEMPLATES, "system-chatml": SYSTEM_CHATML}[family]
    messages = [{"role": r, "content": c} for r, c in TURN_ORDERS[order]]
    ids, mask, _ = tokenize_conversation(tokenizer, messages, max_len=4096)
    trained = [c + CLOSING[family] for r, c in TURN_ORDERS[order] if r == "assistant"]
    assert tokenizer.decode(ids[mask]) == "".join(trained)
    turns = TURN_ORDERS[order]
    before_first = tokenizer.decode(ids[: int(mask.nonzero()[0])])  # "ok" twice: the user's is not the one trained
    assert all(c + CLOSING[family] in before_first for r, c in turns[: [r for r, _ in turns].index("assistant")])
    assert int(mask.sum()) == sum(len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in trained)


# --- damaged and odd data files (issue 13) -------------------------------------------------------

def _summary(tiny_llama_dir, data, out, **kw):
    return prepare(PrepareConfig(model=str(tiny_llama_dir), data=[str(data)], out=str(out), **kw), progress=False)


def test_a_bad_record_inside_a_json_array_does_not_end_reading_and_a_cut_tail_is_reported(tmp_path, tiny_llama_dir):
    text = "[" + ", ".join([json.dumps(GOOD_OPENAI), '{"messages": [oops]}', json.dumps(GOOD_SHAREGPT),
                            json.dumps(GOOD_OPENAI)]) + ', {"conversations": [{"from": "human", "va'
    data = tmp_path / "d.json"
    data.write_text(text)
    summary = _summary(tiny_llama_dir, data, tmp_path / "out")
    assert summary["kept"] == 3 and summary["records_read"] == 5
    assert summary["dropped"] == {"invalid JSON (Expecting value)": 1, "cut off at the end of the file": 1}
    assert summary["truncated_tail_bytes"] == len('{"conversations": [{"from": "human", "va')
    assert "its last 40 bytes (1 record) were not read" in format_summary(summary, "out")
    with pytest.raises(EyasError, match="record 1 of .*invalid JSON"):
        _summary(tiny_llama_dir, data, tmp_path / "strict", strict=True)


def test_undecodable_text_and_wrong_types_are_counted_by_reason(tmp_path, tiny_llama_dir):
    rows = [json.dumps(GOOD_OPENAI).encode(),
            json.dumps(GOOD_OPENAI).encode().replace(b"Hi there", b"Hi \xff\xfe there"),
            json.dumps({"messages": [{"role": "user", "content": "\ud800"}, {"role": "assistant", "content": "x"}]}).encode(),
            json.dumps({"messages": [{"role": 7, "content": "x"}, {"role": "assistant", "content": "y"}]}).encode(),
            json.dumps({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}).encode(),
            b"[" * 100_000 + b"]" * 100_000,
            json.dumps(42).encode()]
    data = tmp_path / "d.jsonl"
    data.write_bytes(b"\n".join(rows) + b"\n")
    summary = _summary(tiny_llama_dir, data, tmp_path / "out")
    assert summary["kept"] == 1 and summary["records_read"] == 7
    assert summary["dropped"] == {"text that is not valid UTF-8": 2, "malformed message": 2, "nested too deeply": 1,
                                  "not a conversation object": 1}


@pytest.mark.parametrize("content,problem", [
    ("\n".join(json.dumps(GOOD_OPENAI) for _ in range(3)), "one JSON object per line \\(JSONL\\) but is named .json"),
    (json.dumps({"a": GOOD_OPENAI, "b": GOOD_SHAREGPT}), "the top level is a JSON object, not a list of conversations"),
    ('"just text"', "is not a JSON array of conversations"),
])
def test_a_json_file_that_is_not_a_list_of_conversations_is_a_clear_error(tmp_path, tiny_llama_dir, content, problem):
    data = tmp_path / "d.json"
    data.write_text(content)
    with pytest.raises(EyasError, match=problem):
        _summary(tiny_llama_dir, data, tmp_path / "out")


def test_utf16_data_is_a_clear_error(tmp_path, tiny_llama_dir):
    data = tmp_path / "d.jsonl"
    data.write_bytes(json.dumps(GOOD_OPENAI).encode("utf-16"))
    with pytest.raises(EyasError, match="UTF-16 or UTF-32 text; eyas reads UTF-8"):
        _summary(tiny_llama_dir, data, tmp_path / "out")


def test_worker_processes_prepare_exactly_what_one_process_does(tmp_path, tiny_llama_dir):
    """Tokenizing in forked workers changes nothing: same samples in the same order, the same
    drops by reason, the same fingerprint, and a cut tail still reported."""
    rows = [GOOD_OPENAI, "{not json", GOOD_SHAREGPT, {"messages": [{"role": "user", "content": "q"}]}] * 40
    text = "\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + '\n{"messages": [{"role": "us'
    data = tmp_path / "d.jsonl"
    data.write_text(text)
    one = prepare(PrepareConfig(model=str(tiny_llama_dir), data=[str(data)], out=str(tmp_path / "one"), workers=1),
                  progress=False)
    many = prepare(PrepareConfig(model=str(tiny_llama_dir), data=[str(data)], out=str(tmp_path / "many"), workers=3),
                   progress=False)
    assert one == many and one["kept"] == 80 and one["dropped"]["invalid JSON (Expecting property name enclosed in double quotes)"] == 40
    a, b = PreparedData(tmp_path / "one"), PreparedData(tmp_path / "many")
    assert a.meta["fingerprint"] == b.meta["fingerprint"] and [s.source_index for s in a] == [s.source_index for s in b]
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask, b.loss_mask)
    assert a.conversations() == b.conversations()
    limited = prepare(PrepareConfig(model=str(tiny_llama_dir), data=[str(data)], out=str(tmp_path / "limited"),
                                    workers=3, limit=5), progress=False)
    assert limited["kept"] == 5 and [s.source_index for s in PreparedData(tmp_path / "limited")] == [0, 2, 4, 6, 8]
