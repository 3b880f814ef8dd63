"""Append captured samples to a store, so that a killed run loses nothing and repeats nothing.

Samples are buffered until a shard is full, then packed and handed to one background
thread, which writes the shard atomically (temp file, fsync, rename) and only then records
it in the manifest. A shard that is on disk but not in the manifest is an orphan of a killed
run: it is overwritten, and its samples are captured again.
"""

from __future__ import annotations

import errno
import hashlib
import queue
import threading
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save

from eyas import __version__
from eyas.errors import EyasError
from eyas.paths import atomic_write_bytes, atomic_write_json
from eyas.store.format import FORMAT, FORMAT_VERSION, MANIFEST, quantize_fp8, shard_name, store_dtype
from eyas.store.reader import Store, read_manifest


class StoreWriter:
    """Open (or resume) a store. `header` fixes what every shard must agree with: target
    identity, layer ids, dtype, hidden size, and the prepared data it was captured from."""

    def __init__(self, path: str | Path, header: dict[str, Any], shard_bytes: int = 1 << 30):
        self.path = Path(path)
        self.dtype_name = header["dtype"]
        self.dtype = store_dtype(self.dtype_name)
        self.shard_bytes = shard_bytes
        self.manifest = self._open(header)
        self.done: set[int] = set(Store(self.path).sample_indices().tolist()) if self.manifest["shards"] else set()
        self._buffer: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self._buffer_bytes = 0
        self._queue: queue.Queue = queue.Queue(maxsize=2)  # bounds memory held by pending shards
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._drain, name="eyas-store-writer", daemon=True)
        self._thread.start()

    def _open(self, header: dict[str, Any]) -> dict[str, Any]:
        if (self.path / MANIFEST).is_file():
            manifest = read_manifest(self.path)
            for key, value in header.items():
                if manifest.get(key) != value:
                    raise EyasError(
                        f"{self.path} already holds a store with a different {key} "
                        f"({manifest.get(key)!r} vs {value!r}); use another --out or delete it."
                    )
            return manifest
        if self.path.exists() and any(self.path.iterdir()):
            raise EyasError(f"{self.path} exists, is not empty and is not an eyas store; choose another --out.")
        manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, "eyas_version": __version__,
                    **header, "shards": [], "num_samples": 0, "num_tokens": 0, "complete": False}
        atomic_write_json(self.path / MANIFEST, manifest)
        return manifest

    def add(self, index: int, input_ids: torch.Tensor, loss_mask: torch.Tensor, hidden: torch.Tensor) -> None:
        """Queue one sample: `input_ids [T]`, `loss_mask [T]`, `hidden [T, L, H]` (any float dtype)."""
        self._raise_pending()
        if not torch.isfinite(hidden).all():
            bad = (~torch.isfinite(hidden)).nonzero()[0].tolist()
            layer = self.manifest["layer_ids"][bad[1]]
            raise EyasError(
                f"Sample {index} has non-finite hidden states (token {bad[0]}, layer id {layer}); nothing of it "
                f"was written. Capture in float32 or bf16 (fp16 can overflow)."
            )
        hidden = hidden.detach().to("cpu", torch.float32 if self.dtype == torch.float8_e4m3fn else self.dtype)
        self._buffer.append((index, input_ids.to("cpu", torch.int32), loss_mask.to("cpu", torch.uint8), hidden))
        self._buffer_bytes += hidden.numel() * self.dtype.itemsize
        if self._buffer_bytes >= self.shard_bytes:
            self._flush()

    def _flush(self) -> None:
        if not self._buffer:
            return
        samples, self._buffer, self._buffer_bytes = self._buffer, [], 0
        lengths = torch.tensor([s[1].numel() for s in samples])
        tensors = {
            "input_ids": torch.cat([s[1] for s in samples]),
            "loss_mask": torch.cat([s[2] for s in samples]),
            "offsets": torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]),
            "sample_index": torch.tensor([s[0] for s in samples], dtype=torch.int64),
        }
        hidden = torch.cat([s[3] for s in samples])  # [T, L, H]
        if self.dtype == torch.float8_e4m3fn:
            tensors["hidden"], tensors["scale"] = quantize_fp8(hidden)
        else:
            tensors["hidden"] = hidden
        self._queue.put(tensors)
        self._raise_pending()

    def _drain(self) -> None:
        while (tensors := self._queue.get()) is not None:
            if self._error is None:
                try:
                    self._write_shard(tensors)
                except BaseException as e:  # handed to the main thread by _raise_pending
                    self._error = e
            self._queue.task_done()
        self._queue.task_done()

    def _write_shard(self, tensors: dict[str, torch.Tensor]) -> None:
        name = shard_name(len(self.manifest["shards"]))
        data = save(tensors, metadata={"format": FORMAT, "layer_ids": ",".join(map(str, self.manifest["layer_ids"]))})
        try:
            atomic_write_bytes(self.path / name, data)
        except OSError as e:
            if e.errno == errno.ENOSPC:
                raise EyasError(
                    f"Disk full while writing {self.path / name}; the store holds every shard before it intact. "
                    f"Free space and run the same command again to resume."
                ) from e
            raise
        indices = tensors["sample_index"].tolist()
        self.manifest["shards"].append({
            "file": name, "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data),
            "num_samples": len(indices), "num_tokens": int(tensors["input_ids"].numel()),
        })
        self.manifest["num_samples"] += len(indices)
        self.manifest["num_tokens"] += int(tensors["input_ids"].numel())
        atomic_write_json(self.path / MANIFEST, self.manifest)
        self.done.update(indices)

    def _raise_pending(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def close(self, complete: bool = True) -> dict[str, Any]:
        """Write what is buffered, wait for the thread, and mark the store complete."""
        try:
            self._flush()
        finally:
            self._queue.put(None)
            self._thread.join()
        self._raise_pending()
        if complete:
            self.manifest["complete"] = True
            atomic_write_json(self.path / MANIFEST, self.manifest)
        return self.manifest

    def abort(self) -> None:
        """Stop after the shards already queued; nothing half-written stays behind."""
        self._buffer, self._buffer_bytes = [], 0
        self._queue.put(None)
        self._thread.join()
