"""Kills that land where they are meant to: `eyas` in a child process that SIGKILLs itself
(or its whole job: torchrun and every rank) on the n-th call of a chosen
function, before the call runs, e.g. at the rename that ends an atomic write (the temp file
whole, not yet in its place). A kill timed from outside hits such a moment only by luck,
and on a loaded machine lands elsewhere.

Run as a script, this file is that child: `python faults.py AT NTH ARG MATCH self|job EYAS-ARGS...`
(a script, so torchrun can start it as each rank)."""

from __future__ import annotations

import importlib
import os
import re
import runpy
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

SRC = str(Path(__file__).resolve().parents[1] / "src")
SCRIPT = str(Path(__file__).resolve())


def child_argv(argv: list, at: str = "os:replace", nth: int = 1, match: str = "", arg: int = 1,
               job: bool = False) -> list[str]:
    """This script's arguments: run `eyas argv`, killed just before its `nth` call of `at`
    (module:function) whose positional argument `arg` matches the regex `match` (arg -1:
    every call counts); the default, os.replace with the destination matched, kills inside
    an atomic write. `job`: kill the launcher (torchrun) and all its ranks, this one included."""
    return [SCRIPT, at, str(nth), str(arg), match, "job" if job else "self", *map(str, argv)]


def env() -> dict[str, str]:
    """The child's environment: torch on as many threads as this process's, so that a run killed
    and resumed computes, bit for bit, what this process computes uninterrupted (a float sum
    split over other threads rounds otherwise)."""
    import torch

    return {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads()), "HF_HUB_OFFLINE": "1",
            "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])}


def killed(argv: list, at: str = "os:replace", nth: int = 1, match: str = "", arg: int = 1,
           timeout: float = 600, new_session: bool = False) -> int:
    """Run `eyas argv` in a child killed as `child_argv` says, and return its pid; fail unless the
    kill happened (the run must not end first). Its output goes to a file, not a pipe: processes
    it started (vLLM's engine) may outlive it."""
    with tempfile.TemporaryFile("w+") as log:
        child = subprocess.Popen([sys.executable, *child_argv(argv, at, nth, match, arg)], env=env(), stdout=log,
                                 stderr=subprocess.STDOUT, text=True, start_new_session=new_session)
        code = child.wait(timeout=timeout)
        log.seek(0)
        assert code == -signal.SIGKILL, f"not killed (exit {code}): {log.read()[-2000:]}"
    return child.pid


def _kill_job() -> None:
    """SIGKILL the launcher (torchrun) and every process it started, this one last: torchrun
    starts each rank in a session of its own, so a process group would not reach them all."""
    launcher = os.getppid()
    ranks = [int(d) for d in os.listdir("/proc") if d.isdigit() and int(d) != os.getpid() and _parent(int(d)) == launcher]
    for pid in [*ranks, launcher]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    os.kill(os.getpid(), signal.SIGKILL)


def _parent(pid: int) -> int | None:
    try:  # /proc/PID/stat: "pid (comm) state ppid ...", comm may hold spaces
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _main() -> None:
    where, nth, arg, pattern, whom = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), re.compile(sys.argv[4]), sys.argv[5]
    module_name, name = where.split(":")
    module = importlib.import_module(module_name)
    real, calls = getattr(module, name), [0]

    def fault(*args, **kwargs):
        if arg < 0 or pattern.search(os.fspath(args[arg])):
            calls[0] += 1
            if calls[0] == nth and whom == "job":
                _kill_job()
            elif calls[0] == nth:
                os.kill(os.getpid(), signal.SIGKILL)
        return real(*args, **kwargs)

    setattr(module, name, fault)
    sys.argv = ["eyas", *sys.argv[6:]]
    runpy.run_module("eyas", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    _main()
