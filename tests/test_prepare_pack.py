"""`eyas prepare --pack`: consecutive conversations joined into long samples, as one chat,
each conversation in exactly one sample and in order, trained exactly where it is trained
alone; never joined across a system message or an unanswered user turn; the same samples
whatever the number of workers."""

from __future__ import annotations

import itertools
import json

import pytest

from eyas.data.config import PrepareConfig
from eyas.data.prepare import prepare
from eyas.data.prepared import PreparedData
from eyas.data.sources import iter_records


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread):
    """Tiny models: see conftest's one_thread."""


def _prepare(model, data, out, **options) -> tuple[PreparedData, dict]:
    summary = prepare(PrepareConfig(model=str(model), data=[str(data)], out=str(out), workers=1, **options),
                      progress=False)
    return PreparedData(out), summary


def _pair(n: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Question number {n}: what is {n} plus {n}?"},
            {"role": "assistant", "content": f"It is {2 * n}, since {n} and {n} make {2 * n}."}]


def test_groups_follow_the_rule(tmp_path, tiny_llama_dir):
    """Joined while they fit; a system message starts a sample, an unanswered user turn ends one."""
    system = [{"role": "system", "content": "Answer in one line."}]
    unanswered = [{"role": "user", "content": "And one more thing?"}]
    conversations = [_pair(1), _pair(2) + _pair(3), system + _pair(4), _pair(5) + unanswered, _pair(6), _pair(7)]
    data = tmp_path / "c.jsonl"
    data.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations))
    alone, _ = _prepare(tiny_llama_dir, data, tmp_path / "alone", max_len=4096)
    packed, summary = _prepare(tiny_llama_dir, data, tmp_path / "packed", max_len=4096, pack=True)
    groups = [[0, 1], [2, 3], [4, 5]]
    assert packed.conversations() == [[m for i in g for m in conversations[i]] for g in groups]
    assert summary["packed_conversations"] == 6
    for n, group in enumerate(groups):
        assert int(packed[n].loss_mask.sum()) == sum(int(alone[i].loss_mask.sum()) for i in group)
        # This template adds no system prompt of its own, so a joined chat takes exactly its conversations' tokens.
        assert len(packed[n].input_ids) == sum(len(alone[i].input_ids) for i in group)
    # At the length of conversations 4 and 5 alone, they are joined; one token less, nothing is.
    two = len(alone[4].input_ids) + len(alone[5].input_ids)
    exact, _ = _prepare(tiny_llama_dir, data, tmp_path / "exact", max_len=two, pack=True)
    assert exact.conversations()[-1] == conversations[4] + conversations[5]
    tight, _ = _prepare(tiny_llama_dir, data, tmp_path / "tight", max_len=two - 1, pack=True)
    assert tight.conversations() == conversations
    assert all(len(s.input_ids) <= two - 1 for s in tight)


def test_packed_smollm2_sharegpt_keeps_every_conversation_and_its_trained_tokens(tmp_path, smollm2_dir):
    """On the real SmolLM2 and ShareGPT: every conversation prepared alone is in exactly one
    packed sample, in order, with the same trained tokens; samples stay within --max-len and
    the summary says how many were joined."""
    data = tmp_path / "sharegpt.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in itertools.islice(iter_records("packaged:sharegpt"), 60)))
    alone, _ = _prepare(smollm2_dir, data, tmp_path / "alone", max_len=4096)
    packed, summary = _prepare(smollm2_dir, data, tmp_path / "packed", max_len=4096, pack=True)
    conversations, k = alone.conversations(), 0
    for n, joined in enumerate(packed.conversations()):
        parts, messages = [], []
        while len(messages) < len(joined):
            parts.append(k)
            messages += conversations[k]
            k += 1
        assert messages == joined, n
        assert int(packed[n].loss_mask.sum()) == sum(int(alone[i].loss_mask.sum()) for i in parts)
        assert len(packed[n].input_ids) <= min(4096, sum(len(alone[i].input_ids) for i in parts))
    assert k == len(alone) and summary["packed_conversations"] > 0
    assert len(packed) < k  # some were joined


def test_a_joined_chat_the_template_refuses_keeps_its_last_conversation_apart(tiny_tokenizer_dir):
    """A template that refuses more than four messages: three two-message conversations join as
    the first two, and the third is a sample of its own; nothing is lost or trained otherwise."""
    from transformers import AutoTokenizer

    from eyas.data.prepare import Packer
    from eyas.data.template import encode_conversation
    from tiny import CHATML

    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    tokenizer.chat_template = "{% if messages|length > 4 %}{{ raise_exception('too long') }}{% endif %}" + CHATML
    packer, conversations = Packer(tokenizer, 4096), [_pair(1), _pair(2), _pair(3)]
    encoded = [encode_conversation(tokenizer, c, 4096) for c in conversations]
    closed = [s for i, (c, (ids, mask, _)) in enumerate(zip(conversations, encoded)) for s in packer.add(i, c, ids, mask)]
    samples = closed + packer.flush()
    assert [s[1] for s in samples] == [conversations[0] + conversations[1], conversations[2]]
    assert [s[0] for s in samples] == [0, 2] and packer.joined == 2
    assert int(samples[0][3].sum()) == int(encoded[0][1].sum() + encoded[1][1].sum())
    assert (samples[1][2] == encoded[2][0]).all()
