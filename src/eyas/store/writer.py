"""Append captured samples to a store, so that a killed run loses nothing and repeats nothing.

Samples are copied into a shard buffer until it is full, then handed to background threads,
which serialise, hash and write the shard; all of that releases the GIL, so shards overlap
each other and the capture loop. A thread writes its shard to a temp file (fsync), then,
holding the store's lock, names it after the highest shard number listed or on disk (never a
count, so no recorded file is ever overwritten), records it as pending in the manifest,
renames it, and moves its entry to the shards. Several writers — the ranks of a data-parallel
capture — can therefore append to one store with one manifest. A run killed between those
steps leaves a pending entry, which the next writer settles: the shard is kept if its file is
whole, else forgotten. Any other disagreement between the manifest and the files stops the
writer, naming it: it is the user's to settle (`eyas inspect --repair`).

Written buffers are reused: a long capture keeps touching the same memory instead of
faulting in fresh pages for every batch (kernel work that every rank of a machine does at once).
"""

from __future__ import annotations

import errno
import fcntl
import math
import os
import queue
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch

from eyas.errors import EyasError
from eyas.lock import LOCK_FILE, open_lock_file
from eyas.models.identity import ModelIdentity
from eyas.paths import atomic_write_json, fsync_dir, remove_leftovers, sha256_file, temp_file
from eyas.store.format import (ADDED_HEADER_KEYS, MANIFEST, SHARD_PATTERN, check_files, first_nonfinite, new_manifest, next_shard_name,
                               quantize_fp8, read_manifest, shard_entry, shard_metadata, store_dtype, with_shard,
                               write_safetensors)
from eyas.store.reader import Store

LOCK = ".lock"
SHARD_TEMP = "shard"  # a shard is written as `.shard.XXXXXXXX.tmp`, then renamed to its name
Buffers = tuple[torch.Tensor, torch.Tensor | None]  # a shard's hidden [rows, L, H], fp8 scales [rows, L] or None


@contextmanager
def store_lock(path: Path) -> Iterator[None]:
    """Exclusive lock on the store folder: one writer at a time touches the manifest."""
    path.mkdir(parents=True, exist_ok=True)
    fd = open_lock_file(path / LOCK, os.O_WRONLY | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _disk_full(path: Path) -> EyasError:
    return EyasError(
        f"Disk full while writing {path}; the store holds every shard recorded before it intact. "
        f"Free space and run the same command again to resume."
    )


def settle_pending(path: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """Settle the shard a killed writer was recording: keep it if its file is whole, else forget
    the entry (its samples are captured again). Call holding the store lock."""
    pending = manifest.get("pending")
    if pending is None:
        return manifest
    settled = {k: v for k, v in manifest.items() if k != "pending"}
    for entry in pending if isinstance(pending, list) else []:
        name = entry.get("file") if isinstance(entry, dict) else None
        file = path / name if isinstance(name, str) and SHARD_PATTERN.fullmatch(name) else None  # a plain shard name
        if (file is not None and file.is_file() and not file.is_symlink()
                and all(s["file"] != file.name for s in settled["shards"]) and sha256_file(file) == entry.get("sha256")):
            settled = with_shard(settled, entry)
    atomic_write_json(path / MANIFEST, settled)
    return read_manifest(path)


class StoreWriter:
    """Open (or resume) a store. `header` (see `format.manifest_header`) fixes what every shard
    must agree with: target identity, layer ids, dtype, hidden size, and the prepared data it
    was captured from."""

    def __init__(self, path: str | Path, header: dict[str, Any], shard_bytes: int = 1 << 30, threads: int = 3,
                 expected_samples: int | None = None):
        self.path = Path(path)
        self.expected_samples = expected_samples  # recorded, so a reader can say how much is missing
        self.dtype = store_dtype(header["dtype"])
        self.layer_ids = list(header["layer_ids"])
        self.done: set[int] = set()
        with store_lock(self.path):  # other ranks of a job may be recording shards meanwhile
            self.manifest = self._open(header)
            if self.manifest["shards"]:
                store = Store(self.path, self.manifest)
                store.check()
                self.done = set(store.sample_indices().tolist())
        self._row_shape = (len(self.layer_ids), int(header["hidden_size"]))
        self._capacity = max(1, shard_bytes // (math.prod(self._row_shape) * self.dtype.itemsize))  # tokens
        self._hidden: torch.Tensor | None = None  # the shard being filled, [rows, L, H]
        self._scale: torch.Tensor | None = None  # its fp8 scales [rows, L] float32, if it came quantized
        self._used = 0  # its rows filled so far
        self._samples: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (index, input_ids, loss_mask)
        self._free: queue.SimpleQueue[Buffers] = queue.SimpleQueue()  # buffers whose shard is written
        # One shard waiting besides those being written: at most 2 + threads shard buffers exist.
        self._queue: queue.Queue = queue.Queue(maxsize=1)
        self._error: BaseException | None = None
        self.wait_seconds = 0.0  # the caller's time blocked on the writer threads: the disk's share
        self._threads = [threading.Thread(target=self._drain, name=f"eyas-store-writer-{i}", daemon=True)
                         for i in range(threads)]
        for thread in self._threads:
            thread.start()

    def _open(self, header: dict[str, Any]) -> dict[str, Any]:
        remove_leftovers(self.path, (MANIFEST, SHARD_TEMP))  # a killed writer's; a live one's are kept
        if (self.path / MANIFEST).is_file():
            manifest = settle_pending(self.path, read_manifest(self.path))
            check_files(self.path, manifest)
            try:  # by identity, as every stage compares: one model may be given as two paths
                ModelIdentity.from_dict(header["target"]).check_same(ModelIdentity.from_dict(manifest["target"]),
                                                                     f"The store in {self.path}")
            except EyasError as e:
                raise EyasError(f"{e} Resume it with the target it was captured from, or use another --out.") from None
            for key, value in header.items():
                if key != "target" and manifest.get(key) != value and (key in manifest or key not in ADDED_HEADER_KEYS):
                    raise EyasError(
                        f"{self.path} already holds a store with a different {key} "
                        f"({manifest.get(key)!r} vs {value!r}); use another --out or delete it."
                    )
            return manifest
        if any(p.name not in (LOCK, LOCK_FILE) for p in self.path.iterdir()):
            raise EyasError(f"{self.path} exists, is not empty and is not an eyas store; choose another --out.")
        manifest = new_manifest(header, self.expected_samples)
        atomic_write_json(self.path / MANIFEST, manifest)
        return manifest

    def add(self, index: int, input_ids: torch.Tensor, loss_mask: torch.Tensor, hidden: torch.Tensor,
            scale: torch.Tensor | None = None) -> None:
        """Queue one sample: `input_ids [T]`, `loss_mask [T]`, `hidden [T, L, H]` (any float dtype,
        any device). It is copied: the caller may reuse its tensors at once.

        An fp8 store also takes samples already quantized by `quantize_fp8` (on the capture
        device, so the host copies 1 byte a value): `hidden` float8_e4m3fn with its `scale [T, L]`
        float32. A NaN or inf in a row makes its scale non-finite, so checking the scale
        refuses exactly the (token, layer) rows the unquantized states would have."""
        self._raise_pending()
        if scale is not None or hidden.dtype == torch.float8_e4m3fn:
            self._check_quantized(hidden, scale)
        if (bad := first_nonfinite(hidden if scale is None else scale)) is not None:
            raise EyasError(
                f"Sample {index} has non-finite hidden states (token {bad[0]}, layer id {self.layer_ids[bad[1]]}); "
                f"nothing of it was written. Capture in float32 or bf16 (fp16 can overflow)."
            )
        n = len(hidden)
        quantized = scale is not None
        if self._hidden is not None and (self._used + n > len(self._hidden) or (self._scale is not None) != quantized):
            self._flush()  # full, or quantized and unquantized samples would share a shard
        if self._hidden is None:
            self._hidden, self._scale = self._take_buffer(n, hidden.dtype, quantized)
        self._hidden[self._used : self._used + n].copy_(hidden.detach())
        if scale is not None:
            self._scale[self._used : self._used + n].copy_(scale)
        self._used += n
        self._samples.append((index, input_ids.to("cpu", torch.int32), loss_mask.to("cpu", torch.uint8)))
        if self._used >= self._capacity:
            self._flush()

    def _check_quantized(self, hidden: torch.Tensor, scale: torch.Tensor | None) -> None:
        """Refuse a `scale` that does not belong to fp8 `hidden` of this store's shape."""
        if self.dtype != torch.float8_e4m3fn:
            raise ValueError(f"Quantized hidden states were given, but this store's dtype is {self.dtype}, not fp8.")
        if scale is None:
            raise ValueError("float8_e4m3fn hidden states need their scale [T, L] (scale=, from quantize_fp8).")
        if hidden.dtype != torch.float8_e4m3fn or scale.dtype != torch.float32:
            raise ValueError(f"Quantized samples are float8_e4m3fn hidden states with float32 scales, "
                             f"not {hidden.dtype} with {scale.dtype}.")
        L, H = self._row_shape
        if hidden.dim() != 3 or tuple(hidden.shape[1:]) != (L, H) or scale.shape != hidden.shape[:2]:
            raise ValueError(f"Quantized hidden states {tuple(hidden.shape)} with scales {tuple(scale.shape)}; "
                             f"expected [T, {L}, {H}] with [T, {L}].")

    def _take_buffer(self, rows: int, incoming: torch.dtype, quantized: bool) -> Buffers:
        """Written buffers if free, else new ones; a sample longer than a shard gets its own.
        An fp8 store's samples that come unquantized are quantized when the shard is packed,
        from exactly what came in; quantized ones come with scales, kept beside them."""
        dtype = incoming if self.dtype == torch.float8_e4m3fn else self.dtype
        if rows <= self._capacity:
            try:
                hidden, scale = self._free.get_nowait()
                if hidden.dtype == dtype and (scale is not None) == quantized:
                    return hidden, scale
            except queue.Empty:
                pass
        rows = max(rows, self._capacity)
        hidden = torch.empty(rows, *self._row_shape, dtype=dtype)  # [rows, L, H]
        scale = torch.empty(rows, self._row_shape[0], dtype=torch.float32) if quantized else None  # [rows, L]
        return hidden, scale

    def _flush(self) -> None:
        if self._samples:
            job = (self._samples, (self._hidden, self._scale), self._used)
            self._samples, self._hidden, self._scale, self._used = [], None, None, 0
            started = time.monotonic()
            self._queue.put(job)
            self.wait_seconds += time.monotonic() - started
        self._raise_pending()

    def _drain(self) -> None:
        while (job := self._queue.get()) is not None:
            samples, (hidden, scale), used = job
            if self._error is None:
                try:
                    self._write_shard(self._pack(samples, hidden[:used], None if scale is None else scale[:used]))
                except BaseException as e:  # handed to the main thread by _raise_pending
                    self._error = e
            if len(hidden) == self._capacity:
                self._free.put((hidden, scale))

    def _pack(self, samples: list[tuple[int, torch.Tensor, torch.Tensor]], hidden: torch.Tensor,
              scale: torch.Tensor | None) -> dict[str, Any]:
        """A shard's samples, their `hidden [T, L, H]` and fp8 `scale [T, L]` if already quantized
        -> the shard's tensors (see store.format)."""
        lengths = torch.tensor([s[1].numel() for s in samples])
        tensors = {
            "input_ids": torch.cat([s[1] for s in samples]),
            "loss_mask": torch.cat([s[2] for s in samples]),
            "offsets": torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]),
            "sample_index": torch.tensor([s[0] for s in samples], dtype=torch.int64),
        }
        if scale is not None:
            tensors["hidden"], tensors["scale"] = hidden, scale
        elif self.dtype == torch.float8_e4m3fn:
            tensors["hidden"], tensors["scale"] = quantize_fp8(hidden)
        else:
            tensors["hidden"] = hidden
        return tensors

    def _write_shard(self, tensors: dict[str, Any]) -> None:
        f, tmp, sha256, size = self._write_temp(tensors)
        try:
            with store_lock(self.path):
                manifest = read_manifest(self.path)  # other ranks may have appended
                on_disk = [p.name for p in self.path.iterdir()]
                name = next_shard_name([s["file"] for s in manifest["shards"]] + on_disk)
                indices = tensors["sample_index"].tolist()
                entry = shard_entry(name, sha256, size, len(indices), int(tensors["input_ids"].numel()))
                atomic_write_json(self.path / MANIFEST, {**manifest, "pending": [entry]})
                os.replace(tmp, self.path / name)  # still open: its flock keeps another rank's clean-up off it
                fsync_dir(self.path)
                self.manifest = with_shard(manifest, entry)
                atomic_write_json(self.path / MANIFEST, self.manifest)
        finally:
            f.close()
            Path(tmp).unlink(missing_ok=True)
        self.done.update(indices)

    def _write_temp(self, tensors: dict[str, Any]) -> tuple[Any, str, str, int]:
        """The shard in a durable temp file -> (the file, still open and locked, its path, sha256,
        size in bytes)."""
        fd, tmp = temp_file(self.path, f".{SHARD_TEMP}.")
        f = os.fdopen(fd, "wb")
        try:
            sha256 = write_safetensors(f, tensors, shard_metadata(self.layer_ids))
            f.flush()
            os.fsync(f.fileno())
            size = f.tell()
        except BaseException as e:
            f.close()
            Path(tmp).unlink(missing_ok=True)
            if isinstance(e, OSError) and e.errno == errno.ENOSPC:
                raise _disk_full(self.path) from e
            raise
        return f, tmp, sha256, size

    def _raise_pending(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def close(self, expected_samples: int | None = None) -> dict[str, Any]:
        """Write what is buffered and wait for the thread. The store is marked complete once
        it holds `expected_samples` samples, whichever writer gets there."""
        try:
            self._flush()
        finally:
            self._stop_threads()
        self._raise_pending()
        with store_lock(self.path):
            self.manifest = read_manifest(self.path)
            if expected_samples is not None and self.manifest["num_samples"] == expected_samples:
                self.manifest["complete"] = True
                atomic_write_json(self.path / MANIFEST, self.manifest)
        return self.manifest

    def abort(self) -> None:
        """Stop after the shards already queued; nothing half-written stays behind."""
        self._samples, self._hidden, self._scale, self._used = [], None, None, 0
        self._stop_threads()

    def _stop_threads(self) -> None:
        started = time.monotonic()
        for _ in self._threads:
            self._queue.put(None)
        for thread in self._threads:
            thread.join()
        self.wait_seconds += time.monotonic() - started
