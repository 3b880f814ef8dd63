"""The hidden-state store: a folder of checksummed, memory-mapped safetensors shards plus
`manifest.json`. `StoreWriter` appends (in a background thread, atomically, resumably);
`Store` reads and verifies."""

from eyas.store.reader import Store
from eyas.store.writer import StoreWriter

__all__ = ["Store", "StoreWriter"]
