"""Format versions. Each on-disk format eyas writes (prepared data, store, drafter checkpoint)
records the version of its layout beside its contents, so that a later eyas can tell an old
folder it still reads from a newer one it cannot: guessing at a layout it does not know would
read wrong data without a word."""

from __future__ import annotations

from typing import Any

from eyas import __version__
from eyas.errors import EyasError


def check_version(found: Any, supported: int, what: str, where: object) -> int:
    """The version of `where` (a `what` format), given its recorded `found`: missing means 1, the
    version of folders written before versions were recorded. One this eyas does not read is
    refused in one line naming both versions."""
    version = 1 if found is None else found
    if isinstance(version, int) and not isinstance(version, bool) and 1 <= version <= supported:
        return version
    newer = isinstance(version, int) and not isinstance(version, bool) and version > supported
    raise EyasError(f"{where}: {what} format version {version!r}, but this eyas ({__version__}) reads version "
                    f"{supported}{' and earlier' if supported > 1 else ''}"
                    f"{' (it was written by a newer eyas: upgrade eyas to read it)' if newer else ''}.")
