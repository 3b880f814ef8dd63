"""What makes two stages agree on a target: the same config and the same tokenizer.

Every artifact eyas writes records a `ModelIdentity`; a later stage compares hashes, not
paths, so `packaged:smollm2-135m` and its cached folder count as the same model while a
different checkpoint of the same family does not.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelIdentity":
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d or k != "tokenizer_parts"})

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
        for name in ("num_layers", "hidden_size", "vocab_size"):  # covered by the hash, unless a record was edited
            if getattr(self, name) != getattr(other, name):
                raise EyasError(f"{what} records {name} {getattr(other, name)!r} for {other.model}, but the model has "
                                f"{getattr(self, name)!r}: the record was edited or is damaged.")


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


def model_identity(spec: str, config, tokenizer) -> ModelIdentity:
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
    )
