"""Tokenize a conversation with the target's chat template (its own, or one the user gives
`prepare`, recorded with the prepared data) and mark the assistant tokens.

The mask is derived from the template itself, not from per-family regexes: for assistant
turn i, the text the template adds when that message is appended after
`messages[:i] + generation prompt` (its content plus the template's end-of-turn text) is
located in the rendering of the whole conversation, and the tokens starting inside it are
trained. Templates that render history differently from the last turn (e.g. ones that drop
earlier reasoning) fall back to locating the turn's content followed by the same closing text.
So do templates whose generation prompt is not a prefix of the turn (QwQ and DeepSeek-R1-Distill
add `<think>\n`): there the closing text is what follows the content when the turn is rendered
last. An answer cut by its token budget (`"cut": true`, from regenerate) never reached its end of
turn, so its closing text is not trained: only up to the end of its content.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eyas.data.sources import BadRecord
from eyas.errors import EyasError


@dataclass(frozen=True)
class ChatTemplate:
    """The template `prepare` rendered with, recorded in the prepared data so that later stages
    render (regenerate) and check (capture, train --online) with the same one, unasked."""

    text: str
    source: str  # "tokenizer" or the file it was read from

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()

    @classmethod
    def from_file(cls, path: str | Path) -> "ChatTemplate":
        path = Path(path).expanduser()
        try:
            return cls(path.read_text(), str(path.resolve()))
        except OSError as e:
            raise EyasError(f"Cannot read the chat template {path}: {e.strerror or e}.") from None

    def to_dict(self) -> dict[str, Any]:
        return {"text": self.text, "source": self.source, "sha256": self.sha256}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ChatTemplate":
        return cls(d["text"], d["source"])

    def apply(self, tokenizer) -> None:
        tokenizer.chat_template = self.text


def check_same_template(recorded: ChatTemplate, given: str | Path | None, what: str) -> None:
    """A stage given `--chat-template FILE` must name the template `what` was prepared with."""
    if given is None:
        return
    other = ChatTemplate.from_file(given)
    if other.sha256 == recorded.sha256:
        return
    if other.source == recorded.source:
        raise EyasError(f"The chat template {given} has changed since {what} was prepared with it (sha256 "
                        f"{recorded.sha256[:12]}, now {other.sha256[:12]}); prepare the data again.")
    made = "the tokenizer's own template" if recorded.source == "tokenizer" else recorded.source
    raise EyasError(
        f"{what} was prepared with {made} (sha256 {recorded.sha256[:12]}), but --chat-template {given} is a "
        f"different template (sha256 {other.sha256[:12]}); drop --chat-template to use the recorded one, or "
        f"prepare the data again with it."
    )


def require_chat_template(tokenizer, model: str) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise EyasError(
            f"The tokenizer of {model} has no chat template, so eyas cannot tell assistant tokens from the rest. "
            f"Use the instruct/chat variant of the model, or pass --chat-template FILE.jinja."
        )
    if not getattr(tokenizer, "is_fast", False):
        raise EyasError(f"The tokenizer of {model} is not a fast tokenizer; eyas needs character offsets.")


def _render(tokenizer, messages, generation_prompt: bool = False) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    except Exception as e:  # jinja raises for conversations a template forbids
        raise BadRecord(f"chat template rejected it ({type(e).__name__})") from None


def _turn(tokenizer, messages: list[dict[str, str]], i: int) -> tuple[str | None, str]:
    """(the rendering before assistant turn i's trained text, that text: content + end of turn),
    or (None, that text as `_closed` finds it) when the template does not render the turn as an
    append.

    Before turn i is `messages[:i]` with the generation prompt. A first turn has no such
    context (templates refuse an empty conversation), so its text is learnt from the same
    message after a stand-in user turn, and must end the rendering of the turn on its own;
    what precedes it there (an injected system prompt, the assistant header) is not trained.
    """
    message = messages[i]
    through = _render(tokenizer, messages[: i + 1])
    if i:
        before = _render(tokenizer, messages[:i], generation_prompt=True)
        if through.startswith(before):
            return before, through[len(before):]
        return None, _closed(tokenizer, messages[:i], through, message["content"])
    probe = [{"role": "user", "content": "?"}]
    try:
        ref_before = _render(tokenizer, probe, generation_prompt=True)
        ref_through = _render(tokenizer, probe + [message])
    except BadRecord:  # a template that wants the conversation to open otherwise
        return None, message["content"]
    if ref_through.startswith(ref_before):
        segment = ref_through[len(ref_before):]
    else:
        segment = _closed(tokenizer, probe, ref_through, message["content"])
    if segment and through.endswith(segment):
        return through[: len(through) - len(segment)], segment
    return None, message["content"]


def _closed(tokenizer, context: list[dict[str, str]], through: str, content: str) -> str:
    """The content and the closing text after it in `through`, the rendering of `context` and
    the turn, where the turn is last: so its closing runs to the end (to where a next message
    would start). The content is looked for after `context`'s own rendering, never in an
    earlier message; the content alone if it is not there."""
    try:
        context_text = _render(tokenizer, context)
    except BadRecord:  # a template that wants a generation prompt after a user turn
        return content
    k = through.find(content, len(context_text)) if through.startswith(context_text) else -1
    return through[k:] if k >= 0 else content


def assistant_spans(tokenizer, messages: list[dict[str, str]]) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the [start, end) character span of each assistant turn."""
    full = _render(tokenizer, messages)
    spans, cursor = [], 0
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before, segment = _turn(tokenizer, messages, i)
        if before is not None and full.startswith(before) and full.startswith(segment, len(before)):
            start = len(before)  # where the turn must be: never a match inside an earlier turn
        else:
            start = full.find(segment, cursor)
        content = message["content"]
        if start >= 0:
            end = start + len(segment)
        else:
            start = full.find(content, cursor)
            k = segment.find(content)
            closing = segment[k + len(content):] if k >= 0 else ""
            if start < 0 or not full.startswith(closing, start + len(content)):
                raise BadRecord("assistant turn not found in the rendered template")
            end = start + len(content) + len(closing)
        if message.get("cut"):  # the end of turn was never the next token: train up to the content's end
            end = _content_end(full, start, end, content)
        spans.append((start, end))
        cursor = end
    return full, spans


def _content_end(full: str, start: int, end: int, content: str) -> int:
    """Where a turn's content ends in `full[start:end]`: as written, or stripped, as templates
    that trim messages render it (a cut answer often ends in a space)."""
    for text in (content, content.strip()):
        k = full.find(text, start, end)
        if k >= 0:
            return k + len(text)
    raise BadRecord("a cut answer's content not found in the rendered template")


def longest_token_chars(tokenizer) -> int:
    """The most characters one token can stand for (its vocabulary entry's length bounds its
    text: byte-level entries hold one character per byte)."""
    longest = getattr(tokenizer, "_eyas_longest_token", None)
    if longest is None:
        longest = max((len(t) for t in tokenizer.get_vocab()), default=1)
        tokenizer._eyas_longest_token = longest
    return longest


def within_reach(tokenizer, messages: list[dict[str, str]], max_len: int) -> tuple[list[dict[str, str]], bool]:
    """What of a conversation can reach its first `max_len` tokens -> (messages, cut): every
    message's text is cut where `max_len` tokens could not get (a 60 MB message sent a worker out
    of memory), and a conversation whose rendering already passes `max_len` tokens ends there
    (found by doubling the messages rendered): each assistant turn renders what precedes it,
    so 100,000 turns took their square in renderings, for tokens cut off anyway."""
    limit = max_len * longest_token_chars(tokenizer)
    cut = any(len(m["content"]) > limit for m in messages)
    messages = [{**m, "content": m["content"][:limit]} if len(m["content"]) > limit else m for m in messages]
    n = 4
    while n < len(messages):
        if len(tokenizer(_render(tokenizer, messages[:n]), add_special_tokens=False)["input_ids"]) > max_len:
            return messages[:n], True
        n *= 2
    return messages, cut


def encode_conversation(tokenizer, messages: list[dict[str, str]], max_len: int):
    """-> (input_ids [T] int64, loss_mask [T] bool, truncated) as numpy arrays, so that
    `prepare`'s worker processes never touch torch. Raises BadRecord."""
    messages, cut = within_reach(tokenizer, messages, max_len)
    text, spans = assistant_spans(tokenizer, messages)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    starts = np.array([a for a, _ in enc["offset_mapping"]], dtype=np.int64)
    mask = np.zeros(len(starts), dtype=bool)
    for a, b in spans:
        mask |= (starts >= a) & (starts < b)
    ids = np.array(enc["input_ids"], dtype=np.int64)
    truncated = cut or len(ids) > max_len
    ids, mask = ids[:max_len], mask[:max_len]
    if not mask.any():
        raise BadRecord("no assistant token within --max-len" if truncated else "no assistant token after templating")
    return ids, mask, truncated


def tokenize_conversation(tokenizer, messages: list[dict[str, str]], max_len: int):
    """-> (input_ids [T] int64, loss_mask [T] bool, truncated) as tensors. Raises BadRecord."""
    ids, mask, truncated = encode_conversation(tokenizer, messages, max_len)
    return torch.from_numpy(ids), torch.from_numpy(mask), truncated
