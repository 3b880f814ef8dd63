"""The `eyas` command: one subcommand per pipeline stage.

Each stage's CLI module exposes `HELP` (one line), `add_arguments(parser)` and
`run(args) -> int`, and imports its heavy dependencies inside `run`, so `eyas --help`
stays fast. A stage that can continue after Ctrl-C says how in `ON_INTERRUPT`.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from eyas import __version__
from eyas.errors import EyasError

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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="eyas",
        description="Train EAGLE-3 speculative-decoding drafters: prepare -> capture -> train -> eval -> export.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"eyas {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, module_name in SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        p = sub.add_parser(name, help=module.HELP, description=module.__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(p)
        p.set_defaults(_run=module.run, _on_interrupt=getattr(module, "ON_INTERRUPT", "interrupted."))
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        code = args._run(args)
    except EyasError as e:
        print(f"eyas {args.command}: error: {e}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:
        print(f"\neyas {args.command}: {args._on_interrupt}", file=sys.stderr)
        code = 130
    sys.stdout.flush()
    sys.exit(code or 0)
