"""What `eyas inspect --repair` may keep, and what a resumed capture must agree with.

Repair keeps a shard only if its file still has the sha256 the old manifest recorded for it
(a flipped bit that decodes to a finite number shows in nothing else); a shard no entry lists
is set aside, never adopted unchecked; a repaired store that holds every expected sample is
complete. A resume compares the target by identity (config, tokenizer, weights), not by the
path it was given as. Mostly on stores written directly (no model); one capture of a tiny Llama."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from eyas.capture.config import CaptureConfig
from eyas.capture.run import capture
from eyas.cli import main
from eyas.data.config import PrepareConfig
from eyas.data.prepare import prepare
from eyas.errors import EyasError
from eyas.store import Store, StoreWriter

L, H, N = 3, 16, 12
TARGET = {"model": "/models/tiny", "config_hash": "c0", "tokenizer_hash": "t0", "num_layers": 4, "hidden_size": H,
          "vocab_size": 1000, "tokenizer_parts": None, "weights_hash": "w0"}
HEADER = {"target": TARGET, "layer_ids": [1, 2, 4], "dtype": "bf16", "hidden_size": H, "prepared": "p0"}


def write_store(path: Path, samples: range = range(N), header: dict = HEADER) -> None:
    """bf16 samples of 5 tokens, 10 tokens a shard: two samples in each shard."""
    writer = StoreWriter(path, header, shard_bytes=10 * L * H * 2, threads=1, expected_samples=N)
    g = torch.Generator().manual_seed(0)
    for i in samples:
        writer.add(i, torch.randint(0, 1000, (5,), generator=g), torch.ones(5, dtype=torch.bool),
                   torch.randn(5, L, H, generator=g))
    writer.close(expected_samples=N)


def manifest(path: Path) -> dict:
    return json.loads((path / "manifest.json").read_text())


def flip_hidden_bit(shard: Path) -> None:
    """Flip the lowest mantissa bit of one bf16 value of `hidden`: still finite, same structure."""
    data = bytearray(shard.read_bytes())
    header_end = 8 + int.from_bytes(data[:8], "little")
    start, end = json.loads(data[8:header_end])["hidden"]["data_offsets"]
    at = header_end + start + 2 * ((end - start) // 4)  # the low (mantissa) byte of a value in the middle
    data[at] ^= 0x01
    shard.write_bytes(bytes(data))


def cli(capsys, *argv: str) -> tuple[int, str]:
    """Exit code and stdout + stderr of one eyas command."""
    try:
        main(list(argv))
        code = 0
    except SystemExit as e:
        code = e.code or 0
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def test_repair_drops_a_shard_whose_states_no_longer_match_their_recorded_sha256(tmp_path, capsys):
    store = tmp_path / "store"
    write_store(store)
    flip_hidden_bit(store / "shard-00002.safetensors")
    assert cli(capsys, "inspect", str(store), "--verify")[0] == 2  # the checksum says so
    code, out = cli(capsys, "inspect", str(store), "--repair", "--verify")
    assert "dropped shard-00002.safetensors (renamed shard-00002.safetensors.dropped): sha256 mismatch" in out, out
    assert code == 3, out  # sound, two samples short
    assert (store / "shard-00002.safetensors.dropped").is_file()
    m = manifest(store)
    assert "shard-00002.safetensors" not in [s["file"] for s in m["shards"]] and m["num_samples"] == N - 2
    assert cli(capsys, "inspect", str(store), "--verify")[0] == 3  # never 0: the corruption is not blessed


def test_repair_checks_a_pending_shard_against_its_pending_sha256(tmp_path, capsys):
    """A writer killed between recording a shard as pending and moving it to the shards: repair
    keeps the file only if it is what the pending entry recorded."""
    for corrupt in (False, True):
        store = tmp_path / f"store-{corrupt}"
        write_store(store)
        m = manifest(store)
        last = m["shards"].pop()
        m.update(num_samples=m["num_samples"] - last["num_samples"], num_tokens=m["num_tokens"] - last["num_tokens"],
                 complete=False, pending=[last])
        (store / "manifest.json").write_text(json.dumps(m))
        if corrupt:
            flip_hidden_bit(store / last["file"])
        code, out = cli(capsys, "inspect", str(store), "--repair")
        assert code == 0, out
        assert (last["file"] in [s["file"] for s in manifest(store)["shards"]]) is not corrupt, out
        assert ("sha256 mismatch" in out) is corrupt, out


def test_repair_sets_aside_a_shard_the_manifest_does_not_list(tmp_path, capsys):
    """Nothing records what an unlisted shard should hold, so it is not adopted: renamed, said so."""
    store = tmp_path / "store"
    write_store(store)
    m = manifest(store)
    gone = m["shards"].pop(1)
    m.update(num_samples=m["num_samples"] - gone["num_samples"], num_tokens=m["num_tokens"] - gone["num_tokens"])
    (store / "manifest.json").write_text(json.dumps(m))
    code, out = cli(capsys, "inspect", str(store), "--repair")
    assert code == 0 and f"dropped {gone['file']} (renamed {gone['file']}.dropped): not listed in the manifest" in out, out
    assert gone["file"] not in [s["file"] for s in manifest(store)["shards"]]
    assert (store / f"{gone['file']}.dropped").is_file() and not manifest(store)["complete"]


def test_repair_leaves_a_store_complete_when_every_expected_sample_is_there(tmp_path, capsys):
    store = tmp_path / "store"
    write_store(store)
    code, out = cli(capsys, "inspect", str(store), "--repair", "--verify")
    assert code == 0 and "kept 6 shard(s)" in out and "(complete)" in out, out
    assert manifest(store)["complete"]
    # Stored out of order, all there: still complete.
    shuffled = tmp_path / "shuffled"
    order = list(range(N))
    random.Random(0).shuffle(order)
    write_store(shuffled, order)
    assert cli(capsys, "inspect", str(shuffled), "--repair", "--verify")[0] == 0
    # Without a recorded count nothing says every sample is there.
    m = manifest(store)
    del m["expected_samples"]
    (store / "manifest.json").write_text(json.dumps(m))
    assert cli(capsys, "inspect", str(store), "--repair", "--verify")[0] == 3


def test_a_resume_compares_the_target_by_identity_not_by_its_path(tmp_path):
    store = tmp_path / "store"
    write_store(store, range(6))
    moved = {**HEADER, "target": {**TARGET, "model": "/elsewhere/../models/tiny/"}}
    writer = StoreWriter(store, moved, expected_samples=N)  # the same model, spelled another way
    assert writer.done == set(range(6))
    writer.abort()
    assert manifest(store)["target"] == TARGET  # the record stays as captured
    for field, value, says in (("config_hash", "c1", "configs differ"), ("tokenizer_hash", "t1", "different tokenizer"),
                               ("weights_hash", "w1", "weights differ")):
        other = {**HEADER, "target": {**TARGET, "model": "/models/other", field: value}}
        with pytest.raises(EyasError, match=f"{says}.*Resume it with the target it was captured from, or use another --out"):
            StoreWriter(store, other)
    with pytest.raises(EyasError, match="different layer_ids"):  # the other header keys as before
        StoreWriter(store, {**HEADER, "layer_ids": [0, 2, 4]})


def test_a_store_from_before_the_optional_identity_fields_still_resumes(tmp_path):
    store = tmp_path / "store"
    old_target = {k: v for k, v in TARGET.items() if k not in ("tokenizer_parts", "weights_hash")}
    write_store(store, range(6), {**HEADER, "target": old_target})
    now = {**HEADER, "target": {**TARGET, "model": "/models/tiny-copy",
                                "tokenizer_parts": {"vocab": "v", "chat_template": "c", "special": {}}}}
    write_store(store, range(6, N), now)
    result = Store(store)
    result.verify()
    assert result.manifest["complete"] and sorted(result.sample_indices().tolist()) == list(range(N))


def test_capture_resumes_with_the_model_given_as_another_path(tmp_path, tiny_llama_dir):
    rng = random.Random(0)
    words = "the a cat dog runs sees big small red blue house tree".split()
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": " ".join(rng.choices(words, k=4)) + "?"},
        {"role": "assistant", "content": " ".join(rng.choices(words, k=rng.randint(3, 12)))}]}) + "\n"
        for _ in range(6)))
    prepared = tmp_path / "prepared"
    prepare(PrepareConfig(model=str(tiny_llama_dir), data=[str(data)], out=str(prepared), max_len=64), progress=False)
    store = tmp_path / "store"

    def run(model: Path) -> dict:
        return capture(CaptureConfig(model=str(model), data=str(prepared), out=str(store), dtype="bf16",
                                     batch_tokens=256, shard_mb=40 * 4 * 64 * 2 / 2**20), progress=False)

    run(tiny_llama_dir)
    m = manifest(store)
    last = m["shards"].pop()  # as if killed before its last shard
    m.update(num_samples=m["num_samples"] - last["num_samples"], num_tokens=m["num_tokens"] - last["num_tokens"],
             complete=False)
    (store / "manifest.json").write_text(json.dumps(m))
    (store / last["file"]).unlink()
    link = tmp_path / "same-model"
    link.symlink_to(tiny_llama_dir, target_is_directory=True)
    result = run(link)
    assert result["complete"] and result["num_samples"] == 6 and result["target"]["model"] == str(tiny_llama_dir)
    Store(store).verify()
