"""One owner per output folder: capture, train, regenerate and export lock the folder they write.

The lock is `flock` on `OUT/.eyas-lock`, which records who holds it (command, host, pid, job).
The kernel drops a flock when its process dies, so a lock left by a killed run is simply
taken over; the record inside is only there to name the running owner to a second run.
The processes of one torchrun job share the lock: each holds it shared under the job's id,
and a process of any other job, or a plain run, is refused.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from eyas.errors import EyasError

LOCK_FILE = ".eyas-lock"


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


def _busy(folder: Path, record: dict) -> EyasError:
    owner = (f"eyas {record.get('command', '?')} (pid {record.get('pid', '?')} on {record.get('host', '?')}, "
             f"since {record.get('started', '?')})") if record else "another eyas run"
    return EyasError(f"{folder} is in use by {owner}; wait for it to finish, or use another folder.")


@contextmanager
def output_lock(folder: str | Path, command: str, wait: float = 10.0) -> Iterator[None]:
    """Hold `folder` for this run (creating it); raise naming the owner if another run holds it."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise EyasError(f"{folder} exists and is not a folder.")
    created = not folder.exists()
    folder.mkdir(parents=True, exist_ok=True)
    job = job_id()
    fd = os.open(folder / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        _acquire(fd, folder, command, job, wait)
        try:
            yield
        finally:
            _release(fd, folder if created else None)
    finally:
        os.close(fd)


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


def _release(fd: int, created: Path | None) -> None:
    """Unlock; the last holder clears the record, so a finished run leaves no owner named, and
    removes a folder it created that holds nothing else (a run that failed early leaves no trace)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.ftruncate(fd, 0)
        if created is not None and [p.name for p in created.iterdir()] == [LOCK_FILE]:
            (created / LOCK_FILE).unlink()
            created.rmdir()
    except BlockingIOError:
        pass  # other processes of the job still hold it
    fcntl.flock(fd, fcntl.LOCK_UN)
