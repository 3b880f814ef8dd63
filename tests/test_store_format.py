"""The store's building blocks: the shard file writer, the NaN/inf scan, host staging."""

from __future__ import annotations

import hashlib
import io

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load

from eyas.capture.staging import HostStager
from eyas.store.format import SAFETENSORS_DTYPES, first_nonfinite, write_safetensors

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
    assert len(out) == 3 and all(torch.equal(a, b) for a, b in zip(out, states))


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
    got = collect()
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
