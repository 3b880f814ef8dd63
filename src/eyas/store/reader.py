"""Read a store: memory-mapped shards, samples by position, and a full verification."""

from __future__ import annotations

import bisect
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors import safe_open

from eyas.errors import EyasError
from eyas.models.identity import ModelIdentity
from eyas.store.format import REPAIR, dequantize, read_manifest
from eyas.store.verify import check_structure, verify_store


class Store:
    """A store opened for reading. Samples are addressed by position 0..len-1 in shard order;
    `sample_index` says which prepared sample each one is."""

    def __init__(self, path: str | Path, manifest: dict[str, Any] | None = None):
        self.path = Path(path)
        self.manifest = manifest if manifest is not None else read_manifest(self.path)
        self._handles: dict[int, Any] = {}
        self._offsets: dict[int, torch.Tensor] = {}
        counts = [s["num_samples"] for s in self.manifest["shards"]]
        self._starts = [sum(counts[:i]) for i in range(len(counts))]

    @property
    def layer_ids(self) -> tuple[int, ...]:
        return tuple(self.manifest["layer_ids"])

    @property
    def identity(self) -> ModelIdentity:
        return ModelIdentity.from_dict(self.manifest["target"])

    @property
    def hidden_size(self) -> int:
        return int(self.manifest["hidden_size"])

    @property
    def num_tokens(self) -> int:
        return int(self.manifest["num_tokens"])

    def __len__(self) -> int:
        return int(self.manifest["num_samples"])

    def _shard(self, i: int):
        if i not in self._handles:
            file = self.path / self.manifest["shards"][i]["file"]
            try:
                self._handles[i] = safe_open(str(file), framework="pt")  # memory-mapped
                self._offsets[i] = self._handles[i].get_tensor("offsets")
            except FileNotFoundError:
                raise EyasError(f"Shard {file} listed in the manifest is missing.") from None
            except Exception as e:  # safetensors' own errors on a damaged file
                raise EyasError(f"{file.name}: unreadable ({e}); {REPAIR.format(path=self.path)}.") from None
        return self._handles[i]

    def shard_tensor(self, i: int, name: str) -> torch.Tensor:
        handle = self._shard(i)
        try:
            return handle.get_tensor(name)
        except Exception as e:  # a missing or damaged tensor
            raise EyasError(f"{self.manifest['shards'][i]['file']}: cannot read {name} ({e}).") from None

    def check(self) -> None:
        """The cheap structural check (headers and small tensors); raise `EyasError` naming the first problem."""
        check_structure(self)

    def sample_indices(self) -> torch.Tensor:
        """`[len]` int64: the prepared-data position of every stored sample, in store order."""
        if not self.manifest["shards"]:
            return torch.zeros(0, dtype=torch.int64)
        return torch.cat([self.shard_tensor(i, "sample_index") for i in range(len(self.manifest["shards"]))])

    def stored(self, pos: int, rows: tuple[int, int] | None = None) -> dict[str, Any]:
        """One sample as stored: `input_ids [T] int64`, `loss_mask [T] bool`, `hidden [T, L, H]` in
        the store's dtype, `scale [T, L] float32` (fp8) or None; `dequantize` turns them into floats.
        With `rows` (lo, hi), hidden and scale hold only positions lo..hi-1 that the sample has:
        a slice read from the shard, not the whole sample's states."""
        if not 0 <= pos < len(self):
            raise IndexError(pos)
        shard = bisect.bisect_right(self._starts, pos) - 1
        j = pos - self._starts[shard]
        handle = self._shard(shard)
        a, b = self._offsets[shard][j].item(), self._offsets[shard][j + 1].item()
        lo, hi = (a, b) if rows is None else (min(a + rows[0], b), min(a + rows[1], b))
        return {
            "input_ids": handle.get_slice("input_ids")[a:b].long(),
            "loss_mask": handle.get_slice("loss_mask")[a:b].bool(),
            "hidden": handle.get_slice("hidden")[lo:hi],
            "scale": handle.get_slice("scale")[lo:hi] if "scale" in handle.keys() else None,
            "index": torch.tensor(handle.get_slice("sample_index")[j : j + 1].item()),
        }

    def sample(self, pos: int) -> dict[str, torch.Tensor]:
        """One sample: `input_ids [T] int64`, `loss_mask [T] bool`, `hidden [T, L, H] float32`."""
        s = self.stored(pos)
        return {"input_ids": s["input_ids"], "loss_mask": s["loss_mask"], "hidden": dequantize(s["hidden"], s["scale"]),
                "index": s["index"]}

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        for pos in range(len(self)):
            yield self.sample(pos)

    def bytes_per_token(self) -> float:
        total = sum(s["bytes"] for s in self.manifest["shards"])
        return total / max(self.num_tokens, 1)

    def verify(self) -> None:
        """The full check (structure, sha256, NaN/inf); raise `EyasError` naming the first problem."""
        verify_store(self)
