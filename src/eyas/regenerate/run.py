"""The regeneration loop: turn by turn, so a later turn sees the target's earlier answers.

Conversations are processed in groups; within a group, round r generates the r-th
assistant turn of every conversation in one generator call. A finished group is appended
to `regenerated.jsonl` in the output folder (one fsync'd line per conversation), so a
killed run resumes after the last complete group. At the end the regenerated
conversations go through `eyas prepare` (same target, same --max-len), which writes a
valid prepared folder next to them. Prompts are rendered, and the result prepared, with the
chat template recorded in the source data.

With `minutes`, the run stops after the first group that ends past that budget; the
prepared folder then holds the conversations finished so far, and the same command
continues where it stopped.

A turn is generated only while its prompt is shorter than --max-len: later turns would be
truncated away by `prepare` anyway, so they are dropped instead of generated. A conversation
also ends before an empty answer (`prepare` would drop the whole conversation for it). An
answer cut by its token budget is marked `"cut": true`, so that `prepare` does not train the
end of turn after it (the target would have gone on); the conversation goes on, its later
turns asked after the answer as cut, since dropping them would lose most second turns at the
recipe's 256 tokens.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from eyas.data.prepare import prepare_into
from eyas.data.prepared import META, PREPARED_FILES, PreparedData
from eyas.device import parse_device, resolve_device
from eyas.errors import EyasError
from eyas.lock import LOCK_FILE, output_lock
from eyas.models import load_tokenizer
from eyas.models.dtype import model_dtype
from eyas.models.identity import ModelIdentity
from eyas.paths import atomic_write_bytes, check_confined, remove_leftovers
from eyas.regenerate.config import RegenerateConfig
from eyas.regenerate.generate import HFGenerator, VLLMGenerator
from eyas.vllm.target import read_target

PROGRESS = "regenerated.jsonl"
CONVERSATIONS = "regenerated-conversations.jsonl"  # the input handed to `prepare`


def make_generator(cfg: RegenerateConfig, max_len: int):
    if cfg.backend == "vllm":
        return VLLMGenerator(cfg.model, dtype=model_dtype(cfg.model_dtype, None), max_len=max_len,
                             tensor_parallel_size=cfg.vllm.tensor_parallel_size,
                             pipeline_parallel_size=cfg.vllm.pipeline_parallel_size, engine_args=cfg.vllm.engine_args)
    dev = resolve_device(cfg.device)
    generator = HFGenerator(cfg.model, dtype=model_dtype(cfg.model_dtype, dev.type), device=str(dev))
    if generator.greedy is None and cfg.temperature == 0:
        print(f"eyas regenerate: {type(generator.model).__name__} decodes with model.generate (sliding-window layers or "
              f"soft-capped attention: the static-cache loop does not compute them)", flush=True)
    elif generator.greedy is not None and cfg.temperature == 0 and dev.type != "cuda":
        print(f"eyas regenerate: greedy batches on a preallocated cache; on {dev.type} each step runs eagerly (CUDA "
              f"graphs need a GPU)", flush=True)
    return generator


def default_group_size(cfg: RegenerateConfig) -> int:
    """Conversations per group when --group-size is not given. A GPU is fed thousands at once
    (1.5 minutes of SmolLM2 on an H200 regenerated 320 conversations in groups of 64, about
    6,000 in groups of 4096); its batches stay within the generator's cache budget either way.
    The CPU saves every 64, so a killed run loses little."""
    if cfg.backend == "vllm":
        return 4096 if torch.cuda.is_available() else 64
    return 4096 if resolve_device(cfg.device).type == "cuda" else 64


def regenerate(cfg: RegenerateConfig, progress: bool = True) -> dict[str, Any]:
    """Regenerate every conversation of `cfg.data` not yet in `cfg.out` (or as many as
    `cfg.minutes` allow), then prepare `cfg.out` from the finished ones; return prepare's summary."""
    model, data, minutes = cfg.model, cfg.data, cfg.minutes
    check_confined(cfg.out, {"--data": data, "--model": model})
    if cfg.backend == "hf":
        parse_device(cfg.device)
    started = time.monotonic()
    seconds = {"load": 0.0, "render": 0.0, "generate": 0.0, "prepare": 0.0}  # where this run's time went
    source = PreparedData(data)
    out = Path(cfg.out)
    conversations, max_len, fingerprint = source.conversations(), source.max_len, source.fingerprint
    target = read_target(model)[2]  # with its weights' digest: the answers are theirs
    target.check_same(source.identity, f"The prepared data in {data}")  # no layer ids: any depth
    tokenizer = load_tokenizer(model)
    if source.chat_template is not None:
        source.chat_template.apply(tokenizer)  # render as `prepare` did
    with output_lock(out, "regenerate"):  # one run per folder: two would interleave the progress file
        check_own_folder(out)
        settings = answer_settings(cfg)
        done = read_progress(out / PROGRESS, fingerprint, settings, target)
        size = cfg.group_size or default_group_size(cfg)
        groups = groups_to_do(len(conversations), done, size, sampled=cfg.temperature > 0)
        todo = [i for group in groups for i in group if i not in done]
        generator = None
        if todo:
            t0 = time.monotonic()
            generator = make_generator(cfg, max_len)
            seconds["load"] = time.monotonic() - t0
            bar = tqdm(total=len(todo), unit=" conv", desc=f"regenerate ({cfg.backend})", disable=not progress)
            try:
                with open(out / PROGRESS, "a", encoding="utf-8") as log:
                    if log.tell() == 0:
                        _append(log, {"data": str(source.path.resolve()), "fingerprint": fingerprint,
                                      "settings": settings, "target": target.to_dict()})
                    for group in groups:
                        answers = regenerate_group(generator, tokenizer, [conversations[i] for i in group],
                                                   max_len, cfg.max_new_tokens, cfg.temperature, cfg.seed + group[0],
                                                   seconds)
                        new = [(i, messages) for i, messages in zip(group, answers) if i not in done]
                        for i, messages in new:
                            _append(log, {"index": i, "messages": messages})
                            done[i] = messages
                        bar.update(len(new))
                        if minutes is not None and time.monotonic() - started > 60 * minutes and len(done) < len(conversations):
                            print(f"eyas regenerate: --minutes {minutes} reached with {len(done)} of {len(conversations)} "
                                  f"conversations; the prepared folder holds those, and the same command continues.")
                            break
            finally:
                bar.close()
                decoding = getattr(getattr(generator, "greedy", None), "stats", None)
                generator.close()
        atomic_write_bytes(out / CONVERSATIONS, "".join(json.dumps({"messages": done[i]}, ensure_ascii=False) + "\n"
                                                        for i in sorted(done)).encode("utf-8"))
        t0 = time.monotonic()
        summary = prepare_into(model, str(out / CONVERSATIONS), out, max_len, chat_template=source.chat_template,
                               progress=progress, pack=cfg.pack, excluded=source.excluded_prompts)
        seconds["prepare"] = time.monotonic() - t0
        summary["regenerate_seconds"] = {k: round(v, 1) for k, v in seconds.items()}
        if generator is not None and decoding and decoding["batches"]:
            summary["static_decoding"] = {**{k: round(v, 1) if isinstance(v, float) else v for k, v in decoding.items()},
                                          "kept_share": round(decoding["kept_tokens"] / max(decoding["row_steps"], 1), 3)}
        return summary


OWN_FILES = (PROGRESS, CONVERSATIONS, *PREPARED_FILES)


def check_own_folder(out: Path) -> None:
    """--out holds nothing but what regenerate writes: a killed run's half-written files are
    removed, anything else is refused before a file is touched. Prepared files are regenerate's
    only beside its progress file, or when prepared from its conversations file: else they are
    `eyas prepare`'s output for other data, which a fresh start would overwrite."""
    prepared = sorted(p.name for p in out.iterdir() if p.name in PREPARED_FILES)
    if prepared and not (out / PROGRESS).exists() and not _prepared_here(out):
        raise EyasError(f"--out {out} holds prepared data that regenerate did not write ({', '.join(prepared)}, no "
                        f"{PROGRESS}); regenerate would overwrite it: choose another --out.")
    remove_leftovers(out, OWN_FILES)
    foreign = sorted(p.name for p in out.iterdir() if p.name not in (*OWN_FILES, LOCK_FILE))
    if foreign:
        raise EyasError(f"--out {out} already holds other files ({', '.join(foreign[:3])}); regenerate writes into an "
                        f"empty folder or one it wrote before: choose another --out.")


def _prepared_here(out: Path) -> bool:
    """Whether the prepared data in `out` was prepared from `out`'s own regenerated conversations."""
    try:
        source = json.loads((out / META).read_bytes())["source"]
        return Path(source).resolve() == (out / CONVERSATIONS).resolve()
    except (OSError, ValueError, KeyError, TypeError):
        return False


def groups_to_do(n: int, done: dict[int, Any], size: int, sampled: bool) -> list[list[int]]:
    """The groups of conversations still to generate. A greedy answer does not depend on its
    group: the conversations not done, `size` at a time. A sampled one follows its group's seed
    and members: the same groups as an uninterrupted run (every `size` conversations), each
    generated whole while any of it is not done (the answers already saved are kept), so a run
    killed while saving a group draws on resume what an uninterrupted run draws."""
    if not sampled:
        todo = [i for i in range(n) if i not in done]
        return [todo[s:s + size] for s in range(0, len(todo), size)]
    groups = [list(range(s, min(s + size, n))) for s in range(0, n, size)]
    return [g for g in groups if any(i not in done for i in g)]


def regenerate_group(generator, tokenizer, conversations: list[list[dict[str, Any]]], max_len: int,
                     max_new_tokens: int, temperature: float, seed: int,
                     seconds: dict[str, float] | None = None) -> list[list[dict[str, Any]]]:
    """Replace the assistant turns of each conversation, one round per turn; adds the time
    spent rendering prompts and generating to `seconds` ("render", "generate"). A conversation
    ends before an empty answer (`prepare` drops a conversation holding an empty message, its
    good turns too). An answer as long as its budget never stopped (the generators cut before
    the first stop id): it is marked "cut", and `prepare` leaves the end of turn after it untrained."""
    seconds = seconds if seconds is not None else {"render": 0.0, "generate": 0.0}
    convs = [_without_leading_answers([dict(m) for m in c]) for c in conversations]
    turn = [_next_assistant(c, 0) for c in convs]  # index of each conversation's next assistant message
    while True:
        t0 = time.monotonic()
        asked = [c for c, j in enumerate(turn) if j is not None]
        texts = [tokenizer.apply_chat_template(convs[c][:turn[c]], tokenize=False, add_generation_prompt=True)
                 for c in asked]
        # One call for the round: a fast tokenizer encodes the batch on every core.
        encoded = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
        pending, prompts, budgets = [], [], []
        for c, ids in zip(asked, encoded):
            if len(ids) >= max_len:  # this turn and later ones would be truncated away
                del convs[c][turn[c]:]
                turn[c] = None
                continue
            pending.append(c)
            prompts.append(ids)
            budgets.append(min(max_new_tokens, max_len - len(ids)))
        seconds["render"] += time.monotonic() - t0
        if not pending:
            return convs
        t0 = time.monotonic()
        generated = generator.generate(prompts, budgets, temperature, seed)
        seconds["generate"] += time.monotonic() - t0
        t0 = time.monotonic()
        texts = tokenizer.batch_decode(generated, skip_special_tokens=True)
        for c, ids, budget, text in zip(pending, generated, budgets, texts):
            j = turn[c]
            if not text.strip():
                del convs[c][j:]
                turn[c] = None
                continue
            convs[c][j]["content"] = text
            convs[c][j].pop("cut", None)  # the source's mark was for its own answer
            if len(ids) >= budget:
                convs[c][j]["cut"] = True
            turn[c] = _next_assistant(convs[c], j + 1)
        seconds["render"] += time.monotonic() - t0
        seed += len(pending)


def _without_leading_answers(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """An answer with no message before it has no prompt to be regenerated from: drop it."""
    first = next((j for j, m in enumerate(messages) if m["role"] != "assistant"), len(messages))
    return messages[first:]


def _next_assistant(messages: list[dict[str, Any]], start: int) -> int | None:
    return next((j for j in range(start, len(messages)) if messages[j]["role"] == "assistant"), None)


def answer_settings(cfg: RegenerateConfig) -> dict[str, Any]:
    """The options that decide the answers, recorded with the first and checked on resume: a
    run continued with others would hold answers of two settings (half capped at 4 tokens)."""
    settings = {"backend": cfg.backend, "temperature": cfg.temperature, "max_new_tokens": cfg.max_new_tokens,
                "model_dtype": cfg.model_dtype}
    if cfg.temperature > 0:  # a group's draws follow the seed and where the group starts
        # The size used, not None: the default differs by device, and a run resumed on another
        # device would otherwise regroup unchecked.
        settings.update(seed=cfg.seed, group_size=cfg.group_size or default_group_size(cfg))
    return settings


def read_progress(path: Path, fingerprint: str, settings: dict[str, Any],
                  target: ModelIdentity | None = None) -> dict[int, list[dict[str, Any]]]:
    """Conversations finished by an earlier run with the same `settings` and, where recorded,
    the same `target` (weights included: another checkpoint of one config and tokenizer answers
    otherwise). A torn last line (a run killed mid-write) is cut off, so the next append starts
    on a fresh line. Records are split at b"\n" only: str.splitlines would also split inside an
    answer holding U+2028, U+0085 and the like, which json.dumps(ensure_ascii=False) writes as
    they are (seen in a SmolLM2 answer)."""
    if not path.exists():
        return {}
    done: dict[int, list[dict[str, Any]]] = {}
    data = path.read_bytes()
    complete = data[: data.rfind(b"\n") + 1]
    for n, line in enumerate(complete.split(b"\n")[:-1]):
        try:
            record = json.loads(line.decode("utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise EyasError(f"{path} line {n + 1} is corrupt; delete it to start over.") from None
        if "fingerprint" in record and record["fingerprint"] != fingerprint:
            raise EyasError(f"{path.parent} holds a regeneration of other prepared data ({record['data']}); "
                            f"choose another --out.")
        if "fingerprint" in record and "settings" in record:  # runs before eyas recorded them have none
            check_same_settings(record["settings"], settings, path.parent)
        if "target" in record and target is not None:  # runs before eyas recorded it have none
            check_same_target(ModelIdentity.from_dict(record["target"]), target, path)
        if "index" in record:
            done[record["index"]] = record["messages"]
    if len(complete) < len(data):
        with open(path, "r+b") as f:
            f.truncate(len(complete))
    return done


def check_same_settings(recorded: dict[str, Any], settings: dict[str, Any], out: Path) -> None:
    differ = [f"--{k.replace('_', '-')} {settings.get(k)!r} (it has {recorded.get(k)!r})"
              for k in sorted(set(recorded) | set(settings)) if recorded.get(k) != settings.get(k)]
    if differ:
        raise EyasError(f"{out} holds answers regenerated with other settings, and this run changes "
                        f"{'; '.join(differ)}: one folder would mix both. Repeat the first run's options, or choose "
                        f"another --out.")


def check_same_target(recorded: ModelIdentity, target: ModelIdentity, progress: Path) -> None:
    """Raise unless `target` is the model (config, tokenizer, weights) that wrote `progress`."""
    try:
        target.check_same(recorded, f"{progress} (the answers so far)")
    except EyasError as e:
        raise EyasError(f"{e} One folder would mix two models' answers: resume with {recorded.model}, or choose "
                        f"another --out.") from None


def _append(log, record: dict[str, Any]) -> None:
    try:
        log.write(json.dumps(record, ensure_ascii=False) + "\n")
        log.flush()
        os.fsync(log.fileno())
    except OSError as e:
        if e.filename is None:  # a write's error names no file: a full disk must say which
            raise OSError(e.errno, e.strerror, log.name) from e
        raise
