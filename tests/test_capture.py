"""`eyas capture` (transformers backend) and the store: numerics against transformers in
float32, resume after SIGKILL, verification, fp8, and every mismatch as a clear error."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eyas.capture.hf import HFCapturer
from eyas.capture.run import capture
from eyas.capture.config import CaptureConfig
from eyas.cli import main
from eyas.data.prepared import PreparedData, PreparedSample
from eyas.errors import EyasError
from eyas.models import decoder_parts
from eyas.store import Store, StoreWriter
from eyas.store.format import quantize_fp8, write_safetensors
from faults import child_argv, env as faults_env, killed
from tiny import FAMILIES, build_model

SMOLLM2 = "packaged:smollm2-135m"
# float32 on both sides; only batch shape and padding differ, which reorders reductions.
ATOL, RTOL = 1e-4, 1e-4


def reference_states(model, input_ids: torch.Tensor, layer_ids) -> torch.Tensor:
    """Batch-1, unpadded, the plain transformers way: hidden_states[k] for aux ids and the
    last decoder layer's output (forward hook) for id N. -> [T, L, H]"""
    parts = decoder_parts(model)
    last = {}

    def keep_output(module, args, output):
        last["h"] = output[0] if isinstance(output, tuple) else output

    handle = parts.layers[-1].register_forward_hook(keep_output)
    try:
        with torch.no_grad():
            out = model(input_ids[None], output_hidden_states=True)
    finally:
        handle.remove()
    n = parts.num_layers
    states = [out.hidden_states[k][0] if k < n else last["h"][0] for k in layer_ids]
    # transformers' hidden_states[N] is after the final norm: our id N must map onto it.
    torch.testing.assert_close(parts.norm(last["h"])[0], out.hidden_states[n][0], atol=ATOL, rtol=RTOL)
    return torch.stack(states, dim=1)


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory, tiny_tokenizer_dir):
    return {f: build_model(tmp_path_factory.mktemp(f), f, tokenizer_dir=tiny_tokenizer_dir) for f in FAMILIES}


def _samples(lengths, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [PreparedSample(torch.randint(0, vocab, (n,), generator=g), torch.ones(n, dtype=torch.bool), i)
            for i, n in enumerate(lengths)]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_tiny_family_matches_transformers_reference(family_dirs, family):
    capturer = HFCapturer(str(family_dirs[family]), layers="auto")
    assert capturer.layer_ids == (2, 4, 5, 8)
    samples = _samples([23, 9, 16], capturer.identity.vocab_size)
    batched = capturer.capture(samples)  # one padded batch
    for sample, got in zip(samples, batched):
        want = reference_states(capturer.model, sample.input_ids, capturer.layer_ids)
        assert got.shape == (len(sample.input_ids), 4, 64)
        torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
        # the ids really are different layers
        assert not torch.allclose(got[:, 0], got[:, 1])


def test_smollm2_store_matches_transformers_float32(smollm2_store, smollm2_prepared):
    from transformers import AutoModelForCausalLM

    from eyas.models import resolve_model

    store = Store(smollm2_store)
    assert store.layer_ids == (2, 15, 27, 30)
    assert len(store) == 16 and store.manifest["complete"]
    model = AutoModelForCausalLM.from_pretrained(resolve_model(SMOLLM2), dtype=torch.float32).eval()
    prepared = PreparedData(smollm2_prepared)
    for pos in (0, 7, 15):
        sample = store.sample(pos)
        source = prepared[int(sample["index"])]
        assert torch.equal(sample["input_ids"], source.input_ids)
        assert torch.equal(sample["loss_mask"], source.loss_mask)
        torch.testing.assert_close(sample["hidden"], reference_states(model, source.input_ids, store.layer_ids),
                                   atol=ATOL, rtol=RTOL)


def test_on_batch_sees_each_batch_before_its_capture_and_changes_nothing(tmp_path, smollm2_prepared, smollm2_store):
    """The batch hook (bench/capture_vllm.py times a plain prefill there) is handed every prepared
    sample exactly once, in batches, and the store is the one captured without it."""
    seen: list[tuple[int, ...]] = []
    calls: list[int] = []

    def hook(samples: list[PreparedSample]) -> None:
        calls.append(len(samples))
        seen.extend(tuple(s.input_ids.tolist()) for s in samples)

    capture(CaptureConfig(model=SMOLLM2, data=str(smollm2_prepared), out=str(tmp_path / "store"), dtype="fp32",
                          batch_tokens=2048), progress=False, on_batch=hook)
    prepared = PreparedData(smollm2_prepared)
    assert sorted(seen) == sorted(tuple(prepared[i].input_ids.tolist()) for i in range(len(prepared)))
    assert len(calls) > 1  # 16 samples of up to 256 tokens do not fit one 2,048-token batch
    _assert_same_store(tmp_path / "store", smollm2_store)


def _store_by_index(path) -> dict[int, dict[str, torch.Tensor]]:
    store = Store(path)
    return {int(s["index"]): s for s in store}


def _assert_same_store(a, b, atol=0.0):
    sa, sb = _store_by_index(a), _store_by_index(b)
    assert sorted(sa) == sorted(sb)
    for i in sa:
        assert torch.equal(sa[i]["input_ids"], sb[i]["input_ids"])
        assert torch.equal(sa[i]["loss_mask"], sb[i]["loss_mask"])
        torch.testing.assert_close(sa[i]["hidden"], sb[i]["hidden"], atol=atol, rtol=atol)


def _capture_cmd(prepared, out, *extra):
    return [sys.executable, "-m", "eyas", "capture", "--model", SMOLLM2, "--data", str(prepared), "--out", str(out),
            "--dtype", "fp32", "--batch-tokens", "512", "--shard-mb", "0.5", *extra]


def _torchrun(nproc: int) -> list[str]:
    """torchrun on a free port of its own (--standalone): two suites on one machine never collide."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]


def _torchrun_capture_cmd(prepared, out, nproc: int):
    return [*_torchrun(nproc), "-m", "eyas", *_capture_cmd(prepared, out)[3:]]


def test_sigkill_mid_capture_resumes_to_the_same_store(tmp_path, smollm2_prepared, smollm2_store):
    """Killed inside the second shard's write (at its rename, tests/faults.py), then the same
    command: the store equals an uninterrupted capture, nothing stored twice."""
    out = tmp_path / "store"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    killed(_capture_cmd(smollm2_prepared, out)[3:], match=r"shard-\d+\.safetensors$", nth=2)
    partial = json.loads((out / "manifest.json").read_text())
    assert not partial["complete"] and 0 < partial["num_samples"] < 16

    done = subprocess.run(_capture_cmd(smollm2_prepared, out), env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    final = Store(out)
    assert final.manifest["complete"] and len(final) == 16
    assert final.sample_indices().unique().numel() == 16  # nothing stored twice
    final.verify()
    _assert_same_store(out, smollm2_store, atol=ATOL)


def test_verify_catches_a_flipped_byte_and_nan(tmp_path, smollm2_store, capsys):
    store = tmp_path / "store"
    shutil.copytree(smollm2_store, store)
    with pytest.raises(SystemExit) as exit_:
        main(["inspect", str(store), "--verify"])
    assert exit_.value.code == 0 and "verify     ok" in capsys.readouterr().out

    shard = store / "shard-00000.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    shard.write_bytes(bytes(raw))
    with pytest.raises(SystemExit) as exit_:
        main(["inspect", str(store), "--verify"])
    assert exit_.value.code == 2
    assert "shard-00000.safetensors: sha256 mismatch" in capsys.readouterr().err

    # NaN with a matching checksum and structure: only the value scan can catch it.
    tensors = load_file(smollm2_store / "shard-00000.safetensors")
    tensors["hidden"][5, 1, 3] = float("nan")
    manifest = json.loads((store / "manifest.json").read_text())
    with open(shard, "wb") as f:
        write_safetensors(f, tensors, {"format": "eyas-store", "layer_ids": ",".join(map(str, manifest["layer_ids"]))})
    manifest["shards"][0]["sha256"] = hashlib.sha256(shard.read_bytes()).hexdigest()
    (store / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(EyasError, match=r"hidden holds NaN/inf \(token 5, layer slot 1\)"):
        Store(store).verify()


def _copy_samples(src, dst, dtype):
    store = Store(src)
    header = {k: store.manifest[k] for k in ("target", "layer_ids", "hidden_size", "prepared")}
    writer = StoreWriter(dst, {**header, "dtype": dtype})
    for s in store:
        writer.add(int(s["index"]), s["input_ids"], s["loss_mask"], s["hidden"])
    writer.close()
    return Store(dst)


def test_fp8_round_trip_and_half_the_bytes_of_bf16(tmp_path, smollm2_store):
    fp8 = _copy_samples(smollm2_store, tmp_path / "fp8", "fp8")
    bf16 = _copy_samples(smollm2_store, tmp_path / "bf16", "bf16")
    fp8.verify()
    exact = _store_by_index(smollm2_store)
    for i, s in _store_by_index(tmp_path / "fp8").items():
        ref = exact[i]["hidden"]
        # per (token, layer) row: e4m3 keeps 3 mantissa bits, so ~2-3% relative error in norm
        rel = (s["hidden"] - ref).norm(dim=-1) / ref.norm(dim=-1)
        assert rel.max() < 0.05, rel.max()
    ratio = fp8.bytes_per_token() / bf16.bytes_per_token()
    assert 0.49 < ratio < 0.52, ratio


def test_fp8_capture_quantizes_on_the_capture_device_to_the_same_bytes(tmp_path, smollm2_prepared, smollm2_store,
                                                                       monkeypatch):
    """`capture --dtype fp8` quantizes where the forward ran (HostStager) and the writer only
    copies: every sample's bytes are quantize_fp8 of the same capture in float32."""
    add, given = StoreWriter.add, []

    def add_recording(self, index, input_ids, loss_mask, hidden, scale=None):
        given.append((hidden.dtype, scale is not None))
        add(self, index, input_ids, loss_mask, hidden, scale=scale)

    monkeypatch.setattr(StoreWriter, "add", add_recording)
    manifest = capture(CaptureConfig(model=SMOLLM2, data=str(smollm2_prepared), out=str(tmp_path / "fp8"),
                                     dtype="fp8", batch_tokens=2048), progress=False)
    assert manifest["complete"] and manifest["dtype"] == "fp8"
    assert given == [(torch.float8_e4m3fn, True)] * 16  # quantized before the writer
    fp8, fp32 = Store(tmp_path / "fp8"), Store(smollm2_store)
    fp8.verify()
    exact = {int(s["index"]): s for s in (fp32.stored(p) for p in range(len(fp32)))}
    assert len(fp8) == len(exact)
    for pos in range(len(fp8)):
        got = fp8.stored(pos)
        hidden, scale = quantize_fp8(exact[int(got["index"])]["hidden"])
        assert torch.equal(got["hidden"].view(torch.uint8), hidden.view(torch.uint8))
        assert torch.equal(got["scale"].view(torch.int32), scale.view(torch.int32))


def test_mismatches_are_clear_errors(tmp_path, smollm2_prepared, smollm2_store, tiny_llama_dir):
    with pytest.raises(EyasError, match=r"Layer id\(s\) \[31\] out of range.*0\.\.29"):
        capture(CaptureConfig(model=SMOLLM2, data=str(smollm2_prepared), out=str(tmp_path / "a"), layers="2,15,31"),
                progress=False)
    assert not (tmp_path / "a").exists()  # nothing was written before the error
    with pytest.raises(EyasError, match="different tokenizer"):
        capture(CaptureConfig(model=str(tiny_llama_dir), data=str(smollm2_prepared), out=str(tmp_path / "b")),
                progress=False)
    with pytest.raises(EyasError, match="different layer_ids"):
        capture(CaptureConfig(model=SMOLLM2, data=str(smollm2_prepared), out=str(smollm2_store), layers="3,10,20"),
                progress=False)
    (tmp_path / "plain").mkdir()
    with pytest.raises(EyasError, match="not prepared data"):
        capture(CaptureConfig(model=SMOLLM2, data=str(tmp_path / "plain"), out=str(tmp_path / "c")), progress=False)
    with pytest.raises(EyasError, match="not an eyas store"):
        Store(tmp_path)


def test_writer_refuses_nan_and_survives_a_full_disk(tmp_path, smollm2_store, monkeypatch):
    src = Store(smollm2_store)
    header = {k: src.manifest[k] for k in ("target", "layer_ids", "hidden_size", "prepared", "dtype")}
    s = src.sample(0)
    writer = StoreWriter(tmp_path / "nan", header)
    bad = s["hidden"].clone()
    bad[3, 2, 0] = float("inf")
    with pytest.raises(EyasError, match="Sample 7 has non-finite hidden states \\(token 3, layer id 27\\)"):
        writer.add(7, s["input_ids"], s["loss_mask"], bad)
    writer.abort()

    import eyas.store.writer as writer_module

    writer = StoreWriter(tmp_path / "full", header, shard_bytes=1)  # one shard per sample
    writer.add(0, s["input_ids"], s["loss_mask"], s["hidden"])
    writer.close()

    def no_space(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    writer = StoreWriter(tmp_path / "full", header, shard_bytes=1)
    assert writer.done == {0}
    monkeypatch.setattr(writer_module.os, "fsync", no_space)
    with pytest.raises(EyasError, match="Disk full.*run the same command again to resume"):
        writer.add(1, s["input_ids"], s["loss_mask"], s["hidden"])
        writer.close()
    monkeypatch.undo()
    kept = Store(tmp_path / "full")
    assert len(kept) == 1 and not list(Path(tmp_path / "full").glob(".*tmp"))
    kept.verify()


def test_two_rank_capture_equals_one_process_and_resumes_after_a_kill(tmp_path, smollm2_prepared, smollm2_store):
    """torchrun with 2 gloo processes on the CPU: same store as one process, and a killed
    run resumed by a second torchrun duplicates nothing."""
    out = tmp_path / "dp"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    cmd = _torchrun_capture_cmd(smollm2_prepared, out, 2)
    # torchrun and both ranks killed when the first rank to get there renames its second shard
    shard = child_argv(_capture_cmd(smollm2_prepared, out)[3:], match=r"shard-\d+\.safetensors$", nth=2, job=True)
    proc = subprocess.run([*_torchrun(2), *shard], env=faults_env(), capture_output=True, text=True,
                          start_new_session=True, timeout=600)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert 0 < json.loads((out / "manifest.json").read_text())["num_samples"] < 16

    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    store = Store(out)
    assert store.manifest["complete"] and len(store) == 16
    assert store.sample_indices().unique().numel() == 16
    store.verify()
    _assert_same_store(out, smollm2_store, atol=ATOL)


def test_four_rank_capture_equals_one_process(tmp_path, smollm2_prepared, smollm2_store):
    """torchrun with 4 gloo processes (oversubscribed on two cores): each captures its quarter
    of the samples, and together they write the one-process store (float32, up to batch shape)."""
    out = tmp_path / "dp4"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(_torchrun_capture_cmd(smollm2_prepared, out, 4), env=env, capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "over 4 processes" in done.stdout
    store = Store(out)
    assert store.manifest["complete"] and len(store) == 16
    assert store.sample_indices().unique().numel() == 16
    store.verify()
    _assert_same_store(out, smollm2_store, atol=ATOL)
