"""The `eyas` command: one subcommand per pipeline stage.

Each stage's CLI module exposes `HELP` (one line), `CONFIG` (the stage's typed config, from
which its options are generated: eyas.options) and `run(config) -> int`, and imports its
heavy dependencies inside `run`; the packages re-export
lazily (`eyas.lazy`), so building this parser imports neither torch nor transformers and
`eyas --help` returns at once (tests/test_cli.py). A stage that can continue after Ctrl-C
says how in `ON_INTERRUPT`, and which of its options shrink its memory in `ON_OUT_OF_MEMORY`.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import re
import sys

from eyas import __version__
from eyas.errors import EyasError
from eyas.options import add_arguments, from_args

# subcommand -> module; the order is the pipeline's.
SUBCOMMANDS = {
    "prepare": "eyas.data.cli",
    "regenerate": "eyas.regenerate.cli",
    "capture": "eyas.capture.cli",
    "inspect": "eyas.store.cli",
    "train": "eyas.train.cli",
    "eval": "eyas.evaluate.cli",
    "export": "eyas.export.cli",
    "import": "eyas.export.import_cli",
    "recipe": "eyas.recipe.cli",
}

OUT_OF_MEMORY = "use smaller sizes or batches"  # a stage's ON_OUT_OF_MEMORY names its own options


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="eyas",
        description="Train speculative-decoding drafters (EAGLE-3, DFlash and P-EAGLE): "
                    "prepare -> capture -> train -> eval -> export.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"eyas {__version__}")
    parser.add_argument("--debug", dest="_debug", action="store_true", help="show the traceback of an unexpected error")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, module_name in SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        p = sub.add_parser(name, help=module.HELP, description=module.__doc__, usage=getattr(module, "USAGE", None),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        add_arguments(p, module.CONFIG)
        p.add_argument("--debug", dest="_debug", action="store_true", default=argparse.SUPPRESS,
                       help="show the traceback of an unexpected error")
        p.set_defaults(_run=module.run, _config=module.CONFIG,
                       _on_interrupt=getattr(module, "ON_INTERRUPT", "interrupted."),
                       _on_out_of_memory=getattr(module, "ON_OUT_OF_MEMORY", OUT_OF_MEMORY))
    return parser


# What to do about an environment fault, by errno: the line names the path and the fix.
ENVIRONMENT = {
    errno.ENOSPC: "free space on that disk",
    errno.EDQUOT: "free space within your disk quota",
    errno.EROFS: "the filesystem is read-only; write to another folder",
    errno.EACCES: "make it writable (or readable) for you, or use another folder",
    errno.EPERM: "make it writable (or readable) for you, or use another folder",
}


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        code = run(args)
    except EyasError as e:
        print(f"eyas {args.command}: error: {e}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:
        print(f"\neyas {args.command}: {args._on_interrupt}", file=sys.stderr)
        code = 130
    except Exception as e:  # noqa: BLE001  (the one place every other failure becomes one line)
        if args._debug:
            raise
        print(f"eyas {args.command}: error: {one_line(e, args._on_out_of_memory)}", file=sys.stderr)
        code = 2 if isinstance(e, OSError) and e.errno in ENVIRONMENT else 1
    sys.stdout.flush()
    sys.exit(code or 0)


def run(args: argparse.Namespace) -> int | None:
    """The stage `args` names, given its typed config built from what was parsed."""
    return args._run(from_args(args._config, args))


def one_line(e: BaseException, on_out_of_memory: str = OUT_OF_MEMORY) -> str:
    """An unexpected exception as one line: an environment fault (disk full, read-only, no
    permission) or running out of host or accelerator memory says what to do; anything else
    points at --debug, which shows the traceback."""
    if isinstance(e, OSError) and e.errno in ENVIRONMENT:
        where = f" ({e.filename})" if e.filename else ""
        return (f"{e.strerror or errno.errorcode[e.errno]}{where}: {ENVIRONMENT[e.errno]}, then run the same command "
                f"again: it continues from what was written.")
    if isinstance(e, MemoryError):
        return f"out of memory; {on_out_of_memory} (run with --debug to see where)."
    if type(e).__name__ == "OutOfMemoryError":  # torch's, for CUDA and other accelerators: no torch import here
        return f"the accelerator ran out of memory ({accelerator_memory(str(e))}); {on_out_of_memory}."
    text = (str(e).strip().splitlines() or [""])[0][:300]
    return f"unexpected {type(e).__name__}: {text} (this is a bug in eyas or an unhandled input; run with --debug " \
           f"for the traceback and report it)."


def accelerator_memory(message: str) -> str:
    """The figures of torch's out-of-memory message ('Tried to allocate 6.65 GiB. GPU 0 has a
    total capacity of 139.80 GiB of which 4.91 GiB is free. ...'), short; its first line if
    they are not there."""
    asked = re.search(r"[Tt]ried to allocate ([\d.]+ \w+)", message)
    free = re.search(r"capacity of ([\d.]+ \w+) of which ([\d.]+ \w+) is free", message)
    if asked and free:
        return f"it asked for {asked.group(1)} more with {free.group(2)} of {free.group(1)} free"
    return (message.strip().splitlines() or ["no detail"])[0][:200]
