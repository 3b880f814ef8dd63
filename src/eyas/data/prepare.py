"""`eyas prepare`: conversations -> token ids + assistant-only loss mask, for one target."""

from __future__ import annotations

import itertools
import multiprocessing
import os
import sys
from collections import Counter, deque
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm
from transformers import AutoConfig

from eyas.data.config import PrepareConfig
from eyas.data.exclusion import exclusion_grams, recorded
from eyas.data.prepared import PREPARED_FILES, PreparedData, PreparedSample, write_prepared
from eyas.data.sources import BadRecord, TruncatedTail, interleave, iter_records, layout, normalize, parse_mix
from eyas.data.synthetic import contaminated
from eyas.data.template import ChatTemplate, encode_conversation, require_chat_template
from eyas.errors import EyasError
from eyas.lock import LOCK_FILE, output_lock
from eyas.models import load_tokenizer, model_identity, resolve_model
from eyas.paths import check_confined, remove_leftovers


TAIL = "cut off at the end of the file"
EXCLUDED = "shares 8 words in a row with an excluded prompt"
UNANSWERED = "no answered user turn (--window cuts at user turns)"


def prepare(cfg: PrepareConfig, progress: bool = True) -> dict[str, Any]:
    """`prepare_into` an output folder of its own: one that is none of the inputs, holds none
    of them, holds nothing but prepared data, and that no other run is writing."""
    inputs = {f"--data {name}": name for name, _ in parse_mix(cfg.data)}
    check_confined(cfg.out, {**inputs, "--model": cfg.model, "--chat-template": cfg.chat_template})
    with output_lock(cfg.out, "prepare"):
        remove_leftovers(cfg.out, PREPARED_FILES)  # a killed run's half-written files
        foreign = sorted(p.name for p in Path(cfg.out).iterdir() if p.name not in PREPARED_FILES + (LOCK_FILE,))
        if foreign:
            raise EyasError(f"--out {cfg.out} already holds other files ({', '.join(foreign[:3])}); prepare writes "
                            f"into an empty folder or one it wrote before: choose another --out.")
        return prepare_into(cfg.model, cfg.data, cfg.out, cfg.max_len, limit=cfg.limit, strict=cfg.strict,
                            chat_template=cfg.chat_template, progress=progress, workers=cfg.workers,
                            window=cfg.window, exclude=cfg.exclude_prompts or [], pack=cfg.pack)


def prepare_into(model: str, source: str | list[str], out: str | Path, max_len: int, *, limit: int | None = None,
                 strict: bool = False, chat_template: str | Path | ChatTemplate | None = None, progress: bool = True,
                 workers: int | None = None, window: int | None = None,
                 exclude: list[str] | None = None, excluded: list[str] | None = None,
                 pack: bool = False) -> dict[str, Any]:
    """Tokenize `source` for `model` with its tokenizer's chat template, or `chat_template` (a
    file, or one recorded earlier); keep at most `limit` samples. Returns the summary.

    `source` may mix several sources, `SRC@WEIGHT` each: samples (windows, with `window`) come
    from each in proportion to its weight, until one runs out (`sources.interleave`). `window`
    cuts each conversation into windows of that many user turns, each a sample of its own (MT-bench
    asks two; on SmolLM2 two-turn windows trained a better drafter than whole long
    conversations, for the same regeneration time). A conversation sharing 8 words in a row
    in any message with a prompt of an `exclude` prompt set (eval's --prompts: mt-bench, a file
    or a `long` spec, histories included) is dropped, every window of it (counted once, as one
    record); so is one that `window` leaves no window of (its assistant turns all come before
    its first user turn). The sets are recorded (`excluded_prompts`), with `excluded`: the sets
    `source` was already kept free of (regeneration's, from the data it answered), so that eval
    can tell whether its prompts were kept out (data/exclusion.py); None for both records that
    nobody knows.
    With `pack`, consecutive kept conversations are joined into one sample of up to `max_len`
    tokens (`Packer`): long contexts from short conversations, as a long chat holds them.

    Rendering a chat template costs about a millisecond per turn, so hundreds of thousands of
    conversations take minutes on one core: `workers` processes (default: up to 8 of the
    machine's cores) tokenize them, and the result is the same, in the same order. The numbers
    are those of a PrepareConfig, checked there (or, from regenerate, recorded by one)."""
    tokenizer = load_tokenizer(model)
    # The identity is the tokenizer as shipped; the template used is recorded beside it, so
    # later stages load the same tokenizer and are not asked for the template again.
    identity = model_identity(model, AutoConfig.from_pretrained(resolve_model(model)), tokenizer)
    if chat_template is not None and not isinstance(chat_template, ChatTemplate):
        chat_template = ChatTemplate.from_file(chat_template)
    if chat_template is not None:
        chat_template.apply(tokenizer)
    require_chat_template(tokenizer, model)
    template = chat_template or ChatTemplate(tokenizer.chat_template, "tokenizer")

    mix = parse_mix(source)
    source = " ".join(s if w == 1 else f"{s}@{w:g}" for s, w in mix)
    grams = exclusion_grams(exclude or [], tokenizer)
    samples: list[PreparedSample] = []
    conversations: list[list[dict[str, str]]] = []
    dropped: Counter[str] = Counter()
    layouts: Counter[str] = Counter()
    truncated = records = tail_bytes = parts = 0  # parts: conversations (windows) in the samples kept
    streams = [_items(iter_records(name), window, grams) for name, _ in mix]  # index: the record's in its source
    items = streams[0] if len(mix) == 1 else interleave(streams, [w for _, w in mix])
    packer = Packer(tokenizer, max_len) if pack else None
    with tqdm(desc="prepare", unit=" sample" if pack else " conv", total=limit, disable=not progress) as bar:

        def keep(index: int, messages: list[dict[str, str]], ids, mask, n: int = 1) -> None:
            nonlocal parts
            if limit is not None and len(samples) >= limit:  # a group that split in two may bring one more
                return
            parts += n
            samples.append(PreparedSample(torch.from_numpy(ids), torch.from_numpy(mask), index))
            conversations.append(messages)
            bar.update(1)

        for index, first, record, result in _encoded(tokenizer, items, max_len, workers):
            if limit is not None and len(samples) >= limit:
                break
            if isinstance(record, TruncatedTail):
                if strict:
                    raise EyasError(f"{source} is cut off inside record {index}: its last {record.nbytes} bytes "
                                    f"are incomplete.")
                records += record.records
                dropped[TAIL] += record.records
                tail_bytes = record.nbytes
                continue
            records += first
            if isinstance(result, str):
                if strict:
                    raise EyasError(f"record {index} of {source}: {result}")
                dropped[result] += 1
                continue
            layouts[record] += first
            messages, ids, mask, was_truncated = result
            truncated += was_truncated
            for done in packer.add(index, messages, ids, mask) if packer else [(index, messages, ids, mask)]:
                keep(*done)
        for done in packer.flush() if packer else []:
            keep(*done)
    if not samples:
        reasons = ", ".join(f"{n} {r}" for r, n in dropped.most_common()) or "the source is empty"
        raise EyasError(f"No usable conversation in {source} ({records} records read: {reasons}).")

    tokens = sum(len(s.input_ids) for s in samples)
    trained = sum(int(s.loss_mask.sum()) for s in samples)
    summary = {
        "records_read": records, "kept": len(samples), "dropped": dict(dropped), "truncated": truncated,
        "layouts": dict(layouts), **({"window": window} if window else {}),
        **({"packed_conversations": packer.joined, "packed_from": parts} if packer else {}),
        "truncated_tail_bytes": tail_bytes,
        "tokens": tokens, "trained_tokens": trained, "trained_share": trained / tokens,
        "excluded_prompts": None if exclude is None and excluded is None else [*(excluded or []), *recorded(exclude or [])],
    }
    write_prepared(out, samples, conversations, identity, template, source, max_len, summary)
    return summary


class Packer:
    """Joins consecutive conversations into samples of up to `max_len` tokens, in order, each
    conversation in one sample: a group grows while its conversations' tokens add up to at most
    `max_len`, and is encoded anew as one chat when it closes (one system prompt, the template's
    own turn markers; chat templates mark turns with special tokens, so the sum is what the
    joined chat takes). A conversation that does not start on a user turn (a system message
    would land mid-chat) joins no group before it, and one ending on an unanswered user turn
    closes its group (two user turns would meet). Should a joined chat still run over, or the
    template refuse it, its last conversation is kept as a sample of its own."""

    def __init__(self, tokenizer, max_len: int):
        self.tokenizer, self.max_len = tokenizer, max_len
        self.group: list[tuple] = []  # (index, messages, ids, mask) of each conversation
        self.joined = 0  # conversations that went into a sample with others

    def add(self, index: int, messages: list[dict[str, str]], ids, mask) -> list[tuple]:
        """Take one encoded conversation; returns the samples it closed, as (index, messages, ids,
        mask, conversations in the sample)."""
        closed = []
        if self.group and (messages[0]["role"] != "user" or sum(len(g[2]) for g in self.group) + len(ids) > self.max_len):
            closed = self.flush()
        self.group.append((index, messages, ids, mask))
        if messages[-1]["role"] != "assistant":
            closed += self.flush()
        return closed

    def flush(self) -> list[tuple]:
        """The open group's samples."""
        group, self.group = self.group, []
        return self._encode(group)

    def _encode(self, group: list[tuple]) -> list[tuple]:
        if len(group) <= 1:
            return [(*g, 1) for g in group]
        joined = [m for _, messages, _, _ in group for m in messages]
        try:
            ids, mask, truncated = encode_conversation(self.tokenizer, joined, self.max_len)
        except BadRecord:  # the template refused the joined chat
            truncated = True
        if truncated:
            return self._encode(group[:-1]) + [(*group[-1], 1)]
        self.joined += len(group)
        return [(group[0][0], joined, ids, mask, len(group))]


def windows(messages: list[dict[str, str]], size: int | None) -> list[list[dict[str, str]]]:
    """The conversation cut into windows of `size` user turns (each with their answers and the
    leading system message, if any); windows without an assistant turn are left out."""
    if size is None:
        return [messages]
    system = [m for m in messages[:1] if m["role"] == "system"]
    users = [i for i, m in enumerate(messages) if m["role"] == "user"] or [len(system)]
    starts = users[::size] + [len(messages)]
    cut = [system + messages[max(a, len(system)):b] for a, b in zip(starts, starts[1:])]
    return [w for w in cut if any(m["role"] == "assistant" for m in w)]


def _items(records: Iterable[Any], window: int | None, grams: frozenset) -> Iterator[tuple[int, bool, Any]]:
    """(record index, first item of its record, TruncatedTail | reason dropped | (layout, messages)):
    normalised here, so a record's windows and exclusions are known before the workers encode.
    Exclusion reads the whole record, answers included, before it is cut: a long prompt's
    history holds later turns of a conversation, which its own windows would not show. A
    dropped record is one item, so the summary counts it once."""
    for index, record in enumerate(records):
        if isinstance(record, TruncatedTail):
            yield index, True, record
            continue
        try:
            messages = normalize(record)
        except BadRecord as e:
            yield index, True, str(e)
            continue
        if grams and any(contaminated(m["content"], grams) for m in messages):
            yield index, True, EXCLUDED
            continue
        cut = windows(messages, window)
        if not cut:
            yield index, True, UNANSWERED
        for k, part in enumerate(cut):
            yield index, k == 0, (layout(record), part)


_WORKER: tuple[Any, int] | None = None  # (tokenizer, max_len), inherited by forked workers


def _encode(item: tuple[int, bool, Any]) -> tuple[int, bool, Any, Any]:
    """(index, first, TruncatedTail | layout, (messages, ids, mask, truncated) or the reason it is dropped)."""
    index, first, payload = item
    if isinstance(payload, TruncatedTail):
        return index, first, payload, None
    if isinstance(payload, str):
        return index, first, None, payload
    tokenizer, max_len = _WORKER
    name, messages = payload
    try:
        return index, first, name, (messages, *encode_conversation(tokenizer, messages, max_len))
    except BadRecord as e:
        return index, first, name, str(e)


def _encode_chunk(chunk: list[tuple[int, bool, Any]]) -> list[tuple[int, bool, Any, Any]]:
    return [_encode(item) for item in chunk]


def _encoded(tokenizer, items: Iterable[Any], max_len: int, workers: int | None) -> Iterator[tuple[int, bool, Any, Any]]:
    """`_encode` over the records, in order; in forked worker processes where the platform has
    fork, so the loaded tokenizer is shared rather than loaded again in each. At most a few
    chunks per worker are in flight (the records are read as they are encoded), and a worker
    that dies (the out-of-memory killer) ends the run in one line naming its records: a
    multiprocessing.Pool would wait for its lost chunk forever."""
    global _WORKER
    workers = min(8, os.cpu_count() or 1) if workers is None else workers
    _WORKER = (tokenizer, max_len)
    try:
        if workers <= 1 or "fork" not in multiprocessing.get_all_start_methods():
            yield from map(_encode, items)
            return
        records = iter(items)
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
            pending: deque = deque()  # (first record, last record, future), in order
            while True:
                chunk = list(itertools.islice(records, CHUNK))
                try:  # a dead worker breaks the pool: the next submit raises, as does a result in flight
                    if chunk:
                        pending.append((chunk[0][0], chunk[-1][0], pool.submit(_encode_chunk, chunk)))
                    while pending and (not chunk or len(pending) >= IN_FLIGHT * workers):
                        results = pending[0][2].result()
                        pending.popleft()
                        yield from results
                except BrokenProcessPool:  # which of the records in flight killed it is unknown
                    spans = [(a, b) for a, b, _ in pending] + ([(chunk[0][0], chunk[-1][0])] if chunk else [])
                    raise EyasError(f"a prepare worker process died (killed, or out of memory) while records "
                                    f"{min(a for a, _ in spans)}..{max(b for _, b in spans)} were being encoded; "
                                    f"run again with --workers 1 to find the record, or with more memory.") from None
                if not chunk:
                    return
    finally:
        _WORKER = None


CHUNK, IN_FLIGHT = 16, 4  # records per task; tasks queued per worker


def format_summary(summary: dict[str, Any], out: str | Path) -> str:
    kept = summary.get("packed_from", summary["kept"])  # conversations (windows): --pack puts them in fewer samples
    lines = [
        (f"kept {kept} windows of {summary['window']} user turns from {summary['records_read']} records"
         if summary.get("window") else f"kept {kept} of {summary['records_read']} records")
        + (f", packed into {summary['kept']} samples" if "packed_from" in summary else "") + f" -> {out}",
        f"tokens {summary['tokens']:,}, trained (assistant) {summary['trained_tokens']:,} "
        f"({100 * summary['trained_share']:.1f}%), truncated to --max-len: {summary['truncated']}",
    ]
    if "packed_conversations" in summary:
        lines.append(f"packed: {summary['packed_conversations']} conversations joined into longer samples (--pack)")
    if summary.get("truncated_tail_bytes"):
        lines.append(f"the file ends inside a record: its last {summary['truncated_tail_bytes']:,} bytes "
                     f"({summary['dropped'][TAIL]} record) were not read")
    if summary.get("layouts"):
        lines.append("layouts: " + ", ".join(f"{n} {name}" for name, n in sorted(summary["layouts"].items(), key=lambda kv: -kv[1]))
                     + (f"; cut into windows of {summary['window']} user turns" if summary.get("window") else ""))
    if summary["dropped"]:
        lines.append("dropped: " + ", ".join(f"{n} {reason}" for reason, n in sorted(summary["dropped"].items(), key=lambda kv: -kv[1])))
    else:
        lines.append("dropped: none")
    return "\n".join(lines)


def show_sample(path: str | Path, n: int, color: bool) -> str:
    """Sample n with trained tokens highlighted (green, or [[...]] without a terminal)."""
    data = PreparedData(path)
    if not 0 <= n < len(data):
        raise EyasError(f"Sample {n} does not exist; {path} holds samples 0..{len(data) - 1}.")
    sample = data[n]
    tokenizer = load_tokenizer(data.identity.model)
    pieces, start = [], 0
    ids, mask = sample.input_ids.tolist(), sample.loss_mask.tolist()
    for end in range(1, len(ids) + 1):
        if end == len(ids) or mask[end] != mask[start]:
            text = tokenizer.decode(ids[start:end])
            if mask[start]:
                text = f"\033[42;30m{text}\033[0m" if color else f"[[{text}]]"
            pieces.append(text)
            start = end
    header = (f"sample {n} (source record {sample.source_index}): {len(ids)} tokens, "
              f"{int(sample.loss_mask.sum())} trained ({'highlighted' if color else 'inside [[ ]]'})")
    return header + "\n" + "".join(pieces)
