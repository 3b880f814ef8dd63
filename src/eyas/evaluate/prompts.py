"""What eval does with its prompts (eyas.prompts reads them): the order that deals them to
workers, and the chat-template rendering of a turn."""

from __future__ import annotations

from eyas.errors import EyasError
from eyas.prompts import EvalPrompt


def stratified(prompts: list[EvalPrompt]) -> list[int]:
    """Prompt indices round-robin over categories (in order of first appearance), so that any
    prefix, and every worker's share of `order[w::n]`, covers the categories alike."""
    by_category: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        by_category.setdefault(p.category, []).append(i)
    queues = list(by_category.values())
    return [q[k] for k in range(max(map(len, queues), default=0)) for q in queues if k < len(q)]


def render(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of `messages` under the chat template, ending with the assistant prompt."""
    if not getattr(tokenizer, "chat_template", None):
        raise EyasError("The target's tokenizer has no chat template; eyas eval needs one to build prompts.")
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]
