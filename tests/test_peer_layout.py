"""bench/peer_layout.py: an eyas store written in speculators' offline layout holds the same
input ids, loss mask and hidden states, within the output dtype's rounding.

Which check this is: the FALLBACK the issue allows, field by field against the layout as
speculators 0.9.0's own readers define it (ArrowDataset in `speculators/train/data.py`,
FileTransfer in `hs_connectors/transfer.py`): the peer and its `datasets`/pyarrow
dependencies are not installed in the test environment. The round trip through the peer's
own data loader (ArrowDataset + its CollateFn + shift_batch) runs in bench/peers.py (its
`--smoke` mode and on the GPU machine, where the peer is installed)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import peer_layout  # noqa: E402

from eyas.errors import EyasError  # noqa: E402
from eyas.store import Store, StoreWriter  # noqa: E402
from eyas.store.format import quantize_fp8  # noqa: E402

N, L, H, V = 6, 4, 16, 500  # target layers; stored layers (3 aux + the final one); width; vocabulary


def _store(path: Path, dtype: str, layer_ids=(2, 3, 4, N)) -> dict[int, tuple]:
    target = {"model": "test", "config_hash": "c", "tokenizer_hash": "t", "num_layers": N, "hidden_size": H,
              "vocab_size": V}
    header = {"target": target, "layer_ids": list(layer_ids), "dtype": dtype, "hidden_size": H, "prepared": "test"}
    writer = StoreWriter(path, header, shard_bytes=30 * L * H, threads=1)  # several shards
    g = torch.Generator().manual_seed(0)
    written = {}
    for i, n in enumerate([7, 13, 21, 3, 40, 1]):
        ids = torch.randint(0, V, (n,), generator=g)
        mask = torch.rand(n, generator=g) < 0.6
        hidden = torch.randn(n, L, H, generator=g) * 3
        written[i] = (ids, mask, hidden)
        if dtype == "fp8":
            writer.add(i, ids, mask, *quantize_fp8(hidden))
        else:
            writer.add(i, ids, mask, hidden.to(torch.bfloat16))
    writer.close(expected_samples=len(written))
    return written


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_states_files_hold_the_store_as_the_peer_reads_it(tmp_path, dtype):
    written = _store(tmp_path / "s", dtype)
    store = Store(tmp_path / "s")
    out = tmp_path / "peer"
    positions = [4, 0, 2, 5]  # any subset, in the order given: row i is positions[i]
    rows, freq = peer_layout.write_states(store, out, positions, "bf16")
    assert peer_layout.check_layers(store) == (2, 3, 4)  # --target-layer-ids: the aux ids, unchanged
    counted: dict[int, int] = {}
    for i, pos in enumerate(positions):
        ids, mask, hidden = written[pos]
        sample = store.sample(pos)  # the store's own float32 reading (fp8: dequantized)
        f = load_file(out / "hidden_states" / f"hs_{i}.safetensors")
        assert set(f) == {"token_ids", "hidden_states"}
        assert f["token_ids"].dtype == torch.int64 and torch.equal(f["token_ids"], ids)
        assert torch.equal(rows["input_ids"][i], f["token_ids"])  # else the peer drops the row
        assert rows["loss_mask"][i].dtype == torch.int64 and torch.equal(rows["loss_mask"][i], mask.long())
        assert rows["seq_len"][i] == len(ids)
        hs = f["hidden_states"]
        assert hs.dtype == torch.bfloat16 and hs.shape == (len(ids), L, H)  # [T, aux + final, H]
        # The layers in the store's order, the final (pre-norm) state last, each within bf16 rounding
        # of what the store holds; the peer's loader splits them as [:, :-1] and [:, -1].
        torch.testing.assert_close(hs.float(), sample["hidden"], rtol=2**-8, atol=0)
        assert torch.equal(hs[:, -1], sample["hidden"][:, -1].bfloat16())
        for t in ids[mask].tolist():
            counted[t] = counted.get(t, 0) + 1
    assert freq == counted  # token_freq.pt counts loss-masked tokens only


def test_a_store_without_the_final_state_last_is_refused(tmp_path):
    _store(tmp_path / "s", "bf16", layer_ids=(1, 2, 3, 4))
    with pytest.raises(EyasError, match="final state before its norm"):
        peer_layout.check_layers(Store(tmp_path / "s"))


def test_vocab_files_are_offsets_and_a_mask(tmp_path):
    import numpy as np

    draft_to_target = torch.tensor([0, 3, 4, 9, 20])
    tmp_path.mkdir(exist_ok=True)
    peer_layout.write_vocab(tmp_path, draft_to_target, 32)
    d2t, t2d = np.load(tmp_path / "d2t-5.npy"), np.load(tmp_path / "t2d-5.npy")
    assert (np.arange(5) + d2t).tolist() == draft_to_target.tolist()
    assert t2d.dtype == bool and t2d.nonzero()[0].tolist() == draft_to_target.tolist()
