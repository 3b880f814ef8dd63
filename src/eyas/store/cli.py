"""Summarise a hidden-state store; with --verify, check it completely.

--verify recomputes every shard's sha256 and checks shapes, dtypes, layer ids, offsets,
token ids and NaN/inf; it exits non-zero naming the first problem.

examples:
  eyas inspect store
  eyas inspect store --verify
"""

from __future__ import annotations

import argparse

HELP = "summarise a store; --verify checks checksums, shapes, layer ids and NaN/inf"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("store", help="store folder")
    p.add_argument("--verify", action="store_true", help="check every shard completely")


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


def run(args: argparse.Namespace) -> int:
    from eyas.store import Store

    store = Store(args.store)
    print(summary(store))
    if args.verify:
        store.verify()
        print(f"verify     ok: {len(store.manifest['shards'])} shard(s), sha256, shapes, layer ids, no NaN/inf")
    return 0
