"""Summarise a hidden-state store; with --verify, check it completely.

--verify recomputes every shard's sha256 and checks shapes, dtypes, layer ids, offsets,
token ids and NaN/inf; it exits non-zero naming the first problem. (`eyas train` runs the
same checks except the sha256 and the NaN/inf scan, which need every byte.) Exit codes:
0 the store is whole and complete, 2 it is damaged (or unreadable), 3 its shards are sound
but it is incomplete or empty (a capture that stopped early; it says which command finishes it).

--repair rebuilds the manifest from the shard files that verify, against the sha256 the old
manifest recorded for each, renaming any that do not (and any it does not list) to *.dropped;
the next `eyas capture` captures their samples again. The store stays complete only if every
sample the capture expected is still there.

examples:
  eyas inspect store
  eyas inspect store --verify
  eyas inspect store --repair
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass

from eyas.options import option

EXIT_INCOMPLETE = 3  # sound but unfinished; a damaged store exits 2, as every eyas error does

HELP = "summarise a store; --verify checks checksums, shapes, layer ids and NaN/inf"


@dataclass(kw_only=True)
class InspectConfig:
    store: str = option("store folder", positional=True)
    verify: bool = option("check every shard completely", False)
    repair: bool = option("rebuild the manifest from the shards that verify (the others are renamed *.dropped)", False)


CONFIG = InspectConfig  # its options (eyas.options)

def summary(store) -> str:
    m = store.manifest
    t = m["target"]
    state = "complete" if m.get("complete") else "incomplete (re-run the capture to finish it)"
    return "\n".join([
        f"store      {store.path} ({state})",
        f"model      {t['model']} ({t['num_layers']} layers, hidden {t['hidden_size']}, vocab {t['vocab_size']})",
        f"layer ids  {list(store.layer_ids)} (aux ids = inputs of those decoder layers; {store.layer_ids[-1]} = last layer output, pre-norm)",
        f"dtype      {m['dtype']}",
        f"samples    {len(store):,} in {len(m['shards'])} shard(s)",
        f"tokens     {store.num_tokens:,}",
        f"bytes/tok  {store.bytes_per_token():,.0f}",
    ])


def run(cfg: InspectConfig) -> int:
    Store = importlib.import_module("eyas.store.reader").Store

    if cfg.repair:
        repair_store = importlib.import_module("eyas.store.repair").repair_store

        kept, dropped = repair_store(cfg.store)
        print(f"repair     kept {len(kept)} shard(s)" + "".join(
            f"\n           dropped {name} (renamed {name}.dropped): {reason}" for name, reason in dropped))
    store = Store(cfg.store)
    print(summary(store))
    if cfg.verify:
        store.verify()
        print(f"verify     ok: {len(store.manifest['shards'])} shard(s), sha256, shapes, layer ids, no NaN/inf")
        if not store.manifest.get("complete") or len(store) == 0:
            print(f"eyas inspect: error: {incomplete(store)}", file=sys.stderr)
            return EXIT_INCOMPLETE
    return 0


def incomplete(store) -> str:
    """Why the store is not ready for training, and the command that finishes it."""
    m = store.manifest
    held = "holds no sample" if len(store) == 0 else f"holds only {len(store):,} sample(s)"
    aux = ",".join(str(k) for k in store.layer_ids[:-1])
    return (f"the store {held}: its capture stopped before the end. The capture that made it resumes where it "
            f"stopped: eyas capture --model {m['target']['model']} --data PREPARED --out {store.path} --layers {aux} "
            f"--dtype {m['dtype']} (PREPARED: the prepared folder it was captured from).")
