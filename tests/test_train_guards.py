"""`eyas train` refuses what it would otherwise do wrong without a word: a --resume over other
samples or another step size (processes x --grad-accum), options it would ignore (--init's
settings, --layers offline, --ttt-steps beside --block-size, --ttt-decay beside D-PACE or
on-policy weights), a fresh run over a trained drafter; its held-out loss is --loss, and
--keep never prunes the checkpoint `latest` names.

All on a tiny random Llama and a dozen short conversations (test_store_damage's store)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from eyas import distributed
from eyas.errors import EyasError
from eyas.train import TrainConfig, train
from eyas.train import loop
from eyas.train.metrics import summarize
from test_store_damage import N_SAMPLES, drop_entry, edit_manifest, tiny_prepared, tiny_store  # noqa: F401

CPU = torch.device("cpu")
SMALL = dict(steps=3, batch_tokens=64, ttt_steps=1, draft_vocab=64, eval_fraction=0.0, save_every=1, lr=1e-3,
             progress=False, device="cpu")


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread):
    """Tiny models: see conftest's one_thread."""


def config(store: Path, out: Path, **options) -> TrainConfig:
    return TrainConfig(store=str(store), out=str(out), **{**SMALL, **options})


def trainer_json(out: Path) -> Path:
    return out / "checkpoints" / (out / "checkpoints" / "latest").read_text().strip() / "trainer.json"


def edit_trainer(out: Path, edit) -> None:
    path = trainer_json(out)
    record = json.loads(path.read_text())
    edit(record)
    path.write_text(json.dumps(record))


@pytest.fixture(scope="module")
def drafter(tmp_path_factory, tiny_store) -> Path:  # noqa: F811
    """A one-step EAGLE-3 drafter (gqa, no fc_norm or norm_output) for --init."""
    out = tmp_path_factory.mktemp("guards") / "base"
    train(config(tiny_store, out, steps=1))
    return out


def test_resume_refuses_a_store_that_grew_since_the_run_started(tmp_path, tiny_store):  # noqa: F811
    """An --allow-incomplete run resumed after its capture finished would hold out samples it
    trained on: refused in one line; over the samples it started with, it resumes."""
    store, later = tmp_path / "store", tmp_path / "later"
    shutil.copytree(tiny_store, store)
    later.mkdir()
    full = json.loads((store / "manifest.json").read_text())
    for shard in full["shards"][-2:]:  # not captured yet
        shutil.move(store / shard["file"], later / shard["file"])
    edit_manifest(store, lambda m: (drop_entry(m, -1), drop_entry(m, -1)))
    partial = json.loads((store / "manifest.json").read_text())["num_samples"]
    common = dict(eval_fraction=0.25, allow_incomplete=True)
    train(config(store, tmp_path / "run", **common), stop_at=1)
    train(config(store, tmp_path / "run", resume=True, **common), stop_at=2)
    for shard in later.iterdir():  # the capture finished
        shutil.move(shard, store / shard.name)
    (store / "manifest.json").write_text(json.dumps(full))
    with pytest.raises(EyasError) as e:
        train(config(store, tmp_path / "run", resume=True, **common))
    assert str(e.value).startswith(f"--resume: the store {store} holds {N_SAMPLES} samples, the run trained on "
                                   f"{partial}, so its held-out split and batches would change.")
    assert "\n" not in str(e.value) and f"--init {tmp_path / 'run'}" in str(e.value)
    assert json.loads(trainer_json(tmp_path / "run").read_text())["step"] == 2


def test_resume_refuses_another_step_size_and_names_the_grad_accum_that_keeps_it(tmp_path, tiny_store):  # noqa: F811
    """Step s trains stream items s*G..s*G+G-1, G = processes x --grad-accum: a run resumed under
    another number of processes would skip or repeat batches. Refused (set up as 2 processes
    would, up to their first collective), naming a --grad-accum that keeps G where one does,
    which resumes; a run from before the record resumes as before (--grad-accum compared as a
    setting)."""
    out = tmp_path / "run"
    train(config(tiny_store, out), stop_at=1)
    with pytest.raises(EyasError) as e:
        loop.setup(config(tiny_store, out, resume=True), distributed.Dist(world=2), CPU)
    assert str(e.value) == ("--resume: the run's steps each train 1 micro-batch(es) (1 process(es) x --grad-accum "
                            "1), this command's 2 (2 process(es) x --grad-accum 1), so its steps would skip or repeat "
                            "batches. Resume on 1 process(es) with --grad-accum 1.")

    def as_two_processes(record: dict) -> None:  # what the run under torchrun --nproc-per-node 2 records
        record.update(group=2, processes=2)

    edit_trainer(out, as_two_processes)
    with pytest.raises(EyasError) as e:
        train(config(tiny_store, out, resume=True))
    assert str(e.value) == ("--resume: the run's steps each train 2 micro-batch(es) (2 process(es) x --grad-accum "
                            "1), this command's 1 (1 process(es) x --grad-accum 1), so its steps would skip or repeat "
                            "batches. Resume with --grad-accum 2, or on 2 process(es) with --grad-accum 1.")
    train(config(tiny_store, out, resume=True, grad_accum=2), stop_at=2)
    assert {k: json.loads(trainer_json(out).read_text())[k] for k in ("group", "processes")} == \
        {"group": 2, "processes": 1}

    edit_trainer(out, lambda record: [record.pop(k) for k in ("group", "processes", "data")])  # an older run
    with pytest.raises(EyasError, match=r"grad-accum 1 \(the run has 2\)"):
        train(config(tiny_store, out, resume=True))
    assert train(config(tiny_store, out, resume=True, grad_accum=2))["step"] == 3


def test_held_out_loss_is_the_runs_loss(tmp_path, tiny_store):  # noqa: F811
    """The held-out pass scores --loss: over the batches of a step it equals that step's train loss."""
    common = dict(batch_tokens=256, ttt_steps=2, draft_vocab=512)  # the random target's tokens in the vocabulary
    run = loop.setup(config(tiny_store, tmp_path / "lk", loss="lk-alpha", **common), distributed.Dist(), CPU)
    soft = loop.setup(config(tiny_store, tmp_path / "ce", **common), distributed.Dist(), CPU)  # the same weights
    positions = [p for batch in run.train_stream.for_step(0, run.group, 0, 1) for p in batch]
    held_out, soft_held_out = loop.evaluate(run, positions), loop.evaluate(soft, positions)
    trained = summarize(loop.accumulate(run)[0])
    assert held_out["acc_per_step"] == soft_held_out["acc_per_step"]
    assert held_out["loss"] > 0 and held_out["loss"] == pytest.approx(trained["loss"], rel=1e-5)
    assert soft_held_out["loss"] != pytest.approx(held_out["loss"], rel=1e-2)


@pytest.mark.parametrize("option, line", [
    (dict(fc_norm=True), "--fc-norm: --init {init} has it off"),
    (dict(norm_output=True), "--norm-output: --init {init} has it off"),
    (dict(draft_attention="mla"), "--draft-attention mla: --init {init} has gqa"),
    (dict(drafter="peagle", mask_token_id=7), "--mask-token-id 7: --init {init} has 511"),
])
def test_init_refuses_a_setting_its_drafter_does_not_have(tmp_path, tiny_store, drafter, option, line):  # noqa: F811
    """--init keeps its drafter's settings: one it lacks is refused, as --draft-layers is."""
    init = drafter
    if option.get("drafter") == "peagle":  # a drafter with a mask token (the target's last id by default)
        init = tmp_path / "peagle"
        train(config(tiny_store, init, steps=1, drafter="peagle"))
    with pytest.raises(EyasError) as e:
        train(config(tiny_store, tmp_path / "run", steps=1, init=str(init), **option))
    assert str(e.value).startswith(line.format(init=init) + "; a run from it keeps its shape and settings (drop --")
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_layers_offline_is_refused(tiny_store, tmp_path):  # noqa: F811
    with pytest.raises(EyasError) as e:
        config(tiny_store, tmp_path / "run", layers="1,3,5")
    assert str(e.value).startswith("--layers 1,3,5 is for --online: offline training reads the layer ids the store "
                                   "was captured with.")
    TrainConfig(online=True, model="m", data="d", out=str(tmp_path / "run"), layers="1,3,5")


def test_pruning_keeps_the_checkpoint_latest_names(tmp_path, tiny_store):  # noqa: F811
    """`latest` moved back to step 2 with a stale step-4 beside it (a kill before `latest` moved,
    or `latest` rewritten by hand): a save at step 3 under --keep 1 keeps step-3 and removes
    the abandoned step-4, and the run resumes from it."""
    out = tmp_path / "run"
    common = dict(steps=6, save_every=2)
    train(config(tiny_store, out, **common), stop_at=4)
    root = out / "checkpoints"
    (root / "latest").write_text("step-0000002\n")
    train(config(tiny_store, out, resume=True, keep=1, **{**common, "save_every": 1}), stop_at=3)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-0000003"]
    assert (root / "latest").read_text().strip() == "step-0000003"
    train(config(tiny_store, out, resume=True, keep=2, **common))
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-0000004", "step-0000006"]


def test_a_trained_drafter_without_checkpoints_is_not_overwritten(tmp_path, tiny_store):  # noqa: F811
    out = tmp_path / "run"
    train(config(tiny_store, out, steps=1))
    shutil.rmtree(out / "checkpoints")
    weights = (out / "model.safetensors").read_bytes()
    for resume in (False, True):
        with pytest.raises(EyasError) as e:
            train(config(tiny_store, out, steps=1, seed=7, resume=resume))
        assert str(e.value) == (f"{out} already holds a trained drafter (config.json) and no checkpoint to resume "
                                f"it from (checkpoints/ is gone); choose another --out, or delete {out} to train "
                                f"anew.")
    assert (out / "model.safetensors").read_bytes() == weights


def test_ttt_steps_that_disagree_with_block_size_are_refused(tiny_store, tmp_path):  # noqa: F811
    dflash = dict(store=str(tiny_store), out=str(tmp_path / "run"), drafter="dflash", batch_tokens=64)
    with pytest.raises(EyasError) as e:
        TrainConfig(**dflash, ttt_steps=3, block_size=5)
    assert str(e.value) == ("--ttt-steps 3 and --block-size 5 disagree: a block drafts --block-size - 1 tokens. Give "
                            "one of them (--ttt-steps 4 with --block-size 5).")
    assert TrainConfig(**dflash, ttt_steps=4, block_size=5).ttt_steps == 4
    assert TrainConfig(**dflash, block_size=5).ttt_steps == 4


@pytest.mark.parametrize("weights", ["dpace", "on-policy"])
def test_ttt_decay_is_refused_where_it_weighs_nothing(tiny_store, tmp_path, weights):  # noqa: F811
    """Refused beside --position-weights dpace or on-policy; a run recorded with one still resumes
    without it (it weighed nothing)."""
    common = dict(store=str(tiny_store), out=str(tmp_path / "run"), position_weights=weights)
    with pytest.raises(EyasError) as e:
        TrainConfig(**common, ttt_decay=0.5)
    assert str(e.value) == (f"--ttt-decay weighs steps under --position-weights decay; --position-weights {weights} "
                            f"weighs them its own way. Drop --ttt-decay, or use --position-weights decay.")
    TrainConfig(store=str(tiny_store), out=str(tmp_path / "run"), ttt_decay=0.5)
    cfg = TrainConfig(**common)
    cfg.check_resumable({**cfg.to_dict(), "ttt_decay": 0.5})
