"""`eyas eval` at scale, on a tiny random Llama: worker processes give the same per-prompt
answers as one process; tau by category and turn recomputes from the records; the
teacher-forced scorer equals the trainer's own held-out pass on the same samples."""

from __future__ import annotations

import json

import pytest

from eyas.evaluate.prompts import stratified
from eyas.evaluate.run import EvalConfig, evaluate
from eyas.evaluate.teacher_forced import teacher_forced
from eyas.prompts import EvalPrompt
from eyas.train import TrainConfig, train

PROMPTS = [
    {"turns": ["write a short poem", "now shorter"], "category": "writing"},
    {"prompt": "what is two plus two?", "category": "math"},
    {"turns": ["name a colour", "and another"], "category": "reasoning"},
    {"prompt": "what is five times three?", "category": "math"},
]


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread):
    """Tiny models: see conftest's one_thread."""


def test_stratified_order_deals_categories_round_robin():
    prompts = [EvalPrompt(str(i), ["x"], category=c) for i, c in enumerate("aabcab")]
    assert stratified(prompts) == [0, 2, 3, 1, 5, 4]


@pytest.fixture(scope="module")
def trained(tiny_llama_dir, tmp_path_factory):
    """A tiny drafter trained online for 3 steps with a quarter of 16 samples held out."""
    from eyas.data.prepare import prepare
    from eyas.data.config import PrepareConfig

    root = tmp_path_factory.mktemp("scale")
    prepare(PrepareConfig(model=str(tiny_llama_dir), data=["packaged:chitchat"], out=str(root / "prep"), max_len=64,
                          limit=16, workers=1), progress=False)
    result = train(TrainConfig(out=str(root / "drafter"), online=True, model=str(tiny_llama_dir),
                               data=str(root / "prep"), steps=3, batch_tokens=256, eval_fraction=0.25, ttt_steps=3,
                               lr=1e-3, progress=False))
    return root, result


def test_two_workers_answer_each_prompt_as_one_process(tiny_llama_dir, trained, tmp_path):
    root, _ = trained
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    common = dict(model=str(tiny_llama_dir), draft=str(root / "drafter"), prompts=str(prompts), max_new_tokens=8,
                  steps=3, temperature=0.5, seed=3)  # sampled: each prompt's draws must not depend on its worker
    one = evaluate(EvalConfig(output=str(tmp_path / "one.json"), workers=1, **common))
    two = evaluate(EvalConfig(output=str(tmp_path / "two.json"), workers=2, **common))

    def answers(results):
        return [{k: v for k, v in r.items() if k != "seconds"} for r in results["records"]]

    assert answers(one) == answers(two) and len(answers(one)) == 3 * 6  # 3 methods x 6 turns
    assert one["tau_by"] == two["tau_by"]
    # Contended timings give no speed-up: one process's are measured, the workers' withheld.
    assert one["summary"]["eagle3-chain"]["speedup"] > 0
    assert all(s["speedup"] is None for s in two["summary"].values())
    chain = [r for r in one["records"] if r["method"] == "eagle3-chain"]
    for category in ("writing", "math", "reasoning"):
        counts = [c for r in chain if r["category"] == category for c in r["accept_counts"]]
        assert one["tau_by"]["category"]["eagle3-chain"][category] == pytest.approx(1 + sum(counts) / len(counts),
                                                                                     abs=1e-4)
    counts = [c for r in chain if r["turn"] == 1 for c in r["accept_counts"]]
    assert one["tau_by"]["turn"]["eagle3-chain"]["1"] == pytest.approx(1 + sum(counts) / len(counts), abs=1e-4)


def test_teacher_forced_equals_the_trainers_held_out_pass(tiny_llama_dir, trained):
    root, result = trained
    scored = teacher_forced(str(tiny_llama_dir), root / "drafter", root / "prep", held_out=True, device="cpu")
    held = result["eval"]
    assert scored["samples"] == 4 and scored["positions"] == held["positions"] > 0
    assert scored["acc_per_step"] == pytest.approx(held["acc_per_step"], abs=1e-6)
    assert scored["loss"] == pytest.approx(held["loss"], rel=1e-5)
    everything = teacher_forced(str(tiny_llama_dir), root / "drafter", root / "prep", device="cpu")
    assert everything["samples"] == 16 and everything["positions"] > scored["positions"]


def test_teacher_forced_from_a_store_equals_running_the_target(tiny_llama_dir, trained, tmp_path):
    """Scored from an fp32 store of the same samples (how a recipe with offline training scores
    a target too large to load in transformers), the held-out figures equal the online ones."""
    from eyas.capture.run import capture
    from eyas.capture.config import CaptureConfig

    root, _ = trained
    capture(CaptureConfig(model=str(tiny_llama_dir), data=str(root / "prep"), out=str(tmp_path / "store"),
                          dtype="fp32"), progress=False)
    online = teacher_forced(str(tiny_llama_dir), root / "drafter", root / "prep", held_out=True, device="cpu")
    stored = teacher_forced(str(tiny_llama_dir), root / "drafter", tmp_path / "store", held_out=True, device="cpu")
    assert stored["samples"] == online["samples"] == 4 and stored["positions"] == online["positions"]
    assert stored["acc_per_step"] == pytest.approx(online["acc_per_step"], abs=1e-6)
    assert stored["loss"] == pytest.approx(online["loss"], rel=1e-5)


def test_teacher_forced_held_out_refuses_data_whose_split_is_not_the_runs(tiny_llama_dir, trained, tmp_path):
    """A prepared set holding the run's 16 samples and 8 more draws another split, which would
    score samples the run trained on as held out: refused, by the prepared data's fingerprint. Scoring every sample of it is not
    a held-out claim, and runs."""
    from eyas.data.prepare import prepare
    from eyas.data.config import PrepareConfig
    from eyas.errors import EyasError

    root, _ = trained
    prepare(PrepareConfig(model=str(tiny_llama_dir), data=["packaged:chitchat"], out=str(tmp_path / "more"),
                          max_len=64, limit=24, workers=1), progress=False)
    with pytest.raises(EyasError, match="--held-out: .* other prepared data than the training run's"):
        teacher_forced(str(tiny_llama_dir), root / "drafter", tmp_path / "more", held_out=True, device="cpu")
    assert teacher_forced(str(tiny_llama_dir), root / "drafter", tmp_path / "more", device="cpu")["samples"] == 24


def test_teacher_forced_loss_is_the_training_runs_loss(tiny_llama_dir, trained, tmp_path):
    """A drafter trained with --loss lk-alpha is scored with it: eval's held-out loss equals the
    trainer's held-out loss, and differs from soft cross-entropy on the same samples."""
    root, _ = trained
    result = train(TrainConfig(out=str(tmp_path / "lk"), online=True, model=str(tiny_llama_dir),
                               data=str(root / "prep"), steps=2, batch_tokens=256, eval_fraction=0.25, ttt_steps=3,
                               lr=1e-3, loss="lk-alpha", progress=False))
    scored = teacher_forced(str(tiny_llama_dir), tmp_path / "lk", root / "prep", held_out=True, device="cpu")
    assert scored["loss_kind"] == "lk-alpha"
    assert scored["loss"] == pytest.approx(result["eval"]["loss"], rel=1e-5)
    soft = teacher_forced(str(tiny_llama_dir), root / "drafter", root / "prep", held_out=True, device="cpu")
    assert soft["loss_kind"] == "soft-ce"


def test_held_out_check_compares_the_samples_held_out_where_no_fingerprint_tells(trained):
    """Data without a prepared fingerprint to compare (a store from before eyas recorded it) is
    checked by the samples its split holds out: the run's own pass, 8 more samples do not."""
    from types import SimpleNamespace

    from eyas.errors import EyasError
    from eyas.evaluate.teacher_forced import _check_held_out, training_record
    from eyas.train.data import split

    root, _ = trained
    record = training_record(root / "drafter")
    seed, fraction = record["config"]["seed"], record["config"]["eval_fraction"]
    for n in (16, 24):
        source = SimpleNamespace(fingerprint=None, sample_index=list(range(n)))
        positions = split(source.sample_index, fraction, seed)[1]
        if n == 16:
            _check_held_out(record["data"], source, positions, "same")
        else:
            with pytest.raises(EyasError, match="holds 24 samples, the training run's data 16"):
                _check_held_out(record["data"], source, positions, "more")
