"""Kills that land where they are meant to: `eyas` in a child process that SIGKILLs itself
on the n-th call of a chosen function, before the call runs, e.g. at the rename that ends
an atomic write (the temp file whole, not yet in its place). A kill timed from outside hits
such a moment only by luck, and on a loaded machine lands elsewhere."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

SRC = str(Path(__file__).resolve().parents[1] / "src")

CHILD = textwrap.dedent("""
    import importlib, os, re, runpy, signal, sys

    where, nth, arg, pattern = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), re.compile(sys.argv[4])
    module_name, name = where.split(":")
    module = importlib.import_module(module_name)
    real, calls = getattr(module, name), [0]

    def fault(*args, **kwargs):
        if arg < 0 or pattern.search(os.fspath(args[arg])):
            calls[0] += 1
            if calls[0] == nth:
                os.kill(os.getpid(), signal.SIGKILL)
        return real(*args, **kwargs)

    setattr(module, name, fault)
    sys.argv = ["eyas", *sys.argv[5:]]
    runpy.run_module("eyas", run_name="__main__", alter_sys=True)
""")


def killed(argv: list, at: str = "os:replace", nth: int = 1, match: str = "", arg: int = 1,
           timeout: float = 600) -> None:
    """Run `eyas argv` and SIGKILL it just before its `nth` call of `at` (module:function) whose
    positional argument `arg` matches the regex `match` (arg -1: every call counts); the
    default, os.replace with the destination matched, kills inside an atomic write. Fails
    unless the kill happened (the run must not end first)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])}
    child = subprocess.run([sys.executable, "-c", CHILD, at, str(nth), str(arg), match, *map(str, argv)], env=env,
                           capture_output=True, text=True, timeout=timeout)
    assert child.returncode == -signal.SIGKILL, f"not killed (exit {child.returncode}): {child.stderr[-2000:]}"
