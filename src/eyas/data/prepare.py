"""`eyas prepare`: conversations -> token ids + assistant-only loss mask, for one target."""

from __future__ import annotations

import hashlib
import multiprocessing
import os
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from eyas.data.prepared import PREPARED_FILES, PreparedSample, write_prepared
from eyas.data.sources import BadRecord, TruncatedTail, iter_records, normalize
from eyas.data.template import ChatTemplate, encode_conversation, require_chat_template
from eyas.errors import EyasError
from eyas.lock import LOCK_FILE, output_lock
from eyas.paths import check_confined
from eyas.validate import COUNT, Number, check_options


TAIL = "cut off at the end of the file"


def prepare(model: str, source: str, out: str | Path, max_len: int = 2048, limit: int | None = None,
            strict: bool = False, chat_template: str | Path | ChatTemplate | None = None,
            progress: bool = True, workers: int | None = None) -> dict[str, Any]:
    """`prepare_into` an output folder of its own: one that is none of the inputs, holds none
    of them, holds nothing but prepared data, and that no other run is writing."""
    template_file = None if isinstance(chat_template, ChatTemplate) else chat_template
    check_confined(out, {"--data": source, "--model": model, "--chat-template": template_file})
    check_options({"max_len": max_len, "limit": limit, "workers": workers}, OPTIONS)
    with output_lock(out, "prepare"):
        foreign = sorted(p.name for p in Path(out).iterdir() if p.name not in PREPARED_FILES + (LOCK_FILE,))
        if foreign:
            raise EyasError(f"--out {out} already holds other files ({', '.join(foreign[:3])}); prepare writes "
                            f"into an empty folder or one it wrote before: choose another --out.")
        return prepare_into(model, source, out, max_len, limit, strict, chat_template, progress, workers)


# The number options of `eyas prepare` (see eyas.validate).
OPTIONS = {"max_len": Number(lo=2, integer=True, required=True), "limit": COUNT, "workers": COUNT}


def prepare_into(model: str, source: str, out: str | Path, max_len: int = 2048, limit: int | None = None,
                 strict: bool = False, chat_template: str | Path | ChatTemplate | None = None,
                 progress: bool = True, workers: int | None = None) -> dict[str, Any]:
    """Tokenize `source` for `model` with its tokenizer's chat template, or `chat_template` (a
    file, or one recorded earlier); keep at most `limit` samples. Returns the summary.

    Rendering a chat template costs about a millisecond per turn, so hundreds of thousands of
    conversations take minutes on one core: `workers` processes (default: up to 8 of the
    machine's cores) tokenize them, and the result is the same, in the same order."""
    from transformers import AutoConfig

    from eyas.models import load_tokenizer, model_identity, resolve_model

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

    samples: list[PreparedSample] = []
    conversations: list[list[dict[str, str]]] = []
    dropped: Counter[str] = Counter()
    truncated = records = tail_bytes = 0
    with tqdm(desc="prepare", unit=" conv", total=limit, disable=not progress) as bar:  # closed on errors too
        for index, record, result in _encoded(tokenizer, iter_records(source), max_len, workers):
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
            records += 1
            if isinstance(result, str):
                if strict:
                    raise EyasError(f"record {index} of {source}: {result}")
                dropped[result] += 1
                continue
            messages, ids, mask, was_truncated = result
            truncated += was_truncated
            samples.append(PreparedSample(torch.from_numpy(ids), torch.from_numpy(mask), index))
            conversations.append(messages)
            bar.update(1)
    if not samples:
        reasons = ", ".join(f"{n} {r}" for r, n in dropped.most_common()) or "the source is empty"
        raise EyasError(f"No usable conversation in {source} ({records} records read: {reasons}).")

    tokens = sum(len(s.input_ids) for s in samples)
    trained = sum(int(s.loss_mask.sum()) for s in samples)
    summary = {
        "records_read": records, "kept": len(samples), "dropped": dict(dropped), "truncated": truncated,
        "truncated_tail_bytes": tail_bytes,
        "tokens": tokens, "trained_tokens": trained, "trained_share": trained / tokens,
    }
    fingerprint = hashlib.sha256()
    for s in samples:
        fingerprint.update(s.input_ids.numpy().tobytes() + s.loss_mask.numpy().tobytes())
    write_prepared(out, samples, conversations, {
        "target": identity.to_dict(), "chat_template": template.to_dict(), "source": source, "max_len": max_len,
        "fingerprint": fingerprint.hexdigest()[:16], "summary": summary,
    })
    return summary


_WORKER: tuple[Any, int] | None = None  # (tokenizer, max_len), inherited by forked workers


def _encode(item: tuple[int, Any]) -> tuple[int, Any, Any]:
    """(index, record, (messages, ids, mask, truncated) or the reason it is dropped)."""
    index, record = item
    if isinstance(record, TruncatedTail):
        return index, record, None
    tokenizer, max_len = _WORKER
    try:
        messages = normalize(record)
        return index, None, (messages, *encode_conversation(tokenizer, messages, max_len))
    except BadRecord as e:
        return index, None, str(e)


def _encoded(tokenizer, records: Iterable[Any], max_len: int, workers: int | None) -> Iterator[tuple[int, Any, Any]]:
    """`_encode` over the records, in order; in forked worker processes where the platform has
    fork, so the loaded tokenizer is shared rather than loaded again in each."""
    global _WORKER
    workers = min(8, os.cpu_count() or 1) if workers is None else workers
    _WORKER = (tokenizer, max_len)
    items = enumerate(records)
    try:
        if workers <= 1 or "fork" not in multiprocessing.get_all_start_methods():
            yield from map(_encode, items)
            return
        with multiprocessing.get_context("fork").Pool(workers) as pool:
            yield from pool.imap(_encode, items, chunksize=16)
    finally:
        _WORKER = None


def format_summary(summary: dict[str, Any], out: str | Path) -> str:
    lines = [
        f"kept {summary['kept']} of {summary['records_read']} records -> {out}",
        f"tokens {summary['tokens']:,}, trained (assistant) {summary['trained_tokens']:,} "
        f"({100 * summary['trained_share']:.1f}%), truncated to --max-len: {summary['truncated']}",
    ]
    if summary.get("truncated_tail_bytes"):
        lines.append(f"the file ends inside a record: its last {summary['truncated_tail_bytes']:,} bytes "
                     f"({summary['dropped'][TAIL]} record) were not read")
    if summary["dropped"]:
        lines.append("dropped: " + ", ".join(f"{n} {reason}" for reason, n in sorted(summary["dropped"].items(), key=lambda kv: -kv[1])))
    else:
        lines.append("dropped: none")
    return "\n".join(lines)


def show_sample(path: str | Path, n: int, color: bool) -> str:
    """Sample n with trained tokens highlighted (green, or [[...]] without a terminal)."""
    from eyas.data.prepared import PreparedData
    from eyas.models import load_tokenizer

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
