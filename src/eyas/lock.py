"""One owner per output folder: capture, train, regenerate and export lock the folder they write.

The lock is `flock` on `OUT/.eyas-lock`, which records who holds it (command, host, pid, job).
The kernel drops a flock when its process dies, so a lock left by a killed run is simply
taken over; the record inside is only there to name the running owner to a second run.
The processes of one torchrun job share the lock: each holds it shared under the job's id,
and a process of any other job, or a plain run, is refused. A run that holds a folder may call
another stage on it (regenerate runs prepare into its own folder): the lock is taken once.

An output folder holds no symbolic link: eyas follows none that it did not create, so a
link in the folder (the lock file itself included) is refused before anything is written.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import stat
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from eyas.errors import EyasError

LOCK_FILE = ".eyas-lock"
_HELD: set[str] = set()  # folders this process holds (resolved paths)


def job_id() -> str | None:
    """The torchrun job this process belongs to (None outside a multi-process job)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    return ":".join(os.environ.get(k, "") for k in ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT"))


def _read(fd: int) -> dict:
    try:
        record = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return record if isinstance(record, dict) else {}
    except (OSError, ValueError):
        return {}


def _owner(record: dict) -> str:
    return (f"eyas {record.get('command', '?')} (pid {record.get('pid', '?')} on {record.get('host', '?')}, "
            f"since {record.get('started', '?')})") if record else "another eyas run"


def _busy(folder: Path, record: dict) -> EyasError:
    return EyasError(f"{folder} is in use by {_owner(record)}; wait for it to finish, or use another folder.")


@contextmanager
def output_lock(folder: str | Path, command: str, wait: float = 10.0) -> Iterator[None]:
    """Hold `folder` for this run (creating it); raise naming the owner if another run holds it."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise EyasError(f"{folder} exists and is not a folder.")
    key = str(folder.resolve())
    if key in _HELD:  # this process holds it already
        yield
        return
    created = not folder.exists()
    new_lock = not os.path.lexists(folder / LOCK_FILE)
    try:  # the first write: a folder that cannot be written is refused before any work
        folder.mkdir(parents=True, exist_ok=True)
        fd = open_lock_file(folder / LOCK_FILE, os.O_RDWR | os.O_CREAT)
    except OSError as e:
        if created and folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()
        raise EyasError(f"Cannot write in {folder} ({e.strerror}); make it writable or choose another folder.") from None
    job = job_id()
    try:
        _acquire(fd, folder, command, job, wait)
        try:
            refuse_links(folder)
            _HELD.add(key)
            try:
                yield
            finally:
                _HELD.discard(key)
        finally:
            _release(fd, folder, created, new_lock)
    finally:
        os.close(fd)


def open_lock_file(path: Path, flags: int) -> int:
    """Open a lock file without following a link to it (O_NOFOLLOW) or blocking on a FIFO put in
    its place; anything but a regular file is refused, so a lock never truncates a file elsewhere."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o666)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise EyasError(f"{path} is a symbolic link; eyas follows no link in an output folder: remove it.") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise EyasError(f"{path} is not a regular file; remove it.")
    return fd


def refuse_links(folder: Path) -> None:
    """Raise naming the first symbolic link inside `folder` (not followed, at any depth): writes,
    renames and deletions inside an output folder must never reach outside it."""
    for root, dirs, files in os.walk(folder):
        for name in sorted(dirs + files):
            if os.path.islink(os.path.join(root, name)):
                raise EyasError(f"{Path(root) / name} is a symbolic link; eyas follows no link in an output folder "
                                f"it writes: remove it, or choose another folder.")


def _acquire(fd: int, folder: Path, command: str, job: str | None, wait: float) -> None:
    deadline = time.monotonic() + wait
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pass
        else:  # sole owner: write who we are, then let the rest of our job in
            record = {"command": command, "host": socket.gethostname(), "pid": os.getpid(), "job": job,
                      "started": time.strftime("%Y-%m-%d %H:%M:%S")}
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(record).encode(), 0)
            if job is not None:
                try:  # not atomic: a run that slips in between is named below
                    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                    return
                except BlockingIOError:
                    raise _busy(folder, _read(fd)) from None
            return
        record = _read(fd)
        if job is not None and record.get("job") == job:
            try:  # a process of our own job holds it: share it
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                if _read(fd).get("job") == job:
                    return
                fcntl.flock(fd, fcntl.LOCK_UN)
            except BlockingIOError:
                pass  # it is still writing its record
        # A plain run is refused at once; a job's process waits a little for its own job's record.
        if job is None or time.monotonic() > deadline:
            raise _busy(folder, record)
        time.sleep(0.05)


def _release(fd: int, folder: Path, created: bool, new_lock: bool) -> None:
    """Unlock; the last holder clears the record, so a finished run leaves no owner named, and
    removes a folder it created that holds nothing else, or else a lock file it created in a
    folder left as it was (a run that failed early, or was refused, leaves no trace)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.ftruncate(fd, 0)
        if created and [p.name for p in folder.iterdir()] == [LOCK_FILE]:
            (folder / LOCK_FILE).unlink()
            folder.rmdir()
        elif new_lock and not created:
            (folder / LOCK_FILE).unlink(missing_ok=True)
    except BlockingIOError:
        pass  # other processes of the job still hold it
    fcntl.flock(fd, fcntl.LOCK_UN)


@contextmanager
def reading_lock(folder: str | Path, what: str) -> Iterator[None]:
    """Read `folder` while no eyas run writes it: a shared hold on its lock (readers share it; a
    writer, which takes it whole, is refused meanwhile). A folder without a lock file, or one
    this user cannot lock, is read as it is."""
    try:
        fd = open_lock_file(Path(folder) / LOCK_FILE, os.O_RDONLY)
    except (OSError, EyasError):
        fd = None
    if fd is None:
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise EyasError(f"{what} {folder} is being written by {_owner(_read(fd))}; wait for it to finish, "
                            f"then run this again.") from None
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
