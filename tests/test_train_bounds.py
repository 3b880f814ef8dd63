"""`eyas train` options whose values cannot work are refused in one line before any work, on a
tiny random Llama trained online: a seed past what the generators take, DFlash layers, anchors
and blocks larger than the target or the samples, a DFlash step larger than the memory free,
a step of more micro-batches than an epoch holds. A refused run leaves no --out behind."""

from __future__ import annotations

import pytest

from eyas.cli import main


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread):
    """Tiny models: see conftest's one_thread."""


@pytest.fixture(scope="module")
def prepared(tiny_llama_dir, tmp_path_factory):
    """8 chitchat dialogues of at most 64 tokens for the tiny 8-layer Llama."""
    from eyas.data.prepare import prepare
    from eyas.data.config import PrepareConfig

    out = tmp_path_factory.mktemp("bounds") / "prep"
    prepare(PrepareConfig(model=str(tiny_llama_dir), data=["packaged:chitchat"], out=str(out), max_len=64, limit=8),
            progress=False)
    return out


def _train(capsys, model, data, out, *options) -> tuple[int, str, str]:
    """`eyas train --online` with `options`: (exit code, stdout, stderr)."""
    args = ["train", "--online", "--model", str(model), "--data", str(data), "--out", str(out), "--device", "cpu",
            "--batch-tokens", "128", "--draft-vocab", "64", "--eval-fraction", "0", "--no-progress", *map(str, options)]
    with pytest.raises(SystemExit) as e:
        main(args)
    captured = capsys.readouterr()
    return e.value.code, captured.out, captured.err


def _refused(capsys, model, data, out, *options) -> str:
    """The one line `eyas train` refuses `options` with; it leaves no --out."""
    code, _, err = _train(capsys, model, data, out, *options)
    assert code == 2, err[-2000:]
    lines = [line for line in err.splitlines() if line.strip() and "Loading weights" not in line]  # transformers' bars
    assert len(lines) == 1 and lines[0].startswith("eyas train: error: "), err[-2000:]
    assert not out.exists()
    return lines[0].removeprefix("eyas train: error: ")


def test_a_seed_past_31_bits_is_refused_by_every_stage(tiny_llama_dir, prepared, tmp_path, capsys):
    from eyas.evaluate.config import EvalConfig
    from eyas.options import SEED_RULE, rules
    from eyas.regenerate.config import RegenerateConfig
    from eyas.train.config import TrainConfig

    line = _refused(capsys, tiny_llama_dir, prepared, tmp_path / "out", "--seed", 10**30)
    assert line == f"--seed must be an integer in [0, 2147483647] (got {10**30})."
    assert all(rules(config)["seed"] is SEED_RULE for config in (TrainConfig, EvalConfig, RegenerateConfig))
    with pytest.raises(Exception, match=r"--seed must be an integer in \[0, 2147483647\] \(got -1\)"):
        EvalConfig(model="m", seed=-1)


def test_dflash_layers_past_the_target_are_refused(tiny_llama_dir, prepared, tmp_path, capsys):
    line = _refused(capsys, tiny_llama_dir, prepared, tmp_path / "out", "--drafter", "dflash", "--draft-layers", 100000)
    assert line == "--draft-layers must be an integer in [1, 256] (got 100000)."
    line = _refused(capsys, tiny_llama_dir, prepared, tmp_path / "out", "--drafter", "dflash", "--draft-layers", 9)
    assert line == "--draft-layers 9 is more than the target's 8 layers; a DFlash drafter takes a few (default 1)."


def test_more_anchors_than_a_sample_has_rows_are_refused(tiny_llama_dir, prepared, tmp_path, capsys):
    line = _refused(capsys, tiny_llama_dir, prepared, tmp_path / "out", "--drafter", "dflash", "--anchors", 10**12)
    assert line == (f"--anchors {10**12} is more than a sample's rows: samples are cropped to 128 tokens (--max-len, "
                    f"--batch-tokens); use at most 128.")


def test_a_block_longer_than_a_sample_is_refused(tiny_llama_dir, prepared, tmp_path, capsys):
    line = _refused(capsys, tiny_llama_dir, prepared, tmp_path / "out", "--drafter", "dflash", "--block-size", 1000)
    assert line == ("--block-size 1000 is longer than any sample: samples are cropped to 128 tokens (--max-len, "
                    "--batch-tokens); use a block of at most 128.")
    line = _refused(capsys, tiny_llama_dir, prepared, tmp_path / "out", "--drafter", "dflash", "--ttt-steps", 128)
    assert line.startswith("--ttt-steps 128 (a block of 129) is longer than any sample")


def test_a_dflash_step_larger_than_the_memory_free_is_refused(tiny_llama_dir, prepared, tmp_path, capsys,
                                                             monkeypatch):
    """Samples of <= 64 tokens, 8 to a 4096-token batch: blocks of 1000 at each of their rows
    (--anchors 512: all of them) are 8 x 64 x 1000 block tokens, whose dense CPU mask alone is
    ~150 GiB."""
    from eyas.device import GIB
    from eyas.train import loop

    monkeypatch.setattr(loop, "free_bytes", lambda device: 16 * GIB)
    line = _refused(capsys, tiny_llama_dir, prepared, tmp_path / "out", "--drafter", "dflash", "--block-size", 1000,
                    "--batch-tokens", 4096, "--anchors", 512)
    assert line.startswith("A DFlash step of --block-size 1000 at --anchors 512 needs about ")
    assert line.endswith(" GiB, more than the 16.0 GiB free on cpu; lower --anchors, --block-size or --batch-tokens "
                         "(or --draft-layers).")
    need = float(line.split("needs about ")[1].split(" GiB")[0].replace(",", ""))
    assert 100 < need < 1000


def test_a_step_of_more_micro_batches_than_an_epoch_is_refused_unless_steps_ask(tiny_llama_dir, prepared, tmp_path,
                                                                               capsys):
    line = _refused(capsys, tiny_llama_dir, prepared, tmp_path / "out", "--grad-accum", 100000)
    assert line.startswith("--grad-accum 100000: a step of 100000 micro-batches (1 process(es) x --grad-accum 100000) "
                           "is more than the ")
    assert line.endswith(" batch(es) of <= 128 tokens an epoch holds, so its samples would repeat within the step. "
                         "Lower --grad-accum to at most " + line.split("more than the ")[1].split(" ")[0]
                         + " (or lower --batch-tokens, for more batches an epoch), or give --steps to train such "
                         "steps anyway.")
    batches = int(line.split("more than the ")[1].split(" ")[0])
    code, out, err = _train(capsys, tiny_llama_dir, prepared, tmp_path / "steps", "--grad-accum", batches + 1,
                            "--steps", 1, "--ttt-steps", 2)
    assert code == 0, err[-2000:]
    assert f"note: a step of {batches + 1} micro-batches (1 process(es) x --grad-accum {batches + 1}) is more than " \
           f"the {batches} batch(es) of <= 128 tokens an epoch holds: its samples repeat within each step" in out
    assert (tmp_path / "steps" / "model.safetensors").is_file()
