"""Long-context prompts built from the packaged ShareGPT conversations, so that `eyas eval
--prompts long` reports tau by context length (does the drafter hold up at 8k, 32k, 64k
tokens?) on material every machine has, and `eyas prepare --exclude-prompts long` keeps
exactly that material out of training.

The rule (deterministic: it reads only the packaged file and the target's tokenizer):
- The material is the packaged ShareGPT conversations in file order, each with its system
  messages and a trailing unanswered user turn dropped, kept only if its turns alternate
  user/assistant, its first user turn has 8 words or more (of ASCII letters and digits) and 8 in
  a row for the exclusion (`synthetic.contaminated`), and no user turn shares 8 words in a row
  with MT-bench. Every prompt quotes the first user turn of each conversation it uses,
  so prepare's 8-word exclusion finds every one of them.
- Each conversation is used once, by one prompt. Prompts are built length by length, in the
  order given, `count` per length.
- A prompt of length L asks the first user turn of the next conversation whose turn renders
  within L/4 tokens (longer ones are passed over), after a history of
  the conversations that follow it, in order: each whole if the rendered prompt (chat template
  and generation prompt included) stays within L tokens, else its leading user/assistant pairs
  that do (none: it is passed over), until the prompt holds 95% of L, or 8 conversations in a
  row were passed over. So a prompt is at most L tokens, and nearly always 95% of L or more;
  the answer comes on top (eval refuses prompts whose answer would not fit the target's
  positions).

A spec is `long` (lengths 8192, 32768, 65536; 4 prompts each), `long:L1,L2` or
`long:L1,L2:N`; a length may be written 8k (8192). Each prompt's category is `ctx L`, its id
`long-L-j`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

from eyas.data.sources import BadRecord, iter_records, normalize
from eyas.data.synthetic import contaminated, ngram_set
from eyas.errors import EyasError
from eyas.prompts import EvalPrompt, load_prompts, mt_bench_turns, render

LONG = "long"
LENGTHS = (8192, 32768, 65536)
PER_LENGTH = 4
MATERIAL = "packaged:sharegpt"
SHORTEST = 256  # a length below this leaves no room for a history
FILL = 0.95  # a prompt is filled to this share of its length ...
PASSES = 8  # ... unless this many conversations in a row had no exchange that fit


def parse_long(source: str) -> tuple[tuple[int, ...], int] | None:
    """`long[:L1,L2[:N]]` -> (lengths, prompts per length); None for any other source."""
    if source != LONG and not source.startswith(LONG + ":"):
        return None
    parts = source.split(":")[1:]
    if len(parts) > 2 or any(not p for p in parts):
        raise EyasError(f"--prompts {source}: expected long, long:L1,L2 or long:L1,L2:N (e.g. long:8k,32k:4).")
    lengths = tuple(_length(t, source) for t in parts[0].split(",")) if parts else LENGTHS
    count = PER_LENGTH
    if len(parts) == 2:
        if not parts[1].isdigit() or int(parts[1]) < 1:
            raise EyasError(f"--prompts {source}: the prompt count {parts[1]!r} is not a positive whole number.")
        count = int(parts[1])
    return lengths, count


def _length(text: str, source: str) -> int:
    m = re.fullmatch(r"(\d+)(k?)", text.strip().lower())
    if not m:
        raise EyasError(f"--prompts {source}: the length {text!r} is not a whole number of tokens (e.g. 8192 or 8k).")
    n = int(m[1]) * (1024 if m[2] else 1)
    if n < SHORTEST:
        raise EyasError(f"--prompts {source}: a length of {n} tokens leaves no room for a history; use {SHORTEST} "
                        f"or more.")
    return n


def load_prompt_set(source: str, tokenizer: Callable[[], Any], limit: int | None = None) -> list[EvalPrompt]:
    """Eval's and prepare's prompts: a `long` spec built with the target's tokenizer (loaded
    only then), else mt-bench or a JSONL file (eyas.prompts)."""
    spec = parse_long(source)
    if spec is None:
        return load_prompts(source, limit)
    prompts = long_prompts(*spec, tokenizer())
    return prompts[:limit] if limit else prompts


def long_prompts(lengths: tuple[int, ...], count: int, tokenizer) -> list[EvalPrompt]:
    """`count` prompts of each length in `lengths`, by the module's rule."""
    material = _material()
    prompts = []
    for length in lengths:
        for j in range(count):
            question = _question(tokenizer, material, length, j)
            history = _history(tokenizer, material, question, length, j)
            prompts.append(EvalPrompt(f"long-{length}-{j}", [question], history, category=f"ctx {length}"))
    return prompts


def _material() -> Iterator[list[dict[str, str]]]:
    """The packaged conversations the rule admits, in file order."""
    grams = ngram_set(mt_bench_turns())
    for record in iter_records(MATERIAL):
        try:
            messages = [m for m in normalize(record) if m["role"] != "system"]
        except BadRecord:
            continue
        if messages and messages[-1]["role"] == "user":
            messages = messages[:-1]
        alternating = all(m["role"] == ("user", "assistant")[k % 2] for k, m in enumerate(messages))
        first = messages[0]["content"] if messages else ""
        if (alternating and _ascii_words(first) >= 8 and ngram_set([first])
                and not any(contaminated(m["content"], grams) for m in messages if m["role"] == "user")):
            yield messages


def _ascii_words(text: str) -> int:
    """The words the rule counts: runs of ASCII letters and digits, apostrophes dropped (the
    8-word exclusion's words before it read every script: kept, so the prompts stay those that
    earlier versions measured)."""
    return len(re.findall(r"[a-z0-9]+", text.lower().replace("'", "").replace("\u2019", "")))


def _next(material: Iterator[list[dict[str, str]]], length: int, j: int) -> list[dict[str, str]]:
    conversation = next(material, None)
    if conversation is None:
        raise EyasError(f"The packaged ShareGPT conversations ran out at prompt {j} of {length} tokens: ask for fewer "
                        f"or shorter long prompts.")
    return conversation


def _question(tokenizer, material, length: int, j: int) -> str:
    """The first user turn of the next conversation whose turn alone is a quarter of `length` or less."""
    while True:
        turn = _next(material, length, j)[0]["content"]
        if _tokens(tokenizer, [], turn) <= length // 4:
            return turn


def _history(tokenizer, material, question: str, length: int, j: int) -> list[dict[str, str]]:
    """Conversations, whole or their leading pairs, while the prompt fits `length` tokens, until
    it holds FILL of them (see the module's rule). Each user/assistant pair is rendered once,
    alone: chat templates mark message boundaries with special tokens, so a prompt's tokens are
    its pairs' added up, which one render of the whole prompt checks at the end."""
    cost = _pair_tokens(tokenizer)
    history: list[dict[str, str]] = []
    total, passed = _tokens(tokenizer, [], question), 0
    while total < FILL * length and passed < PASSES:
        conversation = _next(material, length, j)
        costs = [cost(conversation[k], conversation[k + 1]) for k in range(0, len(conversation), 2)]
        pairs = 0
        for c in costs:
            if total + c > length:
                break
            total += c
            pairs += 1
        history += conversation[:2 * pairs]
        passed = 0 if pairs else passed + 1
    while history and _tokens(tokenizer, history, question) > length:  # a template whose messages do not add up
        history = history[:-2]
    return history


def _pair_tokens(tokenizer) -> Callable[[dict[str, str], dict[str, str]], int]:
    """A user message and its answer -> the tokens they add to a rendered prompt. Measured as a
    pair, as history grows: templates that demand strict user/assistant alternation (Gemma,
    Mistral) refuse an answer rendered without its question."""
    probe = "Hi."
    base = _tokens(tokenizer, [], probe)
    return lambda user, assistant: _tokens(tokenizer, [user, assistant], probe) - base


def _tokens(tokenizer, history: list[dict[str, str]], question: str) -> int:
    """Tokens of the prompt `history` + `question` as eval renders it."""
    return len(render(tokenizer, [*history, {"role": "user", "content": question}]))
