"""The `vllm serve` command that `eyas capture --backend vllm --endpoint URL` needs: the
same extraction settings as the in-process backend (see `engine.py`), as flags."""

from __future__ import annotations

import json
import shlex
from typing import Any

from eyas.capture.vllm.engine import engine_kwargs
from eyas.capture.vllm.target import Target


def serve_argv(target: Target, spool: str, dtype: str = "auto", tensor_parallel_size: int = 1,
               pipeline_parallel_size: int = 1, data_parallel_size: int = 1,
               engine_args: dict[str, Any] | None = None) -> list[str]:
    kwargs = engine_kwargs(target.folder, target.layer_ids, spool, dtype, tensor_parallel_size,
                           pipeline_parallel_size, data_parallel_size, engine_args)
    argv = ["vllm", "serve", kwargs.pop("model")]
    for key, value in kwargs.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, (dict, list)):
            argv += [flag, json.dumps(value, separators=(",", ":"))]
        else:
            argv += [flag, str(value)]
    return argv


def serve_command(*args: Any, **kwargs: Any) -> str:
    """The command line to paste into the server's shell (eyas must be installed there)."""
    return shlex.join(serve_argv(*args, **kwargs))
