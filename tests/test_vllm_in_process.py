"""Engines that vllm_util runs in the pytest process (`in_process`) leave it as they found it.

The same pytest worker goes on to run hundreds of other tests, so after each engine stops:
torch's own `set_num_threads` and the same thread count, the same CPU affinity, no
torch.distributed group and no vLLM parallel state, the same environment (the variable that
makes the engine in-process never reaches a process started meanwhile), random states, NUMA
memory policy, excepthook and torch functions, an unfrozen garbage collector and vLLM reading
the environment afresh; and the next engine starts and serves: a second one with EAGLE-3
speculation (a barely fitted drafter) and a third plain one, as the first one did.
"""

from __future__ import annotations

import gc
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vllm_util import IN_PROCESS_ENV, in_process, memory_policy, require_vllm, vllm_engine

pytestmark = pytest.mark.vllm

PROMPTS = [[1, 5, 9, 14, 20], [3, 7, 11]]


def process_state() -> dict[str, object]:
    import numpy as np
    import vllm.envs as envs
    from vllm.distributed import parallel_state

    policy = memory_policy()
    return {
        "set_num_threads": torch.set_num_threads, "threads": torch.get_num_threads(),
        "affinity": os.sched_getaffinity(0), "distributed": torch.distributed.is_initialized(),
        "vllm_parallel_state": (parallel_state._WORLD, parallel_state.model_parallel_is_initialized()),
        "environ": dict(os.environ), "memory_policy": policy and (policy[0], list(policy[1])),
        "excepthook": sys.excepthook, "gc_frozen": gc.get_freeze_count(), "vllm_envs_cached": envs._is_envs_cache_enabled(),
        "rng": (random.getstate(), np.random.get_state()[1].tolist(), torch.random.get_rng_state().tolist()),
        "torch_functions": (torch.Tensor.pin_memory, torch.Tensor.record_stream, torch.cuda.Stream, torch.Event,
                            torch.accelerator.synchronize),
    }


def drafter(model: str, out) -> str:
    """An EAGLE-3 drafter for `model`, barely fitted (the engine only has to serve it), exported for vLLM."""
    from eyas.export import export_drafter
    from eyas.export.config import ExportConfig
    from test_export_vllm import capture, fit_drafter

    ckpt = fit_drafter(capture(PROMPTS, model=model), out / "ckpt", steps=1)
    export_drafter(ExportConfig(ckpt=str(ckpt), to="vllm", out=str(out / "vllm")))
    return str(out / "vllm")


def test_in_process_engines_leave_the_process_as_they_found_it(tmp_path, smollm2_dir):
    """In a fresh process: a pytest worker that ran a Kimi-K2.5 engine first keeps engines out of
    itself (`in_process`), which would leave this check unrun depending on the test order."""
    require_vllm()
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("only engines on vLLM's CPU backend run in-process")
    script = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
              f"from test_vllm_in_process import check_engines_in_process; "
              f"check_engines_in_process({str(smollm2_dir)!r}, {str(tmp_path)!r})")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-6000:]
    assert "engines checked: 3" in run.stdout


def check_engines_in_process(model: str, tmp: str) -> None:
    """Three engines in this process (plain, EAGLE-3, plain), each checked to have changed it while
    it ran and to have left it as it was."""
    from vllm import SamplingParams

    require_vllm()
    assert "llvmlite.binding.ffi" not in sys.modules  # a fresh process: nothing loaded it yet
    spec = {"method": "eagle3", "model": drafter(model, Path(tmp)), "num_speculative_tokens": 3}
    engines = [{}, {"speculative_config": spec, "disable_log_stats": False}, {}]
    before = process_state()
    outputs = []
    for extra in engines:
        engine = dict(model=model, max_model_len=256, enable_prefix_caching=False, **extra)
        assert in_process(engine)
        with vllm_engine(**engine) as llm:
            during = process_state()
            params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
            outputs.append([list(o.outputs[0].token_ids) for o in
                            llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)])
            if "speculative_config" in extra:
                drafts = [m.value for m in llm.get_metrics() if m.name == "vllm:spec_decode_num_drafts"]
                assert drafts and drafts[0] > 0, "the drafter was not used"
        assert type(llm.llm_engine.engine_core).__name__ == "InprocClient"
        # Otherwise the checks below would prove nothing: the engine did change this process.
        assert during["set_num_threads"] is not before["set_num_threads"] and during["distributed"]
        assert during["environ"].get(IN_PROCESS_ENV) == before["environ"].get(IN_PROCESS_ENV)
        after = process_state()
        changed = [key for key in before if after[key] != before[key]]
        assert changed == [], f"{extra}: left changed: {changed}"
    assert all(len(tokens) == 12 for tokens in outputs[0])
    assert outputs[2] == outputs[0]
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)  # torch's own function again, not vLLM's no-op
    assert torch.get_num_threads() == threads + 1
    torch.set_num_threads(threads)
    print(f"engines checked: {len(engines)}")


@pytest.mark.parametrize("engine, inside", [
    ({}, True),
    ({"tensor_parallel_size": 2}, False),
    ({"pipeline_parallel_size": 2}, False),
    ({"enforce_eager": False}, False),
    ({"kv_transfer_config": {"kv_connector": "EyasHiddenStatesConnector"}}, False),
])
def test_only_one_process_eager_engines_without_capture_run_in_process(engine, inside, monkeypatch):
    require_vllm()
    from vllm.platforms import current_platform

    monkeypatch.delitem(sys.modules, "llvmlite.binding.ffi", raising=False)  # as an earlier test may leave it
    assert in_process(engine) == (inside and current_platform.is_cpu())


def test_engines_keep_their_processes_where_an_in_process_start_would_fail_or_take_over(tmp_path, monkeypatch):
    """A multimodal wrapper, or a process where llvmlite is loaded: vLLM's worker would fail to
    start (`in_process` says why); a process with its own process group: vLLM would take it
    over, and destroy it when it stops."""
    require_vllm()
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "kimi_k25", "text_config": {}}))
    assert not in_process({"model": str(tmp_path)})
    monkeypatch.setitem(sys.modules, "llvmlite.binding.ffi", sys)
    assert not in_process({})
    monkeypatch.delitem(sys.modules, "llvmlite.binding.ffi")
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    assert not in_process({})
