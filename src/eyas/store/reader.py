"""Read a store: memory-mapped shards, samples by position, and a full verification."""

from __future__ import annotations

import bisect
import hashlib
import json
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors import safe_open

from eyas.errors import EyasError
from eyas.models.identity import ModelIdentity
from eyas.paths import plain_name
from eyas.store.format import FORMAT, MANIFEST, SHARD_PATTERN, STORE_DTYPES, dequantize

REPAIR = "run `eyas inspect {path} --repair` to rebuild the manifest from the shards that verify"


def read_manifest(path: str | Path) -> dict[str, Any]:
    """The manifest, checked to be well-formed and self-consistent; any flaw is an `EyasError`."""
    path = Path(path)
    try:
        manifest = json.loads((path / MANIFEST).read_bytes())
    except FileNotFoundError:
        raise EyasError(f"{path} is not an eyas store: it has no {MANIFEST}.") from None
    except (ValueError, RecursionError, OSError) as e:
        raise EyasError(f"{path / MANIFEST} is unreadable or corrupt ({type(e).__name__}: {e}).") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise EyasError(f"{path / MANIFEST} is not an eyas store manifest.")
    check_manifest(manifest, path / MANIFEST)
    return manifest


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def check_manifest(m: dict[str, Any], where: Path) -> None:
    """Types, ranges and totals: what every reader relies on before it opens a shard."""
    def bad(what: str) -> EyasError:
        return EyasError(f"{where}: {what}.")

    target = m.get("target")
    if not isinstance(target, dict) or not all(isinstance(target.get(k), str) for k in ("model", "config_hash", "tokenizer_hash")) \
            or not all(_count(target.get(k)) and target[k] > 0 for k in ("num_layers", "hidden_size", "vocab_size")):
        raise bad("`target` is not a complete model record")
    ids = m.get("layer_ids")
    if not isinstance(ids, list) or len(ids) < 2 or not all(_count(k) for k in ids):
        raise bad(f"`layer_ids` {ids!r} is not a list of at least two layer ids")
    if m.get("dtype") not in STORE_DTYPES:
        raise bad(f"`dtype` {m.get('dtype')!r} is not one of {', '.join(STORE_DTYPES)}")
    if not _count(m.get("hidden_size")) or m["hidden_size"] == 0:
        raise bad(f"`hidden_size` {m.get('hidden_size')!r} is not a positive integer")
    shards = m.get("shards")
    if not isinstance(shards, list) or not _count(m.get("num_samples")) or not _count(m.get("num_tokens")):
        raise bad("`shards`, `num_samples` or `num_tokens` is missing or of the wrong type")
    seen: set[str] = set()
    for i, shard in enumerate(shards):
        if not isinstance(shard, dict) or not isinstance(shard.get("sha256"), str) or \
                not all(_count(shard.get(k)) for k in ("bytes", "num_samples", "num_tokens")):
            raise bad(f"shard entry {i} is malformed")
        name = plain_name(shard.get("file"), f"{where}, shard entry {i},")
        if not SHARD_PATTERN.fullmatch(name):
            raise bad(f"shard entry {i} names {name!r}, which is not a shard file name (shard-NNNNN.safetensors)")
        if name in seen:
            raise bad(f"{name} is listed twice; {REPAIR.format(path=where.parent)}")
        seen.add(name)
    if sum(s["num_samples"] for s in shards) != m["num_samples"] or sum(s["num_tokens"] for s in shards) != m["num_tokens"]:
        raise bad(f"its totals ({m['num_samples']} samples, {m['num_tokens']} tokens) disagree with its shard entries")


def check_files(path: Path, m: dict[str, Any]) -> None:
    """The shard files on disk must be exactly those the manifest lists."""
    pending = m.get("pending")
    listed = {s["file"] for s in m["shards"]} | {s.get("file") for s in (pending if isinstance(pending, list) else [])
                                                 if isinstance(s, dict)}
    on_disk = {p.name for p in path.iterdir() if SHARD_PATTERN.fullmatch(p.name)}
    if missing := sorted({s["file"] for s in m["shards"]} - on_disk):
        raise EyasError(f"{path}: {missing[0]} is listed in the manifest but missing"
                        f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}; {REPAIR.format(path=path)}.")
    if unlisted := sorted(on_disk - listed):
        raise EyasError(f"{path}: {unlisted[0]} is on disk but not in the manifest"
                        f"{f' (and {len(unlisted) - 1} more)' if len(unlisted) > 1 else ''}; nothing was overwritten. "
                        f"Move it away, or {REPAIR.format(path=path)}.")


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
        from eyas.store.verify import check_structure

        check_structure(self)

    def sample_indices(self) -> torch.Tensor:
        """`[len]` int64: the prepared-data position of every stored sample, in store order."""
        if not self.manifest["shards"]:
            return torch.zeros(0, dtype=torch.int64)
        return torch.cat([self.shard_tensor(i, "sample_index") for i in range(len(self.manifest["shards"]))])

    def stored(self, pos: int) -> dict[str, Any]:
        """One sample as stored: `input_ids [T] int64`, `loss_mask [T] bool`, `hidden [T, L, H]` in
        the store's dtype, `scale [T, L] float32` (fp8) or None; `dequantize` turns them into floats."""
        if not 0 <= pos < len(self):
            raise IndexError(pos)
        shard = bisect.bisect_right(self._starts, pos) - 1
        j = pos - self._starts[shard]
        handle = self._shard(shard)
        a, b = self._offsets[shard][j].item(), self._offsets[shard][j + 1].item()
        return {
            "input_ids": handle.get_slice("input_ids")[a:b].long(),
            "loss_mask": handle.get_slice("loss_mask")[a:b].bool(),
            "hidden": handle.get_slice("hidden")[a:b],
            "scale": handle.get_slice("scale")[a:b] if "scale" in handle.keys() else None,
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
        from eyas.store.verify import verify_store

        verify_store(self)
