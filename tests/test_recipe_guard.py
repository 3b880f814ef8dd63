"""`eyas recipe` keeps to its work folder and reads its inputs strictly (issue 39): a work
folder holding the user's files is refused with those files untouched, a second run on the
same folder is refused, a stage recorded as done whose output was deleted is redone (or one
line says what to delete first), and every malformed recipe is one line before any stage
runs, never the CLI's catch-all or a silent choice.

On a tiny random Llama; only the guards' own cost, a few stages at most."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import yaml

from eyas.cli import main
from eyas.errors import EyasError
from eyas.recipe import run_recipe
from test_adversarial import held, tree
from test_recipe import _recipe


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread):
    """Tiny models: see conftest's one_thread."""


def test_a_work_folder_holding_the_users_files_is_refused_and_left_as_it_was(tmp_path, tiny_llama_dir):
    """--work is the folder of the user's data and their own report.md / report.json: refused
    before any stage, dry run included, every file as it was (it used to overwrite both)."""
    work = tmp_path / "project"
    work.mkdir()
    data = work / "conversations.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                             {"role": "assistant", "content": "hello"}]}) + "\n")
    (work / "report.md").write_text("# my notes\n")
    (work / "report.json").write_text("{}\n")
    recipe = _recipe(tmp_path, str(tiny_llama_dir), prepare={"data": str(data), "max_len": 64})
    before = tree(tmp_path)
    for dry_run in (True, False):
        with pytest.raises(EyasError, match=r"the work folder .*project holds files the recipe did not write "
                                            r"\(conversations.jsonl, report.json, report.md\)"):
            run_recipe(recipe, work, dry_run=dry_run)
    assert tree(tmp_path) == before


def test_a_second_run_on_the_same_work_folder_is_refused(tmp_path, tiny_llama_dir):
    recipe = _recipe(tmp_path, str(tiny_llama_dir))
    proc = held(tmp_path / "work", "recipe")
    try:
        with pytest.raises(EyasError, match=r"work is in use by eyas recipe"):
            run_recipe(recipe, tmp_path / "work")
        assert [p.name for p in (tmp_path / "work").iterdir()] == [".eyas-lock"]  # the refused run wrote nothing
    finally:
        proc.stdin.write("\n")
        proc.stdin.flush()
        proc.wait()


def test_a_done_stage_whose_output_was_deleted_is_redone_or_named(tmp_path, tiny_llama_dir, capsys):
    """prepare and regenerate done; prepared/ deleted: regenerate was made from it, so one line
    says what to delete; once regen/ is gone too, both run again to the same outputs. A lost
    output nothing was made from (regen/ alone) is simply redone, with a note."""
    recipe = _recipe(tmp_path, str(tiny_llama_dir))
    work = tmp_path / "work"
    run_recipe(recipe, work, stop_after="regenerate")
    samples = (work / "regen" / "samples.safetensors").read_bytes()
    state = json.loads((work / "recipe-state.json").read_text())
    shutil.rmtree(work / "prepared")
    with pytest.raises(EyasError, match=rf"the prepare stage is recorded as done, but its output {work}/prepared is "
                                        rf"gone, and regenerate was made from it. To redo them: rm -rf {work}/regen "
                                        r"and run the recipe again."):
        run_recipe(recipe, work, stop_after="regenerate")
    assert (work / "regen" / "samples.safetensors").read_bytes() == samples  # refused: nothing touched
    for lost, note in (("regen", f"the prepare stage was done, but its output {work}/prepared is gone: it runs again, "
                                 f"with regenerate."),
                       ("regen", f"the regenerate stage was done, but its output {work}/regen is gone: it runs again.")):
        shutil.rmtree(work / lost)
        capsys.readouterr()
        run_recipe(recipe, work, stop_after="regenerate")
        assert f"note: {note}\n" in capsys.readouterr().out
        assert (work / "regen" / "samples.safetensors").read_bytes() == samples
        assert json.loads((work / "recipe-state.json").read_text()) == state


BAD = {  # recipe text -> the one line (after "eyas recipe: error: ")
    "work: 123\n": r"`work` names a folder \(a text\), not 123",
    "work: [a, b]\n": r"`work` names a folder \(a text\), not \['a', 'b'\]",
    "train: {nproc_per_node: two}\n": r"`train: nproc_per_node` must be an integer >= 1 \(got 'two'\)",
    "train: {nproc_per_node: [2]}\n": r"`train: nproc_per_node` must be an integer >= 1 \(got \[2\]\)",
    "train: {nproc_per_node: 0}\n": r"`train: nproc_per_node` must be an integer >= 1 \(got 0\)",
    "train: {nproc_per_node: -3}\n": r"`train: nproc_per_node` must be an integer >= 1 \(got -3\)",
    "train: {steps: 2, steps: 500}\n": r"is not valid YAML, line \d+ column \d+: the key 'steps' is given twice",
    "# caf\xe9\n": r"is not UTF-8 text \(byte 0xe9 at offset \d+\); save it as UTF-8",
}


@pytest.mark.parametrize("extra", list(BAD))
def test_a_malformed_recipe_is_one_line_before_any_stage(tmp_path, capsys, extra):
    path = tmp_path / "r.yaml"
    path.write_bytes(b"model: m\nprepare: {data: packaged:chitchat}\n" + extra.encode("latin-1"))
    before = tree(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        main(["recipe", str(path), "--work", str(tmp_path / "w")])
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("eyas recipe: error: ") and re.search(BAD[extra], err), err
    assert tree(tmp_path) == before


def test_a_cut_off_state_file_and_a_recipe_without_suffix_are_one_line(tmp_path, capsys):
    path = tmp_path / "recipe"  # no suffix, no `work`: its default work folder would be the file itself
    path.write_text(yaml.safe_dump({"model": "m", "prepare": {"data": "packaged:chitchat"}}))
    work = tmp_path / "w"
    work.mkdir()
    (work / "recipe-state.json").write_text('{"done": {"prep')
    for argv, line in ((["recipe", str(path), "--dry-run"], r"the work folder would be the recipe file .*recipe itself"),
                       (["recipe", str(path), "--work", str(work)], r"recipe-state.json is damaged .* Restore it, or "
                                                                    r"delete it to run every stage again")):
        before = tree(tmp_path)
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        err = capsys.readouterr().err.strip()
        assert exit_.value.code == 2 and len(err.splitlines()) == 1 and re.search(line, err), err
        assert tree(tmp_path) == before
