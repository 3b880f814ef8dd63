"""An eyas store written in speculators' offline layout, so its own trainer reads the same data.

speculators 0.9.0's offline layout (read from its wheel: `train/data.py` ArrowDataset,
`hs_connectors/transfer.py` FileTransfer, `data_generation/preprocessing.py`):

  OUT/                       a `datasets` `save_to_disk` folder, format "torch", one row per sample:
                               input_ids [T] int64, loss_mask [T] int64 (1 = assistant token),
                               seq_len int (= T)
  OUT/hidden_states/hs_{i}.safetensors   row i's states: token_ids [T] int64 (must equal the row's
                               input_ids, else the row is dropped) and hidden_states [T, L+1, H]: the
                               aux layers in `--target-layer-ids` order, then the final state
  OUT/token_freq.pt          {token id: count} over loss-masked tokens (its draft vocabulary source)
  OUT/d2t-{Vd}.npy, t2d-{Vd}.npy   a given draft vocabulary (offsets, and a bool mask)

Conventions, eyas -> speculators, and what the conversion does about each:
- final state: both take the last layer's output *before* the final norm (eyas id N; the peer
  applies its frozen `verifier_norm` itself): copied unchanged, after checking the store's last
  id is N.
- aux-layer ids: both count inputs of layers (vLLM's convention: id k = transformers'
  hidden_states[k]); the ids are passed through unchanged as the peer's `--target-layer-ids`.
- dtype: the peer casts whatever it reads to `--hidden-states-dtype` (bf16); its file backend has
  no per-row scale, so an fp8 store is dequantized (hidden * scale) and written as `dtype`.
- loss mask: both mark assistant tokens token by token; eyas keeps bool, the peer int64 0/1.
  Each trainer applies its own shift (the peer's `shift_batch` drops token 0).
- rows: one per stored sample, in store order (the peer's train/val split is by row order).

The datasets folder needs the `datasets` package (the peer's own dependency); everything else is
written with what eyas already depends on.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import torch
from safetensors.torch import save

from eyas.errors import EyasError
from eyas.paths import atomic_write_bytes, atomic_write_json
from eyas.store.format import dequantize
from eyas.store.reader import Store

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
HIDDEN_DIR = "hidden_states"
SIDECAR = "eyas-peer.json"  # what was converted from where, and the peer's --target-layer-ids


def hs_name(i: int) -> str:
    return f"hs_{i}.safetensors"


def peer_rows(store: Store, positions: Iterable[int], dtype: torch.dtype):
    """Per stored sample: the peer's row (input_ids, loss_mask, seq_len) and its states file's
    tensors (token_ids [T] int64, hidden_states [T, L+1, H] in `dtype`)."""
    for pos in positions:
        s = store.stored(pos)
        ids = s["input_ids"].long()
        hidden = s["hidden"] if s["scale"] is None else dequantize(s["hidden"], s["scale"])
        row = {"input_ids": ids, "loss_mask": s["loss_mask"].long(), "seq_len": int(ids.shape[0])}
        yield row, {"token_ids": ids.clone(), "hidden_states": hidden.to(dtype).contiguous()}


def check_layers(store: Store) -> tuple[int, ...]:
    """The peer's --target-layer-ids; raises unless the store's last id is the pre-norm final state."""
    ids, n = store.layer_ids, store.identity.num_layers
    if len(ids) < 2 or ids[-1] != n or any(not 0 <= k < n for k in ids[:-1]):
        raise EyasError(f"{store.path}: layer ids {list(ids)} are not aux ids then {n} (the {n}-layer target's "
                        "final state before its norm), which speculators' layout needs last.")
    return tuple(ids[:-1])


def write_states(store: Store, out: Path, positions: list[int], dtype: str) -> tuple[dict[str, list], dict[int, int]]:
    """hidden_states/hs_{i}.safetensors for row i = positions[i]; returns the rows' columns and the
    loss-masked token counts (token_freq.pt). Needs nothing beyond eyas's own dependencies."""
    rows: dict[str, list] = {"input_ids": [], "loss_mask": [], "seq_len": []}
    freq: dict[int, int] = {}
    for i, (row, states) in enumerate(peer_rows(store, positions, DTYPES[dtype])):
        atomic_write_bytes(out / HIDDEN_DIR / hs_name(i), save(states))
        for k in rows:
            rows[k].append(row[k])
        ids, counts = row["input_ids"][row["loss_mask"].bool()].unique(return_counts=True)
        for t, c in zip(ids.tolist(), counts.tolist()):
            freq[t] = freq.get(t, 0) + c
    return rows, freq


def datasets_quiet() -> None:
    """`datasets` checks every row it formats against torchvision's VideoReader whenever
    torchvision is imported (transformers imports it); torchvision releases without VideoReader
    then fail the import. No row here is a video: tell `datasets` torchvision is absent."""
    import datasets.config

    datasets.config.TORCHVISION_AVAILABLE = False


def quiet_worker(worker_id: int) -> None:
    """The peer's DataLoader worker set-up with `datasets_quiet` first: its workers are spawned,
    so they import `datasets` afresh and would not see the parent's setting."""
    from speculators.train import dataloader

    datasets_quiet()
    dataloader._worker_init_fn(worker_id)


def convert(store_path: str | Path, out: str | Path, *, dtype: str = "bf16", positions: list[int] | None = None,
            draft_to_target: torch.Tensor | None = None) -> dict[str, Any]:
    """Write `store_path`'s samples (all, or `positions` in that order) to `out` in speculators'
    offline layout; with `draft_to_target` [Vd] (target id of each draft id), also its vocab files."""
    from datasets import Dataset

    datasets_quiet()
    store = Store(store_path)
    aux = check_layers(store)
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise EyasError(f"{out} is not empty; the peer's layout is written into a new folder.")
    positions = list(range(len(store))) if positions is None else list(positions)
    rows, freq = write_states(store, out, positions, dtype)
    data = Dataset.from_dict({k: [v.tolist() if torch.is_tensor(v) else v for v in vals] for k, vals in rows.items()})
    data.set_format(type="torch")
    data.save_to_disk(str(out))
    buf = io.BytesIO()
    torch.save(freq, buf)  # the peer's own format for it
    atomic_write_bytes(out / "token_freq.pt", buf.getvalue())
    if draft_to_target is not None:
        write_vocab(out, draft_to_target, store.identity.vocab_size)
    summary = {"store": str(store_path), "rows": len(positions), "tokens": sum(rows["seq_len"]), "dtype": dtype,
               "target_layer_ids": list(aux), "final_state": f"id {store.layer_ids[-1]}, before the final norm",
               "store_dtype": store.manifest.get("dtype"), "positions": positions}
    atomic_write_json(out / SIDECAR, summary)
    return summary


def write_vocab(out: Path, draft_to_target: torch.Tensor, vocab_size: int) -> None:
    """d2t-{Vd}.npy (target = draft + d2t[draft]) and t2d-{Vd}.npy ([V] bool), as the peer reads them."""
    d2t_ids = draft_to_target.long().cpu()
    d2t = d2t_ids - torch.arange(len(d2t_ids))
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[d2t_ids] = True
    for name, array in ((f"d2t-{len(d2t_ids)}.npy", d2t.numpy()), (f"t2d-{len(d2t_ids)}.npy", t2d.numpy())):
        buf = io.BytesIO()
        np.save(buf, array)
        atomic_write_bytes(out / name, buf.getvalue())
