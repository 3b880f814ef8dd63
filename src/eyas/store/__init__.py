"""The hidden-state store: a folder of checksummed, memory-mapped safetensors shards plus
`manifest.json`. `StoreWriter` appends (in a background thread, atomically, resumably);
`Store` reads and verifies."""

from eyas.lazy import lazy_exports

__all__ = ["Store", "StoreWriter"]
__getattr__ = lazy_exports(__name__, {"eyas.store.reader": ("Store",), "eyas.store.writer": ("StoreWriter",)})
