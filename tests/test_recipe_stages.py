"""`eyas recipe` decides which stages run from the whole plan and its recorded state: a
`capture` section that online training would ignore is refused, --stop-after stops at a stage
already done, a changed finished stage is refused before any stage runs, a folder a stage of
the recipe wrote stays its own when the plan changes, the report reads only the planned
stages' outputs, and --dry-run shows a done stage whose output is gone as to be redone.

The stage commands are replaced by a stand-in that writes each stage's output (these tests
are about the recipe's own bookkeeping, not the stages): no model is loaded."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import yaml

import eyas.recipe.run as recipe_run
from eyas.errors import EyasError
from eyas.recipe import run_recipe
from eyas.recipe.report import write_report
from test_recipe import _recipe

ONLINE = {"online": True, "steps": 1, "batch_tokens": 256, "ttt_steps": 2, "draft_vocab": 512, "eval_fraction": 0,
          "progress": False}


class Ran(list):
    """The names of the stages run, in order; a stage named in `failing` writes its output,
    then fails (as a killed stage leaves a partial output)."""

    def __init__(self) -> None:
        super().__init__()
        self.failing: set[str] = set()

    def __call__(self, stage: recipe_run.Stage, where: str) -> None:
        self.append(stage.name)
        if stage.output.suffix == ".json":
            stage.output.parent.mkdir(parents=True, exist_ok=True)
            stage.output.write_text("{}")
        else:
            stage.output.mkdir(parents=True, exist_ok=True)
        if stage.name in self.failing:
            raise RuntimeError(f"{stage.name} failed")


@pytest.fixture
def ran(monkeypatch) -> Ran:
    """Each stage's command replaced by a `Ran` stand-in."""
    ran = Ran()
    monkeypatch.setattr(recipe_run, "_run_stage", ran)
    return ran


def _spec(path: Path, drop: tuple[str, ...] = (), **changes) -> Path:
    """The recipe at `path` without the keys `drop` and with `changes`, written next to it."""
    spec = {k: v for k, v in yaml.safe_load(path.read_text()).items() if k not in drop}
    spec.update(changes)
    out = path.with_name(f"{path.stem}-{len(list(path.parent.glob('*.yaml')))}.yaml")
    out.write_text(yaml.safe_dump(spec))
    return out


def test_a_capture_section_with_online_training_is_refused(tmp_path, tiny_llama_dir):
    """Online training has no capture stage, so `capture: layers` would be ignored without a
    word; one line points to `train: layers` instead, before anything runs."""
    recipe = _recipe(tmp_path, str(tiny_llama_dir), train=ONLINE, capture={"layers": "1,3,6", "dtype": "fp8"})
    with pytest.raises(EyasError, match=r"`capture` has no stage with `train: online: true`.*`train: layers: "
                                        r"1,3,6`"):
        run_recipe(recipe, tmp_path / "work", dry_run=True)
    assert not (tmp_path / "work").exists()
    for empty in ({}, None):  # an empty section asks for nothing
        run_recipe(_spec(recipe, capture=empty), tmp_path / "work", dry_run=True)


def test_stop_after_a_stage_already_done_stops_there(tmp_path, tiny_llama_dir, ran, capsys):
    """Repeating `--stop-after regenerate` (a session split, as recipes/smollm2-1gpu.yaml
    suggests) runs nothing further: it used to go on to training and eval."""
    recipe, work = _recipe(tmp_path, str(tiny_llama_dir), train=ONLINE), tmp_path / "work"
    assert run_recipe(recipe, work, stop_after="regenerate") is None
    assert ran == ["prepare", "regenerate"]
    capsys.readouterr()
    assert run_recipe(recipe, work, stop_after="regenerate") is None
    assert ran == ["prepare", "regenerate"]
    assert "regenerate: done" in capsys.readouterr().out.split("stopped after regenerate")[0]
    assert list(json.loads((work / "recipe-state.json").read_text())["done"]) == ["prepare", "regenerate"]


def test_a_changed_finished_stage_is_refused_before_any_stage_runs(tmp_path, tiny_llama_dir, ran):
    """A finished online recipe flipped to offline: the plan gains a capture stage before the
    finished train stage it changes. The run is refused before capture runs (it used to run a
    whole capture, then stop), and the work folder is as it was."""
    online = _spec(_recipe(tmp_path, str(tiny_llama_dir), train=ONLINE), drop=("regenerate",))
    work = tmp_path / "work"
    run_recipe(online, work, stop_after="train")
    state = (work / "recipe-state.json").read_text()
    offline = _spec(online, train={**ONLINE, "online": False})
    with pytest.raises(EyasError, match=r"the train stage finished earlier as"):
        run_recipe(offline, work)
    assert ran == ["prepare", "train"] and not (work / "store").exists()
    assert (work / "recipe-state.json").read_text() == state


def test_a_folder_a_stage_of_the_recipe_wrote_stays_its_own(tmp_path, tiny_llama_dir, ran):
    """An offline recipe's store, finished or cut off, then the same recipe online (no capture
    stage): the store is the recipe's own, not a file it did not write, so the run goes on."""
    offline = _spec(_recipe(tmp_path, str(tiny_llama_dir), train={**ONLINE, "online": False}), drop=("regenerate",))
    online = _spec(offline, train=ONLINE)
    for work, cut_off in ((tmp_path / "finished", False), (tmp_path / "cut", True)):
        if cut_off:
            ran.failing.add("capture")
            with pytest.raises(RuntimeError, match="capture failed"):
                run_recipe(offline, work)
        else:
            run_recipe(offline, work, stop_after="capture")
        assert (work / "store").is_dir()
        ran.clear()
        assert run_recipe(online, work, stop_after="train") is None
        assert ran == ["train"] and (work / "store").is_dir()


def test_the_report_reads_only_the_planned_stages_outputs(tmp_path, tiny_llama_dir):
    """A DFlash recipe has no tree stage and (eval_fraction 0) no heldout one: a tree.json,
    its plot and a heldout.json left by an earlier EAGLE-3 plan stay out of its report."""
    from eyas.recipe.run import load_recipe, plan

    dflash = {**ONLINE, "drafter": "dflash", "block_size": 3, "draft_layers": 1}
    path = _recipe(tmp_path, str(tiny_llama_dir), train=dflash)
    recipe, work = load_recipe(path), tmp_path / "work"
    stages = [s for s in plan(recipe, work, str(path)) if s.command != "export"]  # export's needs a drafter
    assert [s.name for s in stages] == ["prepare", "regenerate", "train", "eval-chain"]
    ev = work / "eval"
    ev.mkdir(parents=True)
    row = {"tau": 2.0, "answers": 3}
    (ev / "chain.json").write_text(json.dumps({"summary": {"plain": {**row, "tau": 1.0}, "dflash": row},
                                               "tau_by": {"turn": {"dflash": {"1": 2.0, "2": 2.0}}}}))
    (ev / "tree.json").write_text(json.dumps({"summary": {"plain": row, "eagle3-tree": {**row, "tau": 4.0}},
                                              "tau_by": {"turn": {"eagle3-tree": {"1": 4.0, "2": 4.0}}}}))
    (ev / "heldout.json").write_text(json.dumps({"teacher_forced": {"samples": 1, "positions": 2,
                                                                    "acc_per_step": [0.5], "tau_sim": 1.5}}))
    (ev / "chain.png").write_bytes(b"png")
    (ev / "tree.png").write_bytes(b"png")
    text = write_report(recipe, work, stages, str(path)).read_text()
    data = json.loads((work / "report.json").read_text())
    assert set(data["summary"]) == {"plain", "dflash"} and data["tau_by"]["turn"] == {"dflash": {"1": 2.0, "2": 2.0}}
    assert data["heldout"] == {} and data["plots"] == [str(ev / "chain.png")]
    assert "eagle3-tree" not in text and "Held-out" not in text and "tree.png" not in text


def test_dry_run_shows_a_done_stage_whose_output_is_gone_as_redone(tmp_path, tiny_llama_dir, ran, capsys):
    """prepare done, WORK/prepared deleted: --dry-run used to fail opening it; it shows the
    stage as one the run does again (as the run does, with its note)."""
    recipe, work = _recipe(tmp_path, str(tiny_llama_dir), train=ONLINE), tmp_path / "work"
    run_recipe(recipe, work, stop_after="prepare")
    shutil.rmtree(work / "prepared")
    capsys.readouterr()
    assert run_recipe(recipe, work, dry_run=True) is None
    out = capsys.readouterr().out
    assert f" 1. prepare        to do again: it was done, but its output {work / 'prepared'} is gone\n" in out
    assert "<= 6 samples" in out  # bounds from the recipe, not the lost data
    assert ran == ["prepare"]


def test_dry_run_shows_the_stages_built_from_a_lost_output(tmp_path, tiny_llama_dir, ran, capsys):
    """prepare, regenerate and train done, WORK/prepared deleted: the two stages made from it used
    to show "done". The dry run says what the run does: stop while their outputs are kept, redo
    them once they are gone too."""
    recipe, work = _recipe(tmp_path, str(tiny_llama_dir), train=ONLINE), tmp_path / "work"
    run_recipe(recipe, work, stop_after="train")
    assert ran == ["prepare", "regenerate", "train"]
    shutil.rmtree(work / "prepared")
    capsys.readouterr()
    run_recipe(recipe, work, dry_run=True)
    out = capsys.readouterr().out
    for k, name, folder in ((2, "regenerate", "regen"), (3, "train", "drafter")):
        assert re.search(rf" {k}\. {name} +STOPS: made from the prepare stage's lost output; the run asks to remove "
                         + re.escape(str(work / folder)) + " first\n", out), out
    with pytest.raises(EyasError, match=r"rm -rf .*regen .*drafter"):  # as the run does
        run_recipe(recipe, work)
    shutil.rmtree(work / "regen")
    shutil.rmtree(work / "drafter")
    run_recipe(recipe, work, dry_run=True)
    out = capsys.readouterr().out
    for k, name, folder in ((2, "regenerate", "regen"), (3, "train", "drafter")):
        assert f" {k}. {name:<14} to do again: it was done, but its output {work / folder} is gone\n" in out
    assert " 4. " in out and "STOPS" not in out
    assert ran == ["prepare", "regenerate", "train"]
