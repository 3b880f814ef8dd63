"""`eyas recipe`: the packaged SmolLM2 goes through every stage to a report on a tiny budget;
a run failing in the middle of each stage in turn, re-run with the same command each time,
ends with what an uninterrupted run makes; finished stages are never silently redone;
--stop-after ends a run after the stage it names."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from eyas.data.prepared import PreparedData
from eyas.errors import EyasError
from eyas.recipe import run_recipe
from eyas.vllm.serve import serve_launcher
from faults import killed


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread):
    """Tiny models: see conftest's one_thread."""


def _recipe(tmp_path: Path, model: str, name: str = "r.yaml", **changes) -> Path:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"turns": ["Name a colour.", "And another?"], "category": "writing"}) + "\n"
                       + json.dumps({"prompt": "What is two plus two?", "category": "math"}) + "\n")
    recipe = {
        "model": model,
        "prepare": {"data": ["packaged:chitchat@1", "packaged:synthetic:50:0@1"], "window": 2, "max_len": 96,
                    "limit": 6, "workers": 1},
        "regenerate": {"max_new_tokens": 6, "group_size": 3},
        "train": {"online": True, "steps": 3, "batch_tokens": 256, "ttt_steps": 2, "draft_vocab": 512,
                  "eval_fraction": 0.34, "save_every": 1, "lr": 0.001, "progress": False},
        "eval": {"prompts": str(prompts), "max_new_tokens": 6, "steps": 2},
        "export": {"to": ["vllm"]},
        **changes,
    }
    path = tmp_path / name
    path.write_text(yaml.safe_dump(recipe))
    return path


def test_smollm2_recipe_runs_every_stage_to_a_report(smollm2_dir, tmp_path, capsys):
    recipe = _recipe(tmp_path, "packaged:smollm2-135m")
    report = run_recipe(recipe, tmp_path / "work")
    text = report.read_text()
    data = json.loads((tmp_path / "work" / "report.json").read_text())
    assert len(data["heldout"]["acc_per_step"]) == 2 and data["heldout"]["samples"] >= 1
    assert {"plain", "prompt-lookup", "eagle3-chain", "eagle3-tree"} <= set(data["summary"])
    assert set(data["tau_by"]["category"]["eagle3-tree"]) == {"writing", "math"}
    assert shlex.join(serve_launcher("")[:-1]) in data["exports"]["vllm"]["serve"] and (tmp_path / "work/export/vllm/config.json").is_file()
    assert "Held-out accuracy per TTT step" in text and "tau by category" in text and ".png" in text
    # The real SmolLM2 decodes greedily: every method's answers are plain decoding's, and the report says so.
    answers = data["summary"]["plain"]["answers"]
    assert answers == 3 and all(data["summary"][m]["identical"] == answers for m in ("prompt-lookup", "eagle3-chain",
                                                                                     "eagle3-tree"))
    assert f"| eagle3-tree | {data['summary']['eagle3-tree']['tau']:.2f} | " in text and f"| {answers}/{answers} |" in text
    capsys.readouterr()
    run_recipe(recipe, tmp_path / "work", dry_run=True)  # everything done, nothing runs
    assert capsys.readouterr().out.count(" done\n") == 7


def test_failing_in_each_stage_then_rerunning_ends_as_an_uninterrupted_run(tiny_llama_dir, tmp_path, monkeypatch):
    """The same recipe (a tiny random Llama) uninterrupted, and interrupted in the middle of
    each stage in turn (an injected failure on a later call of the stage's inner loop), then
    re-run until done: the same prepared and regenerated data, drafter weights, held-out and
    eval results, and exported weights."""
    import eyas.data.prepare as prep
    import eyas.evaluate.run as ev
    import eyas.export.exporter as ex
    import eyas.regenerate.run as regen
    import eyas.train.loop as loop

    recipe = _recipe(tmp_path, str(tiny_llama_dir))
    clean = run_recipe(recipe, tmp_path / "clean").parent

    def fail_on(module, name: str, call: int) -> None:
        real, calls = getattr(module, name), [0]

        def failing(*args, **kwargs):
            calls[0] += 1
            if calls[0] == call:
                monkeypatch.setattr(module, name, real)
                raise RuntimeError(f"injected failure in {name}")
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, failing)

    work = tmp_path / "broken"
    # Each stage in turn fails after some of its work is done (train after 2 of 3 steps, with a
    # checkpoint at step 1; regenerate after its first group; eval on its second prompt).
    for module, name, call in ((prep, "write_prepared", 1), (regen, "regenerate_group", 2), (loop, "train_step", 3),
                               (loop, "score", 1), (ev, "run_prompt", 4), (ev, "run_prompt", 4), (ex, "export_drafter", 1)):
        fail_on(module, name, call)
        with pytest.raises(RuntimeError, match="injected"):
            run_recipe(recipe, work)
    report = run_recipe(recipe, work)
    assert report == work / "report.md"

    a, b = PreparedData(clean / "regen"), PreparedData(work / "regen")
    assert a.meta["fingerprint"] == b.meta["fingerprint"] and a.conversations() == b.conversations()
    assert PreparedData(clean / "prepared").meta["fingerprint"] == PreparedData(work / "prepared").meta["fingerprint"]
    for weights in ("drafter/model.safetensors", "export/vllm/model.safetensors"):
        x, y = load_file(clean / weights), load_file(work / weights)
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x), weights
    for result in ("chain", "tree"):
        x, y = (json.loads((w / "eval" / f"{result}.json").read_text())["records"] for w in (clean, work))
        assert [r["generated_ids"] for r in x] == [r["generated_ids"] for r in y]
        assert [r["accept_counts"] for r in x] == [r["accept_counts"] for r in y]
    x, y = (json.loads((w / "eval/heldout.json").read_text())["teacher_forced"] for w in (clean, work))
    assert x["acc_per_step"] == y["acc_per_step"] and x["positions"] == y["positions"]

    # A finished stage whose options change is refused, not redone.
    changed = _recipe(tmp_path, str(tiny_llama_dir), name="changed.yaml",
                      regenerate={"max_new_tokens": 7, "group_size": 3})
    with pytest.raises(EyasError, match="regenerate stage finished earlier"):
        run_recipe(changed, work)

    # --stop-after ends the run once that stage is done; the state holds only the stages run.
    assert run_recipe(recipe, tmp_path / "part", stop_after="prepare") is None
    assert list(json.loads((tmp_path / "part/recipe-state.json").read_text())["done"]) == ["prepare"]
    with pytest.raises(EyasError, match="this recipe's stages are prepare, regenerate, train, heldout"):
        run_recipe(recipe, tmp_path / "part", stop_after="nothing")


def test_recipe_killed_in_training_resumes_to_an_uninterrupted_runs_drafter(tiny_llama_dir, tmp_path):
    """A real SIGKILL: `eyas recipe` in its own process, killed inside the write of training's
    top-level drafter after its first checkpoint (at the rename, tests/faults.py: the moment
    a timed kill hit on a loaded machine), then the same command again: the half-written file
    is cleared, and the drafter and its export equal those of an uninterrupted run."""
    train = {"online": True, "steps": 6, "batch_tokens": 256, "ttt_steps": 2, "draft_vocab": 512,
             "eval_fraction": 0.34, "save_every": 1, "lr": 0.001, "progress": False}
    recipe = _recipe(tmp_path, str(tiny_llama_dir), train=train, eval={"prompts": str(tmp_path / "prompts.jsonl"),
                                                                       "max_new_tokens": 4, "steps": 2})
    clean = run_recipe(recipe, tmp_path / "clean").parent
    work = tmp_path / "killed"
    killed(["recipe", recipe, "--work", work], match=r"killed/drafter/model\.safetensors$")
    assert [p.name.startswith(".model.safetensors.") for p in (work / "drafter").glob(".*.tmp")] == [True]
    assert (work / "drafter" / "checkpoints" / "latest").is_file() and not (work / "report.md").exists()
    run_recipe(recipe, work)
    assert not list((work / "drafter").glob(".*.tmp"))
    for weights in ("drafter/model.safetensors", "export/vllm/model.safetensors"):
        x, y = load_file(clean / weights), load_file(work / weights)
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x), weights


@pytest.mark.parametrize("name", ["smollm2-1gpu", "kimi-k2.5-8gpu"])
def test_dry_run_plans_the_shipped_gpu_recipes_without_a_gpu(name, tmp_path, capsys):
    """--dry-run checks every stage's options and prints its command, status and estimate; it
    needs no GPU and no model (Kimi-K2.5's folder does not exist here), and writes nothing."""
    recipe = Path(__file__).parents[1] / "recipes" / f"{name}.yaml"
    assert run_recipe(recipe, tmp_path / "work", dry_run=True) is None
    out = capsys.readouterr().out
    assert not (tmp_path / "work").exists()
    names = [line.split()[1] for line in out.splitlines() if line[:3].strip().rstrip(".").isdigit()]
    if name == "smollm2-1gpu":
        assert names == ["prepare", "regenerate", "train", "heldout", "eval-chain", "eval-tree", "export-vllm",
                         "export-speculators"]
        assert "<= 40,960 samples" in out and "<= 7 min" in out and "7.5 min (the schedule is sized to it)" in out
    else:
        assert names == ["prepare", "regenerate", "capture", "train", "heldout", "export-vllm"]
        assert "torchrun --nproc-per-node 8 -m eyas train" in out and "fp8 store: 4 states" in out
        assert f"--teacher-forced {tmp_path / 'work' / 'store'} --held-out" in out  # scored without the target
    assert out.count(" to do\n") == len(names)


def test_a_dflash_recipe_drafts_no_tree_and_refuses_other_formats_before_any_work(tiny_llama_dir, tmp_path, capsys):
    """`train: drafter: dflash`: the plan has no tree stage (a DFlash drafter drafts one block,
    which `eyas eval --tree` refuses) and refuses an export format other than vLLM's before
    anything runs, not after the GPU work; its stages run, DFlash decoded in the chain stage."""
    dflash = {"online": True, "steps": 3, "batch_tokens": 256, "drafter": "dflash", "block_size": 3, "draft_layers": 1,
              "draft_vocab": 512, "eval_fraction": 0.34, "lr": 0.001, "progress": False}
    bad = _recipe(tmp_path, str(tiny_llama_dir), name="bad.yaml", train=dflash, export={"to": ["vllm", "speculators"]})
    with pytest.raises(EyasError, match=r"bad.yaml: `export: to` speculators: A DFlash drafter exports only --to vllm"):
        run_recipe(bad, tmp_path / "bad")
    assert not (tmp_path / "bad").exists()
    work, recipe = tmp_path / "work", _recipe(tmp_path, str(tiny_llama_dir), train=dflash)
    run_recipe(recipe, work, stop_after="eval-chain")  # the DFlash export's serving is test_export_vllm_dflash's
    chain = json.loads((work / "eval" / "chain.json").read_text())["summary"]
    assert set(chain) == {"plain", "prompt-lookup", "dflash"} and chain["dflash"]["answers"] == 3
    assert len(json.loads((work / "eval" / "heldout.json").read_text())["teacher_forced"]["acc_per_step"]) == 2
    assert json.loads((work / "drafter" / "config.json").read_text())["eyas"]["drafter"] == "dflash"
    capsys.readouterr()
    run_recipe(recipe, work, dry_run=True)
    out = capsys.readouterr().out
    names = [line.split()[1] for line in out.splitlines() if line[:3].strip().rstrip(".").isdigit()]
    assert names == ["prepare", "regenerate", "train", "heldout", "eval-chain", "export-vllm"]
    assert out.count(" done\n") == 5 and out.count(" to do\n") == 1


def test_offline_recipe_scores_held_out_samples_from_the_store(tiny_llama_dir, tmp_path, capsys):
    """A recipe training from a store (as the Kimi-K2.5 one does) and without `eval` still gets
    held-out accuracy per TTT step in its report, read from the store; once data and store
    exist, --dry-run gives the store's size from the measured tokens."""
    recipe = _recipe(tmp_path, str(tiny_llama_dir), capture={"dtype": "fp8"},
                     train={"steps": 2, "batch_tokens": 256, "ttt_steps": 2, "draft_vocab": 512,
                            "eval_fraction": 0.34, "progress": False})
    spec = yaml.safe_load(recipe.read_text())
    del spec["eval"]
    recipe.write_text(yaml.safe_dump(spec))
    work = tmp_path / "work"
    run_recipe(recipe, work)
    data = json.loads((work / "report.json").read_text())
    assert len(data["heldout"]["acc_per_step"]) == 2 and data["heldout"]["samples"] >= 1 and not data["summary"]
    capsys.readouterr()
    run_recipe(recipe, work, dry_run=True)
    out = capsys.readouterr().out
    regen = PreparedData(work / "regen")
    hidden = regen.identity.hidden_size
    per_token = 4 * hidden + 4 * 4 + 5
    assert out.count(" done\n") == 6 and f"{len(regen):,} samples, {int(regen.offsets[-1]):,} tokens" in out
    assert f"fp8 store: {per_token:,} B per token" in out


BASE = {"model": "packaged:smollm2-135m", "prepare": {"data": "packaged:chitchat"}, "regenerate": {},
        "train": {"steps": 1}, "eval": {}}


@pytest.mark.parametrize("stage,options,message", [
    ("capture", {"backend": "nonsense"}, r"`capture`: --backend must be one of hf, vllm \(got 'nonsense'\)"),
    ("capture", {"backend": "vllm", "endpoint": "http://gpu:8000"}, r"the capture stage: --endpoint needs --spool"),
    ("regenerate", {"backend": "tpu"}, r"`regenerate`: --backend must be one of hf, vllm"),
    ("prepare", {"window": 0}, r"`prepare`: --window must be an integer >= 1"),
    ("train", {"steps": 3, "epochs": 1}, r"the train stage: give --steps or --epochs, not both"),
    ("eval", {"held_out": True}, r"`eval: held_out` is set by the recipe itself"),
    ("export", {"num_speculative_tokens": 0}, r"`export`: --num-speculative-tokens must be an integer >= 1"),
])
def test_an_invalid_stage_option_is_refused_before_the_first_stage_runs(tmp_path, stage, options, message):
    """Each stage's config is built, with every rule its command applies, before any stage
    runs: a recipe whose capture (the fourth stage) would be refused writes nothing."""
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({**BASE, stage: {**BASE.get(stage, {}), **options}}))
    with pytest.raises(EyasError, match=message):
        run_recipe(path, tmp_path / "work")
    assert not (tmp_path / "work").exists()


def test_each_recorded_command_line_makes_the_config_the_recipe_runs(tmp_path):
    """The line a stage records (and, for train under torchrun, launches) is derived from its
    options, not parsed from them: run by `eyas`, it builds the very config the recipe runs."""
    from eyas.cli import build_parser
    from eyas.options import from_args
    from eyas.recipe.run import load_recipe, plan

    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({**BASE, "capture": {"layers": "2,5", "engine_arg": ["max_model_len=512"]},
                                    "train": {"steps": 2, "nproc_per_node": 2, "progress": False, "lr": 0.001},
                                    "eval": {"baseline": "prompt-lookup", "steps": 2},
                                    "export": {"to": ["vllm", "speculators"]}}))
    stages = plan(load_recipe(path), tmp_path / "work", str(path))
    assert [s.name for s in stages] == ["prepare", "regenerate", "capture", "train", "heldout", "eval-chain",
                                        "eval-tree", "export-vllm", "export-speculators"]
    for stage in stages:
        argv = shlex.split(stage.line)
        args = build_parser().parse_args(argv[argv.index("eyas") + 1:])
        assert from_args(args._config, args) == stage.config(str(path)), stage.name
    assert stages[3].line.startswith("torchrun --nproc-per-node 2 -m eyas train --store ")
