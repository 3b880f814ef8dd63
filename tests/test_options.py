"""Typed stage configs (eyas.options, issue 24): every option of every stage is one dataclass
field, and the command line, the recipe and the library entry points all read it, so their
defaults, help and rules cannot disagree."""

from __future__ import annotations

import argparse
import importlib
import inspect
import typing
from dataclasses import MISSING
from pathlib import Path

import pytest
import yaml

from eyas.cli import SUBCOMMANDS, build_parser
from eyas.errors import EyasError
from eyas.options import (AUTO_LAYERS, AUTO_LAYERS_MEANS, BATCH_TOKENS, default_of, from_mapping,
                          help_text, key_of, option_fields, option_type)
from eyas.recipe.run import STAGE_COMMAND, STAGE_KEYS, check_stage_options, plan, run_recipe


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    return next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices


def _config(command: str) -> type:
    return importlib.import_module(SUBCOMMANDS[command]).CONFIG


def _actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in parser._actions if a.dest not in ("help", "_debug")}


@pytest.mark.parametrize("command", list(SUBCOMMANDS))
def test_every_option_on_the_command_line_is_its_config_field(command):
    """Each flag is a field: same default, help = the field's doc (plus its default), same
    choices; and each field is a flag, none left over on either side."""
    actions, cls = _actions(_subparsers()[command]), _config(command)
    fields = dict((f.name, (f, meta)) for f, meta in option_fields(cls))
    assert set(actions) == set(fields), command
    for name, (f, meta) in fields.items():
        action = actions[name]
        assert action.default == default_of(f), (command, name)
        assert action.help == help_text(f) and action.help.startswith(meta.help), (command, name)
        assert tuple(action.choices or ()) == tuple(meta.choices or ()), (command, name)
        if not meta.positional:
            assert action.option_strings[0] == (meta.flag or "--" + name.replace("_", "-")), (command, name)
        no_default = f.default is MISSING and f.default_factory is MISSING
        assert action.required == (no_default or meta.required), (command, name)


def _sample(f, meta, tp: str) -> object:
    """A value the option accepts, of the kind a recipe's YAML gives."""
    default = default_of(f)
    if meta.parse is not None:  # read from text, as on the command line
        if isinstance(default, dict):
            return "max_model_len=512"
        return ",".join(default) if default else "2"  # a list's items, else a count (--anchors)
    if meta.choices:
        return list(meta.choices)[-1]
    if default is not None and default != ():
        return default
    return {bool: True, int: 2, float: 0.5, str: "x"}.get(tp, ["x"])  # else a list option


def _linked(key: str) -> frozenset[str]:
    """The options a recipe sets itself in its stages of recipe key `key` (a recipe with every stage)."""
    recipe = {"model": "m", "prepare": {"data": "packaged:chitchat"}, "regenerate": {}, "onpolicy": {}, "eval": {}}
    return frozenset().union(*(s.linked for s in plan(recipe, Path("w"), "r.yaml")
                               if (s.name if s.name in STAGE_COMMAND else s.command) == key))


@pytest.mark.parametrize("stage", STAGE_KEYS)
def test_a_recipe_key_for_each_option_of_a_stage_is_accepted(stage):
    cls, linked = _config(STAGE_COMMAND.get(stage, stage)), _linked(stage)
    for f, meta in option_fields(cls):
        key = key_of(f)
        if key in linked:
            with pytest.raises(EyasError, match=rf"`{stage}: {key}` is set by the recipe itself"):
                check_stage_options(stage, {key: "x"}, "r.yaml", linked)
            continue
        value = _sample(f, meta, option_type(cls, f.name))
        check_stage_options(stage, {key: value}, "r.yaml")  # no error
        check_stage_options(stage, {key.replace("_", "-"): value}, "r.yaml")


@pytest.mark.parametrize("stage,options,message", [
    ("train", {"stepz": 3}, r"^r\.yaml: `train`: unknown option `stepz`; the options are .*\bsteps\b"),
    ("train", {"steps": 0}, r"^r\.yaml: `train`: --steps must be an integer >= 1 \(got 0\)\.$"),
    ("train", {"steps": "many"}, r"^r\.yaml: `train`: `steps` takes an integer, not 'many'\.$"),
    ("train", {"lr": True}, r"^r\.yaml: `train`: `lr` takes a number, not True\.$"),
    ("train", {"drafter": "medusa"}, r"^r\.yaml: `train`: --drafter must be one of eagle3, dflash, peagle \(got 'medusa'\)"),
    ("capture", {"tensor_paralel_size": 2}, r"^r\.yaml: `capture`: unknown option `tensor_paralel_size`"),
    ("capture", {"batch_tokens": 1}, r"^r\.yaml: `capture`: --batch-tokens must be an integer >= 2 \(got 1\)"),
    ("capture", {"retries": -1}, r"^r\.yaml: `capture`: --retries must be an integer >= 0 \(got -1\)"),
    ("regenerate", {"data_parallel_size": 2}, r"^r\.yaml: `regenerate`: unknown option `data_parallel_size`"),
    ("regenerate", {"engine_args": {"seed": 1}}, r"^r\.yaml: `regenerate`: unknown option `engine_args`.*engine_arg\b"),
    ("regenerate", {"engine_arg": "seed"}, r"^r\.yaml: `regenerate`: --engine-arg takes key=value, not 'seed'"),
    ("eval", {"top_k": 0.5}, r"^r\.yaml: `eval`: `top_k` takes an integer, not 0\.5\.$"),
    ("export", {"dtype": "int4"}, r"^r\.yaml: `export`: --dtype must be one of keep, bf16, fp16, fp32 \(got 'int4'\)"),
    ("prepare", {"max_len": 1}, r"^r\.yaml: `prepare`: --max-len must be an integer >= 2 \(got 1\)"),
])
def test_a_bad_recipe_key_or_value_is_one_line_naming_the_stage_and_key(stage, options, message):
    with pytest.raises(EyasError, match=message) as e:
        check_stage_options(stage, options, "r.yaml")
    assert "\n" not in str(e.value)


def test_a_bad_key_in_any_stage_stops_the_recipe_before_the_first_stage_runs(tmp_path):
    """The typo is in the last stage; nothing of the first is written."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"model": "packaged:smollm2-135m", "prepare": {"data": "packaged:chitchat"},
                                      "train": {"steps": 1}, "export": {"to": "vllm", "num_speculative_token": 3}}))
    with pytest.raises(EyasError, match=r"`export`: unknown option `num_speculative_token`"):
        run_recipe(recipe, tmp_path / "work")
    assert not (tmp_path / "work").exists()
    recipe.write_text(yaml.safe_dump({"model": "packaged:smollm2-135m", "prepare": {"data": "packaged:chitchat"},
                                      "train": {"steps": 3, "epochs": 1}}))
    with pytest.raises(EyasError, match=r"r\.yaml: the train stage: give --steps or --epochs, not both\.$"):
        run_recipe(recipe, tmp_path / "work")
    assert not (tmp_path / "work").exists()


def test_every_stage_runs_from_its_typed_config_which_refuses_what_the_stage_would():
    """One entry-point shape: each stage's library function takes the config its command line
    and a recipe build; building one refuses a misspelt option, a backend that does not exist
    and a rule between options, before any work."""
    from eyas.capture.config import CaptureConfig
    from eyas.capture.run import capture
    from eyas.data.prepare import prepare
    from eyas.evaluate.run import evaluate
    from eyas.export.exporter import export_drafter
    from eyas.regenerate.run import regenerate
    from eyas.train.loop import train

    for command, function in (("prepare", prepare), ("regenerate", regenerate), ("capture", capture),
                              ("train", train), ("eval", evaluate), ("export", export_drafter)):
        first = next(iter(inspect.signature(function).parameters))
        assert typing.get_type_hints(function)[first] is _config(command), command
    stage = {"model": "m", "data": "d", "out": "s"}
    with pytest.raises(EyasError, match=r"^capture: unknown option `tensor_paralel_size`"):
        from_mapping(CaptureConfig, {**stage, "backend": "vllm", "tensor_paralel_size": 2}, "capture")
    with pytest.raises(EyasError, match=r"^--backend must be one of hf, vllm \(got 'nonsense'\)\.$"):
        CaptureConfig(**stage, backend="nonsense")
    with pytest.raises(EyasError, match=r"^--endpoint needs --spool DIR"):
        from_mapping(CaptureConfig, {**stage, "backend": "vllm", "endpoint": "http://x"}, "capture")
    with pytest.raises(EyasError, match=r"^missing --out \(see eyas capture --help\)$"):
        CaptureConfig(model="m", data="d")


def test_vllm_options_are_a_typed_config():
    from eyas.vllm.options import CaptureVLLMOptions

    o = from_mapping(CaptureVLLMOptions, {"tensor-parallel-size": 2, "engine_arg": ["max_model_len=512", "seed=1"]},
                     "capture")
    assert o.tensor_parallel_size == 2 and o.engine_args == {"max_model_len": 512, "seed": 1} and o.retries == 3
    assert from_mapping(CaptureVLLMOptions, {"engine_args": {"enforce_eager": True}}, "capture").engine_args == \
        {"enforce_eager": True}  # a library caller's mapping, as it is
    with pytest.raises(EyasError, match=r"--tensor-parallel-size must be an integer >= 1 \(got 0\)"):
        CaptureVLLMOptions(tensor_parallel_size=0)
    with pytest.raises(EyasError, match=r"^capture: --engine-arg takes key=value"):
        from_mapping(CaptureVLLMOptions, {"engine_arg": "max_model_len"}, "capture")
    parser = build_parser()
    args = parser.parse_args(["capture", "--model", "m", "--engine-arg", "max_model_len=512", "--engine-arg",
                              "enforce_eager=true", "--engine-arg", "max_model_len=256"])
    assert args.engine_args == {"max_model_len": 256, "enforce_eager": True}  # the later flag wins, as in vLLM


def test_shared_defaults_are_stated_once_and_mean_what_the_help_says():
    from eyas.capture.config import CaptureConfig
    from eyas.draft.config import DraftConfig
    from eyas.models.layers import default_aux_ids
    from eyas.train.config import TrainConfig

    capture, train = (dict((f.name, f) for f, _ in option_fields(c)) for c in (CaptureConfig, TrainConfig))
    for config in (capture, train):
        assert default_of(config["layers"]) == AUTO_LAYERS and AUTO_LAYERS_MEANS in help_text(config["layers"])
        assert default_of(config["batch_tokens"]) == BATCH_TOKENS
    assert capture["batch_tokens"].metadata["eyas.option"].rule == train["batch_tokens"].metadata["eyas.option"].rule
    n = 32  # "(2, N//2, N-3)" is what auto resolves to
    assert default_aux_ids(n) == eval(AUTO_LAYERS_MEANS, {"N": n})
    assert default_of(train["ttt_decay"]) == DraftConfig.ttt_decay
    # --ttt-steps left open is the drafter's default depth (which the budget rule may lower), as its help says
    assert default_of(train["ttt_steps"]) is None and f"default {DraftConfig.ttt_steps};" in help_text(train["ttt_steps"])
    assert TrainConfig(out="o", store="s").start_depth == DraftConfig.ttt_steps
