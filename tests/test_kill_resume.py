"""A kill at any moment resumes (issue 39): every stage killed inside one of its atomic
writes (SIGKILL at the rename, tests/faults.py: never by timing) leaves that write's temp
file; the same command run again removes it under the stage's lock and ends with what an
uninterrupted run makes. A stage still refuses files it did not write, and a temp file a
live writer holds is never taken from it.

All on a tiny random Llama and a dozen short conversations."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eyas.cli import main
from eyas.paths import LEFTOVER, atomic_write_bytes, remove_leftovers, temp_file
from eyas.store import Store
from faults import killed
from test_capture import ATOL, _assert_same_store
from test_store_damage import N_SAMPLES, conversations, tiny_prepared, tiny_store  # noqa: F401


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread):
    """Tiny models: see conftest's one_thread."""


def ok(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as exit_:
        main([str(a) for a in argv])
    out = capsys.readouterr()
    assert exit_.value.code == 0, out.err[-2000:]
    return out.out


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if LEFTOVER.fullmatch(p.name))


def same_files(a: Path, b: Path, names: list[str]) -> None:
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_prepare_killed_inside_a_write_resumes(tmp_path, capsys, tiny_llama_dir):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in conversations(N_SAMPLES)))
    argv = ["prepare", "--model", tiny_llama_dir, "--data", data, "--max-len", "64", "--workers", "1"]
    ok(capsys, *argv, "--out", tmp_path / "whole")
    out = tmp_path / "killed"
    killed([*argv, "--out", out], match=r"killed/samples\.safetensors$")
    assert leftovers(out) == [n for n in leftovers(out) if n.startswith(".samples.safetensors.")] != []
    ok(capsys, *argv, "--out", out)
    assert leftovers(out) == []
    same_files(out, tmp_path / "whole", ["samples.safetensors", "conversations.jsonl"])


def test_capture_killed_inside_a_shard_write_resumes_to_the_same_store(tmp_path, capsys, tiny_llama_dir,
                                                                        tiny_prepared, tiny_store):  # noqa: F811
    out = tmp_path / "store"
    shard_mb = 40 * 4 * 64 * 2 / 2**20  # capture_into's: a dozen samples in several shards
    argv = ["capture", "--model", tiny_llama_dir, "--data", tiny_prepared, "--out", out, "--dtype", "bf16",
            "--batch-tokens", "256", "--shard-mb", shard_mb]
    killed(argv, match=r"shard-\d+\.safetensors$", nth=2)  # the second shard's rename
    assert leftovers(out) and all(n.startswith(".shard.") for n in leftovers(out))  # the writer threads' shards
    assert json.loads((out / "manifest.json").read_text())["pending"]  # recorded as pending, then killed
    ok(capsys, *argv)
    assert leftovers(out) == []
    got = Store(out)
    assert got.manifest["complete"] and len(got) == N_SAMPLES
    assert got.sample_indices().unique().numel() == N_SAMPLES  # nothing stored twice
    _assert_same_store(out, tiny_store, atol=ATOL)  # other batches after the resume: float32 rounding apart


def test_regenerate_killed_inside_a_write_resumes(tmp_path, capsys, tiny_llama_dir, tiny_prepared):  # noqa: F811
    argv = ["regenerate", "--model", tiny_llama_dir, "--data", tiny_prepared, "--max-new-tokens", "4",
            "--group-size", "4", "--device", "cpu"]
    ok(capsys, *argv, "--out", tmp_path / "whole")
    out = tmp_path / "killed"
    killed([*argv, "--out", out], match=r"killed/regenerated-conversations\.jsonl$")
    assert leftovers(out) != [] and not (out / "prepared.json").exists()
    ok(capsys, *argv, "--out", out)
    assert leftovers(out) == []
    same_files(out, tmp_path / "whole", ["regenerated-conversations.jsonl", "samples.safetensors"])


TRAIN = ["--steps", "3", "--batch-tokens", "64", "--ttt-steps", "1", "--draft-vocab", "64", "--eval-fraction", "0",
         "--save-every", "1", "--lr", "0.001", "--no-progress", "--device", "cpu"]


@pytest.mark.parametrize("where", ["model.safetensors", "checkpoints/latest"])
def test_train_killed_inside_a_checkpoint_write_resumes_to_the_uninterrupted_drafter(tmp_path, capsys, tiny_store,
                                                                                     where):  # noqa: F811
    """Killed in the write of the top-level drafter (after step 1's checkpoint is complete),
    or of `latest` (step 2's checkpoint complete, `latest` still naming step 1): --resume
    removes the leftover and ends with the drafter of a run never killed."""
    ok(capsys, "train", "--store", tiny_store, "--out", tmp_path / "whole", *TRAIN)
    out = tmp_path / "killed"
    killed(["train", "--store", tiny_store, "--out", out, *TRAIN], match=f"killed/{where}$",
           nth=1 if where == "model.safetensors" else 2)
    folder = (out / where).parent
    assert [n.startswith(f".{Path(where).name}.") for n in leftovers(folder)] == [True]
    ok(capsys, "train", "--store", tiny_store, "--out", out, *TRAIN, "--resume")
    assert leftovers(out) == leftovers(out / "checkpoints") == []
    assert not list((out / "checkpoints").glob(".step-*"))
    a, b = load_file(tmp_path / "whole" / "model.safetensors"), load_file(out / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def drafter(tmp_path_factory, tiny_store) -> Path:  # noqa: F811
    out = tmp_path_factory.mktemp("drafter") / "run"
    with pytest.raises(SystemExit) as exit_:
        main([str(a) for a in ["train", "--store", tiny_store, "--out", out, *TRAIN]])
    assert exit_.value.code == 0
    return out


def test_export_killed_inside_a_write_resumes(tmp_path, capsys, drafter):
    ok(capsys, "export", drafter, "--to", "sglang", "--out", tmp_path / "whole")
    out = tmp_path / "killed"
    killed(["export", drafter, "--to", "sglang", "--out", out], match=r"killed/model\.safetensors$")
    assert leftovers(out) != []
    ok(capsys, "export", drafter, "--to", "sglang", "--out", out, "--force")
    assert leftovers(out) == []
    same_files(out, tmp_path / "whole", ["model.safetensors", "config.json"])


def test_eval_killed_inside_its_output_write_resumes(tmp_path, capsys, tiny_llama_dir, drafter):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "the big red house?"}) + "\n")
    argv = ["eval", "--model", tiny_llama_dir, "--draft", drafter, "--prompts", prompts, "--max-new-tokens", "4",
            "--steps", "1", "--baseline", "none", "--device", "cpu", "--output", tmp_path / "results.json"]
    killed(argv, match=r"results\.json$")
    assert [n.startswith(".results.json.") for n in leftovers(tmp_path)] == [True]
    ok(capsys, *argv)
    assert leftovers(tmp_path) == [] and json.loads((tmp_path / "results.json").read_text())["records"]


def test_leftovers_are_only_a_dead_writers_temp_files_of_the_stages_own_names(tmp_path):
    """`remove_leftovers` takes `.NAME.XXXXXXXX.tmp` for the names given, and nothing else: not
    a temp file of another name, not a user's file, not a folder, and not one a live writer
    holds (its flock), which an atomic write keeps until its rename."""
    (tmp_path / ".model.safetensors.abcd1234.tmp").write_bytes(b"x")
    keep = [".notes.txt.abcd1234.tmp", "model.safetensors.abcd1234.tmp", ".model.safetensors.tmp", "mine.tmp"]
    for name in keep:
        (tmp_path / name).write_bytes(b"user")
    (tmp_path / ".config.json.abcd1234.tmp").mkdir()
    fd, live = temp_file(tmp_path, ".config.json.")
    try:
        assert remove_leftovers(tmp_path, ["model.safetensors", "config.json"]) == [".model.safetensors.abcd1234.tmp"]
        assert Path(live).exists() and all((tmp_path / n).exists() for n in keep)
    finally:
        os.close(fd)
    assert remove_leftovers(tmp_path, ["config.json"]) == [Path(live).name]  # its writer is gone now


def test_an_atomic_write_holds_its_temp_file_until_the_rename(tmp_path, monkeypatch):
    """The rename happens while the temp file is locked: a clean-up running meanwhile skips it."""
    seen = []
    real = os.replace

    def replace(src, dst):
        fd = os.open(src, os.O_RDONLY)
        try:
            with pytest.raises(BlockingIOError):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            seen.append(remove_leftovers(tmp_path, ["f"]))
        finally:
            os.close(fd)
        real(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    atomic_write_bytes(tmp_path / "f", b"data")
    assert seen == [[]] and (tmp_path / "f").read_bytes() == b"data" and leftovers(tmp_path) == []


@pytest.mark.parametrize("stage", ["prepare", "train"])
def test_a_file_the_stage_did_not_write_is_still_refused(tmp_path, capsys, tiny_llama_dir, tiny_prepared, tiny_store,
                                                         stage):  # noqa: F811
    """Beside a leftover of its own, a user's file that looks like one (another name's temp
    file) still stops the stage, and neither file is touched."""
    out = tmp_path / "out"
    out.mkdir()
    (out / ".samples.safetensors.abcd1234.tmp").write_bytes(b"ours")
    (out / ".notes.md.abcd1234.tmp").write_bytes(b"theirs")
    argv = ["prepare", "--model", tiny_llama_dir, "--data", "packaged:chitchat", "--limit", "2"] if stage == "prepare" \
        else ["train", "--store", tiny_store, *TRAIN]
    with pytest.raises(SystemExit) as exit_:
        main([str(a) for a in [*argv, "--out", out]])
    assert exit_.value.code == 2 and ".notes.md.abcd1234.tmp" in capsys.readouterr().err
    assert (out / ".notes.md.abcd1234.tmp").read_bytes() == b"theirs"


@pytest.mark.parametrize("damage", ["trainer.json", "optimizer.pt", "trainer.json:fields"])
def test_a_damaged_checkpoint_is_one_line_naming_the_one_before_it(tmp_path, capsys, drafter, tiny_store, damage):  # noqa: F811
    """A cut-off trainer.json or optimizer.pt (eyas writes them whole: damage from outside)
    stops --resume in one line, nothing changed, naming the checkpoint to fall back on; doing
    what it says resumes."""
    out = tmp_path / "run"
    shutil.copytree(drafter, out)
    latest = out / "checkpoints" / (out / "checkpoints" / "latest").read_text().strip()
    name = damage.split(":")[0]
    data = (latest / name).read_bytes()
    (latest / name).write_bytes(b'{"step": "3"}' if damage.endswith(":fields") else data[: len(data) // 2])
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    with pytest.raises(SystemExit) as exit_:
        main([str(a) for a in ["train", "--store", tiny_store, "--out", out, *TRAIN, "--resume"]])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert exit_.value.code == 2 and f"{latest / name} cannot be read" in err, err
    assert f"write `step-0000002` into {out / 'checkpoints' / 'latest'}" in err, err
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    (out / "checkpoints" / "latest").write_text("step-0000002\n")
    ok(capsys, "train", "--store", tiny_store, "--out", out, *TRAIN, "--resume")
    a, b = load_file(drafter / "model.safetensors"), load_file(out / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)  # step 3 again from step 2: the same drafter
