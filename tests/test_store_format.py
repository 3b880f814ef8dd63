"""The store's building blocks: the shard file writer, the NaN/inf scan, host staging."""

from __future__ import annotations

import hashlib
import io

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load

from eyas.capture.staging import HostStager
from eyas.store.format import SAFETENSORS_DTYPES, first_nonfinite, quantize_fp8, write_safetensors

FLOATS = [torch.bfloat16, torch.float16, torch.float32]


def _shard_like() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    tensors = {f"x_{str(d).split('.')[-1]}": (torch.randn(7, 3, 5, generator=g) * 100).to(d)
               for d in SAFETENSORS_DTYPES if d.is_floating_point}
    tensors |= {"ids": torch.randint(0, 50_000, (13,), generator=g, dtype=torch.int32),
                "mask": torch.randint(0, 2, (13,), generator=g, dtype=torch.uint8),
                "offsets": torch.tensor([0, 4, 13]), "empty": torch.zeros(0, 3, dtype=torch.bfloat16)}
    return tensors


def test_write_safetensors_is_read_back_exactly_by_safetensors(tmp_path):
    tensors = _shard_like()
    buf = io.BytesIO()
    sha = write_safetensors(buf, tensors, {"format": "eyas-store", "layer_ids": "1,2"})
    data = buf.getvalue()
    assert sha == hashlib.sha256(data).hexdigest()
    back = load(data)
    assert back.keys() == tensors.keys()
    for k, t in tensors.items():
        assert back[k].dtype == t.dtype and back[k].shape == t.shape
        assert torch.equal(back[k].view(torch.uint8), t.view(torch.uint8)), k  # bit for bit, NaN-safe
    (tmp_path / "a.safetensors").write_bytes(data)
    with safe_open(str(tmp_path / "a.safetensors"), framework="pt") as f:  # memory-mapped, as the store reads
        assert f.metadata() == {"format": "eyas-store", "layer_ids": "1,2"}
        assert torch.equal(f.get_slice("x_float32")[2:5], tensors["x_float32"][2:5])
    header_len = int.from_bytes(data[:8], "little")
    assert header_len % 8 == 0  # so every tensor starts aligned


@pytest.mark.parametrize("dtype", FLOATS + [torch.float8_e4m3fn])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_first_nonfinite_finds_the_first_bad_value(dtype, bad):
    x = torch.randn(6, 4, 8).to(dtype)
    assert first_nonfinite(x) is None
    assert first_nonfinite(x[:0]) is None
    if dtype == torch.float8_e4m3fn and bad == bad:  # e4m3fn has NaN but no infinities
        return
    y = x.float()
    y[4, 1, 2] = bad
    y[5, 3, 0] = bad
    assert first_nonfinite(y.to(dtype)) == [4, 1, 2]


def test_host_stager_on_the_cpu_hands_back_the_states():
    states = [torch.randn(n, 2, 4) for n in (3, 1, 5)]
    out = HostStager(torch.device("cpu")).start(states)()
    assert len(out) == 3 and all(torch.equal(a, b) and s is None for (a, s), b in zip(out, states))


def _same_fp8(got: list, states: list[torch.Tensor]) -> bool:
    """Each staged (hidden, scale) is, bit for bit, quantize_fp8 of the sample on the CPU."""
    want = [quantize_fp8(s.cpu()) for s in states]
    return len(got) == len(want) and all(
        h.device.type == "cpu" and torch.equal(h.view(torch.uint8), wh.view(torch.uint8))
        and torch.equal(sc.view(torch.int32), ws.view(torch.int32)) for (h, sc), (wh, ws) in zip(got, want))


def test_host_stager_quantizes_fp8_on_the_cpu():
    states = [torch.randn(n, 2, 4).to(torch.bfloat16) * 100 for n in (3, 1, 5)]
    assert _same_fp8(HostStager(torch.device("cpu"), fp8=True).start(states)(), states)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="quantizing on the device needs a GPU")
def test_host_stager_quantizes_fp8_on_the_gpu_to_the_cpu_bits():
    """CUDA divides by a Python number through its reciprocal: quantize_fp8 must not, or scales
    move by an ulp (seen on an H200: 13,534 of 24,576 scales differed)."""
    g = torch.Generator().manual_seed(0)
    states = [(torch.randn(n, 3, 1024, generator=g) * torch.exp(torch.randn(n, 3, 1, generator=g) * 6)).bfloat16()
              for n in (4096, 17, 2000, 1)]
    got = HostStager(torch.device("cuda"), fp8=True).start([s.cuda() for s in states])()
    assert _same_fp8(got, states)
    # states already on the host (vLLM's spool) come back as they are: the writer quantizes them
    assert all(h is s and sc is None for (h, sc), s in zip(HostStager(torch.device("cuda"), fp8=True).start(states)(),
                                                             states))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned copies on a side stream need a GPU")
def test_host_stager_copy_survives_the_next_batch_reusing_the_memory():
    dev = torch.device("cuda")
    stager = HostStager(dev)
    big = torch.randn(4, 4096, 3, 1024, device=dev, dtype=torch.bfloat16)  # [B, T, L, H]
    lengths = [4096, 17, 2000, 1]
    expected = [big[b, :n].cpu() for b, n in enumerate(lengths)]
    collect = stager.start([big[b, :n] for b, n in enumerate(lengths)])
    del big
    for _ in range(8):  # the next batch's forward, reusing freed device memory on the main stream
        torch.zeros(4, 4096, 3, 1024, device=dev, dtype=torch.bfloat16).mul_(2)
    got = [g for g, _ in collect()]
    assert [len(g) for g in got] == lengths and all(g.device.type == "cpu" for g in got)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_writer_reuses_shard_buffers_and_keeps_every_sample_exact(tmp_path, dtype):
    """Many shards through a few reused buffers, with a sample longer than a shard among
    them: every sample reads back as written (fp8: within its quantisation step)."""
    from eyas.store import Store, StoreWriter

    L, H = 3, 16
    target = {"model": "test", "config_hash": "c", "tokenizer_hash": "t", "num_layers": 4, "hidden_size": H,
              "vocab_size": 1000}
    header = {"target": target, "layer_ids": [1, 2, 4], "dtype": dtype,
              "hidden_size": H, "prepared": "test"}
    row_bytes = L * H * (1 if dtype == "fp8" else 2)
    writer = StoreWriter(tmp_path / "s", header, shard_bytes=40 * row_bytes, threads=2)  # 40 tokens a shard
    g = torch.Generator().manual_seed(0)
    written = {}
    for i, n in enumerate([7, 13, 21, 3, 90, 11, 40, 1, 25, 17] * 3):
        hidden = torch.randn(n, L, H, generator=g).to(torch.bfloat16)
        written[i] = (torch.randint(0, 1000, (n,), generator=g), hidden.clone())
        writer.add(i, written[i][0], torch.ones(n, dtype=torch.bool), hidden)
        hidden.fill_(0)  # the writer copied it: reusing the caller's memory changes nothing
    writer.close(expected_samples=len(written))
    store = Store(tmp_path / "s")
    store.verify()
    assert len(store.manifest["shards"]) > 6 and store.manifest["complete"]
    for pos in range(len(store)):
        s = store.sample(pos)
        ids, hidden = written[int(s["index"])]
        assert torch.equal(s["input_ids"], ids)
        if dtype == "bf16":
            assert torch.equal(s["hidden"], hidden.float())
        else:
            err = (s["hidden"] - hidden.float()).norm(dim=-1) / hidden.float().norm(dim=-1)
            assert err.max() < 0.05


def _fp8_header(L: int, H: int) -> dict:
    target = {"model": "test", "config_hash": "c", "tokenizer_hash": "t", "num_layers": 4, "hidden_size": H,
              "vocab_size": 1000}
    return {"target": target, "layer_ids": [1, 2, 4][:L], "dtype": "fp8", "hidden_size": H, "prepared": "test"}


def test_writer_stores_quantized_samples_as_it_would_have_quantized_them(tmp_path):
    """Samples quantized by the caller (capture quantizes on its device), left to the writer, or
    alternating (the kinds never share a shard): the same bytes for every sample."""
    from eyas.store import Store, StoreWriter

    L, H = 3, 16
    g = torch.Generator().manual_seed(0)
    hidden = {i: (torch.randn(n, L, H, generator=g) * 50).to(torch.bfloat16)
              for i, n in enumerate([7, 13, 21, 3, 90, 11, 40, 1, 25, 17])}
    stored = {}
    for mode in ("writer", "caller", "mixed"):
        writer = StoreWriter(tmp_path / mode, _fp8_header(L, H), shard_bytes=40 * L * H, threads=2)
        for i, h in hidden.items():
            ids, mask = torch.arange(len(h)), torch.ones(len(h), dtype=torch.bool)
            if mode == "writer" or (mode == "mixed" and i % 2):
                writer.add(i, ids, mask, h)
            else:
                q, scale = quantize_fp8(h)
                writer.add(i, ids, mask, q, scale=scale)
        writer.close(expected_samples=len(hidden))
        store = Store(tmp_path / mode)
        store.verify()
        stored[mode] = {int(s["index"]): s for s in (store.stored(p) for p in range(len(store)))}
    for i in hidden:
        for mode in ("caller", "mixed"):
            a, b = stored["writer"][i], stored[mode][i]
            assert torch.equal(a["hidden"].view(torch.uint8), b["hidden"].view(torch.uint8))
            assert torch.equal(a["scale"].view(torch.int32), b["scale"].view(torch.int32))


def test_writer_refuses_bad_quantized_samples_and_nonfinite_scales(tmp_path):
    from eyas.errors import EyasError
    from eyas.store import StoreWriter

    L, H = 3, 16
    writer = StoreWriter(tmp_path / "s", _fp8_header(L, H))
    ids, mask = torch.arange(5), torch.ones(5, dtype=torch.bool)
    q, scale = quantize_fp8(torch.randn(5, L, H))
    with pytest.raises(ValueError, match="need their scale"):
        writer.add(0, ids, mask, q)
    with pytest.raises(ValueError, match="not torch.float32 with torch.float32"):
        writer.add(0, ids, mask, q.float(), scale=scale)
    with pytest.raises(ValueError, match="not torch.float8_e4m3fn with torch.bfloat16"):
        writer.add(0, ids, mask, q, scale=scale.bfloat16())
    with pytest.raises(ValueError, match=r"\(5, 3, 16\) with scales \(5, 2\); expected \[T, 3, 16\] with \[T, 3\]"):
        writer.add(0, ids, mask, q, scale=scale[:, :2])
    for bad in (float("nan"), float("inf"), -float("inf")):  # hidden by quantization, never by the scale
        h = torch.randn(5, L, H)
        h[3, 2, 7] = bad
        h[4, 0, 0] = bad
        with pytest.raises(EyasError, match=r"Sample 9 has non-finite hidden states \(token 3, layer id 4\)"):
            writer.add(9, ids, mask, *quantize_fp8(h))
    writer.abort()
    header = {**_fp8_header(L, H), "dtype": "bf16"}
    writer = StoreWriter(tmp_path / "b", header)
    with pytest.raises(ValueError, match="this store's dtype is torch.bfloat16, not fp8"):
        writer.add(0, ids, mask, q, scale=scale)
    writer.abort()
