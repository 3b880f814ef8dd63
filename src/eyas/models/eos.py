"""Where a target's answer ends: the end-of-sequence ids regenerate and eval stop on."""

from __future__ import annotations

from transformers import GenerationConfig

from eyas.errors import EyasError


def saved_generation_config(folder: str) -> GenerationConfig | None:
    """The folder's generation_config.json, read without loading the model; None without one."""
    try:
        return GenerationConfig.from_pretrained(folder)
    except OSError:  # no generation_config.json
        return None


def eos_ids(generation_config: GenerationConfig | None, tokenizer) -> list[int]:
    """The tokenizer's EOS and the generation config's (one id or a list), sorted; refused when
    there is none, since nothing would tell where an answer ends."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    eos = generation_config.eos_token_id if generation_config is not None else None
    ids |= set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if not ids:
        raise EyasError("The target defines no end-of-sequence token; eyas cannot tell where an answer ends.")
    return sorted(ids)


def cut_at_stop(ids: list[int], stops: list[int]) -> list[int]:
    """`ids` up to (not including) the first of `stops`."""
    for i, t in enumerate(ids):
        if t in stops:
            return ids[:i]
    return ids
