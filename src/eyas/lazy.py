"""Package re-exports that load on first use, so that building `eyas --help` (which imports
every stage's CLI module, and through them these packages) never imports torch."""

from __future__ import annotations

import importlib
from typing import Any, Callable


def lazy_exports(package: str, exports: dict[str, tuple[str, ...]]) -> Callable[[str], Any]:
    """A module `__getattr__` (PEP 562) for `package`: `exports` maps a submodule to the names
    it provides, and `from package import Name` imports that submodule only then."""
    where = {name: module for module, names in exports.items() for name in names}

    def __getattr__(name: str) -> Any:
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(where[name]), name)

    return __getattr__
