"""Shared fixtures: the real SmolLM2 (packaged, converted once), tiny random models, and a
small prepared set and store built from real conversations. Everything runs offline."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SMOLLM2 = "packaged:smollm2-135m"


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    from eyas.models import resolve_model

    return Path(resolve_model(SMOLLM2))


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory) -> Path:
    from tiny import build_tokenizer

    out = tmp_path_factory.mktemp("tiny-tokenizer")
    build_tokenizer(out)
    return out


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, tiny_tokenizer_dir) -> Path:
    from tiny import build_model

    return build_model(tmp_path_factory.mktemp("tiny-llama"), "llama", tokenizer_dir=tiny_tokenizer_dir)


@pytest.fixture(scope="session")
def smollm2_prepared(tmp_path_factory, smollm2_dir) -> Path:
    """16 real ShareGPT conversations for SmolLM2, at most 256 tokens each."""
    from eyas.data.prepare import prepare
    from eyas.data.config import PrepareConfig

    out = tmp_path_factory.mktemp("smollm2-prepared")
    prepare(PrepareConfig(model=SMOLLM2, data=["packaged:sharegpt"], out=str(out), max_len=256, limit=16),
            progress=False)
    return out


@pytest.fixture(scope="session")
def smollm2_store(tmp_path_factory, smollm2_prepared) -> Path:
    """A float32 store of `smollm2_prepared` with the default layer ids (2, 15, 27, 30)."""
    from eyas.capture.run import capture
    from eyas.capture.config import CaptureConfig

    out = tmp_path_factory.mktemp("smollm2-store") / "store"
    capture(CaptureConfig(model=SMOLLM2, data=str(smollm2_prepared), out=str(out), dtype="fp32", batch_tokens=2048),
            progress=False)
    return out


@pytest.fixture(scope="session")
def smollm2_vllm_plain(smollm2_dir) -> tuple:
    """test_export_vllm's prompts, plain vLLM's greedy answers and the states a drafter is fitted
    on (`plain_and_captured`): the reference of every module that serves a SmolLM2 drafter, all
    with the same prompts and engine arguments, so one engine start serves them all. On one
    thread, as the modules' own `one_thread` fixtures (set up after this one) would run it."""
    from test_export_vllm import plain_and_captured

    with single_thread():
        return plain_and_captured(smollm2_dir)


@contextlib.contextmanager
def single_thread():
    """Tiny models run faster on one thread (no cross-thread hand-off per small op)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


@pytest.fixture(scope="module")
def one_thread():
    with single_thread():
        yield


def pytest_configure(config):
    """Under `pytest -n N` each worker takes its share of the cores for torch (and the CLI
    processes tests start): N workers each running torch on every core would oversubscribe
    them."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1:
        threads = str(max(1, len(os.sched_getaffinity(0)) // workers))
        os.environ["OMP_NUM_THREADS"] = threads
        import torch

        torch.set_num_threads(int(threads))


def pytest_collection_modifyitems(items):
    """Every test on the real SmolLM2 (135M parameters, float32 on the CPU) is `slow`:
    `make test-fast` leaves those out, `make test` runs them."""
    for item in items:
        if any(name.startswith("smollm2") for name in item.fixturenames):
            item.add_marker(pytest.mark.slow)
