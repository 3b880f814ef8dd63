"""The vLLM options of `eyas capture`, and the factory the capture loop calls for
`--backend vllm` (in-process engine, or `--endpoint` client)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from eyas.errors import EyasError
from eyas.vllm.engine import parse_engine_args, text_only
from eyas.vllm.preflight import preflight_where_installed


def add_vllm_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "vLLM backend (--backend vllm)",
        "Runs the target in vLLM with its extract_hidden_states method and eyas's KV connector, prefill only. "
        "In process by default; with --endpoint, through a running `vllm serve` that writes to a shared --spool. "
        "--model-dtype defaults to vLLM's 'auto' (the checkpoint's dtype); use float32 to compare with transformers.",
    )
    add_engine_arguments(g)
    g.add_argument("--endpoint", metavar="URL", help="capture through a running `vllm serve` at URL (http://host:8000)")
    g.add_argument("--spool", metavar="DIR",
                   help="folder the engine writes states to before they enter the store (default: a temp folder); "
                        "with --endpoint, the server's folder as this machine sees it (a shared filesystem)")
    g.add_argument("--served-model-name", metavar="NAME", help="with --endpoint, when the server serves several models")
    g.add_argument("--concurrency", type=int, default=16, metavar="N", help="with --endpoint, requests in flight (default 16)")
    g.add_argument("--request-timeout", type=float, default=300.0, metavar="S",
                   help="with --endpoint, seconds per request before it counts as failed (default 300)")
    g.add_argument("--retries", type=int, default=3, metavar="N", help="with --endpoint, retries per sample (default 3)")
    g.add_argument("--print-serve-command", action="store_true",
                   help="print the `vllm serve` command a server for --endpoint needs (with --model, --layers, --spool, "
                        "parallel sizes, --engine-arg) and exit")


def add_engine_arguments(g, data_parallel: bool = True) -> None:
    """Parallel sizes and free-form engine arguments: shared by `capture` and `regenerate`."""
    g.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N", help="GPUs per model replica (tensor parallel)")
    g.add_argument("--pipeline-parallel-size", type=int, default=1, metavar="N", help="pipeline stages (e.g. across nodes)")
    if data_parallel:
        g.add_argument("--data-parallel-size", type=int, default=1, metavar="N",
                       help="model replicas; vLLM runs them only as a server (--print-serve-command, then --endpoint)")
    g.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="any other vllm.LLM / `vllm serve` argument, repeatable: --engine-arg max_model_len=8192 "
                        "--engine-arg gpu_memory_utilization=0.85 (values read as JSON when they parse)")


def vllm_options(args: argparse.Namespace) -> dict[str, Any]:
    """The keyword arguments `capture(...)` forwards to `make_vllm_backend`."""
    return {
        "tensor_parallel_size": args.tensor_parallel_size, "pipeline_parallel_size": args.pipeline_parallel_size,
        "data_parallel_size": args.data_parallel_size, "engine_args": parse_engine_args(args.engine_arg),
        "endpoint": args.endpoint, "spool": args.spool, "served_model_name": args.served_model_name,
        "concurrency": args.concurrency, "request_timeout": args.request_timeout, "retries": args.retries,
    }


def print_serve_command(args: argparse.Namespace) -> None:
    from eyas.vllm.serve import serve_command
    from eyas.vllm.target import describe_target

    if not args.spool:
        raise EyasError("--print-serve-command needs --spool DIR: the folder the server writes states to.")
    o = vllm_options(args)
    print("# eyas must be installed where vLLM runs (its connector is imported from eyas); the server writes to "
          f"{args.spool}, which must be the same folder for the capture client.", file=sys.stderr)
    target = describe_target(args.model, args.layers)
    engine_args = text_only(target.config, o["engine_args"])
    preflight_where_installed(target.config, args.model, target.layer_ids, args.model_dtype or "auto",
                              "use --backend hf", engine_args, target.folder)
    print(serve_command(target, args.spool, args.model_dtype or "auto", o["tensor_parallel_size"],
                        o["pipeline_parallel_size"], o["data_parallel_size"], engine_args))


def make_vllm_backend(model: str, layers: str, model_dtype: str, endpoint: str | None = None, spool: str | None = None,
                      tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1, data_parallel_size: int = 1,
                      engine_args: dict[str, Any] | None = None, served_model_name: str | None = None,
                      concurrency: int = 16, request_timeout: float = 300.0, retries: int = 3, **_: Any):
    """`--backend vllm`: the endpoint client when `endpoint` is given, else an in-process engine."""
    for name, n in (("tensor", tensor_parallel_size), ("pipeline", pipeline_parallel_size), ("data", data_parallel_size)):
        if n < 1:
            raise EyasError(f"--{name}-parallel-size must be at least 1.")
    if data_parallel_size > 1 and not endpoint:
        raise EyasError(
            "vLLM runs data parallel only across processes (vllm.LLM refuses data_parallel_size > 1). Start a server "
            "with the command from `eyas capture --backend vllm --print-serve-command --data-parallel-size N --spool DIR` "
            "and capture through it with --endpoint URL --spool DIR."
        )
    if endpoint:
        from eyas.vllm.endpoint import EndpointCapturer

        if not spool:
            raise EyasError("--endpoint needs --spool DIR: the folder the server writes states to, as this machine sees it.")
        return EndpointCapturer(model, endpoint, spool, layers=layers, served_model_name=served_model_name,
                                concurrency=concurrency, request_timeout=request_timeout, retries=retries)
    from eyas.vllm.backend import VLLMCapturer

    return VLLMCapturer(model, layers=layers, dtype=model_dtype, tensor_parallel_size=tensor_parallel_size,
                        pipeline_parallel_size=pipeline_parallel_size, engine_args=engine_args, spool=spool)
