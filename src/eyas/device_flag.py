"""The `--device` flag every stage takes: one name, default and help. No torch here: building
`eyas --help` imports this (eyas.device resolves the name to a device)."""

from __future__ import annotations

import argparse

AUTO = "auto"
DEVICE_HELP = "auto (default): CUDA when a GPU is visible, else the CPU; or cpu, cuda, cuda:I"
TORCHRUN_NOTE = "under torchrun each process takes its LOCAL_RANK's GPU"


def add_device_argument(p: argparse.ArgumentParser | argparse._ArgumentGroup, note: str = "") -> None:
    """Every stage's `--device`: same name, default and help (`note` says what it applies to)."""
    p.add_argument("--device", default=AUTO, help=DEVICE_HELP + (f"; {note}" if note else ""))
