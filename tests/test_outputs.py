"""Outputs that defend themselves (issue 13): one run per output folder (a second one is refused
naming the first, a dead one's lock is taken over, the processes of one torchrun job share it),
files readable under the user's umask, and a Ctrl-C message that says what really resumes."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from eyas.capture.run import capture
from eyas.capture.config import CaptureConfig
from eyas.cli import main
from eyas.errors import EyasError
from eyas.lock import LOCK_FILE, output_lock
from eyas.paths import atomic_write_bytes
from eyas.regenerate.run import regenerate
from eyas.regenerate.config import RegenerateConfig
from eyas.store import StoreWriter
from eyas.train import TrainConfig, train
from test_store_damage import tiny_prepared, tiny_store  # noqa: F401  (fixtures)

SRC = str(Path(__file__).resolve().parents[1] / "src")
HOLD = textwrap.dedent("""
    import sys
    from eyas.lock import output_lock
    with output_lock(sys.argv[1], "train"):
        print("held", flush=True)
        sys.stdin.readline()
""")


def holder(folder: Path, **env: str) -> subprocess.Popen:
    """Another process holding `folder` until it reads a line."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": SRC, **env})
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_run_on_a_held_folder_is_refused_naming_the_first(tmp_path, tiny_llama_dir, tiny_prepared,
                                                                   tiny_store):
    out = tmp_path / "out"
    proc = holder(out)
    try:
        owner = rf"{out} is in use by eyas train \(pid {proc.pid} on {socket.gethostname()}, since .*\); wait"
        with pytest.raises(EyasError, match=owner):
            capture(CaptureConfig(model=str(tiny_llama_dir), data=str(tiny_prepared), out=str(out)), progress=False)
        with pytest.raises(EyasError, match=owner):
            train(TrainConfig(store=str(tiny_store), out=str(out), steps=1, progress=False))
        with pytest.raises(EyasError, match=owner):
            regenerate(RegenerateConfig(model=str(tiny_llama_dir), data=str(tiny_prepared), out=str(out)),
                       progress=False)
        assert sorted(p.name for p in out.iterdir()) == [LOCK_FILE]  # none of them wrote anything
    finally:
        proc.communicate("\n")
    assert proc.returncode == 0
    with output_lock(out, "capture"):  # released on exit
        pass


def test_the_lock_of_a_killed_run_is_taken_over(tmp_path):
    out = tmp_path / "out"
    script = "import os, sys\nfrom eyas.lock import output_lock\nheld = output_lock(sys.argv[1], 'capture')\nheld.__enter__()\nos._exit(9)"
    subprocess.run([sys.executable, "-c", script, str(out)], env={**os.environ, "PYTHONPATH": SRC})
    assert json.loads((out / LOCK_FILE).read_text())["command"] == "capture"  # its record is left behind
    with output_lock(out, "train"):
        assert json.loads((out / LOCK_FILE).read_text())["pid"] == os.getpid()


def test_processes_of_one_torchrun_job_share_the_lock(tmp_path, monkeypatch):
    out = tmp_path / "out"
    job = {"WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "job-a", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    proc = holder(out, **job)
    try:
        for key, value in job.items():
            monkeypatch.setenv(key, value)
        with output_lock(out, "train"):  # rank 1 of the same job
            pass
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-b")
        with pytest.raises(EyasError, match="in use by eyas train"):
            with output_lock(out, "train", wait=0.3):
                pass
        monkeypatch.setenv("WORLD_SIZE", "1")
        with pytest.raises(EyasError, match="in use by eyas train"):
            with output_lock(out, "train"):
                pass
    finally:
        proc.communicate("\n")


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_written_files_get_the_mode_of_an_ordinary_file_under_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        atomic_write_bytes(tmp_path / "a.json", b"{}")
        target = {"model": "m", "config_hash": "c", "tokenizer_hash": "t", "num_layers": 2, "hidden_size": 4,
                  "vocab_size": 10}
        writer = StoreWriter(tmp_path / "store", {"target": target, "layer_ids": [1, 2], "dtype": "fp32",
                                                  "hidden_size": 4, "prepared": "p"})
        writer.add(0, torch.tensor([1, 2]), torch.tensor([True, True]), torch.zeros(2, 2, 4))
        writer.close(expected_samples=1)
    finally:
        os.umask(old)
    files = [tmp_path / "a.json", tmp_path / "store" / "manifest.json", tmp_path / "store" / "shard-00000.safetensors"]
    assert {stat.S_IMODE(f.stat().st_mode) for f in files} == {0o666 & ~umask}


@pytest.mark.parametrize("command,function,hint", [
    ("train", "eyas.train.loop.train", "add --resume to the same command to continue from its last checkpoint."),
    ("capture", "eyas.capture.run.capture", "run the same command again to resume."),
    ("export", "eyas.export.exporter.export_drafter", "interrupted."),
])
def test_ctrl_c_says_what_resumes(monkeypatch, capsys, command, function, hint):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(function, interrupted)
    argv = {"train": ["train", "--store", "s", "--out", "o"],
            "capture": ["capture", "--model", "m", "--data", "d", "--out", "o"],
            "export": ["export", "ckpt", "--to", "vllm", "--out", "o"]}[command]
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 130 and err.startswith(f"eyas {command}: ") and err.endswith(hint), err
    assert command == "capture" or "run the same command again" not in err


def test_names_in_a_checkpoint_pointer_or_a_weight_index_stay_inside_their_folder(tmp_path, tiny_store):
    from eyas.export.weights import read_tensors

    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    (out / "checkpoints" / "latest").write_text("../../elsewhere\n")
    with pytest.raises(EyasError, match=r"latest names '../../elsewhere', which is not a plain file name"):
        train(TrainConfig(store=str(tiny_store), out=str(out), steps=1, resume=True, progress=False))
    folder = tmp_path / "drafter"
    folder.mkdir()
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"fc.weight": "/etc/x.safetensors"}}))
    with pytest.raises(EyasError, match=r"names '/etc/x.safetensors', which is not a plain file name"):
        read_tensors(folder)
