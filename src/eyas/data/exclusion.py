"""Eval prompts kept out of training data, and the check that an eval's prompts were.

`eyas prepare --exclude-prompts` drops every conversation that shares 8 words in a row with a
prompt of the sets named (`exclusion_grams`), and records those sets in the prepared data;
regeneration, capture and training carry the record on to the drafter. A drafter's tau on
prompts its training data held is not its tau on new prompts, so eval checks its own prompts
against that record (`not_excluded`): a prompt all of whose 8-word sequences belong to the
excluded sets cannot share one with a kept conversation; any other may, and eval says which.
"""

from __future__ import annotations

import sys
from pathlib import Path

from eyas.data.long_prompts import load_prompt_set, parse_long
from eyas.data.synthetic import ngram_set
from eyas.errors import EyasError
from eyas.prompts import EvalPrompt


def prompt_grams(prompt: EvalPrompt) -> frozenset:
    """The 8-word sequences of what a prompt puts before the target: its turns and its history."""
    return ngram_set([*prompt.turns, *(m["content"] for m in prompt.history)])


def recorded(prompt_sets: list[str]) -> list[str]:
    """The sets as the prepared data records them: a file by its absolute path, so that a later
    stage run elsewhere in the tree reads the same file; names (mt-bench, long specs) as given."""
    return [str(Path(s).resolve()) if parse_long(s) is None and Path(s).is_file() else s for s in prompt_sets]


def exclusion_grams(prompt_sets: list[str], tokenizer) -> frozenset:
    """The 8-word sequences of every eval input in `prompt_sets`: the turns asked and the
    histories before them (a long prompt's history is most of it). A prompt too short to hold
    one could never be matched: a warning names it rather than let it through unsaid."""
    grams, blind = _grams(prompt_sets, tokenizer)
    if blind:
        print(f"eyas prepare: warning: {len(blind)} prompt(s) of --exclude-prompts ({', '.join(blind[:3])}"
              f"{', ...' if len(blind) > 3 else ''}) are shorter than 8 words (or 16 characters of Chinese, "
              f"Japanese, Thai...), so no conversation is dropped for them.", file=sys.stderr)
    return grams


def _grams(prompt_sets: list[str], tokenizer) -> tuple[frozenset, list[str]]:
    """The sets' 8-word sequences, and the ids of prompts too short to hold one."""
    grams: set[tuple[str, ...]] = set()
    blind = []
    for name in prompt_sets:
        for p in load_prompt_set(name, lambda: tokenizer):
            own = prompt_grams(p)
            grams |= own
            if not own:
                blind.append(p.id)
    return frozenset(grams), blind


def not_excluded(prompts: list[EvalPrompt], excluded: list[str], tokenizer, source: str | None = None) -> list[str]:
    """Ids of `prompts` that the training data's exclusion of `excluded` did not cover: some 8
    words in a row of theirs are in none of the excluded prompts, so a conversation holding them
    may have been trained on. Prompts read from `source`, a set that was itself excluded, are
    covered without building the sets again (a `long` set's take a while). Raises EyasError
    when an excluded set cannot be read here."""
    if source is not None and recorded([source])[0] in excluded:
        return []
    try:
        grams = _grams(excluded, tokenizer)[0]
    except EyasError as e:
        raise EyasError(f"the prompts its data excluded cannot be read here ({e})") from None
    return [p.id for p in prompts if not prompt_grams(p) <= grams]
