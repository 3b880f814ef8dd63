"""`eyas eval` as a user runs it, on a tiny random Llama: the table, results.json and the
plot agree with each other and with the recorded accept counts; bad input is refused with
one clear line."""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image

from eyas.cli import main
from eyas.draft import DraftConfig, Eagle3Drafter, save_drafter
from eyas.evaluate.report import acceptance_rates
from eyas.models import load_target, model_identity, resolve_layer_ids
from eyas.prompts import load_prompts


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread):
    """Tiny models: see conftest's one_thread."""


def _drafter(model_dir, out, **identity_changes):
    model, tokenizer = load_target(str(model_dir))
    identity = model_identity(str(model_dir), model.config, tokenizer)
    cfg = DraftConfig.for_target(model.config, identity, resolve_layer_ids("auto", identity.num_layers), 128)
    cfg.target = {**cfg.target, **identity_changes}
    torch.manual_seed(0)
    drafter = Eagle3Drafter(cfg)
    drafter.set_vocab(torch.arange(128))
    save_drafter(drafter, out)
    return out


@pytest.fixture(scope="module")
def tiny_drafter(tiny_llama_dir, tmp_path_factory):
    return _drafter(tiny_llama_dir, tmp_path_factory.mktemp("tiny-drafter"))


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    lines = [
        {"prompt": "hello there, how are you today?"},
        {"turns": ["what do you like to do?", "and what else?"]},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hey"},
                      {"role": "user", "content": "tell me about your day"}]},
    ]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_eval_writes_consistent_results(tiny_llama_dir, tiny_drafter, prompts_file, tmp_path, capsys, tree):
    out = tmp_path / "results.json"
    args = ["eval", "--model", str(tiny_llama_dir), "--draft", str(tiny_drafter), "--prompts", str(prompts_file),
            "--max-new-tokens", "24", "--steps", "3", "--output", str(out)]
    with pytest.raises(SystemExit) as e:
        main(args + (["--tree", "--top-k", "3", "--draft-tokens", "8"] if tree else []))
    assert e.value.code == 0
    printed = capsys.readouterr().out
    assert "tau = 1 + accepted draft tokens per verification step" in printed
    results = json.loads(out.read_text())
    drafter = "eagle3-tree" if tree else "eagle3-chain"
    assert set(results["summary"]) == {"plain", "prompt-lookup", drafter}
    records = results["records"]
    assert len(records) == 3 * 4  # 4 answers (one prompt has 2 turns) per method
    for method, s in results["summary"].items():
        rs = [r for r in records if r["method"] == method]
        counts = [c for r in rs for c in r["accept_counts"]]
        tau = 1 + sum(counts) / len(counts)
        rates = acceptance_rates(counts, 3) if method != "plain" else []
        assert s["tau"] == pytest.approx(tau) and s["acceptance"] == pytest.approx(rates)
        assert s["tokens"] == sum(len(r["generated_ids"]) for r in rs)
        row = next(line for line in printed.splitlines() if line.startswith(method + " "))
        assert row.split()[1] == f"{tau:.2f}"
        assert row.split()[7:] == [f"{r:.2f}" for r in rates]
        same = None if method == "plain" else 4  # greedy: all 4 answers are plain decoding's
        assert s["identical"] == same and row.split()[6] == ("-" if same is None else f"{same}/4")
    # Greedy speculative decoding reproduces plain decoding, answer by answer.
    plain = [r["generated_ids"] for r in records if r["method"] == "plain"]
    assert plain == [r["generated_ids"] for r in records if r["method"] == drafter]
    assert plain == [r["generated_ids"] for r in records if r["method"] == "prompt-lookup"]
    second = [r for r in records if r["method"] == "plain" and r["turn"] == 1][0]
    assert len(second["prompt_ids"]) > len(records[0]["prompt_ids"])  # turn 2 carries turn 1's answer
    with Image.open(out.with_suffix(".png")) as img:
        assert img.size == (900, 520)


def test_temperature_runs_are_reproducible_from_the_seed(tiny_llama_dir, tiny_drafter, prompts_file, tmp_path):
    answers = []
    for name in ("a.json", "b.json"):
        with pytest.raises(SystemExit) as e:
            main(["eval", "--model", str(tiny_llama_dir), "--draft", str(tiny_drafter), "--prompts", str(prompts_file),
                  "--limit", "1", "--max-new-tokens", "16", "--temperature", "1.0", "--baseline", "none",
                  "--seed", "3", "--output", str(tmp_path / name)])
        assert e.value.code == 0
        results = json.loads((tmp_path / name).read_text())
        assert set(results["summary"]) == {"plain", "eagle3-chain"}
        answers.append([r["generated_ids"] for r in results["records"]])
    assert answers[0] == answers[1]
    assert all(1 <= len(ids) <= 16 for ids in answers[0])


@pytest.mark.parametrize("change, message", [
    ({"hidden_size": 96}, "hidden size"),
    ({"tokenizer_hash": "0" * 16}, "different tokenizer"),
    ({"config_hash": "0" * 16}, "configs differ"),
])
def test_mismatched_drafter_is_refused(tiny_llama_dir, prompts_file, tmp_path, capsys, change, message):
    draft = _drafter(tiny_llama_dir, tmp_path / "d", **change)
    if "hidden_size" in change:
        cfg = json.loads((draft / "config.json").read_text())
        cfg["eyas"]["hidden_size"] = 96
        (draft / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SystemExit) as e:
        main(["eval", "--model", str(tiny_llama_dir), "--draft", str(draft), "--prompts", str(prompts_file),
              "--output", str(tmp_path / "r.json")])
    assert e.value.code == 2
    last = capsys.readouterr().err.splitlines()[-1]  # after transformers' loading bar
    assert last.startswith("eyas eval: error: The drafter") and message in last
    assert not (tmp_path / "r.json").exists()


@pytest.mark.parametrize("content, message", [
    ('{"nothing": 1}\n', "expected a 'prompt' string"),
    ("not json\n", "invalid JSON"),
    ('{"messages": [{"role": "assistant", "content": "x"}]}\n', "no user message"),
    ("\n", "holds no prompt"),
])
def test_bad_prompt_files_are_refused(tmp_path, content, message):
    from eyas.errors import EyasError

    path = tmp_path / "p.jsonl"
    path.write_text(content)
    with pytest.raises(EyasError, match=message):
        load_prompts(str(path))


def test_mt_bench_has_80_two_turn_questions():
    prompts = load_prompts("mt-bench")
    assert len(prompts) == 80 and all(len(p.turns) == 2 for p in prompts)
    assert prompts[0].id == "81" and load_prompts("mt-bench", limit=3)[2].id == prompts[2].id


def test_bad_options_are_refused(tiny_llama_dir, capsys):
    for extra, message in ((["--baseline", "medusa"], "Unknown baseline"), (["--steps", "0"], "--steps must be"),
                           (["--limit", "0"], "--limit must be")):
        with pytest.raises(SystemExit) as e:
            main(["eval", "--model", str(tiny_llama_dir), *extra])
        assert e.value.code == 2 and message in capsys.readouterr().err
