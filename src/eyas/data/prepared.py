"""The prepared-data folder that `eyas prepare` writes and every later stage reads.

prepared/
  prepared.json          format and its version, eyas version, target identity, max_len, source,
                         a fingerprint of the samples, counts, and the chat template the samples
                         were rendered with (text, source, sha256); built and read only here
  samples.safetensors    input_ids [T] int32, loss_mask [T] uint8, offsets [n+1] int64,
                         source_index [n] int64 (the record's position in the source)
  conversations.jsonl    the normalised messages of each kept sample, in the same order
                         (regeneration and `prepare --show` read them)
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors.torch import load_file, save

from eyas import __version__
from eyas.data.template import ChatTemplate
from eyas.errors import EyasError
from eyas.models.identity import ModelIdentity
from eyas.paths import atomic_write_bytes, atomic_write_json
from eyas.versions import check_version

FORMAT = "eyas-prepared"
FORMAT_VERSION = 1  # the layout this eyas writes and reads (and every earlier one: they recorded none)
META = "prepared.json"
SAMPLES = "samples.safetensors"
CONVERSATIONS = "conversations.jsonl"
PREPARED_FILES = (META, SAMPLES, CONVERSATIONS)


@dataclass
class PreparedSample:
    input_ids: torch.Tensor  # [T] int64
    loss_mask: torch.Tensor  # [T] bool, True on assistant (trained) tokens
    source_index: int


class PreparedData:
    """Random access to prepared samples; the whole token array is small enough to load."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_dir():
            what = "does not exist" if not self.path.exists() else "is a file, not a prepared folder"
            raise EyasError(f"{self.path} {what}; give the folder `eyas prepare` wrote (--out of eyas prepare).")
        try:
            self.meta = json.loads((self.path / META).read_bytes())
        except FileNotFoundError:
            raise EyasError(f"{self.path} is not prepared data (no {META}); run `eyas prepare` first.") from None
        except (ValueError, RecursionError):
            raise EyasError(f"{self.path / META} is cut off or corrupt; run `eyas prepare` again.") from None
        if not isinstance(self.meta, dict) or self.meta.get("format", FORMAT) != FORMAT \
                or not all(k in self.meta for k in ("target", "max_len", "fingerprint")):
            raise EyasError(f"{self.path / META} is not a prepared-data record; run `eyas prepare` again.")
        check_version(self.meta.get("format_version"), FORMAT_VERSION, "prepared data", self.path / META)
        try:
            t = load_file(self.path / SAMPLES)
            self.input_ids, self.loss_mask = t["input_ids"], t["loss_mask"]
            self.offsets, self.source_index = t["offsets"], t["source_index"]
        except FileNotFoundError:
            raise EyasError(f"{self.path} has no {SAMPLES}; run `eyas prepare` again.") from None
        except Exception as e:  # safetensors' own errors on a damaged file, or a tensor missing
            raise EyasError(f"{self.path / SAMPLES} is damaged ({type(e).__name__}: {e}); "
                            f"run `eyas prepare` again.") from None
        if len(self) == 0:
            raise EyasError(f"{self.path} holds no samples.")

    @property
    def identity(self) -> ModelIdentity:
        return ModelIdentity.from_dict(self.meta["target"])

    @property
    def chat_template(self) -> ChatTemplate | None:
        """The template `prepare` rendered with (None in data from before eyas recorded it:
        the tokenizer's own was used then)."""
        record = self.meta.get("chat_template")
        return ChatTemplate.from_dict(record) if record else None

    @property
    def max_len(self) -> int:
        """The longest sample `prepare` kept, in tokens (longer conversations were cut)."""
        return int(self.meta["max_len"])

    @property
    def fingerprint(self) -> str:
        """A hash of the samples' tokens and masks: what a store or a regeneration records to
        tell which prepared data it was made from."""
        return self.meta["fingerprint"]

    @property
    def excluded_prompts(self) -> list[str] | None:
        """The eval prompt sets no sample shares 8 words in a row with (`prepare --exclude-prompts`,
        carried through regeneration); None where the data recorded none (made before eyas did)."""
        excluded = self.meta.get("summary", {}).get("excluded_prompts")
        return list(excluded) if isinstance(excluded, list) else None

    def __len__(self) -> int:
        return len(self.source_index)

    def length(self, i: int) -> int:
        return int(self.offsets[i + 1] - self.offsets[i])

    def __getitem__(self, i: int) -> PreparedSample:
        if not 0 <= i < len(self):
            raise IndexError(i)
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return PreparedSample(self.input_ids[a:b].long(), self.loss_mask[a:b].bool(), int(self.source_index[i]))

    def __iter__(self) -> Iterator[PreparedSample]:
        for i in range(len(self)):
            yield self[i]

    def conversations(self) -> list[list[dict[str, str]]]:
        """The conversation of each sample, as `prepare` wrote them; a file cut or edited since
        is refused (regeneration would answer fewer, or other, conversations without a word)."""
        path = self.path / CONVERSATIONS
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise EyasError(f"{self.path} has no {CONVERSATIONS}; run `eyas prepare` again.") from None
        changed = f"{path} was changed since `eyas prepare` wrote it"
        recorded = self.meta.get("conversations_sha256")  # absent in data from before eyas recorded it
        if recorded is not None and recorded != hashlib.sha256(data).hexdigest():
            raise EyasError(f"{changed} (its sha256 differs from {self.path / META}'s); run `eyas prepare` again.")
        try:
            # "\n" only: a conversation may hold U+2028 or U+0085, which splitlines() would also cut at
            rows = [json.loads(line) for line in data.decode("utf-8").split("\n") if line]
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            raise EyasError(f"{changed}: it is not one JSON conversation a line ({type(e).__name__}); run "
                            f"`eyas prepare` again.") from None
        if len(rows) != len(self):
            raise EyasError(f"{changed}: it holds {len(rows)} conversations for {len(self)} samples; run "
                            f"`eyas prepare` again.")
        return rows


def samples_fingerprint(samples: list[PreparedSample]) -> str:
    digest = hashlib.sha256()
    for s in samples:
        digest.update(s.input_ids.numpy().tobytes() + s.loss_mask.numpy().tobytes())
    return digest.hexdigest()[:16]


def write_prepared(path: str | Path, samples: list[PreparedSample], conversations: list[list[dict[str, str]]],
                   target: ModelIdentity, chat_template: ChatTemplate | None, source: str, max_len: int,
                   summary: dict[str, Any]) -> None:
    """Write the three files atomically; `prepared.json` last, so its presence means complete."""
    path = Path(path)
    meta = {"format": FORMAT, "format_version": FORMAT_VERSION, "eyas_version": __version__,
            "target": target.to_dict(), "chat_template": None if chat_template is None else chat_template.to_dict(),
            "source": source, "max_len": max_len, "fingerprint": samples_fingerprint(samples), "summary": summary}
    ids = [s.input_ids.to(torch.int32) for s in samples]
    lengths = torch.tensor([len(x) for x in ids], dtype=torch.int64)
    tensors = {
        "input_ids": torch.cat(ids) if ids else torch.zeros(0, dtype=torch.int32),
        "loss_mask": torch.cat([s.loss_mask.to(torch.uint8) for s in samples]) if ids else torch.zeros(0, dtype=torch.uint8),
        "offsets": torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]),
        "source_index": torch.tensor([s.source_index for s in samples], dtype=torch.int64),
    }
    lines = "".join(json.dumps(c, ensure_ascii=False) + "\n" for c in conversations).encode()
    meta["conversations_sha256"] = hashlib.sha256(lines).hexdigest()
    (path / META).unlink(missing_ok=True)  # an interrupted rewrite must not look complete
    atomic_write_bytes(path / SAMPLES, save(tensors))
    atomic_write_bytes(path / CONVERSATIONS, lines)
    atomic_write_json(path / META, meta)
