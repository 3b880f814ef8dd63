"""The `--device` flag every stage takes: one name, default and help. No torch here: building
`eyas --help` imports this (eyas.device resolves the name to a device)."""

from __future__ import annotations

AUTO = "auto"
DEVICE_HELP = f"{AUTO} (default): CUDA when a GPU is visible, else the CPU; or cpu, cuda, cuda:I"
TORCHRUN_NOTE = "under torchrun each process takes its LOCAL_RANK's GPU"

