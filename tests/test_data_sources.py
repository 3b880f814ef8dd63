"""Data sources beyond JSON: parquet, Arrow and `save_to_disk` folders give exactly what the
same conversations give as JSONL; column layouts are named; windows, mixes and exclusions."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from eyas.data.prepare import EXCLUDED, format_summary, prepare
from eyas.data.config import PrepareConfig
from eyas.data.prepared import PreparedData
from eyas.errors import EyasError

ROWS = [
    {"conversations": [{"from": "human", "value": "Name a fruit"}, {"from": "gpt", "value": "An apple."}]},
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
                  {"role": "assistant", "content": "Hello! How can I help?"}]},
    {"data": ["What is two plus two?", "Four.", "And three plus three?", "Six."]},  # UltraChat
    {"conversations": [{"from": "alien", "value": "x"}, {"from": "gpt", "value": "y"}]},  # bad: unknown role
    {"messages": [{"role": "user", "content": "only a question"}]},  # bad: no assistant turn
    {"conversations": [{"role": "user", "content": "Say yes"}, {"role": "assistant", "content": "Yes."}]},
    {"id": "no conversation at all"},  # bad: no field
]
LAYOUTS = {"sharegpt": 1, "messages": 1, "ultrachat": 1, "conversations": 1}
DROPPED = {"unknown role 'alien'": 1, "no assistant turn": 1, "no conversations/messages field": 1}


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _arrow(path: Path, table: pa.Table, stream: bool) -> Path:
    with pa.OSFile(str(path), "wb") as sink:
        with (pa.ipc.new_stream if stream else pa.ipc.new_file)(sink, table.schema) as writer:
            writer.write_table(table, max_chunksize=3)
    return path


def _save_to_disk(folder: Path, table: pa.Table) -> Path:
    """The layout `datasets.Dataset.save_to_disk` writes: Arrow stream shards named in state.json."""
    folder.mkdir()
    halves = [table.slice(0, 4), table.slice(4)]
    names = [f"data-0000{i}-of-00002.arrow" for i in range(2)]
    for name, half in zip(names, halves):
        _arrow(folder / name, half, stream=True)
    (folder / "state.json").write_text(json.dumps({"_data_files": [{"filename": n} for n in names],
                                                   "_fingerprint": "0", "_split": None}))
    (folder / "dataset_info.json").write_text("{}")
    return folder


def _same(a: Path, b: Path) -> None:
    x, y = PreparedData(a), PreparedData(b)
    assert torch.equal(x.input_ids, y.input_ids) and torch.equal(x.loss_mask, y.loss_mask)
    assert [s.source_index for s in x] == [s.source_index for s in y] and x.conversations() == y.conversations()
    assert x.meta["fingerprint"] == y.meta["fingerprint"]


def test_parquet_arrow_and_save_to_disk_prepare_exactly_as_jsonl(tmp_path, tiny_llama_dir):
    """The same rows (four layouts, three bad ones) as JSONL, parquet, a folder of parquet
    shards, an Arrow file, an Arrow stream and a save_to_disk folder: identical samples,
    summaries (layouts named, bad rows counted by reason) and fingerprints."""
    table = pa.Table.from_struct_array(pa.array(ROWS))  # the union of the columns: a row's others are null
    shards = tmp_path / "shards"
    shards.mkdir()
    pq.write_table(table.slice(0, 3), shards / "part-0.parquet")
    pq.write_table(table.slice(3), shards / "part-1.parquet")
    pq.write_table(table, tmp_path / "rows.parquet", row_group_size=2)
    sources = [tmp_path / "rows.parquet", shards, _arrow(tmp_path / "file.arrow", table, stream=False),
               _arrow(tmp_path / "stream.arrow", table, stream=True), _save_to_disk(tmp_path / "saved", table)]
    reference = prepare(PrepareConfig(model=str(tiny_llama_dir), data=[str(_jsonl(tmp_path / "rows.jsonl", ROWS))],
                                      out=str(tmp_path / "ref"), workers=1), progress=False)
    assert reference["layouts"] == LAYOUTS and reference["dropped"] == DROPPED and reference["kept"] == 4
    for k, source in enumerate(sources):
        assert prepare(PrepareConfig(model=str(tiny_llama_dir), data=[str(source)], out=str(tmp_path / f"p{k}"),
                                     workers=1), progress=False) == reference
        _same(tmp_path / "ref", tmp_path / f"p{k}")


def test_unreadable_tables_are_clear_errors(tmp_path, tiny_llama_dir):
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 not really parquet")
    (tmp_path / "empty").mkdir()
    for source, message in ((tmp_path / "broken.parquet", "Cannot read .*broken.parquet"),
                            (tmp_path / "empty", "holds no .parquet or .arrow file")):
        with pytest.raises(EyasError, match=message):
            prepare(PrepareConfig(model=str(tiny_llama_dir), data=[str(source)], out=str(tmp_path / "out")),
                    progress=False)


def test_windows_of_two_user_turns(tmp_path, tiny_llama_dir):
    """Five user turns after a system message become windows of two, two and one user turns,
    each with the system message; the summary counts the record once."""
    turns = [{"role": "system", "content": "Be kind."}]
    for k in range(5):
        turns += [{"role": "user", "content": f"Question {k}?"}, {"role": "assistant", "content": f"Answer {k}."}]
    summary = prepare(PrepareConfig(model=str(tiny_llama_dir), data=[str(_jsonl(tmp_path / "long.jsonl",
                                    [{"messages": turns}]))], out=str(tmp_path / "w"), window=2, workers=1),
                      progress=False)
    assert summary["kept"] == 3 and summary["records_read"] == 1 and summary["layouts"] == {"messages": 1}
    assert format_summary(summary, "w").startswith("kept 3 windows of 2 user turns from 1 records -> w")
    assert PreparedData(tmp_path / "w").conversations() == [turns[:5], turns[:1] + turns[5:9], turns[:1] + turns[9:]]


def test_weighted_mix_and_excluded_prompts(tmp_path, tiny_llama_dir):
    """A@2 B@1 interleaves two samples of A per one of B and ends when A runs out (windows count
    as samples); a conversation whose user turn shares 8 words in a row with an excluded prompt
    file is dropped and counted."""
    def rows(name: str) -> list[dict]:
        return [{"messages": [{"role": "user", "content": f"Tell me about {name} number {k} in a few plain words"},
                              {"role": "assistant", "content": f"{name} {k}."}]} for k in range(6)]

    a, b = _jsonl(tmp_path / "a.jsonl", rows("apples")), _jsonl(tmp_path / "b.jsonl", rows("boats"))
    prompts = _jsonl(tmp_path / "eval.jsonl", [{"prompt": "Please tell me about boats number 1 in a few plain words."}])
    summary = prepare(PrepareConfig(model=str(tiny_llama_dir), data=[f"{a}@2", f"{b}@1"], out=str(tmp_path / "mix"),
                                    exclude_prompts=[str(prompts)], workers=1), progress=False)
    answers = [c[1]["content"] for c in PreparedData(tmp_path / "mix").conversations()]
    assert answers == ["apples 0.", "apples 1.", "boats 0.", "apples 2.", "apples 3.", "apples 4.", "apples 5.",
                       "boats 2."]
    assert summary["dropped"] == {EXCLUDED: 1} and summary["records_read"] == 9
    # Weights count samples: windows of a long conversation alternate with short ones.
    long = [{"messages": [m for k in range(6) for m in ({"role": "user", "content": f"Q{r}.{k}?"},
                                                         {"role": "assistant", "content": f"L{r}w{k // 2}"})]}
            for r in range(2)]
    summary = prepare(PrepareConfig(model=str(tiny_llama_dir), data=[f"{_jsonl(tmp_path / 'long.jsonl', long)}@1",
                                    f"{a}@1"], out=str(tmp_path / "w"), window=2, workers=1), progress=False)
    answers = [c[-1]["content"] for c in PreparedData(tmp_path / "w").conversations()]
    assert answers == [x for k in range(6) for x in (f"L{k // 3}w{k % 3}", f"apples {k}.")]
    assert summary["records_read"] == 8 and summary["kept"] == 12
    with pytest.raises(EyasError, match="SOURCE@WEIGHT"):
        prepare(PrepareConfig(model=str(tiny_llama_dir), data=[f"{a}@0"], out=str(tmp_path / "bad")), progress=False)
