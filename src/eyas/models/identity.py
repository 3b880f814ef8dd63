"""What makes two stages agree on a target: the same config and tokenizer, and where the
weights matter (states, labels, decoding) the same weights.

Every artifact eyas writes records a `ModelIdentity`; a later stage compares hashes, not
paths, so `packaged:smollm2-135m` and its cached folder count as the same model while a
different checkpoint of the same family does not.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from eyas.errors import EyasError

# Config keys that say how a model was stored or run, not what it computes.
_VOLATILE_KEYS = {
    "_name_or_path", "transformers_version", "torch_dtype", "dtype", "quantization_config",
    "_attn_implementation", "attn_implementation", "_attn_implementation_autoset", "use_cache",
    "architectures", "output_hidden_states", "return_dict", "_commit_hash",
}


@dataclass(frozen=True)
class ModelIdentity:
    model: str  # what the user passed; informative only
    config_hash: str
    tokenizer_hash: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    # What tokenizer_hash covers, part by part (vocabulary and chat-template digests, special
    # tokens as text), so a refusal can say what differs; None in artifacts from before it.
    tokenizer_parts: dict[str, Any] | None = field(default=None, compare=False, hash=False)
    # A digest sampled from the weights (`weights_hash`), where the stage had them: the states
    # and labels a drafter learns come from the weights, not only the config and tokenizer.
    # None where not taken (prepared data depends on the tokenizer alone) or in older artifacts.
    weights_hash: str | None = field(default=None, compare=False, hash=False)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelIdentity":
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d or k not in OPTIONAL})

    def check_same(self, other: "ModelIdentity", what: str) -> None:
        """Raise unless `other` (recorded in `what`) describes the same model and tokenizer."""
        same_name = self.model == other.model  # then say "changed", never "X differs from X"
        if self.tokenizer_hash != other.tokenizer_hash:
            raise EyasError(
                (f"{what} was made with a different tokenizer than the one now at {self.model} (it has changed since)."
                 if same_name else
                 f"{what} was made with a different tokenizer ({other.model}) than the one given ({self.model}).")
                + _tokenizer_difference(other.tokenizer_parts, self.tokenizer_parts)
            )
        if self.config_hash != other.config_hash:
            raise EyasError(
                f"{what} was made for model {self.model} before its config changed (configs differ)." if same_name else
                f"{what} was made for model {other.model}, not for {self.model} (configs differ)."
            )
        if self.weights_hash and other.weights_hash and self.weights_hash != other.weights_hash:
            raise EyasError(
                f"{what} was made from other weights than those now at {self.model} (they have changed since)."
                if same_name else
                f"{what} was made from the weights of {other.model}, not {self.model}: the config and tokenizer are "
                f"the same, the weights differ (a fine-tune or another checkpoint).")
        for name in ("num_layers", "hidden_size", "vocab_size"):  # covered by the hash, unless a record was edited
            if getattr(self, name) != getattr(other, name):
                raise EyasError(f"{what} records {name} {getattr(other, name)!r} for {other.model}, but the model has "
                                f"{getattr(self, name)!r}: the record was edited or is damaged.")


OPTIONAL = ("tokenizer_parts", "weights_hash")  # fields an older record may lack


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _stable(d: dict[str, Any]) -> dict[str, Any]:
    """`d` without volatile keys, at every level: a wrapper's nested text and vision configs
    get their own dtype when the model loads."""
    return {k: _stable(v) if isinstance(v, dict) else v for k, v in d.items() if k not in _VOLATILE_KEYS}


def config_hash(config) -> str:
    return _digest(_stable(config.to_dict()))


def _tokenizer_content(tokenizer) -> dict[str, Any]:
    return {
        "vocab": sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1]),
        "chat_template": getattr(tokenizer, "chat_template", None),
        "special": {k: str(v) for k, v in sorted(tokenizer.special_tokens_map.items())},
    }


def tokenizer_hash(tokenizer) -> str:
    return _digest(_tokenizer_content(tokenizer))


def tokenizer_parts(tokenizer) -> dict[str, Any]:
    content = _tokenizer_content(tokenizer)
    return {"vocab": _digest(content["vocab"]), "chat_template": _digest(content["chat_template"]),
            "special": content["special"]}


def _tokenizer_difference(then: dict[str, Any] | None, now: dict[str, Any] | None) -> str:
    """' What differs: ...' between two recorded tokenizer_parts, or '' when either is unknown.
    The same model files can give different tokenizers under different transformers versions
    (a GGUF's special tokens, for one), which is worth saying when only those differ."""
    if not then or not now:
        return ""
    differs = [name for name in ("vocab", "chat_template") if then.get(name) != now.get(name)]
    special = [f"{k} {then['special'].get(k)!r} there, {now['special'].get(k)!r} here"
               for k in sorted(set(then.get("special", {})) | set(now.get("special", {})))
               if then["special"].get(k) != now["special"].get(k)]
    parts = [{"vocab": "the vocabulary", "chat_template": "the chat template"}[n] for n in differs]
    if special:
        parts.append("special tokens (" + "; ".join(special) + ")")
    text = f" What differs: {', '.join(parts)}." if parts else ""
    if not differs and special:
        text += (" Vocabulary and chat template are the same; different transformers versions can read the same "
                 "model files with different special tokens, and if that is the case here, run this stage with "
                 "the version the artifact was made with.")
    return text


def text_config(config):
    """The language-model part of a config (multimodal wrappers nest it)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


SAMPLED_TENSORS = 4096  # at most this many tensors are sampled, evenly over the checkpoint
SAMPLE_BYTES = 256  # from the middle of each


def weights_hash(folder: str | Path) -> str | None:
    """A digest of a safetensors checkpoint's weights, sampled: every tensor's name, dtype and
    shape, and 256 bytes from the middle of each (of at most 4096 tensors), read from the
    files' headers and a few small reads. A fine-tune changes nearly every tensor, so this
    tells two checkpoints of one config and tokenizer apart in well under a second even at
    a trillion parameters, where hashing every byte would take minutes. None for a folder
    without safetensors weights (a hub id, .bin weights)."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    try:
        files = sorted(set(json.loads(index.read_bytes())["weight_map"].values())) if index.is_file() else \
            ["model.safetensors"] if (folder / "model.safetensors").is_file() else []
        tensors = []  # (file, name, dtype, shape, data start, begin, end)
        for name in files:
            with open(folder / Path(name).name, "rb") as f:
                size = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(size))
            tensors += [(name, k, v["dtype"], v["shape"], 8 + size, *v["data_offsets"])
                        for k, v in sorted(header.items()) if k != "__metadata__"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None  # not readable as safetensors: the stage that loads the weights says why
    if not tensors:
        return None
    step = max(1, len(tensors) // SAMPLED_TENSORS)
    digest = hashlib.sha256(json.dumps([t[1:4] for t in tensors]).encode())
    handles: dict[str, Any] = {}
    try:
        for file, _, _, _, start, begin, end in tensors[::step]:
            if file not in handles:
                handles[file] = open(folder / Path(file).name, "rb")
            f = handles[file]
            f.seek(start + max(begin, (begin + end - SAMPLE_BYTES) // 2))
            digest.update(f.read(min(SAMPLE_BYTES, end - begin)))
    except OSError:
        return None
    finally:
        for f in handles.values():
            f.close()
    return digest.hexdigest()[:16]


def model_identity(spec: str, config, tokenizer, folder: str | Path | None = None) -> ModelIdentity:
    """The identity of `spec`; with its `folder`, the weights' digest too (`weights_hash`)."""
    tc = text_config(config)
    if not hasattr(tc, "num_hidden_layers"):
        raise EyasError(f"{type(config).__name__} has no num_hidden_layers: not a decoder-only language model.")
    return ModelIdentity(
        model=spec,
        config_hash=config_hash(config),
        tokenizer_hash=tokenizer_hash(tokenizer),
        num_layers=int(tc.num_hidden_layers),
        hidden_size=int(tc.hidden_size),
        vocab_size=int(tc.vocab_size),
        tokenizer_parts=tokenizer_parts(tokenizer),
        weights_hash=weights_hash(folder) if folder is not None else None,
    )
