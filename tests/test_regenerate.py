"""`eyas regenerate` with the real SmolLM2, both backends, greedy.

Claim checked: the text of every regenerated assistant turn is what greedy decoding of the
target produces after everything before it (the earlier turns being the target's own
answers). Reference: a plain float32 transformers loop, one full forward per token (no
cache, no batching). A step may take any token whose logit is within 1e-3 of the maximum
(float32 kernels summing in a different order can flip a near-tie), provided the text so
far stays a prefix of the turn. Text, not token ids: the turn is stored as text and
tokenized again by `prepare`, which may split a word differently than the sampler did.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eyas.data.prepared import PreparedData
from eyas.errors import EyasError
from eyas.regenerate.config import RegenerateConfig
from eyas.regenerate.run import PROGRESS, regenerate
from eyas.vllm.options import EngineOptions
from faults import killed
from vllm_util import require_vllm

SMOLLM2 = "packaged:smollm2-135m"
NEW = 12  # --max-new-tokens
TIE = 1e-3


@pytest.fixture(scope="module")
def source(tmp_path_factory, smollm2_dir) -> Path:
    """Three real multi-turn ShareGPT conversations, at most 160 tokens."""
    from eyas.data.prepare import prepare
    from eyas.data.config import PrepareConfig

    out = tmp_path_factory.mktemp("regen-source")
    prepare(PrepareConfig(model=SMOLLM2, data=["packaged:sharegpt"], out=str(out), max_len=160, limit=3),
            progress=False)
    return out


@pytest.fixture(scope="module")
def reference(smollm2_dir):
    from eyas.models import load_target

    model, _ = load_target(SMOLLM2, dtype="float32")
    return model


def greedy_continuation(model, tokenizer, prompt: list[int], text: str, budget: int, stops: list[int]) -> bool:
    """Can greedy decoding (near-ties either way) of `prompt` produce exactly `text`?"""
    ids, out = list(prompt), []
    for _ in range(budget):
        with torch.no_grad():
            row = model(torch.tensor([ids])).logits[0, -1]  # [V]
        candidates = sorted((row >= row.max() - TIE).nonzero().flatten().tolist(), key=lambda t: -row[t])
        for t in candidates:
            if t in stops:
                if tokenizer.decode(out, skip_special_tokens=True) == text:
                    return True
            elif text.startswith(tokenizer.decode(out + [t], skip_special_tokens=True).rstrip("\ufffd")):
                break
        else:
            return False
        out.append(t)
        ids.append(t)
    return tokenizer.decode(out, skip_special_tokens=True) == text


def assert_greedy_turns(folder: Path, source: Path, model) -> None:
    from eyas.models import load_tokenizer, resolve_model
    from eyas.models.eos import eos_ids, saved_generation_config

    data, before = PreparedData(folder), PreparedData(source)
    assert data.identity == before.identity and data.meta["max_len"] == before.meta["max_len"]
    assert len(data) == len(before) and data.loss_mask.any()
    tokenizer = load_tokenizer(SMOLLM2)
    stops = eos_ids(saved_generation_config(resolve_model(SMOLLM2)), tokenizer)
    max_len = data.meta["max_len"]
    conversations, originals = data.conversations(), before.conversations()
    assert max(sum(m["role"] == "assistant" for m in c) for c in conversations) >= 2  # a turn after a regenerated one
    changed = 0
    for i, (conversation, original) in enumerate(zip(conversations, originals)):
        assert len(conversation) <= len(original)  # turns past --max-len are dropped, never added
        for j, message in enumerate(conversation):
            assert message["role"] == original[j]["role"]
            if message["role"] != "assistant":
                assert message["content"] == original[j]["content"]
                continue
            changed += message["content"] != original[j]["content"]
            text = tokenizer.apply_chat_template(conversation[:j], tokenize=False, add_generation_prompt=True)
            prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
            budget = min(NEW, max_len - len(prompt))
            assert greedy_continuation(model, tokenizer, prompt, message["content"], budget, stops), \
                f"conversation {i} turn {j}: {message['content']!r} is not the greedy answer"
    assert changed >= 3


@pytest.fixture(scope="module")
def hf_regenerated(tmp_path_factory, source) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("regen-hf")
    summary = regenerate(RegenerateConfig(model=SMOLLM2, data=str(source), out=str(out), backend="hf",
                                          max_new_tokens=NEW, group_size=2), progress=False)
    return out, summary


def test_regenerate_hf_is_greedy(hf_regenerated, source, reference):
    assert_greedy_turns(hf_regenerated[0], source, reference)


def test_regenerate_says_where_its_time_went(hf_regenerated):
    """The breakdown a slow regeneration is diagnosed from: its parts are measured, not
    invented, so together they stay within the run, and the decode counts agree with the data."""
    out, summary = hf_regenerated
    seconds, decoding = summary["regenerate_seconds"], summary["static_decoding"]
    assert set(seconds) == {"load", "render", "generate", "prepare"} and all(v >= 0 for v in seconds.values())
    assert seconds["generate"] > 0 and seconds["generate"] >= decoding["prefill_s"] + decoding["decode_s"] - 0.2
    answers = sum(len(m["content"]) > 0 for c in PreparedData(out).conversations() for m in c if m["role"] == "assistant")
    assert 0 < decoding["kept_tokens"] <= decoding["row_steps"] and decoding["batches"] >= 1
    assert 0 < decoding["kept_share"] <= 1 and answers >= 1


@pytest.mark.vllm
@pytest.mark.slow
def test_regenerate_vllm_is_greedy(tmp_path, source, reference):
    require_vllm()
    out = tmp_path / "regen"
    regenerate(RegenerateConfig(model=SMOLLM2, data=str(source), out=str(out), backend="vllm", max_new_tokens=NEW,
                                model_dtype="float32", vllm=EngineOptions(engine_args={"enforce_eager": True})),
               progress=False)
    assert_greedy_turns(out, source, reference)


def test_killed_regenerate_resumes_to_the_same_result(tmp_path, source):
    out = tmp_path / "killed"
    argv = [sys.executable, "-m", "eyas", "regenerate", "--model", SMOLLM2, "--data", str(source), "--out", str(out),
            "--max-new-tokens", str(NEW), "--group-size", "1"]
    killed(argv[3:], at="eyas.regenerate.run:_append", arg=-1, nth=3)  # after the header and one conversation
    progress = out / PROGRESS
    lines = progress.read_text().splitlines()
    assert len(lines) == 2 and not (out / "prepared.json").exists()  # stopped part-way
    with open(progress, "a") as f:
        f.write('{"index": 2, "messages": [{"role": "us')  # a line torn by the kill
    resumed = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    indices = [json.loads(line)["index"] for line in progress.read_text().splitlines()[1:]]
    assert sorted(indices) == [0, 1, 2]  # each conversation generated once

    whole = tmp_path / "whole"
    regenerate(RegenerateConfig(model=SMOLLM2, data=str(source), out=str(whole), backend="hf", max_new_tokens=NEW,
                                group_size=1), progress=False)
    assert PreparedData(out).conversations() == PreparedData(whole).conversations()
    assert torch.equal(PreparedData(out).input_ids, PreparedData(whole).input_ids)
    assert torch.equal(PreparedData(out).loss_mask, PreparedData(whole).loss_mask)


def test_sampled_regeneration_resumed_after_a_failure_equals_an_uninterrupted_run(tmp_path, source, monkeypatch):
    """At T > 0 a group's seed comes from its first conversation's index, not from its place
    among the conversations still to do: a resumed run draws what an uninterrupted one draws."""
    import eyas.regenerate.run as run

    options = dict(model=SMOLLM2, data=str(source), backend="hf", max_new_tokens=NEW, group_size=1, temperature=1.0,
                   seed=7)
    regenerate(RegenerateConfig(out=str(tmp_path / "whole"), **options), progress=False)
    real, calls = run.regenerate_group, [0]

    def failing(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 2:
            raise RuntimeError("injected failure")
        return real(*args, **kwargs)

    monkeypatch.setattr(run, "regenerate_group", failing)
    with pytest.raises(RuntimeError, match="injected"):
        regenerate(RegenerateConfig(out=str(tmp_path / "resumed"), **options), progress=False)
    monkeypatch.setattr(run, "regenerate_group", real)
    regenerate(RegenerateConfig(out=str(tmp_path / "resumed"), **options), progress=False)
    assert PreparedData(tmp_path / "resumed").conversations() == PreparedData(tmp_path / "whole").conversations()


def test_regenerate_refuses_data_prepared_for_another_model(tmp_path, tiny_llama_dir, source):
    with pytest.raises(EyasError, match="different tokenizer"):
        regenerate(RegenerateConfig(model=str(tiny_llama_dir), data=str(source), out=str(tmp_path / "out")),
                   progress=False)
    assert not (tmp_path / "out").exists()


MIXED = ["Write a long story about a dragon.", "hi", "2+2?", "Name a colour.", "Say yes.",
         "Explain photosynthesis in detail."]  # long and short answers: rows stop mid-batch


def user_prompts(tokenizer, questions: list[str]) -> list[list[int]]:
    """Each question as a one-turn chat prompt's token ids, ready for the assistant's answer."""
    return [tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                    add_generation_prompt=True), add_special_tokens=False)["input_ids"]
            for q in questions]


def test_static_cache_path_equals_generate(smollm2_dir):
    """The fast path (length-sorted batches over a StaticCache, chunked prefill, folded
    grouped-query decode attention) gives the greedy tokens of plain `model.generate` with
    transformers' sdpa exactly, for prompts of mixed lengths and budgets over several batches."""
    from eyas.regenerate.generate import HFGenerator

    gen = HFGenerator(SMOLLM2, dtype="float32", cache_tokens=200)
    assert gen.greedy is not None
    questions = ["What is the capital of France?", "hi", "Write a haiku about rain.", "Name three prime numbers.",
                 "Explain in two sentences why the sky is blue, for a child who asks a lot of questions."]
    prompts = user_prompts(gen.tokenizer, questions)
    budgets = [14, 6, 16, 12, 16]
    assert len(list(gen.greedy._batches(list(range(5)), prompts, budgets))) >= 2
    fast = gen.generate(prompts, budgets, temperature=0.0, seed=0)
    gen.model.set_attn_implementation("sdpa")  # the reference runs transformers' own attention throughout
    assert fast == gen.sample(prompts, budgets, temperature=0.0, seed=0)
    assert all(0 < len(f) <= b for f, b in zip(fast, budgets)) and any(len(f) == b for f, b in zip(fast, budgets))


def test_sampling_batches_stay_within_the_cache_budget(tiny_llama_dir, monkeypatch):
    """A group can hold thousands of conversations (4096 by default on a GPU): sampling, which
    takes `model.generate`, runs it in batches of rows x (longest prompt + longest answer) within
    the generator's cache budget. A seed gives the same answers again; greedy answers do not
    depend on how the prompts were split."""
    from eyas.regenerate.generate import HFGenerator
    from eyas.regenerate.run import RegenerateConfig, default_group_size

    gen = HFGenerator(str(tiny_llama_dir), dtype="float32", cache_tokens=40)
    prompts = [[5 + i, 6, 7 + i % 3] for i in range(7)]  # 3 tokens each
    budgets = [5, 3, 5, 4, 5, 2, 5]
    seen = []
    generate = gen._generate
    monkeypatch.setattr(gen, "_generate", lambda p, b, t: seen.append(len(p)) or generate(p, b, t))
    sampled = gen.sample(prompts, budgets, temperature=1.0, seed=3)
    assert seen == [5, 2]  # 40 slots // (3 + 5) = 5 rows a batch
    assert gen.sample(prompts, budgets, temperature=1.0, seed=3) == sampled
    assert all(len(a) <= b for a, b in zip(sampled, budgets))
    greedy = gen.sample(prompts, budgets, temperature=0.0, seed=0)
    gen.slots = 8  # one row a batch
    assert gen.sample(prompts, budgets, temperature=0.0, seed=0) == greedy and seen[-7:] == [1] * 7
    cfg = RegenerateConfig(model="m", data="d", out="o", device="cpu")
    assert cfg.group_size is None and default_group_size(cfg) == 64


def test_gpu_cache_budget_follows_the_models_cache_per_token():
    """On a GPU a batch takes the cache slots that half the memory left after the weights holds: keys and values
    of every layer and kv head (MLA models: nope + rope key dims, v dims), at most 2M slots."""
    from transformers import DeepseekV3Config, LlamaConfig

    from eyas.regenerate.generate import cache_tokens_within

    llama_8b = LlamaConfig(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, num_hidden_layers=32)
    per_token = 32 * 8 * (128 + 128) * 2  # layers x kv heads x (k + v dims) x bf16 bytes = 128 KiB
    assert cache_tokens_within(llama_8b, 64 << 30, 2) == (64 << 30) // per_token == 524288
    deepseek = DeepseekV3Config(num_hidden_layers=61)  # 128 heads, keys 128 + 64 wide, values 128
    assert cache_tokens_within(deepseek, 64 << 30, 2) == (64 << 30) // (61 * 128 * (192 + 128) * 2)
    assert cache_tokens_within(llama_8b, 1 << 50, 2) == 1 << 21 and cache_tokens_within(llama_8b, 0, 2) == 1024


def test_static_path_drops_stopped_rows_and_stays_greedy(smollm2_dir, monkeypatch):
    """When a quarter of a batch has stopped, the fast path compacts it (the cache keeps only
    live rows), and each decode step reads only the cache slots written so far (rounded up to
    KV_ALIGN); the tokens are still plain `model.generate`'s, exactly."""
    import eyas.models.attention as attention
    import eyas.regenerate.static as static
    from eyas.regenerate.generate import HFGenerator

    read: list[tuple[int, int]] = []  # (rows, cache slots) each attention call reads

    def spy(name):
        inner = getattr(attention, name)

        def call(module, q, k, v, *args, **kw):
            read.append((k.shape[0], k.shape[2]))
            return inner(module, q, k, v, *args, **kw)

        return call

    for name in ("folded_attention", "sdpa_attention_forward"):  # the paths few_rows_attention takes
        monkeypatch.setattr(attention, name, spy(name))

    monkeypatch.setattr(static, "KV_ALIGN", 8)  # a few reads below the cache's whole length
    gen = HFGenerator(SMOLLM2, dtype="float32", cache_tokens=1 << 14)
    prompts = user_prompts(gen.tokenizer, MIXED)
    budgets = [40, 3, 4, 8, 5, 40]
    fast = gen.generate(prompts, budgets, temperature=0.0, seed=0)
    assert gen.greedy.stats["batches"] == 1 and gen.greedy.stats["compactions"] >= 1
    assert gen.greedy.stats["row_steps"] < len(prompts) * max(budgets)
    layers = gen.model.config.num_hidden_layers
    T = max(map(len, prompts))
    L = T + max(budgets)  # the cache's slots
    aligned = lambda n: min(-(-n // 8) * 8, L)  # noqa: E731
    assert read[0] == (len(prompts), aligned(T))  # the prefill (one chunk) reads the prompt's slots
    per_step = read[layers::layers]
    assert [n for _, n in per_step] == [aligned(n) for n in range(T + 1, T + len(per_step) + 1)]  # written only
    assert per_step[0][1] < L
    assert per_step[0][0] == len(prompts) and per_step[-1][0] < len(prompts)  # rows dropped
    monkeypatch.undo()
    gen.model.set_attn_implementation("sdpa")
    assert fast == gen.sample(prompts, budgets, temperature=0.0, seed=0)
    assert [len(f) for f in fast][0] == 40 or any(len(f) > 16 for f in fast)


def test_an_answer_that_opens_a_conversation_is_dropped(smollm2_dir):
    """ShareGPT holds conversations that start with the assistant: that answer has no prompt to
    be regenerated from (the chat template refuses an empty conversation), so it is dropped."""
    from eyas.models import load_tokenizer
    from eyas.regenerate.run import regenerate_group

    class Echo:
        def generate(self, prompts, budgets, temperature, seed):
            return [[42] for _ in prompts]

    conv = [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4"}]
    tokenizer = load_tokenizer(SMOLLM2)
    (out,) = regenerate_group(Echo(), tokenizer, [conv], 160, NEW, 0.0, 0)
    assert [m["role"] for m in out] == ["user", "assistant"]
    assert out[1]["content"] == tokenizer.decode([42], skip_special_tokens=True)


def test_regenerate_runs_on_a_shallow_target(tmp_path, tiny_tokenizer_dir):
    """A 4-layer target: too shallow for the default aux-layer ids, which regenerate does not
    need (it reads no hidden states), so the command runs and its answers are the target's."""
    from tiny import build_model

    from eyas.cli import main
    from eyas.data.prepare import prepare
    from eyas.data.config import PrepareConfig

    model = str(build_model(tmp_path / "model", "llama", layers=4, tokenizer_dir=tiny_tokenizer_dir))
    prepare(PrepareConfig(model=model, data=["packaged:chitchat"], out=str(tmp_path / "prepared"), max_len=64,
                          limit=2), progress=False)
    with pytest.raises(SystemExit) as e:
        main(["regenerate", "--model", model, "--data", str(tmp_path / "prepared"), "--out", str(tmp_path / "out"),
              "--max-new-tokens", "4", "--group-size", "2"])
    assert e.value.code == 0
    data, before = PreparedData(tmp_path / "out"), PreparedData(tmp_path / "prepared")
    assert data.identity == before.identity and data.identity.num_layers == 4 and len(data) == 2
    answers = [m["content"] for c in data.conversations() for m in c if m["role"] == "assistant"]
    originals = [m["content"] for c in before.conversations() for m in c if m["role"] == "assistant"]
    assert answers and answers != originals[: len(answers)]


def test_progress_keeps_answers_holding_unicode_line_separators(tmp_path):
    """An answer may hold U+2028, U+2029 or U+0085 (a SmolLM2 answer did), which json.dumps
    writes as they are: the progress file is split at newlines only, so such a run resumes."""
    from eyas.regenerate.run import _append, read_progress

    path = tmp_path / "regenerated.jsonl"
    answers = {0: "a\u2028b", 1: "c\u2029d\x85e\x0bf\x1cg", 2: "plain"}
    with open(path, "w", encoding="utf-8") as log:
        _append(log, {"fingerprint": "fp", "data": "prepared"})
        for i, text in answers.items():
            _append(log, {"index": i, "messages": [{"role": "user", "content": "q"},
                                                   {"role": "assistant", "content": text}]})
    done = read_progress(path, "fp", {})  # a header without settings: a run from before eyas recorded them
    assert {i: m[1]["content"] for i, m in done.items()} == answers


def test_pack_joins_the_regenerated_conversations(tmp_path, smollm2_dir):
    """`regenerate --pack`: each conversation answered on its own, then joined as `prepare
    --pack` joins them; resuming a finished run with it only packs again (the answers are
    kept), into samples that hold the same conversations in order and train the same tokens."""
    import shutil

    from eyas.data.config import PrepareConfig
    from eyas.data.prepare import prepare

    source = tmp_path / "prepared"
    prepare(PrepareConfig(model=SMOLLM2, data=["packaged:chitchat"], out=str(source), max_len=512, limit=6),
            progress=False)
    common = dict(model=SMOLLM2, data=str(source), backend="hf", max_new_tokens=8, group_size=6)
    regenerate(RegenerateConfig(out=str(tmp_path / "alone"), **common), progress=False)
    shutil.copytree(tmp_path / "alone", tmp_path / "packed")
    summary = regenerate(RegenerateConfig(out=str(tmp_path / "packed"), pack=True, **common), progress=False)
    alone, packed = PreparedData(tmp_path / "alone"), PreparedData(tmp_path / "packed")
    assert [m for c in packed.conversations() for m in c] == [m for c in alone.conversations() for m in c]
    assert len(packed) < len(alone) and summary["packed_conversations"] >= 2
    assert int(packed.loss_mask.sum()) == int(alone.loss_mask.sum())
    assert max(len(s.input_ids) for s in packed) <= 512


def test_prefill_parts_read_past_their_own_padding_only(smollm2_dir, monkeypatch):
    """A batch is prefilled a few rows of like length at a time: each part reads the cache from
    its own longest prompt's start on (aligned down to KV_ALIGN), not from the batch's longest;
    the tokens are still plain `model.generate`'s, exactly."""
    import eyas.models.attention as attention
    from eyas.regenerate.generate import HFGenerator
    from eyas.regenerate.static import StaticGreedy

    gen = HFGenerator(SMOLLM2, dtype="float32", cache_tokens=1 << 14)
    questions = ["hi", "2+2?", "Name a colour.", "Say yes please.", "Write a long story about a dragon who learns to fly.",
                 "Explain photosynthesis in detail, step by step, for a student who has never heard of it before."]
    prompts = sorted(user_prompts(gen.tokenizer, questions), key=len)
    budgets = [6] * len(prompts)
    loop = StaticGreedy(gen.model, gen.pad, gen.stops, gen.slots, kv_align=8, prefill_tokens=2 * len(prompts[-1]))
    parts = list(loop._parts(list(map(len, prompts))))
    assert len(parts) >= 3 and [p[:2] for p in parts] == [(0, parts[0][1])] + [(a[1], b[1]) for a, b in
                                                                              zip(parts, parts[1:])]
    assert all((r1 - r0) * longest <= loop.prefill_tokens for r0, r1, longest in parts)
    read: list[tuple[int, int]] = []
    inner = attention.folded_attention

    def spy(module, q, k, v, *args, **kw):
        read.append((k.shape[0], k.shape[2]))
        return inner(module, q, k, v, *args, **kw)

    monkeypatch.setattr(attention, "folded_attention", spy)
    monkeypatch.setattr(attention, "sdpa_attention_forward", lambda module, q, k, v, *a, **kw: spy(module, q, k, v,
                                                                                                    *a, **kw))
    fast = loop.generate(prompts, budgets)
    layers, T = gen.model.config.num_hidden_layers, len(prompts[-1])
    prefill = read[: len(parts) * layers : layers]  # one chunk a part here
    assert prefill == [(r1 - r0, -(-T // 8) * 8 - (T - longest) // 8 * 8) for r0, r1, longest in parts]
    assert prefill[0][1] < prefill[-1][1]  # the shortest prompts' part reads fewer slots than the longest's
    monkeypatch.undo()
    gen.model.set_attn_implementation("sdpa")
    assert fast == gen.sample(prompts, budgets, temperature=0.0, seed=0)


def test_flex_decoding_equals_generate(smollm2_dir, monkeypatch):
    """Decoding with flex attention over per-row block masks (CUDA's default; here the unfused
    reference, forced) gives plain `model.generate`'s tokens exactly, on prompts of mixed lengths
    and budgets, with rows dropped mid-batch; every decode step's attention took the flex path."""
    import eyas.models.attention as attention
    from eyas.regenerate.generate import HFGenerator
    from eyas.regenerate.static import StaticGreedy

    gen = HFGenerator(SMOLLM2, dtype="float32", cache_tokens=1 << 14)
    assert not gen.greedy.flex  # off CUDA, unless asked
    prompts = user_prompts(gen.tokenizer, MIXED)
    budgets = [40, 3, 4, 8, 5, 40]
    loop = StaticGreedy(gen.model, gen.pad, gen.stops, gen.slots, flex=True)
    assert loop.flex
    flexed = []
    inner = attention._flex
    monkeypatch.setattr(attention, "_flex", lambda *a: flexed.append(a[1].shape) or inner(*a))
    fast = loop.generate(prompts, budgets)
    layers, L = gen.model.config.num_hidden_layers, max(map(len, prompts)) + max(budgets)
    assert loop.stats["compactions"] >= 1 and len(flexed) == layers * (max(budgets) - 1)  # every decode step's layers
    assert all(shape[2] == L for shape in flexed)  # the whole cache given: the block mask decides what is read
    monkeypatch.undo()
    gen.model.set_attn_implementation("sdpa")
    assert fast == gen.sample(prompts, budgets, temperature=0.0, seed=0)
