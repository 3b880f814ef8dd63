"""`eyas recipe RECIPE.yaml`: the whole pipeline from one file, resumable stage by stage.

A recipe names the target, a work folder and, per stage, that stage command's own options
(YAML keys are the long option names, `max_len` or `max-len`). The recipe fills in what
links the stages (--model, --data, --out, --store, --draft...). Stages, in order:

  prepare     WORK/prepared            conversations -> samples
  regenerate  WORK/regen               the target's own answers (only with a `regenerate` key)
  capture     WORK/store               hidden states (only when `train` is not `online: true`)
  train       WORK/drafter             online, or offline from the store (under torchrun with
                                       `train: nproc_per_node: N`)
  onpolicy    WORK/onpolicy            on-policy distillation (only with an `onpolicy` key): training
                                       goes on from WORK/drafter on the same data, scoring only what
                                       greedy decoding with the drafter reaches (--position-weights
                                       on-policy); its keys override train's (minutes, lr...), and
                                       the stages after it take its drafter
  heldout     WORK/eval/heldout.json   teacher-forced accuracy per TTT step on the held-out samples
                                       (offline: from the store, without loading the target)
  eval-chain  WORK/eval/chain.json     MT-bench (or `eval: prompts`), chain, against prompt lookup
  eval-tree   WORK/eval/tree.json      the same prompts, dynamic tree (the eval stages run only
                                       with an `eval` key: they load the target in transformers;
                                       a DFlash or P-EAGLE drafter drafts no tree, so has none)
  export      WORK/export/FORMAT       one folder per `export: to` format, with its serve command
  report      WORK/report.md

Each stage's output folder is its checkpoint: WORK/recipe-state.json records the stages that
finished and the exact command each ran (and the folders its stages wrote, which stay the
recipe's own when its plan changes). A finished stage is skipped; an unfinished one runs
again and continues where its own output allows (regenerate and capture keep what they
wrote, train resumes from its last checkpoint); a finished stage whose options changed is an
error, never silently redone, and is found before any stage runs.
"""

from __future__ import annotations

import importlib
import json
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping

import yaml

from eyas.cli import SUBCOMMANDS
from eyas.draft import kinds
from eyas.errors import EyasError
from eyas.options import argv_of, check_mapping, from_mapping, snake_keys
from eyas.lock import LOCK_FILE, output_lock
from eyas.paths import atomic_write_json, is_leftover, remove_leftovers
from eyas.recipe.estimate import describe
from eyas.recipe.report import REPORTS, write_report
from eyas.validate import COUNT

STATE = "recipe-state.json"
STAGE_KEYS = ("prepare", "regenerate", "capture", "train", "onpolicy", "eval", "export")
STAGE_COMMAND = {"onpolicy": "train"}  # a recipe key whose stage runs another key's command
SCHEDULE = ("minutes", "steps", "epochs")  # train's keys the onpolicy stage does not inherit


@dataclass(frozen=True)
class Stage:
    name: str  # recipe-state key
    command: str  # the eyas subcommand
    options: dict[str, Any]  # its config's options, keyed as in a recipe: those linking the stages, then the user's
    output: Path  # the stage's checkpoint: its output folder or file
    processes: int = 1  # > 1: run under torchrun with this many processes
    linked: frozenset[str] = frozenset()  # the options the recipe sets itself (they link the stages)

    @property
    def argv(self) -> list[str]:
        """Its options as on the command line (derived from them, never parsed back)."""
        return argv_of(_config_class(self.command), self.options)

    def config(self, where: str) -> Any:
        """The stage's typed config: every rule its command applies, checked before any stage runs."""
        cls = _config_class(self.command)
        check_mapping(cls, self.options, f"{where}: `{self.command}`")  # the linked values too (`train: online`)
        try:
            return from_mapping(cls, self.options, where)
        except EyasError as e:
            raise EyasError(f"{where}: the {self.name} stage: {e}") from None

    @property
    def line(self) -> str:
        launch = f"torchrun --nproc-per-node {self.processes} -m eyas" if self.processes > 1 else "eyas"
        return launch + " " + " ".join(shlex.quote(a) for a in [self.command, *self.argv])


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping: PyYAML would keep the
    last silently (`{steps: 2, steps: 500}` trains 500 steps)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, (str, int, float, bool)):  # hashable scalars; YAML also allows others
                if key in seen:
                    raise yaml.constructor.ConstructorError(None, None, f"the key {key!r} is given twice",
                                                            key_node.start_mark)
                seen.add(key)
        return super().construct_mapping(node, deep)


def load_recipe(path: str | Path) -> dict[str, Any]:
    try:
        text = Path(path).read_bytes().decode("utf-8")
    except OSError as e:
        raise EyasError(f"Cannot read the recipe {path}: {e.strerror}.") from None
    except UnicodeDecodeError as e:
        raise EyasError(f"{path} is not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start}); save it as "
                        f"UTF-8.") from None
    try:
        recipe = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f", line {mark.line + 1} column {mark.column + 1}" if mark is not None else ""
        why = getattr(e, "problem", None) or (str(e).splitlines() or ["?"])[0]
        raise EyasError(f"{path} is not valid YAML{where}: {why}.") from None
    if not isinstance(recipe, dict) or not isinstance(recipe.get("model"), str):
        raise EyasError(f"{path}: a recipe is a mapping with at least `model: TARGET` and `prepare: {{data: ...}}`.")
    unknown = set(recipe) - {"model", "work", *STAGE_KEYS}
    if unknown:
        raise EyasError(f"{path}: unknown key(s) {sorted(map(str, unknown))}; a recipe has model, work and the stages "
                        f"{', '.join(STAGE_KEYS)}.")
    if "work" in recipe and (not isinstance(recipe["work"], str) or not recipe["work"].strip()):
        raise EyasError(f"{path}: `work` names a folder (a text), not {recipe['work']!r}.")
    for key in STAGE_KEYS:
        if not isinstance(recipe.get(key) or {}, dict):
            raise EyasError(f"{path}: `{key}` holds that stage's options as a mapping (option: value).")
    if not (recipe.get("prepare") or {}).get("data"):
        raise EyasError(f"{path}: `prepare: data:` names the conversations (a file, a folder or packaged:...).")
    return recipe


def work_folder(path: str | Path, recipe: dict[str, Any], work: str | Path | None) -> Path:
    """--work, else the recipe's `work`, else the recipe's path without its suffix; never the
    recipe file itself (a recipe named without a suffix)."""
    folder = Path(work or recipe.get("work") or Path(path).with_suffix(""))
    if folder.exists() and folder.resolve() == Path(path).resolve():
        raise EyasError(f"the work folder would be the recipe file {path} itself (its name has no suffix to drop); "
                        f"give one with `work:` in the recipe or --work.")
    return folder


def _config_class(command: str) -> type:
    """The typed config of `eyas command` (eyas.options), whose options a recipe stage may set."""
    return importlib.import_module(SUBCOMMANDS[command]).CONFIG


def check_stage_options(stage: str, options: Mapping[str, Any], where: str,
                        linked: frozenset[str] = frozenset()) -> None:
    """Before any stage runs: each key names an option of the stage's command (by its flag's
    name), with a value it takes, and none is one of the `linked` options the recipe sets
    itself; else one line naming the stage (its recipe key) and the key."""
    for key in options:
        if str(key).replace("-", "_") in linked:
            raise EyasError(f"{where}: `{stage}: {key}` is set by the recipe itself (it links the stages).")
    check_mapping(_config_class(STAGE_COMMAND.get(stage, stage)), options, f"{where}: `{stage}`", flags_only=True)


def _stage(name: str, command: str, output: Path, where: str, head: Mapping[str, Any],
           user: Mapping[str, Any] = {}, tail: Mapping[str, Any] = {}, processes: int = 1) -> Stage:
    """A stage whose options are the linking ones (`head` and `tail`, which the recipe alone
    sets) around the user's, checked as a whole config (`Stage.config`)."""
    linked = frozenset(str(k) for k in [*head, *tail])
    check_stage_options(name if STAGE_COMMAND.get(name) == command else command, user, where, linked)
    stage = Stage(name, command, {**head, **user, **tail}, output, processes, linked)
    stage.config(where)
    return stage


def plan(recipe: dict[str, Any], work: Path, where: str) -> list[Stage]:
    """The stages this recipe runs, each with its options checked as its command's config."""
    model = recipe["model"]
    opts = {k: dict(recipe.get(k) or {}) for k in STAGE_KEYS}
    prepared = work / "prepared"
    stages = [_stage("prepare", "prepare", prepared, where, {"model": model, "out": str(prepared)}, opts["prepare"])]
    data = prepared
    if "regenerate" in recipe:
        data = work / "regen"
        stages.append(_stage("regenerate", "regenerate", data, where,
                             {"model": model, "data": str(prepared), "out": str(data)}, opts["regenerate"]))
    drafter = work / "drafter"
    train = opts["train"]
    online, processes = train.pop("online", False), train.pop("nproc_per_node", 1)  # read by the recipe itself
    COUNT.check(f"{where}: `train: nproc_per_node`", processes)
    check_stage_options("train", train, where)  # before the kind is read from it
    kind = kinds.get(train.get("drafter", kinds.DEFAULT))  # its record says if it drafts trees, which layouts it has
    store = work / "store"
    if online and opts["capture"]:
        layers = snake_keys(opts["capture"]).get("layers")
        raise EyasError(f"{where}: `capture` has no stage with `train: online: true` (training captures the target's "
                        f"states itself as it runs): remove `capture`"
                        + (f" and give its layers as `train: layers: {layers}`" if layers is not None else "")
                        + ", or train offline without `online: true`.")
    if not online:
        stages.append(_stage("capture", "capture", store, where, {"model": model, "data": str(data), "out": str(store)},
                             opts["capture"]))
    source = {"online": online, "store": None if online else str(store), "model": model,
              "data": str(data) if online else None}
    stages.append(_stage("train", "train", drafter, where, {**source, "out": str(drafter)}, train, {"resume": False},
                         processes=processes))
    if "onpolicy" in recipe:
        # The same data, split and settings as train's (not its length: minutes, steps or epochs are
        # the stage's own), from train's drafter.
        check_stage_options("onpolicy", opts["onpolicy"], where, frozenset({"online", "nproc_per_node"}))
        inherited = {k: v for k, v in snake_keys(train).items() if k not in SCHEDULE}
        onpolicy = work / "onpolicy"
        stages.append(_stage("onpolicy", "train", onpolicy, where, {**source, "out": str(onpolicy)},
                             {**inherited, **snake_keys(opts["onpolicy"])},
                             {"init": str(drafter), "position_weights": "on-policy", "resume": False},
                             processes=processes))
        drafter = onpolicy
    ev = work / "eval"
    # Held-out accuracy (when training holds samples out) needs no eval key: offline it reads the store (the
    # target is not loaded), online it runs the target as training did.
    device = opts["eval"].get("device", train.get("device"))
    if stages[-1].config(where).eval_fraction > 0:
        stages.append(_stage("heldout", "eval", ev / "heldout.json", where, {
            "model": model, "draft": str(drafter), "teacher_forced": str(data if online else store), "held_out": True,
            "output": str(ev / "heldout.json"), **({"device": str(device)} if device else {})}))
    if "eval" in recipe:
        stages += _eval_stages(model, drafter, ev, opts["eval"], where, tree=kind.drafts_trees)
    export = opts["export"]
    formats = export.pop("to", ["vllm"])
    for fmt in [formats] if isinstance(formats, str) else formats:
        check_stage_options("export", {"to": fmt}, where)
        try:
            kind.check_format(fmt)
        except EyasError as e:
            raise EyasError(f"{where}: `export: to` {fmt}: {e}") from None
        out = work / "export" / fmt
        stages.append(_stage(f"export-{fmt}", "export", out, where,
                             {"ckpt": str(drafter), "to": fmt, "out": str(out), "force": True}, export,
                             {"serve_command": False}))
    return stages


def _eval_stages(model: str, drafter: Path, ev: Path, options: dict[str, Any], where: str,
                 tree: bool) -> list[Stage]:
    """The chain against prompt lookup, then (`tree`: the drafter's kind drafts trees) the tree."""
    head = {"model": model, "draft": str(drafter)}

    def tail(name: str, tree: bool) -> dict[str, Any]:
        return {"tree": tree, "teacher_forced": None, "held_out": False, "plot": None, "output": str(ev / name)}

    stages = [_stage("eval-chain", "eval", ev / "chain.json", where, head, options, tail("chain.json", False))]
    if tree:
        stages.append(_stage("eval-tree", "eval", ev / "tree.json", where, head, {**options, "baseline": "none"},
                             tail("tree.json", True)))
    return stages


class State:
    """WORK/recipe-state.json: the finished stages and the command each ran, and the folders
    of WORK its stages wrote (a plan that no longer has a stage still owns what it wrote)."""

    def __init__(self, work: Path):
        self.path = work / STATE
        self.done: dict[str, str] = {}
        self.wrote: set[str] = set()
        if self.path.is_file():
            self.done, self.wrote = self._read()

    def _read(self) -> tuple[dict[str, str], set[str]]:
        try:
            state = json.loads(self.path.read_bytes())
            done, wrote = state["done"], state.get("wrote", [])  # files of earlier versions have no `wrote`
            if (isinstance(done, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in done.items())
                    and isinstance(wrote, list) and all(isinstance(n, str) for n in wrote)):
                return done, set(wrote)
        except (OSError, ValueError, KeyError, TypeError):
            pass
        raise EyasError(f"{self.path} is damaged (eyas writes it whole, so it was changed since): it records which "
                        f"stages finished. Restore it, or delete it to run every stage again (each continues from "
                        f"what its output folder holds).")

    def check(self, stage: Stage) -> bool:
        """True if `stage` finished with this very command; an error if with another."""
        if stage.name not in self.done:
            return False
        if self.done[stage.name] != stage.line:
            raise EyasError(f"the {stage.name} stage finished earlier as\n  {self.done[stage.name]}\nbut the recipe now "
                            f"asks\n  {stage.line}\nRestore the recipe, or delete {stage.output} and the "
                            f"{stage.name!r} entry of {self.path} (and the stages after it) to redo it.")
        return True

    def lost(self, stage: Stage) -> bool:
        """True if `stage` is recorded as done but its output is gone."""
        return stage.name in self.done and not stage.output.exists()

    def start(self, stage: Stage) -> None:
        """Record the folder of WORK that `stage` writes into, before it writes anything."""
        folder = stage.output.relative_to(self.path.parent).parts[0]
        if folder not in self.wrote:
            self.wrote.add(folder)
            self._write()

    def finish(self, stage: Stage) -> None:
        self.done[stage.name] = stage.line
        self._write()

    def forget(self, stages: list[Stage]) -> None:
        for stage in stages:
            self.done.pop(stage.name, None)
        self._write()

    def _write(self) -> None:
        atomic_write_json(self.path, {"done": self.done, "wrote": sorted(self.wrote)})


def built_from(stages: list[Stage], k: int) -> list[Stage]:
    """The stages after `stages[k]` that read its output, directly or through another one
    (a stage's command names the outputs it reads)."""
    read, found = {str(stages[k].output)}, []
    for stage in stages[k + 1:]:
        if read & set(stage.argv):
            found.append(stage)
            read.add(str(stage.output))
    return found


def built_from_lost(stages: list[Stage], state: State) -> dict[str, str]:
    """Each stage built (directly or not) from a stage recorded as done whose output is gone ->
    that lost stage's name: the run redoes it, or stops while its output is kept."""
    return {later.name: stage.name for k, stage in enumerate(stages)
            if state.lost(stage) for later in built_from(stages, k)}


def redo_lost(stages: list[Stage], state: State) -> None:
    """A stage recorded as done whose output is gone runs again, with the stages built from
    it, when none of their outputs is left; if one is, one line says what to delete first
    (they were made from the lost output, so keeping them would mix two runs)."""
    for k, stage in enumerate(stages):
        if not state.lost(stage):
            continue
        after = built_from(stages, k)
        if kept := [s for s in after if s.output.exists()]:
            raise EyasError(f"the {stage.name} stage is recorded as done, but its output {stage.output} is gone, and "
                            f"{', '.join(s.name for s in kept)} {'was' if len(kept) == 1 else 'were'} made from it. "
                            f"To redo them: rm -rf {' '.join(shlex.quote(str(s.output)) for s in kept)} and run the "
                            f"recipe again.")
        again = [s for s in after if s.name in state.done]
        print(f"note: the {stage.name} stage was done, but its output {stage.output} is gone: it runs again"
              + (f", with {', '.join(s.name for s in again)}" if again else "") + ".", flush=True)
        state.forget([stage, *again])


def check_work_folder(work: Path, stages: list[Stage], state: State, clean: bool) -> None:
    """WORK holds nothing but what the recipe writes (its stages' outputs, those its state says
    earlier stages wrote, its state, and once that exists its report), as every stage's own
    output folder does: a file it did not write is refused before anything runs, never
    overwritten. With `clean`, a killed run's half-written files are removed."""
    if work.exists() and not work.is_dir():
        raise EyasError(f"the work folder {work} is a file; give a folder with `work:` or --work.")
    if not work.is_dir():
        return
    own = {STATE, LOCK_FILE, *state.wrote, *(s.output.relative_to(work).parts[0] for s in stages)}
    if clean:
        remove_leftovers(work, [STATE, *REPORTS])
    if state.path.is_file():
        own.update(REPORTS)
    foreign = sorted(p.name for p in work.iterdir() if p.name not in own and not is_leftover(p.name, [STATE, *REPORTS]))
    if foreign:
        raise EyasError(f"the work folder {work} holds files the recipe did not write ({', '.join(foreign[:3])}); "
                        f"it writes only into a new folder or one it wrote before: choose another `work:` or --work.")


def _run_stage(stage: Stage, where: str) -> None:
    """The stage's command, given its config: `run(config)`, as `eyas COMMAND` runs it (under
    torchrun its command line, derived from the config's options)."""
    if stage.command == "train" and (stage.output / "checkpoints" / "latest").is_file():
        stage = replace(stage, options={**stage.options, "resume": True})
    if stage.processes > 1:
        launch = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(stage.processes),
                  "-m", "eyas", stage.command, *stage.argv]
        if subprocess.run(launch).returncode != 0:
            raise EyasError(f"the {stage.name} stage failed under torchrun (see above); run the recipe again to "
                            f"continue from its last checkpoint.")
        return
    importlib.import_module(SUBCOMMANDS[stage.command]).run(stage.config(where))


def run_recipe(path: str | Path, work: str | Path | None = None, dry_run: bool = False,
               stop_after: str | None = None) -> Path | None:
    """Run (or with `dry_run`, describe) the recipe's stages that are not done, up to `stop_after`
    if given; returns the report once every stage is done."""
    recipe = load_recipe(path)
    work = work_folder(path, recipe, work)
    stages = plan(recipe, work, str(path))  # every stage's config is checked before the first one runs
    names = [s.name for s in stages]
    if stop_after is not None and stop_after not in names:
        raise EyasError(f"--stop-after {stop_after!r}: this recipe's stages are {', '.join(names)}.")
    state = State(work)
    check_work_folder(work, stages, state, clean=False)
    if dry_run:
        print(describe(recipe, stages, state, built_from_lost(stages, state)))
        return None
    with output_lock(work, "recipe"):  # one run per work folder; its stages lock their own folders
        state = State(work)  # as it is now that no other run can change it
        check_work_folder(work, stages, state, clean=True)
        redo_lost(stages, state)
        for stage in stages:  # a finished stage the recipe changed is refused before an earlier one runs
            state.check(stage)
        for k, stage in enumerate(stages, 1):
            if state.check(stage):
                print(f"[{k}/{len(stages)}] {stage.name}: done ({stage.output})", flush=True)
            else:
                again = " (continuing: its output exists)" if stage.output.exists() else ""
                print(f"[{k}/{len(stages)}] {stage.name}{again}\n  {stage.line}", flush=True)
                started = time.monotonic()
                state.start(stage)
                _run_stage(stage, str(path))
                state.finish(stage)
                print(f"[{k}/{len(stages)}] {stage.name}: done in {time.monotonic() - started:.0f} s", flush=True)
            if stage.name == stop_after and k < len(stages):
                print(f"stopped after {stop_after} (--stop-after); run without it to go on.", flush=True)
                return None
        report = write_report(recipe, work, stages, str(path))
    print(f"recipe finished: report in {report}", flush=True)
    return report
