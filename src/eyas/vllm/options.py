"""The vLLM options of `eyas capture` and `eyas regenerate` as typed configs, and the
factory the capture loop calls for `--backend vllm` (in-process engine, or `--endpoint`
client). The options are fields (eyas.options): a recipe or caller naming one that does not
exist is refused with its name."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from eyas.errors import EyasError
from eyas.models.dtype import model_dtype
from eyas.options import check_rules, option
from eyas.validate import COUNT, Number
from eyas.vllm.engine import parse_engine_args, text_only
from eyas.vllm.preflight import preflight_where_installed

VLLM_GROUP = "vLLM backend (--backend vllm)"
CAPTURE_DESCRIPTION = (
    "Runs the target in vLLM with its extract_hidden_states method and eyas's KV connector, prefill only. "
    "In process by default; with --endpoint, through a running `vllm serve` that writes to a shared --spool. "
    "--model-dtype defaults to vLLM's 'auto' (the checkpoint's dtype); use float32 to compare with transformers."
)


def parse_engine_arg(text: str) -> dict[str, Any]:
    """One `--engine-arg KEY=VALUE` as the keyword argument of `vllm.LLM` it sets."""
    return parse_engine_args([text])


@dataclass(kw_only=True)
class EngineOptions:
    """How vLLM places the target (`capture` and `regenerate`), and any other engine argument."""

    tensor_parallel_size: int = option("GPUs per model replica (tensor parallel)", 1, rule=COUNT, metavar="N",
                                       show_default=False)
    pipeline_parallel_size: int = option("pipeline stages (e.g. across nodes)", 1, rule=COUNT, metavar="N",
                                         show_default=False)
    engine_args: dict[str, Any] = option(
        "any other vllm.LLM / `vllm serve` argument, repeatable: --engine-arg max_model_len=8192 "
        "--engine-arg gpu_memory_utilization=0.85 (values read as JSON when they parse)",
        default_factory=dict, flag="--engine-arg", parse=parse_engine_arg, repeat=True, metavar="KEY=VALUE")

    def __post_init__(self) -> None:
        check_rules(self)


@dataclass(kw_only=True)
class CaptureVLLMOptions(EngineOptions):
    """`eyas capture --backend vllm`: the engine, data parallel replicas, and the `--endpoint` client."""

    data_parallel_size: int = option(
        "model replicas; vLLM runs them only as a server (--print-serve-command, then --endpoint)", 1, rule=COUNT,
        metavar="N", show_default=False)
    endpoint: str | None = option("capture through a running `vllm serve` at URL (http://host:8000)", None,
                                  metavar="URL")
    spool: str | None = option(
        "folder the engine writes states to before they enter the store (default: a temp folder); with "
        "--endpoint, the server's folder as this machine sees it (a shared filesystem)", None, metavar="DIR")
    served_model_name: str | None = option("with --endpoint, when the server serves several models", None,
                                           metavar="NAME")
    concurrency: int = option("with --endpoint, requests in flight", 16, rule=COUNT, metavar="N")
    request_timeout: float = option("with --endpoint, seconds per request before it counts as failed", 300.0,
                                    rule=Number(lo=0, lo_open=True, required=True), metavar="S")
    retries: int = option("with --endpoint, retries per sample", 3, rule=Number(lo=0, integer=True, required=True),
                          metavar="N")
    print_serve_command: bool = option(
        "print the `vllm serve` command a server for --endpoint needs (with --model, --layers, --spool, parallel "
        "sizes, --engine-arg) and exit", False)

    def check_together(self) -> None:
        """The rules between these options, for `--backend vllm` (checked before any work)."""
        if self.print_serve_command and not self.spool:
            raise EyasError("--print-serve-command needs --spool DIR: the folder the server writes states to.")
        if self.endpoint and not self.spool:
            raise EyasError("--endpoint needs --spool DIR: the folder the server writes states to, as this machine "
                            "sees it.")
        if self.data_parallel_size > 1 and not (self.endpoint or self.print_serve_command):
            raise EyasError(
                "vLLM runs data parallel only across processes (vllm.LLM refuses data_parallel_size > 1). Start a "
                "server with the command from `eyas capture --backend vllm --print-serve-command --data-parallel-size "
                "N --spool DIR` and capture through it with --endpoint URL --spool DIR.")


def print_serve_command(model: str, layers: str, asked: str | None, options: CaptureVLLMOptions) -> None:
    """`--print-serve-command`: the `vllm serve` line a server for `--endpoint` needs, the target
    running in `asked` (--model-dtype) or its checkpoint's dtype, checked here first."""
    from eyas.vllm.serve import serve_command
    from eyas.vllm.target import describe_target

    print("# eyas must be installed where vLLM runs (its connector is imported from eyas); the server writes to "
          f"{options.spool}, which must be the same folder for the capture client.", file=sys.stderr)
    target = describe_target(model, layers)
    engine_args = text_only(target.config, options.engine_args)
    dtype = model_dtype(asked, None)
    preflight_where_installed(target.config, model, target.layer_ids, dtype,
                              "use --backend hf", engine_args, target.folder)
    print(serve_command(target, options.spool, dtype, options.tensor_parallel_size,
                        options.pipeline_parallel_size, options.data_parallel_size, engine_args))


def make_vllm_backend(model: str, layers: str, model_dtype: str, options: CaptureVLLMOptions):
    """`--backend vllm`: the endpoint client when `options.endpoint` is given, else an in-process engine."""
    if options.endpoint:
        from eyas.vllm.endpoint import EndpointCapturer

        return EndpointCapturer(model, options.endpoint, options.spool, layers=layers,
                                served_model_name=options.served_model_name, concurrency=options.concurrency,
                                request_timeout=options.request_timeout, retries=options.retries)
    from eyas.vllm.backend import VLLMCapturer

    return VLLMCapturer(model, layers=layers, dtype=model_dtype, tensor_parallel_size=options.tensor_parallel_size,
                        pipeline_parallel_size=options.pipeline_parallel_size, engine_args=options.engine_args,
                        spool=options.spool)
