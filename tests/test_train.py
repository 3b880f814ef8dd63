"""`eyas train` on real SmolLM2 hidden states (and a tiny random Llama where only plumbing
is tested): overfitting, checkpoints, resumption, DDP equivalence, online = offline, and
clear errors for bad stores and diverging runs.

Run as a script (`python tests/test_train.py ...`, or under torchrun) it computes the first
step's loss and gradients and saves them: the DDP test compares 2 processes to 1.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eyas.draft import load_config, load_drafter
from eyas.errors import EyasError
from eyas.store import Store, StoreWriter
from eyas.train import TrainConfig, train
from eyas.train.data import BatchStream

# Small settings shared by the SmolLM2 runs: 2 TTT steps and an 8192-token draft vocab (which
# holds the target's greedy token at ~96% of the tiny store's positions) keep a step near a
# second on two CPU cores; no held-out split unless a test asks for one.
FAST = dict(ttt_steps=2, draft_vocab=8192, eval_fraction=0.0, batch_tokens=512, progress=False, log_every=1)


def derive_store(src: Path, out: Path, n: int, length: int, dtype: str = "fp32", edit=None, from_answer=False,
                 reverse=False, **header) -> Path:
    """A store of the first `n` samples of `src` cut to `length` tokens (from the start, or
    from just before the first assistant token), optionally written in reverse order;
    `edit(pos, hidden)` may change a sample's states and `header` overrides manifest fields."""
    store = Store(src)
    base = {k: store.manifest[k] for k in ("target", "layer_ids", "dtype", "hidden_size", "prepared")}
    writer = StoreWriter(out, {**base, "dtype": dtype, **header})
    for pos in (reversed(range(n)) if reverse else range(n)):
        s = store.sample(pos)
        a = max(int(s["loss_mask"].nonzero()[0]) - 2, 0) if from_answer else 0
        hidden = s["hidden"][a : a + length].clone()
        if edit is not None:
            edit(pos, hidden)
        writer.add(int(s["index"]), s["input_ids"][a : a + length], s["loss_mask"][a : a + length], hidden)
    writer.close()
    return out


@pytest.fixture(scope="module")
def tiny_store(smollm2_store, tmp_path_factory) -> Path:
    """4 real SmolLM2 answers of 64 tokens (nearly all trained): small enough to overfit fast."""
    return derive_store(smollm2_store, tmp_path_factory.mktemp("train") / "tiny", n=4, length=64, from_answer=True)


@pytest.fixture(scope="module")
def two_batch_store(smollm2_store, tmp_path_factory) -> Path:
    """8 samples of 48 tokens: several 128-token batches per step for the DDP and resume tests."""
    return derive_store(smollm2_store, tmp_path_factory.mktemp("train") / "eight", n=8, length=48)


@pytest.fixture(scope="module")
def tiny_llama_data(tiny_llama_dir, tmp_path_factory) -> tuple[Path, Path]:
    """A prepared folder of 8 chitchat dialogues for the tiny random Llama, and its fp32 store."""
    from eyas.capture.run import capture
    from eyas.capture.config import CaptureConfig
    from eyas.data.prepare import prepare
    from eyas.data.config import PrepareConfig

    root = tmp_path_factory.mktemp("tiny-llama-data")
    prepare(PrepareConfig(model=str(tiny_llama_dir), data=["packaged:chitchat"], out=str(root / "prep"), max_len=64,
                          limit=8), progress=False)
    capture(CaptureConfig(model=str(tiny_llama_dir), data=str(root / "prep"), out=str(root / "store"), dtype="fp32"),
            progress=False)
    return root / "prep", root / "store"


def rows(out: Path, split: str = "train") -> list[dict]:
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["split"] == split]


def test_drafter_overfits_a_small_smollm2_store(tiny_store, tmp_path):
    """Step-0 accuracy against the target's greedy token on the training samples > 0.9,
    and the loss falls: each mean over 5 consecutive steps is below the previous one."""
    out = tmp_path / "drafter"
    result = train(TrainConfig(out=str(out), store=str(tiny_store), steps=40, lr=3e-3, warmup=4, **FAST))
    log = rows(out)
    assert [r["step"] for r in log] == list(range(1, 41))
    assert result["train"]["acc_per_step"][0] > 0.9, result["train"]
    assert log[0]["acc_per_step"][0] < 0.2  # it learned this, it did not start there
    means = [sum(r["loss"] for r in log[i : i + 5]) / 5 for i in range(0, 40, 5)]
    assert all(b < a for a, b in zip(means, means[1:])), means
    assert result["train"]["tau_sim"] > 2.5
    # The folder is a complete drafter: the newest checkpoint, copied to the top level.
    assert (out / "checkpoints" / "step-0000040" / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()


def test_checkpoint_reloads_to_identical_logits(tiny_store, tmp_path):
    from eyas import distributed
    from eyas.train.loop import save, setup, train_step

    cfg = TrainConfig(out=str(tmp_path / "d"), store=str(tiny_store), steps=3, **FAST)
    d, device = distributed.init("cpu", False)
    run = setup(cfg, d, device)
    train_step(run)
    train_step(run)
    save(run)
    reloaded = load_drafter(tmp_path / "d", run.head.embed_weight)
    sample = run.source.store.sample(0)
    ids, aux = sample["input_ids"][None], sample["hidden"][None, :, :-1]
    with torch.no_grad():
        for a, b in zip(run.drafter.forward_ttt(ids, aux), reloaded.forward_ttt(ids, aux)):
            assert torch.equal(a, b)
    assert torch.equal(reloaded.d2t, run.drafter.d2t) and torch.equal(reloaded.t2d, run.drafter.t2d)
    assert reloaded.config.layer_ids == (2, 15, 27, 30) and reloaded.config.ttt_steps == 2


def test_intermediate_size_sets_the_drafters_mlp_width(tiny_store, tmp_path):
    """--intermediate-size widens (or narrows) the drafter's MLP, in its weights and the config
    an export hands to vLLM/SGLang; a resume with another width is refused."""
    out = tmp_path / "wide"
    train(TrainConfig(out=str(out), store=str(tiny_store), steps=1, intermediate_size=96, **FAST))
    weights = load_file(out / "model.safetensors")
    ups = [v.shape for k, v in weights.items() if k.endswith("up_proj.weight")]
    assert ups and all(shape[0] == 96 for shape in ups)
    assert json.loads((out / "config.json").read_text())["intermediate_size"] == 96
    with pytest.raises(EyasError, match="intermediate-size 128"):
        train(TrainConfig(out=str(out), store=str(tiny_store), steps=2, resume=True, intermediate_size=128, **FAST))
    with pytest.raises(EyasError, match="--intermediate-size must be an integer >= 1"):
        TrainConfig(out=str(out), store=str(tiny_store), intermediate_size=0)


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_interrupted_and_resumed_run_reaches_the_same_weights(two_batch_store, tmp_path, optimizer):
    """Same seed, 6 steps straight vs. 3 steps, a stop, and --resume: identical weights
    (tolerance 1e-6: both runs do the same float32 operations in the same order), with either
    optimizer (Muon's momentum and AdamW's moments come back from the checkpoint). The
    straight run reads a store holding the same samples in reverse order: batches follow
    the samples' prepared indices, not their places in a store."""
    common = dict(store=str(two_batch_store), steps=6, batch_tokens=128, save_every=2, optimizer=optimizer, **{
        k: v for k, v in FAST.items() if k != "batch_tokens"})
    reversed_store = derive_store(two_batch_store, tmp_path / "reversed", n=8, length=48, reverse=True)
    train(TrainConfig(out=str(tmp_path / "straight"), **{**common, "store": str(reversed_store)}))
    train(TrainConfig(out=str(tmp_path / "resumed"), **common), stop_at=3)
    assert (tmp_path / "resumed" / "checkpoints" / "latest").read_text().strip() == "step-0000003"
    with pytest.raises(EyasError, match="--resume"):
        train(TrainConfig(out=str(tmp_path / "resumed"), **common))
    with pytest.raises(EyasError, match="lr"):
        train(TrainConfig(out=str(tmp_path / "resumed"), resume=True, **{**common, "lr": 1e-3}))
    other = "adamw" if optimizer == "muon" else "muon"
    with pytest.raises(EyasError, match=f"optimizer '{other}' \\(the run has '{optimizer}'\\)"):
        train(TrainConfig(out=str(tmp_path / "resumed"), resume=True, **{**common, "optimizer": other}))
    train(TrainConfig(out=str(tmp_path / "resumed"), resume=True, **common))
    a, b = load_file(tmp_path / "straight" / "model.safetensors"), load_file(tmp_path / "resumed" / "model.safetensors")
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(b[key], a[key], atol=1e-6, rtol=0)
    assert [r["step"] for r in rows(tmp_path / "resumed")] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in rows(tmp_path / "resumed")] == pytest.approx([r["loss"] for r in rows(tmp_path / "straight")])


def test_resume_refuses_a_store_that_disagrees_with_the_checkpoint(tiny_store, smollm2_store, tiny_llama_data,
                                                                   tmp_path):
    out = tmp_path / "d"
    train(TrainConfig(out=str(out), store=str(tiny_store), steps=1, **FAST))
    other_ids = derive_store(smollm2_store, tmp_path / "ids", n=2, length=32, layer_ids=[3, 15, 27, 30])
    with pytest.raises(EyasError, match=r"layer ids \[3, 15, 27, 30\].*\[2, 15, 27, 30\]"):
        train(TrainConfig(out=str(out), store=str(other_ids), resume=True, steps=1, **FAST))
    with pytest.raises(EyasError, match="different tokenizer"):  # another model: tokenizer, config, hidden size
        train(TrainConfig(out=str(out), store=str(tiny_llama_data[1]), resume=True, steps=1, **FAST))
    assert (out / "checkpoints" / "latest").read_text().strip() == "step-0000001"


def test_bad_stores_get_clear_errors(smollm2_store, tmp_path):
    target = Store(smollm2_store).manifest["target"]

    def fails(store: Path, pattern: str):
        with pytest.raises(EyasError, match=pattern):
            train(TrainConfig(out=str(tmp_path / f"out-{store.name}"), store=str(store), steps=1, **FAST))

    fails(derive_store(smollm2_store, tmp_path / "other-model", 1, 16, target={**target, "config_hash": "0" * 16}),
          "made for model")
    fails(derive_store(smollm2_store, tmp_path / "other-tokenizer", 1, 16, target={**target, "tokenizer_hash": "0" * 16}),
          "different tokenizer")
    fails(derive_store(smollm2_store, tmp_path / "no-label-layer", 1, 16, layer_ids=[2, 15, 27, 29]),
          r"layer ids \[2, 15, 27, 29\] do not fit the 30-layer target")
    empty = tmp_path / "empty"
    StoreWriter(empty, {k: Store(smollm2_store).manifest[k] for k in ("target", "layer_ids", "dtype", "hidden_size",
                                                                      "prepared")}).close()
    fails(empty, "holds no samples")

    def overflow(pos, hidden):  # finite in float32, inf once stored as fp16
        if pos == 1:
            hidden[5, 0, 7] = 1e6

    fails(derive_store(smollm2_store, tmp_path / "inf", 2, 16, dtype="fp16", edit=overflow, from_answer=True),
          rf"Sample\(s\) \[{int(Store(smollm2_store).sample(1)['index'])}\] hold NaN/inf")
    fails(derive_store(smollm2_store, tmp_path / "prompts-only", 2, 8), "no trained \\(assistant\\) token")
    with pytest.raises(EyasError, match="--online needs --model and --data"):
        TrainConfig(out="x", online=True)


def test_a_diverging_run_stops_at_the_bad_step_without_saving_it(tiny_store, tmp_path):
    """lr 1e30 makes the attention scores overflow at step 2: training stops naming the step
    and samples; the newest checkpoint stays the finite one of step 1."""
    out = tmp_path / "d"
    with pytest.raises(EyasError, match=r"not finite at step 2 \(sample\(s\) \[\d+"):
        train(TrainConfig(out=str(out), store=str(tiny_store), steps=5, lr=1e30, warmup=0, save_every=1, **FAST))
    assert (out / "checkpoints" / "latest").read_text().strip() == "step-0000001"
    assert all(torch.isfinite(t.float()).all() for t in load_file(out / "model.safetensors").values())


def test_minutes_stops_with_a_checkpoint_and_resume_finishes(tiny_llama_data, tmp_path):
    """--minutes ends a run early (here after its first step) with metrics and a checkpoint;
    --resume (which may drop --minutes) completes the schedule."""
    out = tmp_path / "d"
    common = dict(store=str(tiny_llama_data[1]), steps=4, batch_tokens=128, eval_fraction=0.0, progress=False,
                  log_every=3)
    assert train(TrainConfig(out=str(out), minutes=1e-9, **common))["step"] == 1
    assert (out / "checkpoints" / "latest").read_text().strip() == "step-0000001"
    assert [r["step"] for r in rows(out)] == [1]
    assert train(TrainConfig(out=str(out), resume=True, **common))["step"] == 4
    assert [r["step"] for r in rows(out)] == [1, 3, 4]


def _budgeted_run(data: Path, out: Path, monkeypatch, seconds_per_step, minutes: float = 0.5,
                  eval_seconds=None, per_depth: bool = False, stop_at: int | None = None,
                  **options) -> tuple[dict, list[dict], float]:
    """A --minutes run on a fake clock that `seconds_per_step(step)` advances after each step
    (times depth / 7 with `per_depth`: a step's cost follows its TTT steps) and `eval_seconds(n)`
    after the n-th held-out pass, when given; returns its result, its train rows and the clock
    at its end."""
    from eyas.train import budget, loop

    now = [0.0]
    monkeypatch.setattr(budget, "clock", lambda: now[0])
    real_step, real_eval = loop.train_step, loop.evaluate
    passes = []

    def timed(run):
        stats = real_step(run)
        now[0] += seconds_per_step(run.step) * (run.draft.ttt_steps / 7 if per_depth else 1)
        return stats

    def timed_eval(run, positions):
        passes.append(run.step)
        now[0] += eval_seconds(len(passes))
        return real_eval(run, positions)

    monkeypatch.setattr(loop, "train_step", timed)
    if eval_seconds is not None:
        monkeypatch.setattr(loop, "evaluate", timed_eval)
    options = {"eval_fraction": 0.0, "ttt_steps": 1, **options}
    result = train(TrainConfig(out=str(out), store=str(data), minutes=minutes, batch_tokens=128, progress=False,
                               log_every=1, **options), stop_at)
    return result, rows(out), now[0]


def test_minutes_sizes_the_schedule_from_the_steady_state_rate(tiny_llama_data, tmp_path, monkeypatch, capsys):
    """A slow first step (compilation: 10 s of a 30 s budget) does not shrink the plan: the
    schedule is sized from the steady-state rate, completes (learning rate at its end) before
    the deadline, and twice the rate fits about twice the steps after the slow step. The plan's
    line says how many epochs of the training samples the steps it fits make."""
    for rate in (1.0, 0.5):
        result, log, end = _budgeted_run(tiny_llama_data[1], tmp_path / f"d{rate}", monkeypatch,
                                         lambda step: 10.0 if step == 1 else rate)
        steady = (30 * (1 - 0.03) - 10) / rate  # steps that fit after the slow one, less the 3% margin
        assert result["step"] == log[-1]["total_steps"] == log[-1]["step"], log[-1]
        assert steady - 2 <= result["step"] <= steady + 2, (rate, result["step"], steady)
        assert end <= 30 and log[-1]["lr"] < 1e-6  # the cosine (peak 1e-4) reached its end
        printed = capsys.readouterr().out
        per_epoch = int(re.search(r"(\d+) batches of <= \d+ tokens per epoch", printed).group(1))
        plans = re.findall(r"(\d+) steps fit --minutes \S+ \(([\d.]+) epochs of the training samples\)", printed)
        assert plans and all(abs(float(e) - int(n) / per_epoch) <= 0.005 * int(n) / per_epoch for n, e in plans), plans


def test_a_cold_start_costs_only_the_seconds_it_spent_compiling(tiny_llama_data, tmp_path, monkeypatch):
    """A cold compile cache (first step 10 s, then 1 s) against a warm one (every step 1 s) at
    the same steady rate: the warm start's plan follows the rate (29 steps fit 30 s less the 3%
    margin), the cold one's is shorter by the 9 s spent compiling, and given a budget shorter by
    those seconds (21 s) the warm start trains the same schedule to the same drafter, bit for
    bit: the first steps' learning rates do not depend on how long compilation took."""
    cold, cold_log, _ = _budgeted_run(tiny_llama_data[1], tmp_path / "cold", monkeypatch,
                                      lambda step: 10.0 if step == 1 else 1.0)
    warm, warm_log, _ = _budgeted_run(tiny_llama_data[1], tmp_path / "warm", monkeypatch, lambda step: 1.0)
    short, short_log, _ = _budgeted_run(tiny_llama_data[1], tmp_path / "short", monkeypatch, lambda step: 1.0,
                                        minutes=21 / 60)
    assert (warm["step"], cold["step"], short["step"]) == (29, 20, 20)
    for log in (cold_log, warm_log, short_log):
        assert log[-1]["step"] == log[-1]["total_steps"] and log[-1]["lr"] < 1e-6  # the schedule completed
        assert len({r["total_steps"] for r in log if r["step"] >= 5}) == 1  # planned once, at the steady state
    assert [(r["step"], r["lr"], r["total_steps"]) for r in cold_log] == \
        [(r["step"], r["lr"], r["total_steps"]) for r in short_log]
    x, y = load_file(tmp_path / "cold" / "model.safetensors"), load_file(tmp_path / "short" / "model.safetensors")
    assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def test_minutes_replans_when_the_rate_changes(tiny_llama_data, tmp_path, monkeypatch):
    """Steps slow from 0.5 s to 1 s at step 12: the plan shrinks and the schedule still ends by
    the deadline; --steps caps a plan that would allow more."""
    result, log, end = _budgeted_run(tiny_llama_data[1], tmp_path / "slower", monkeypatch,
                                     lambda step: 0.5 if step < 12 else 1.0)
    before = max(r["total_steps"] for r in log if r["step"] < 12)
    assert result["step"] == log[-1]["total_steps"] < before - 10 and end <= 30, (before, result["step"], end)
    result, log, _ = _budgeted_run(tiny_llama_data[1], tmp_path / "capped", monkeypatch, lambda step: 1.0, steps=12)
    assert result["step"] == 12 and {r["total_steps"] for r in log} == {12}


def test_minutes_completes_the_schedule_through_recompiles_and_a_compiling_first_held_out_pass(
        tiny_llama_data, tmp_path, monkeypatch):
    """A cold compile cache beyond the first steps, as one H200 showed it. (a) Steps at 1 s with
    a 4 s recompile every fifth step (a batch shape not seen yet), in a 39 s budget; (b) steady
    1 s steps and a first held-out pass that compiles for 8 s (later passes 0.5 s), in 40 s.
    Each schedule completes (the last step is the plan's last, whose cosine rate is < 2% of the
    1e-4 peak) inside its budget, final held-out pass included; in (b) the first pass ran as
    soon as the steady state showed. Without the stall reserve (a) ends 1 s late; without the
    early pass (b) ends 5 s late."""
    runs = {"stalls": dict(seconds_per_step=lambda step: 4.0 if step % 5 == 2 else 1.0, minutes=39 / 60),
            "eval": dict(seconds_per_step=lambda step: 1.0, minutes=40 / 60, eval_fraction=0.2, eval_every=10**6,
                         eval_seconds=lambda n: 8.0 if n == 1 else 0.5)}
    for name, options in runs.items():
        result, log, end = _budgeted_run(tiny_llama_data[1], tmp_path / name, monkeypatch, **options)
        assert result["step"] == log[-1]["total_steps"] == log[-1]["step"] and log[-1]["lr"] < 2e-6, (name, log[-1])
        assert end <= 60 * options["minutes"], (name, end)
    evals = [json.loads(x) for x in (tmp_path / "eval" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in evals if r["split"] == "eval"] == [5, result["step"]]


def test_budget_rule_picks_the_depth_from_the_tokens_a_budget_fits():
    """The rule alone: below SHORT_RUN_TOKENS at depth 7 an EAGLE-3 run trains 3 TTT steps; at or
    above it, when --steps/--epochs end the run first, or at a depth of 3 or less, it keeps its
    depth; the same inputs always give the same choice, and the reason names the figures."""
    from eyas.train.budget import SHORT_RUN_DEPTH, SHORT_RUN_TOKENS, depth_choice

    short = depth_choice(193, 56_000.0, 7, 0.466, 1.5, capped=False)  # the 1.5-minute run at 65,536 tokens
    assert short == depth_choice(193, 56_000.0, 7, 0.466, 1.5, capped=False)
    assert short[0] == SHORT_RUN_DEPTH == 3
    assert "193 steps" in short[1] and "10.8 M tokens" in short[1] and "training 3 TTT steps" in short[1]
    assert depth_choice(SHORT_RUN_TOKENS // 1000, 1000.0, 7, 0.5, 7.5, capped=False)[0] == 7  # exactly at the line
    assert depth_choice(SHORT_RUN_TOKENS // 1000 - 1, 1000.0, 7, 0.5, 7.5, capped=False)[0] == 3
    assert depth_choice(691, 57_000.0, 7, 0.6, 7.5, capped=False)[0] == 7  # the recipe: 39 M tokens
    kept = depth_choice(100, 1000.0, 7, 0.5, 1.5, capped=True)
    assert kept[0] == 7 and "--steps/--epochs" in kept[1]
    assert depth_choice(100, 1000.0, 2, 0.5, 1.5, capped=False)[0] == 2


def test_budget_rule_lowers_a_short_runs_depth_once_the_rate_shows_and_resume_keeps_it(
        tiny_llama_data, tmp_path, monkeypatch, capsys):
    """An EAGLE-3 run without --ttt-steps in 30 s of 1 s steps (a few thousand tokens): at the
    steady state (step 5) the rule lowers its depth from 7 to 3, says why, and records it; the
    steps after it are the cheaper depth's (3/7 s), so the schedule is replanned to more steps
    than 7 would fit (29) and still completes inside the budget. The drafter is saved at depth 3,
    and a run stopped after the switch resumes at depth 3 without deciding again."""
    result, log, end = _budgeted_run(tiny_llama_data[1], tmp_path / "short", monkeypatch, lambda step: 1.0,
                                     per_depth=True, ttt_steps=None)
    printed = capsys.readouterr().out
    assert printed.count("budget rule:") == 1 and "training 3 TTT steps instead" in printed, printed
    assert [len(r["acc_per_step"]) for r in log] == [7] * 5 + [3] * (len(log) - 5)
    assert result["step"] == log[-1]["total_steps"] > 35 and end <= 30 and log[-1]["lr"] < 1e-6, (result, end)
    assert load_config(tmp_path / "short").ttt_steps == 3
    trainer = json.loads(next((tmp_path / "short" / "checkpoints").glob("step-*/trainer.json")).read_text())
    assert (trainer["depth_rule"]["from"], trainer["depth_rule"]["depth"], trainer["depth_rule"]["at_step"]) == (7, 3, 5)

    _budgeted_run(tiny_llama_data[1], tmp_path / "cut", monkeypatch, lambda step: 1.0, per_depth=True,
                  ttt_steps=None, stop_at=8, save_every=4)
    capsys.readouterr()
    resumed, log, _ = _budgeted_run(tiny_llama_data[1], tmp_path / "cut", monkeypatch, lambda step: 1.0,
                                    per_depth=True, ttt_steps=None, resume=True)
    assert "budget rule:" not in capsys.readouterr().out
    assert {len(r["acc_per_step"]) for r in log if r["step"] > 8} == {3} and resumed["step"] > 8
    assert load_config(tmp_path / "cut").ttt_steps == 3
    with pytest.raises(EyasError, match=r"ttt-steps 7 \(the run left it unset\)"):  # the rule's run, resumed at 7
        _budgeted_run(tiny_llama_data[1], tmp_path / "cut", monkeypatch, lambda step: 1.0, ttt_steps=7, resume=True)


def test_budget_rule_keeps_the_depth_of_a_long_enough_run_and_never_overrides_ttt_steps(
        tiny_llama_data, tmp_path, monkeypatch, capsys):
    """With the line moved below what the run fits, the rule keeps depth 7 and says so; with
    --ttt-steps given (even 7) there is no rule: the run trains the depth asked for."""
    from eyas.train import budget

    monkeypatch.setattr(budget, "SHORT_RUN_TOKENS", 100)
    _, log, _ = _budgeted_run(tiny_llama_data[1], tmp_path / "long", monkeypatch, lambda step: 1.0, ttt_steps=None)
    printed = capsys.readouterr().out
    assert "budget rule:" in printed and "keeping 7 TTT steps" in printed, printed
    assert {len(r["acc_per_step"]) for r in log} == {7}
    monkeypatch.setattr(budget, "SHORT_RUN_TOKENS", 10**12)
    _, log, _ = _budgeted_run(tiny_llama_data[1], tmp_path / "asked", monkeypatch, lambda step: 1.0, ttt_steps=7)
    assert "budget rule:" not in capsys.readouterr().out and {len(r["acc_per_step"]) for r in log} == {7}


def test_learning_rate_warms_up_then_decays_to_zero():
    from eyas.train.loop import lr_at

    cfg = TrainConfig(out="x", store="s", lr=1.0, warmup=0.1, steps=100)
    lrs = [lr_at(cfg, s, 100) for s in range(100)]
    assert all(a < b for a, b in zip(lrs[:10], lrs[1:11])) and max(lrs) == pytest.approx(1.0, abs=0.01)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:])) and lrs[-1] < 0.001


# 50 samples, 30 of them cut at the 64-token crop (ties), in a store order that is not the
# prepared order; every fifth position is held out.
TIED_LENGTHS = [64] * 30 + [12 + p for p in range(20)]
TIED_INDEX = [(7 * p) % 50 for p in range(50)]
TIED_TRAIN = [p for p in range(50) if p % 5]


def _tied_stream(seed: int) -> BatchStream:
    return BatchStream(TIED_TRAIN, TIED_LENGTHS, TIED_INDEX, 256, seed)


def _epoch_items(stream: BatchStream, epoch: int) -> list[list[int]]:
    return [stream.item(epoch * len(stream) + i) for i in range(len(stream))]


def test_each_epoch_regroups_ties_into_batches_of_the_same_shapes():
    """Samples tied at the crop length meet new neighbours every epoch, while the batch count,
    sizes and longest lengths (steps, memory, compiled shapes) stay those of the fixed grouping."""
    stream = _tied_stream(seed=3)

    def shape(batch: list[int]) -> tuple[int, int]:
        return len(batch), max(TIED_LENGTHS[p] for p in batch)

    shapes = sorted(map(shape, stream.batches))
    epochs = [_epoch_items(stream, e) for e in range(3)]
    for items in epochs:
        assert len(items) == len(stream) and sorted(map(shape, items)) == shapes
    groups = [{frozenset(b) for b in items} for items in epochs]
    assert groups[0] != groups[1] != groups[2]
    # Held-out passes use the fixed grouping, whatever the seed.
    assert _tied_stream(seed=4).batches == stream.batches


def test_each_epoch_trains_on_every_position_once():
    stream = _tied_stream(seed=0)
    for e in range(4):
        assert sorted(p for b in _epoch_items(stream, e) for p in b) == TIED_TRAIN


def test_stream_items_depend_only_on_seed_and_index():
    stream = _tied_stream(seed=5)
    items = [stream.item(s) for s in range(4 * len(stream))]
    # A resumed run asks a fresh stream from any step on; the prefetch thread may be an epoch ahead.
    fresh = _tied_stream(seed=5)
    order = [*range(len(items) - 1, 2 * len(stream) - 1, -1), *range(2 * len(stream))]
    assert {s: fresh.item(s) for s in order} == dict(enumerate(items))
    assert [_tied_stream(seed=6).item(s) for s in range(len(items))] != items


def _first_step(argv: list[str]) -> None:
    """Script mode: one step's loss and gradients (after DDP's all-reduce) -> a file."""
    from eyas import distributed
    from eyas.train.loop import accumulate, setup
    from eyas.train.metrics import summarize

    store, out, dump, accum = argv
    cfg = TrainConfig(out=out, store=store, steps=1, batch_tokens=128, grad_accum=int(accum),
                      **{k: v for k, v in FAST.items() if k != "batch_tokens"})
    d, device = distributed.init("cpu", False)
    run = setup(cfg, d, device)
    stats, _ = accumulate(run)
    if d.main:
        grads = {n: p.grad.clone() for n, p in run.drafter.named_parameters() if p.requires_grad}
        torch.save({"summary": summarize(distributed.all_reduce(stats, d)), "grads": grads}, dump)
    else:
        distributed.all_reduce(stats, d)
    distributed.shutdown(d)


def test_two_process_ddp_equals_one_process_over_the_same_global_batch(two_batch_store, tmp_path):
    """2 gloo processes x 1 micro-batch vs. 1 process x 2 accumulated micro-batches: the same
    first-step loss (1e-6) and gradients (rtol 1e-5, float32 sums in another order)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    me = str(Path(__file__).resolve())
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", me,
                    str(two_batch_store), str(tmp_path / "ddp"), str(tmp_path / "ddp.pt"), "1"], check=True, env=env,
                   timeout=300)  # a hang fails here, not at CI's limit
    subprocess.run([sys.executable, me, str(two_batch_store), str(tmp_path / "one"), str(tmp_path / "one.pt"), "2"],
                   check=True, env=env, timeout=300)
    ddp, one = torch.load(tmp_path / "ddp.pt"), torch.load(tmp_path / "one.pt")
    assert ddp["summary"]["positions"] == one["summary"]["positions"] > 0
    assert ddp["summary"]["loss_per_step"] == pytest.approx(one["summary"]["loss_per_step"], abs=1e-6)
    assert ddp["grads"].keys() == one["grads"].keys()
    for name in one["grads"]:
        torch.testing.assert_close(ddp["grads"][name], one["grads"][name], rtol=1e-5, atol=1e-8)


def test_torchrun_fsdp_cli_trains_like_one_process(two_batch_store, tmp_path):
    """`torchrun -m eyas train --fsdp` (4 gloo processes, oversubscribing two cores; sharded
    weights and AdamW state) ends 2 steps with the weights of one process accumulating the 4
    micro-batches of each step (1e-6). The DDP test above runs 2 processes."""
    args = ["train", "--store", str(two_batch_store), "--steps", "2", "--batch-tokens", "128", "--ttt-steps", "2",
            "--draft-vocab", "4096", "--eval-fraction", "0.25", "--log-every", "1", "--no-progress"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", "-m", "eyas"]
    result = subprocess.run(torchrun + args + ["--out", str(tmp_path / "fsdp"), "--fsdp"], env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr.startswith("eyas: 4 torchrun processes on the CPU (no CUDA device is visible)"), \
        result.stderr[:500]
    assert "4 process(es) on cpu, FSDP" in result.stdout and result.stdout.count("draft vocabulary:") == 1
    assert "eval acc" in result.stdout and "tau_sim" in result.stdout
    one = subprocess.run([sys.executable, "-m", "eyas"] + args + ["--out", str(tmp_path / "one"), "--grad-accum", "4"],
                         env=env, capture_output=True, text=True)
    assert one.returncode == 0, one.stderr[-3000:]
    for out in (tmp_path / "fsdp", tmp_path / "one"):
        assert (out / "checkpoints" / "latest").read_text().strip() == "step-0000002"
        assert [r["step"] for r in rows(out)] == [1, 2] and rows(out, "eval")
    a, b = load_file(tmp_path / "one" / "model.safetensors"), load_file(tmp_path / "fsdp" / "model.safetensors")
    for key in a:
        torch.testing.assert_close(b[key], a[key], atol=1e-6, rtol=0)


def test_torchrun_context_parallel_cli_trains_like_one_process(two_batch_store, tmp_path):
    """`torchrun -m eyas train --context-parallel` (2 gloo processes, each training its half of
    every sample, with --checkpoint-steps) ends 2 steps with the weights of one process on the
    same batches (1e-6), and says how it splits the samples."""
    args = ["train", "--store", str(two_batch_store), "--steps", "2", "--batch-tokens", "128", "--ttt-steps", "3",
            "--draft-vocab", "4096", "--eval-fraction", "0.25", "--log-every", "1", "--no-progress",
            "--grad-accum", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "eyas"]
    result = subprocess.run(torchrun + args + ["--out", str(tmp_path / "cp"), "--context-parallel",
                                               "--checkpoint-steps"], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "2 process(es) on cpu, each sample split over them (context parallel)" in result.stdout
    one = subprocess.run([sys.executable, "-m", "eyas"] + args + ["--out", str(tmp_path / "one")], env=env,
                         capture_output=True, text=True)
    assert one.returncode == 0, one.stderr[-3000:]
    split, whole = rows(tmp_path / "cp"), rows(tmp_path / "one")
    assert [r["step"] for r in split] == [1, 2] and split[0]["positions"] == whole[0]["positions"] > 0
    assert split[-1]["loss"] == pytest.approx(whole[-1]["loss"], abs=1e-5)
    # The held-out pass splits each batch too: its statistics add up to one process's, decoding's
    # chains included (walked by each shard alone, they start anew at its first row: 24 against 22).
    held, alone_held = rows(tmp_path / "cp", "eval")[-1], rows(tmp_path / "one", "eval")[-1]
    assert held["positions"] == alone_held["positions"] > 0 and held["chains"] == alone_held["chains"]
    for key in ("loss_per_step", "acc_per_step", "accept_walk_per_step"):
        assert held[key] == pytest.approx(alone_held[key], abs=1e-5), key
    a, b = load_file(tmp_path / "one" / "model.safetensors"), load_file(tmp_path / "cp" / "model.safetensors")
    # AdamW divides each step by the root of its second moment: where a gradient is near zero, a
    # rounding difference between the shards' and the whole sample's sums moves the weight by up
    # to ~1e-6 (one of 995,328 elements on an AMX machine: 1.04e-6 on a weight of 6.3e-3), so
    # 1e-3 of the weight beside 1e-6; a split computed wrongly differs by whole updates.
    for key in a:
        torch.testing.assert_close(b[key], a[key], atol=1e-6, rtol=1e-3)
    alone = subprocess.run([sys.executable, "-m", "eyas"] + args + ["--out", str(tmp_path / "alone"),
                                                                    "--context-parallel"],
                           env=env, capture_output=True, text=True)
    assert alone.returncode != 0 and "run it under torchrun with --nproc-per-node 2 or more" in alone.stderr


BUDGETED_RANKS = """
import os, sys
from eyas.train import budget, loop, train, TrainConfig

rank = int(os.environ["RANK"])

now = [0.0]
budget.clock = lambda: now[0]
real = loop.train_step

def timed(run):
    stats = real(run)
    now[0] += 1.0 + 0.5 * rank  # each process its own clock: rank 1's steps look slower
    return stats

loop.train_step = timed
out = train(TrainConfig(out=sys.argv[1], store=sys.argv[2], minutes=0.5, batch_tokens=128, ttt_steps=1,
                        eval_fraction=0.0, progress=False, log_every=1))
sys.stdout.write(f"\\nRESULT {rank} {out['step']}\\n")  # one write: the other rank logs to the same pipe
sys.stdout.flush()
"""


def test_budgeted_processes_agree_on_one_schedule(two_batch_store, tmp_path):
    """Under --minutes each process plans from its own clock; with different clocks (rank 1's
    steps take 1.5 s, rank 0's 1 s) they still run one schedule, the shorter, and end together
    (without agreeing, the process with the longer plan waits forever in a collective)."""
    script = tmp_path / "ranks.py"
    script.write_text(BUDGETED_RANKS)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    child = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                              str(script), str(tmp_path / "d"), str(two_batch_store)],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = child.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)  # the processes too, not only torchrun
        pytest.fail("the processes did not end: one waited in a collective")
    result = subprocess.CompletedProcess(child.args, child.returncode, stdout, stderr)
    assert result.returncode == 0, result.stderr[-3000:]
    ends = sorted(list(m) for m in re.findall(r"^RESULT (\d+) (\d+)$", result.stdout, re.M))
    assert len(ends) == 2 and ends[0][1] == ends[1][1], result.stdout[-2000:]
    log = rows(tmp_path / "d")
    assert log[-1]["step"] == log[-1]["total_steps"] == int(ends[0][1]), ([(r["step"], r["total_steps"]) for r in log], result.stdout[-3000:])
    assert int(ends[0][1]) <= (30 * 0.97) / 1.5 + 1  # the slower clock's plan


def test_online_training_equals_offline_on_the_same_states(tiny_llama_dir, tiny_llama_data, tmp_path):
    """--online captures with the target beside the drafter; on the same prepared data it
    takes the steps offline training takes from a store of the same states (up to float32
    differences between padded batch shapes in the target's forward)."""
    prep, store = tiny_llama_data
    common = dict(steps=3, batch_tokens=128, ttt_steps=3, eval_fraction=0.25, progress=False, lr=1e-3)
    offline = train(TrainConfig(out=str(tmp_path / "off"), store=str(store), **common))
    online = train(TrainConfig(out=str(tmp_path / "on"), online=True, model=str(tiny_llama_dir), data=str(prep),
                               **common))
    assert online["eval"]["loss_per_step"] == pytest.approx(offline["eval"]["loss_per_step"], rel=1e-5)
    a, b = load_file(tmp_path / "off" / "model.safetensors"), load_file(tmp_path / "on" / "model.safetensors")
    for key in a:
        torch.testing.assert_close(b[key], a[key], atol=1e-5, rtol=1e-4)
    assert not list((tmp_path / "on").glob("**/shard-*"))


if __name__ == "__main__":
    _first_step(sys.argv[1:])


def test_store_source_reads_only_a_shards_rows(smollm2_store):
    """Under --context-parallel a process reads only its shard's (and halo's) states: a slice of
    each sample in the shard file, zeros past a sample's end and past the batch, ids whole."""
    from eyas.train.data import StoreSource

    source = StoreSource(smollm2_store, crop=10_000)
    by_length = sorted(range(len(source.lengths)), key=lambda p: source.lengths[p])
    positions = [by_length[-1], by_length[0], by_length[len(by_length) // 2]]
    assert len({source.lengths[p] for p in positions}) > 1  # rows of different lengths
    whole = source.read(positions)
    T = whole.hidden.shape[1]
    padded = torch.cat([whole.hidden, whole.hidden.new_zeros(len(positions), 16, *whole.hidden.shape[2:])], dim=1)
    for lo, hi in ((0, 10), (7, T + 5), (T + 2, T + 9)):
        part = source.read(positions, rows=(lo, hi))
        assert part.rows == (lo, hi) and torch.equal(part.hidden, padded[:, lo:hi])
        assert torch.equal(part.input_ids, whole.input_ids) and torch.equal(part.loss_mask, whole.loss_mask)
        batch = source.load(positions, torch.device("cpu"), (lo, hi))
        assert batch.rows == (lo, hi) and torch.equal(batch.hidden, padded[:, lo:hi].float())


def _old_load(source, positions: list[int]):
    """The batch as training loaded it before the host/device split: every sample dequantised to
    float32 on the CPU (hidden_fp8.float() * scale), zero-padded, then moved."""
    from eyas.train.data import Batch

    T = max(source.lengths[p] for p in positions)
    rows = []
    for p in positions:
        s = source.store.stored(p)
        hidden = s["hidden"].float() if s["scale"] is None else s["hidden"].float() * s["scale"].unsqueeze(-1)
        rows.append((s["input_ids"], s["loss_mask"], hidden))

    def pad(k: int) -> torch.Tensor:
        first = rows[0][k][: source.crop]
        out = first.new_zeros(len(rows), T, *first.shape[1:])
        for b, row in enumerate(rows):
            out[b, : min(len(row[k]), source.crop)] = row[k][: source.crop]
        return out

    return Batch(pad(0), pad(1), pad(2), [source.sample_index[p] for p in positions])


@pytest.mark.parametrize("dtype", ["fp8", "bf16"])
def test_batches_are_the_same_read_ahead_or_not(smollm2_store, tmp_path, dtype):
    """From fp8 and bf16 stores: the batches `load` returns, read in a background thread or
    directly, equal the float32 ones of the old path bit for bit (fp8 -> float32 is exact and the
    scale product is one float32 rounding on either side), in the same order, same samples."""
    import threading

    from eyas.train.data import StoreSource

    store = derive_store(smollm2_store, tmp_path / dtype, n=8, length=48, dtype=dtype)
    source = StoreSource(store, crop=40)  # some samples cropped, batches of several lengths
    stream = BatchStream(list(range(8)), source.lengths, source.sample_index, 128, seed=1)
    items = [stream.item(s) for s in range(3 * len(stream))]  # three epochs, reshuffled
    threads = []
    read = source.read
    source.read = lambda positions, pin=False, rows=None: (threads.append(threading.current_thread().name)
                                                            or read(positions, pin, rows))
    direct = [source.load(p, torch.device("cpu")) for p in items]
    source.read_ahead(iter(items), torch.device("cpu"))
    ahead = [source.load(p, torch.device("cpu")) for p in items]
    source.close()
    assert threads == ["MainThread"] * len(items) + ["eyas-prefetch"] * len(items)
    for positions, a, b in zip(items, direct, ahead):
        old = _old_load(source, positions)
        for batch in (a, b):
            assert batch.sample_index == old.sample_index
            assert batch.hidden.dtype == torch.float32 and batch.input_ids.dtype == torch.long
            for k in ("input_ids", "loss_mask", "hidden"):
                assert torch.equal(getattr(batch, k), getattr(old, k)), k
    # A batch asked for out of the read-ahead order is read directly; the order goes on after it.
    source.read_ahead(iter(items), torch.device("cpu"))
    assert torch.equal(source.load(items[5], torch.device("cpu")).hidden, direct[5].hidden)
    assert torch.equal(source.load(items[0], torch.device("cpu")).hidden, direct[0].hidden)
    source.close()
    # A context-parallel shard's rows, read ahead: the same slice of the old path's batch.
    source.read_ahead(iter(items), torch.device("cpu"), lambda positions: (3, 45))
    for positions in items[:4]:
        old = _old_load(source, positions).hidden
        expected = torch.cat([old, old.new_zeros(len(positions), 45, *old.shape[2:])], dim=1)[:, 3:45]
        assert torch.equal(source.load(positions, torch.device("cpu"), (3, 45)).hidden, expected)
    source.close()


def test_training_reads_ahead_and_trains_on_the_same_data(smollm2_store, tmp_path, monkeypatch):
    """A short run from an fp8 store (2 micro-batches a step, several epochs) reads every
    training batch in the background thread and ends with exactly the weights of a run that
    loads each batch the old way, in the old order, on the main thread."""
    import threading

    from eyas.train.data import StoreSource

    store = derive_store(smollm2_store, tmp_path / "fp8", n=8, length=48, dtype="fp8")
    common = dict(store=str(store), steps=6, batch_tokens=128, grad_accum=2, lr=3e-3, warmup=0,
                  **{k: v for k, v in FAST.items() if k != "batch_tokens"})
    threads = []
    read = StoreSource.read
    monkeypatch.setattr(StoreSource, "read", lambda self, positions, pin=False, rows=None: (
        threads.append(threading.current_thread().name), read(self, positions, pin, rows))[1])
    train(TrainConfig(out=str(tmp_path / "new"), **common))
    assert threads and set(threads) == {"eyas-prefetch"}
    monkeypatch.setattr(StoreSource, "load", lambda self, positions, device, rows=None: _old_load(self, positions))
    monkeypatch.setattr(StoreSource, "read_ahead", lambda self, items, device, rows_of=None: None)
    train(TrainConfig(out=str(tmp_path / "old"), **common))
    a, b = load_file(tmp_path / "new" / "model.safetensors"), load_file(tmp_path / "old" / "model.safetensors")
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert rows(tmp_path / "new") == [{**r, "tokens_per_s": n["tokens_per_s"]} for r, n in
                                      zip(rows(tmp_path / "old"), rows(tmp_path / "new"))]
