"""`eyas regenerate`'s guards, with tiny random models and stub generators: what it refuses
to overwrite or mix, how an empty answer ends its conversation and a cut one is marked, and that a
sampled run killed mid-group resumes with the same draws."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

import eyas.regenerate.run as run
from eyas.data.config import PrepareConfig
from eyas.data.prepare import prepare, prepare_into
from eyas.data.prepared import PreparedData
from eyas.errors import EyasError
from eyas.models import load_tokenizer
from eyas.regenerate.config import RegenerateConfig
from eyas.regenerate.run import CONVERSATIONS, PROGRESS, read_progress, regenerate, regenerate_group

QUESTIONS = [[{"role": "user", "content": "What is the capital of France?"}, {"role": "assistant", "content": "Paris."},
              {"role": "user", "content": "And of Spain?"}, {"role": "assistant", "content": "Madrid."}],
             [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "Blue."}],
             [{"role": "user", "content": "Count to three."}, {"role": "assistant", "content": "1 2 3"}],
             [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi."}],
             [{"role": "user", "content": "Two plus two?"}, {"role": "assistant", "content": "Four."}]]


@pytest.fixture(scope="module")
def models(tmp_path_factory, tiny_tokenizer_dir):
    """Two checkpoints of one config and tokenizer: other weights."""
    from tiny import build_model

    root = tmp_path_factory.mktemp("regen-guard-models")
    yield tuple(str(build_model(root / f"seed{s}", "llama", layers=2, tokenizer_dir=tiny_tokenizer_dir, seed=s))
                for s in (0, 1))
    shutil.rmtree(root)


@pytest.fixture(scope="module")
def source(tmp_path_factory, models) -> Path:
    """QUESTIONS prepared for the tiny target."""
    root = tmp_path_factory.mktemp("regen-guard-source")
    (root / "questions.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n" for c in QUESTIONS))
    prepare_into(models[0], str(root / "questions.jsonl"), root / "prepared", 128, workers=1, progress=False)
    return root / "prepared"


class Echo:
    """A generator that answers `text`, one token per character while the budget lasts."""

    greedy = None

    def __init__(self, tokenizer, text: str = "fine thanks"):
        self.ids = tokenizer(text, add_special_tokens=False)["input_ids"]

    def generate(self, prompts, budgets, temperature, seed):
        return [self.ids[:n] for n in budgets]

    def close(self) -> None:
        pass


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_regenerate_refuses_an_out_holding_data_prepare_wrote(tmp_path, models, source, monkeypatch):
    """A folder `eyas prepare` wrote for other data holds the files regenerate writes too, but no
    progress file: a fresh start would overwrite it, so it is refused with nothing touched. A
    folder regenerate wrote is still resumed, even with its progress file deleted."""
    tokenizer = load_tokenizer(models[0])
    monkeypatch.setattr(run, "make_generator", lambda cfg, max_len: Echo(tokenizer))
    other = tmp_path / "other"
    prepare(PrepareConfig(model=models[0], data=["packaged:chitchat"], out=str(other), max_len=64, limit=2),
            progress=False)
    before = snapshot(other)
    with pytest.raises(EyasError, match=rf"holds prepared data that regenerate did not write .*no {PROGRESS}.*"
                                        r"choose another --out"):
        regenerate(RegenerateConfig(model=models[0], data=str(source), out=str(other), max_new_tokens=4),
                   progress=False)
    assert snapshot(other) == before

    mine = tmp_path / "mine"
    regenerate(RegenerateConfig(model=models[0], data=str(source), out=str(mine), max_new_tokens=4), progress=False)
    regenerate(RegenerateConfig(model=models[0], data=str(source), out=str(mine), max_new_tokens=4), progress=False)
    (mine / PROGRESS).unlink()  # prepared from its own regenerated conversations: still regenerate's
    regenerate(RegenerateConfig(model=models[0], data=str(source), out=str(mine), max_new_tokens=4), progress=False)
    assert len(PreparedData(mine)) == len(QUESTIONS)


def test_resuming_with_other_weights_is_refused(tmp_path, models, source, monkeypatch):
    """Another checkpoint of the same config and tokenizer would add its answers to the first
    one's: the progress file records the target's weights digest, and a resume with others is
    refused, naming both. A progress file from before eyas recorded it still resumes."""
    from eyas.vllm.target import read_target

    tokenizer = load_tokenizer(models[0])
    monkeypatch.setattr(run, "make_generator", lambda cfg, max_len: Echo(tokenizer))
    first, second = read_target(models[0])[2], read_target(models[1])[2]
    assert first.config_hash == second.config_hash and first.tokenizer_hash == second.tokenizer_hash
    assert first.weights_hash and first.weights_hash != second.weights_hash
    out = tmp_path / "out"
    options = dict(data=str(source), out=str(out), max_new_tokens=4, group_size=2, minutes=1e-6)
    regenerate(RegenerateConfig(model=models[0], **options), progress=False)  # stops after its first group
    lines = (out / PROGRESS).read_text().splitlines()
    assert len(lines) == 3 and json.loads(lines[0])["target"]["weights_hash"] == first.weights_hash
    a, b = map(re.escape, models)
    with pytest.raises(EyasError, match=rf"weights of {a}, not {b}.*resume with {a}"):
        regenerate(RegenerateConfig(model=models[1], **options), progress=False)
    assert (out / PROGRESS).read_text().splitlines() == lines
    regenerate(RegenerateConfig(model=models[0], **options), progress=False)  # the same weights resume

    header = json.loads(lines[0])
    del header["target"]
    (out / PROGRESS).write_text("\n".join([json.dumps(header), *lines[1:]]) + "\n")
    assert len(read_progress(out / PROGRESS, header["fingerprint"], header["settings"], second)) == 2


def test_an_empty_answer_ends_the_conversation_before_its_turn(models):
    """`prepare` drops a conversation holding an empty message, its good turns too: an answer that
    is empty (a stop at once, only special tokens, only whitespace) ends the conversation before
    its turn; a conversation left with no answer is dropped, as it would be anyway."""
    tokenizer = load_tokenizer(models[0])
    good = tokenizer("Paris is the capital.", add_special_tokens=False)["input_ids"]
    for empty in ([], [tokenizer.all_special_ids[0]], tokenizer(" \n ", add_special_tokens=False)["input_ids"]):
        class Stub:
            calls = 0

            def generate(self, prompts, budgets, temperature, seed):
                Stub.calls += 1
                return [good if Stub.calls == 1 and len(prompts) == 2 and b == 0 else empty
                        for b, _ in enumerate(prompts)]

        first, second = regenerate_group(Stub(), tokenizer, [QUESTIONS[0], QUESTIONS[1]], 128, 64, 0.0, 0)
        assert tokenizer.decode(empty, skip_special_tokens=True).strip() == ""
        assert first == [QUESTIONS[0][0], {"role": "assistant", "content": "Paris is the capital."}, QUESTIONS[0][2]]
        assert second == [QUESTIONS[1][0]]


def test_an_answer_that_fills_its_budget_is_marked_cut(tmp_path, models, source,
                                                                                 monkeypatch):
    """An answer as long as its budget never stopped: it is marked "cut", and the turns after it
    are still asked; one that stopped within its budget is not marked. The mark survives the
    progress file and the conversations handed to `prepare`, and a resume."""
    tokenizer = load_tokenizer(models[0])
    stub = Echo(tokenizer, "Paris is the capital of France, and Madrid of Spain.")
    (cut,) = regenerate_group(stub, tokenizer, [QUESTIONS[0]], 128, 3, 0.0, 0)
    short = {"role": "assistant", "content": tokenizer.decode(stub.ids[:3]), "cut": True}
    assert cut == [QUESTIONS[0][0], short, QUESTIONS[0][2], short]
    (whole,) = regenerate_group(stub, tokenizer, [QUESTIONS[0]], 128, len(stub.ids) + 1, 0.0, 0)
    assert [m.get("cut") for m in whole] == [None] * 4 and whole[3]["content"] == whole[1]["content"]
    marked = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "old", "cut": True}]
    (again,) = regenerate_group(stub, tokenizer, [marked], 128, len(stub.ids) + 1, 0.0, 0)
    assert "cut" not in again[1]  # the source's mark was for its own answer

    monkeypatch.setattr(run, "make_generator", lambda cfg, max_len: stub)
    out = tmp_path / "out"
    options = dict(model=models[0], data=str(source), out=str(out), max_new_tokens=3, group_size=2, minutes=1e-6)
    regenerate(RegenerateConfig(**options), progress=False)
    regenerate(RegenerateConfig(**{**options, "minutes": None}), progress=False)
    recorded = [json.loads(line)["messages"] for line in (out / PROGRESS).read_text().splitlines()[1:]]
    handed = [json.loads(line)["messages"] for line in (out / CONVERSATIONS).read_text().splitlines()]
    assert recorded == handed and len(handed) == len(QUESTIONS)
    assert all([m.get("cut") for m in c] == [None, True] * (len(c) // 2) for c in handed)
    assert [len(c) for c in handed] == [len(c) for c in QUESTIONS]


def test_generators_return_answers_cut_before_the_first_stop(models):
    """What "cut" rests on: a generator's answer stops short of its budget exactly when the
    target produced a stop id within it (static greedy, and `model.generate` greedy or sampled)."""
    from eyas.regenerate.generate import HFGenerator

    generator = HFGenerator(models[0], device="cpu")
    assert generator.greedy is not None
    tokenizer = generator.tokenizer
    prompts = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in ("hello there", "a longer prompt here")]
    budgets = [6, 4]
    paths = {"static": lambda: generator.generate(prompts, budgets, 0.0, 0),
             "generate": lambda: generator.sample(prompts, budgets, 0.0, 0),
             "sampled": lambda: generator.sample(prompts, budgets, 1.0, 3)}
    for name, path in paths.items():
        generator.stops = generator.greedy.stops = [-1]  # no stop: every answer fills its budget
        free = path()
        assert [len(a) for a in free] == budgets, name
        stop = free[0][2]  # now a stop id: row 0 ends before its first occurrence
        generator.stops = generator.greedy.stops = [stop]
        stopped = path()
        assert stopped[0] == free[0][: free[0].index(stop)] and len(stopped[0]) < budgets[0], name
        assert all(stop not in a and len(a) <= n for a, n in zip(stopped, budgets)), name


def test_groups_to_do():
    """Greedy: the conversations not done, `size` at a time (as before). Sampled: an
    uninterrupted run's groups, whole, wherever one is not done."""
    from eyas.regenerate.run import groups_to_do

    done = {0: [], 1: [], 5: []}
    assert groups_to_do(7, done, 3, sampled=False) == [[2, 3, 4], [6]]
    assert groups_to_do(7, done, 3, sampled=True) == [[0, 1, 2], [3, 4, 5], [6]]
    assert groups_to_do(6, {i: [] for i in range(3)}, 3, sampled=True) == [[3, 4, 5]]


def test_a_sampled_run_killed_while_saving_a_group_resumes_with_the_same_draws(tmp_path, models, source,
                                                                               monkeypatch):
    """A group's draws follow its seed and its members, in order: a run killed after saving part
    of a group generates that whole group again on resume and keeps the answers it had, so its
    conversations are those of an uninterrupted run."""
    tokenizer = load_tokenizer(models[0])

    class Sampler:  # as HFGenerator.sample: one seed for the call, drawn from in order
        greedy = None

        def generate(self, prompts, budgets, temperature, seed):
            torch.manual_seed(seed)
            return [tokenizer(f"draw {int(torch.randint(0, 1000, ()))}", add_special_tokens=False)["input_ids"]
                    for _ in prompts]

        def close(self) -> None:
            pass

    monkeypatch.setattr(run, "make_generator", lambda cfg, max_len: Sampler())
    options = dict(model=models[0], data=str(source), temperature=1.0, group_size=3, seed=0, max_new_tokens=16)
    regenerate(RegenerateConfig(out=str(tmp_path / "whole"), **options), progress=False)
    real, appended = run._append, [0]

    def dying(log, record):
        appended[0] += 1
        if appended[0] == 3:  # the header and conversation 0 saved; killed before conversation 1
            raise KeyboardInterrupt
        real(log, record)

    monkeypatch.setattr(run, "_append", dying)
    with pytest.raises(KeyboardInterrupt):
        regenerate(RegenerateConfig(out=str(tmp_path / "killed"), **options), progress=False)
    monkeypatch.setattr(run, "_append", real)
    regenerate(RegenerateConfig(out=str(tmp_path / "killed"), **options), progress=False)
    whole, killed = PreparedData(tmp_path / "whole").conversations(), PreparedData(tmp_path / "killed").conversations()
    assert len(set(m["content"] for c in whole for m in c if m["role"] == "assistant")) > 2
    assert killed == whole
    indices = [json.loads(line)["index"] for line in (tmp_path / "killed" / PROGRESS).read_text().splitlines()[1:]]
    assert sorted(indices) == list(range(len(QUESTIONS)))  # each saved once


def test_a_sampled_run_records_the_group_size_it_used(tmp_path):
    """Sampled draws follow the grouping, whose default differs by device (64 on a CPU, 4096 on
    a GPU): the size used is recorded, so a resume that would regroup is refused, not mixed."""
    cpu = RegenerateConfig(model="m", data="d", out="o", device="cpu", temperature=1.0)
    assert cpu.group_size is None and run.answer_settings(cpu)["group_size"] == 64
    gpu = RegenerateConfig(model="m", data="d", out="o", device="cpu", temperature=1.0, group_size=4096)
    with pytest.raises(EyasError, match=r"--group-size 4096 \(it has 64\)"):
        run.check_same_settings(run.answer_settings(cpu), run.answer_settings(gpu), tmp_path)
    greedy = RegenerateConfig(model="m", data="d", out="o", device="cpu")
    assert "group_size" not in run.answer_settings(greedy)  # greedy answers do not depend on the grouping
