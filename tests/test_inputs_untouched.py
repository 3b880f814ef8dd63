"""No stage writes inside its own inputs, and a resume never mixes options or weights
(issue 44). Each case hashes every file under the test's folder before and after (outside
the stage's own output) and asserts a one-line refusal, or the correct result.

On a tiny random Llama and a dozen short conversations."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eyas.data.prepared import PreparedData
from eyas.data.template import encode_conversation
from eyas.models import load_tokenizer
from test_adversarial import cli, fails, train_args
from test_store_damage import tiny_prepared, tiny_store  # noqa: F401


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread):
    """Tiny models: see conftest's one_thread."""


@pytest.fixture(scope="module")
def drafter(tmp_path_factory, tiny_store) -> Path:  # noqa: F811
    out = tmp_path_factory.mktemp("drafter") / "run"
    with pytest.raises(SystemExit) as exit_:
        from eyas.cli import main

        main([str(a) for a in train_args(tiny_store, out, "--steps", "2")])
    assert exit_.value.code == 0
    return out


def copy(folder: Path, root: Path) -> Path:
    shutil.copytree(folder, root / folder.name, ignore=shutil.ignore_patterns(".eyas-lock"))
    return root / folder.name


def test_eval_never_writes_inside_an_input_folder(tmp_path, capsys, tiny_llama_dir, tiny_prepared, drafter):  # noqa: F811
    """`--output D/config.json` replaced the drafter's config, and `--teacher-forced P --output
    P/prepared.json` the prepared folder's record (that path skipped the checks): both refused."""
    draft, prepared = copy(drafter, tmp_path), copy(tiny_prepared, tmp_path)
    argv = ["eval", "--model", tiny_llama_dir, "--draft", draft, "--limit", "1", "--max-new-tokens", "4"]
    fails(capsys, tmp_path, None, *argv, "--output", draft / "config.json",
          match=rf"--output {draft}/config.json lies inside the input --draft {draft}")
    fails(capsys, tmp_path, None, *argv, "--teacher-forced", prepared, "--output", prepared / "prepared.json",
          match=rf"--output {prepared}/prepared.json lies inside the input --teacher-forced {prepared}")
    fails(capsys, tmp_path, None, *argv, "--teacher-forced", prepared, "--output", prepared / "new" / "tf.json",
          match=r"lies inside the input --teacher-forced")


def test_a_resumed_regeneration_with_other_settings_is_refused(tmp_path, capsys, tiny_llama_dir, tiny_prepared):  # noqa: F811
    """Resumed at 24 new tokens after a start at 4, half the answers would be capped at 4."""
    argv = ["regenerate", "--model", tiny_llama_dir, "--data", tiny_prepared, "--group-size", "4", "--device", "cpu",
            "--out", tmp_path / "regen"]
    assert cli(capsys, *argv, "--max-new-tokens", "4", "--minutes", "1e-9")[0] == 0  # stops after one group
    progress = (tmp_path / "regen" / "regenerated.jsonl").read_text().splitlines()
    assert 1 < len(progress) < 13
    fails(capsys, tmp_path, None, *argv, "--max-new-tokens", "24",
          match=r"holds answers regenerated with other settings, and this run changes --max-new-tokens 24 \(it has "
                r"4\): one folder would mix both")
    assert (tmp_path / "regen" / "regenerated.jsonl").read_text().splitlines() == progress
    assert cli(capsys, *argv, "--max-new-tokens", "4")[0] == 0  # the first run's options continue it


def test_a_resumed_capture_in_another_precision_is_refused(tmp_path, capsys, tiny_llama_dir, tiny_prepared,
                                                           tiny_store):  # noqa: F811
    store = copy(tiny_store, tmp_path)  # captured with the target in float32 (the CPU's default)
    manifest = json.loads((store / "manifest.json").read_text())
    manifest.update(complete=False)
    (store / "manifest.json").write_text(json.dumps(manifest))
    argv = ["capture", "--model", tiny_llama_dir, "--data", tiny_prepared, "--out", store, "--dtype", "bf16"]
    fails(capsys, tmp_path, None, *argv, "--model-dtype", "bfloat16",
          match=r"already holds a store with a different model_dtype \('float32' vs 'bfloat16'\)")


def test_training_on_a_store_with_other_weights_of_the_same_config_is_refused(tmp_path, capsys, tiny_llama_dir,
                                                                              tiny_store):  # noqa: F811
    """A fine-tune (same config, same tokenizer, other weights) would label the stored states
    with another model's head."""
    tuned = copy(tiny_llama_dir, tmp_path)
    weights = load_file(tuned / "model.safetensors")
    save_file({k: v + 0.01 if v.is_floating_point() else v for k, v in weights.items()}, tuned / "model.safetensors",
              metadata={"format": "pt"})
    out = tmp_path / "run"
    fails(capsys, tmp_path, out, *train_args(tiny_store, out, "--model", tuned),
          match=r"The store .* was made from the weights of .*tiny-llama0, not .*tiny-llama0: the config and "
                r"tokenizer are the same, the weights differ")


def test_a_drafter_holding_nan_is_refused_by_eval_export_and_import(tmp_path, capsys, tiny_llama_dir, drafter):
    def poisoned(folder: Path) -> str:
        weights = load_file(folder / "model.safetensors")
        name = next(k for k, v in weights.items() if v.is_floating_point())
        weights[name] = weights[name].clone()
        weights[name].view(-1)[0] = float("nan")
        save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
        return name

    draft = tmp_path / "nan"
    shutil.copytree(drafter, draft, ignore=shutil.ignore_patterns("checkpoints", ".eyas-lock"))
    name = poisoned(draft)
    line = rf"the tensor {name} holds NaN or inf values, so the drafter is damaged or its training diverged"
    fails(capsys, tmp_path, tmp_path / "exp", "export", draft, "--to", "sglang", "--out", tmp_path / "exp", match=line)
    fails(capsys, tmp_path, None, "eval", "--model", tiny_llama_dir, "--draft", draft, "--limit", "1",
          "--max-new-tokens", "4", "--output", tmp_path / "r.json", match=line)
    exported = tmp_path / "served"  # a drafter in an engine's layout, as `eyas import` takes it
    assert cli(capsys, "export", drafter, "--to", "sglang", "--out", exported)[0] == 0
    name = poisoned(exported)
    fails(capsys, tmp_path, tmp_path / "imp", "import", exported, "--out", tmp_path / "imp",
          match=r"the tensor \S+ holds NaN or inf values")


def test_a_cut_conversations_file_is_refused_not_regenerated_in_part(tmp_path, capsys, tiny_llama_dir,
                                                                     tiny_prepared):  # noqa: F811
    prepared = copy(tiny_prepared, tmp_path)
    lines = (prepared / "conversations.jsonl").read_text().splitlines(keepends=True)
    (prepared / "conversations.jsonl").write_text("".join(lines[:5]))
    fails(capsys, tmp_path, tmp_path / "regen", "regenerate", "--model", tiny_llama_dir, "--data", prepared,
          "--out", tmp_path / "regen", "--max-new-tokens", "4",
          match=r"conversations.jsonl was changed since `eyas prepare` wrote it \(its sha256 differs")


def test_huge_messages_and_conversations_are_encoded_within_max_len(tmp_path, capsys, tiny_llama_dir):
    """A 60 MB message sent a worker out of memory (and the pool waited forever); 100,000 turns
    re-rendered the template per turn. Both now cost what their first --max-len tokens cost,
    and give the tokens a whole-conversation encoding gives within --max-len."""
    turns = [m for i in range(50_000) for m in ({"role": "user", "content": f"question {i}?"},
                                                  {"role": "assistant", "content": f"answer {i}."})]
    huge = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes " * 15_000_000}]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"messages": m}) + "\n" for m in (turns, huge)))
    out = tmp_path / "p"
    assert cli(capsys, "prepare", "--model", tiny_llama_dir, "--data", data, "--max-len", "64", "--workers", "2",
               "--out", out)[0] == 0
    prepared, tokenizer = PreparedData(out), load_tokenizer(str(tiny_llama_dir))
    for sample, messages in zip(prepared, (turns[:40], huge[:1] + [{"role": "assistant", "content": "yes " * 200}])):
        ids, mask, truncated = encode_conversation(tokenizer, messages, 64)  # a short conversation, as long
        assert truncated and torch.equal(sample.input_ids, torch.from_numpy(ids))
        assert torch.equal(sample.loss_mask, torch.from_numpy(mask))


def test_a_prepare_worker_that_dies_is_one_line_not_a_hang(tmp_path, capsys, tiny_llama_dir, monkeypatch):
    """The out-of-memory killer takes a forked worker mid-record: one line naming its records."""
    import eyas.data.prepare as prepare

    real = prepare._encode

    def encode(item):
        if item[0] == 20:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(item)

    monkeypatch.setattr(prepare, "_encode", encode)  # the forked workers run this one
    line = fails(capsys, tmp_path, tmp_path / "p", "prepare", "--model", tiny_llama_dir, "--data", "packaged:chitchat",
                 "--limit", "40", "--workers", "2", "--out", tmp_path / "p",
                 match=r"a prepare worker process died \(killed, or out of memory\) while records \d+\.\.\d+ were "
                       r"being encoded; run again with --workers 1")
    first, last = map(int, re.search(r"records (\d+)\.\.(\d+)", line).groups())
    assert first <= 20 <= last


def test_a_pool_found_broken_at_the_next_submit_is_the_same_one_line(tmp_path, capsys, tiny_llama_dir, monkeypatch):
    """On a loaded machine a worker's death can be seen first by the next submit, not by a
    result: the same line, naming the records in flight and the chunk being submitted."""
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    real, calls = ProcessPoolExecutor.submit, []

    def submit(self, fn, chunk):
        calls.append(chunk[0][0])
        if len(calls) == 3:
            raise BrokenProcessPool("A child process terminated abruptly")
        return real(self, fn, chunk)

    monkeypatch.setattr(ProcessPoolExecutor, "submit", submit)
    line = fails(capsys, tmp_path, tmp_path / "p", "prepare", "--model", tiny_llama_dir, "--data", "packaged:chitchat",
                 "--limit", "80", "--workers", "2", "--out", tmp_path / "p",
                 match=r"a prepare worker process died \(killed, or out of memory\) while records \d+\.\.\d+ were "
                       r"being encoded; run again with --workers 1")
    first, last = map(int, re.search(r"records (\d+)\.\.(\d+)", line).groups())
    assert first <= calls[2] < last


def test_messages_name_the_path(tmp_path, capsys, tiny_llama_dir, monkeypatch):
    """A full disk names the file being written (a write's error carries none); --prompts
    naming a folder says so."""
    (tmp_path / "prompts").mkdir()
    fails(capsys, tmp_path, None, "eval", "--model", tiny_llama_dir, "--prompts", tmp_path / "prompts", "--output",
          tmp_path / "r.json", match=rf"Prompt file {tmp_path}/prompts is a folder, not a file")
    real, calls = os.fsync, []

    def fsync(fd):
        calls.append(fd)
        if len(calls) == 1:
            raise OSError(28, "No space left on device")  # as from a write: no file name
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    fails(capsys, tmp_path, tmp_path / "p", "prepare", "--model", tiny_llama_dir, "--data", "packaged:chitchat",
          "--limit", "2", "--workers", "1", "--out", tmp_path / "p",
          match=rf"No space left on device \({tmp_path}/p/samples.safetensors\): free space on that disk")
