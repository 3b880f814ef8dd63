"""Randomly damaged data files (issue 13): whatever bytes `prepare` is given, it never raises
anything but one clear `EyasError`, and kept + dropped accounts for every record it read
(in a .jsonl file, every non-blank line)."""

from __future__ import annotations

import json
import random

import pytest

from eyas.data.prepare import format_summary, prepare
from eyas.data.config import PrepareConfig
from eyas.errors import EyasError

GOOD = [
    {"messages": [{"role": "user", "content": "Name a colour"}, {"role": "assistant", "content": "Blue, like the sea."}]},
    {"conversations": [{"from": "human", "value": "Name a fruit"}, {"from": "gpt", "value": "An apple."}]},
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                  {"role": "assistant", "content": [{"type": "text", "text": "Hello!"}]}]},
    {"conversations": [{"from": "gpt", "value": "I speak first."}, {"from": "human", "value": "ok"},
                       {"from": "gpt", "value": "Fine."}]},
]
ODD = [5, "text", None, [], {"messages": "x"}, {"messages": [{"role": 1, "content": "x"}]},
       {"messages": [{"role": "user", "content": {"a": 1}}, {"role": "assistant", "content": "y"}]},
       {"conversations": [{"from": "human", "value": ["no"]}]}, {"messages": [[["deep"]]]}]


def records(rng: random.Random) -> list:
    return [rng.choice(GOOD) if rng.random() < 0.7 else rng.choice(ODD) for _ in range(rng.randint(3, 9))]


def damage(data: bytes, rng: random.Random) -> bytes:
    data = bytearray(data)
    for _ in range(rng.randint(1, 3)):
        kind = rng.choice(["cut", "remove", "flip", "insert"])
        at = rng.randrange(len(data) + 1)
        if kind == "cut":
            del data[at:]
        elif kind == "remove":
            del data[at:at + rng.randint(1, 20)]
        elif kind == "flip" and data:
            data[min(at, len(data) - 1)] ^= rng.randrange(1, 256)
        else:
            data[at:at] = rng.choice([b"\xff\xfe", b"{", b"]", b",", b'"', b"\n", b"[" * 3000, b"\\u", b"\x00"])
        if not data:
            data = bytearray(b"[")
    return bytes(data)


@pytest.mark.parametrize("suffix", [".json", ".jsonl"])
def test_prepare_on_randomly_damaged_data_never_raises_anything_but_a_clear_error(tmp_path, tiny_llama_dir, suffix):
    rng = random.Random(suffix)
    errors = kept = 0
    for case in range(10):
        rows = records(rng)
        if suffix == ".json":
            clean = json.dumps(rows, indent=rng.choice([None, 1])).encode()
        else:
            clean = "".join(json.dumps(r) + "\n" for r in rows).encode()
        data = tmp_path / f"{case}{suffix}"
        data.write_bytes(damage(clean, rng))
        try:
            summary = prepare(PrepareConfig(model=str(tiny_llama_dir), data=[str(data)],
                                            out=str(tmp_path / f"out{case}"), max_len=64), progress=False)
        except EyasError as e:
            assert "\n" not in str(e)
            errors += 1
            continue
        kept += summary["kept"]
        format_summary(summary, "out").encode("utf-8")  # printable: reasons never carry undecodable text
        assert summary["kept"] + sum(summary["dropped"].values()) == summary["records_read"]
        if suffix == ".jsonl":
            lines = [x for x in data.read_bytes().split(b"\n") if x.strip()]
            assert summary["records_read"] == len(lines)
    assert kept and errors < 10  # the cases exercised the readers, not only the error paths
