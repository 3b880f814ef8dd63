"""One chat template, recorded once: `prepare --chat-template FILE` records the template with
the prepared data; capture, train (offline and --online) and regenerate use it without being
told, a different template or tokenizer is refused, and no error names one path twice."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from eyas.capture.run import capture
from eyas.capture.config import CaptureConfig
from eyas.cli import main
from eyas.data.prepared import PreparedData
from eyas.data.template import ChatTemplate
from eyas.draft import load_config
from eyas.errors import EyasError
from eyas.regenerate.config import RegenerateConfig
from eyas.store import Store
from eyas.train import TrainConfig, train
from tiny import CHATML, LLAMA3


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, tiny_llama_dir) -> tuple[Path, Path]:
    """Chitchat prepared for the tiny Llama (whose tokenizer ships ChatML) with a Llama-3 template file."""
    root = tmp_path_factory.mktemp("template")
    template = root / "llama3.jinja"
    template.write_text(LLAMA3)
    with pytest.raises(SystemExit) as e:
        main(["prepare", "--model", str(tiny_llama_dir), "--data", "packaged:chitchat", "--out", str(root / "prep"),
              "--limit", "4", "--max-len", "64", "--chat-template", str(template)])
    assert e.value.code == 0
    return root / "prep", template


def test_prepare_records_the_template_it_rendered_with(prepared, tiny_llama_dir):
    prep, template = prepared
    data = PreparedData(prep)
    assert data.chat_template.text == LLAMA3 and data.chat_template.source == str(template.resolve())
    assert json.loads((prep / "prepared.json").read_text())["chat_template"]["sha256"] == data.chat_template.sha256
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    assert tokenizer.decode(data[0].input_ids[:4]).startswith("<|begin_of_text|><|start_header_id|>")
    # The identity is the tokenizer as shipped, so later stages load it unchanged.
    plain = PreparedData(_prepare_plain(prep.parent / "plain", tiny_llama_dir))
    assert plain.identity == data.identity and plain.chat_template.source == "tokenizer"
    assert plain.chat_template.text == CHATML


def _prepare_plain(out: Path, model: Path) -> Path:
    from eyas.data.prepare import prepare
    from eyas.data.config import PrepareConfig

    prepare(PrepareConfig(model=str(model), data=["packaged:chitchat"], out=str(out), max_len=64, limit=1),
            progress=False)
    return out


def test_prepare_with_template_then_capture_then_train(prepared, tiny_llama_dir, tmp_path, capsys):
    prep, template = prepared
    store = tmp_path / "store"
    for given in ([], ["--chat-template", str(template)]):  # unasked, or asked for the same one
        with pytest.raises(SystemExit) as e:
            main(["capture", "--model", str(tiny_llama_dir), "--data", str(prep), "--out", str(store),
                  "--dtype", "fp32", *given])
        assert e.value.code == 0
    assert Store(store).manifest["num_samples"] == len(PreparedData(prep))
    common = dict(steps=2, batch_tokens=128, ttt_steps=2, eval_fraction=0.0, progress=False)
    offline = train(TrainConfig(out=str(tmp_path / "off"), store=str(store), **common))
    online = train(TrainConfig(out=str(tmp_path / "on"), online=True, model=str(tiny_llama_dir), data=str(prep),
                               **common))
    assert offline["step"] == online["step"] == 2
    recorded = PreparedData(prep).chat_template
    for run in ("off", "on"):  # the drafter carries the template on, for eval
        assert ChatTemplate.from_dict(load_config(tmp_path / run).chat_template) == recorded
    # eval renders its prompts with it, unasked
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "hello there"}) + "\n")
    with pytest.raises(SystemExit) as e:
        main(["eval", "--model", str(tiny_llama_dir), "--draft", str(tmp_path / "off"), "--prompts", str(prompts),
              "--max-new-tokens", "4", "--baseline", "none", "--output", str(tmp_path / "eval.json")])
    assert e.value.code == 0
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    for record in json.loads((tmp_path / "eval.json").read_text())["records"]:
        assert tokenizer.decode(record["prompt_ids"]).startswith("<|begin_of_text|><|start_header_id|>user")


def test_a_different_template_at_capture_is_refused(prepared, tiny_llama_dir, tmp_path):
    prep, template = prepared
    other = tmp_path / "chatml.jinja"
    other.write_text(CHATML)
    out = tmp_path / "store"
    with pytest.raises(EyasError) as e:
        capture(CaptureConfig(model=str(tiny_llama_dir), data=str(prep), out=str(out), chat_template=str(other)),
                progress=False)
    message = str(e.value)
    assert f"prepared with {template.resolve()}" in message and f"--chat-template {other} is a different" in message
    assert not out.exists()
    # The same path, edited since: said as a change, not as two "different" paths.
    edited = tmp_path / "edited"
    shutil.copytree(prep, edited)
    record = json.loads((edited / "prepared.json").read_text())
    record["chat_template"]["source"] = str(other.resolve())
    (edited / "prepared.json").write_text(json.dumps(record))
    with pytest.raises(EyasError, match=rf"The chat template {other} has changed since .* prepared with it"):
        capture(CaptureConfig(model=str(tiny_llama_dir), data=str(edited), out=str(out), chat_template=str(other)),
                progress=False)


def test_a_different_tokenizer_is_still_refused_and_named_once(prepared, tiny_llama_dir, tmp_path):
    prep, _ = prepared
    model = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["eos_token"] = "<|endoftext|>"
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    edited = tmp_path / "prep"
    shutil.copytree(prep, edited)
    meta = json.loads((edited / "prepared.json").read_text())
    meta["target"]["model"] = str(model)
    (edited / "prepared.json").write_text(json.dumps(meta))
    with pytest.raises(EyasError) as e:
        capture(CaptureConfig(model=str(model), data=str(edited), out=str(tmp_path / "store")), progress=False)
    message = str(e.value)
    assert "different tokenizer than the one now at" in message and message.count(str(model)) == 1


def test_regenerate_renders_and_records_the_recorded_template(prepared, tiny_llama_dir, tmp_path, monkeypatch):
    """Regeneration's prompts are the recorded template's rendering, not the tokenizer's own,
    and its output records the same template (a stand-in generator answers every turn)."""
    from eyas.regenerate import run

    prep, _ = prepared
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    answer = tokenizer("Sure.", add_special_tokens=False)["input_ids"]
    prompts = []

    class Fixed:
        def generate(self, batch, budgets, temperature, seed):
            prompts.extend(batch)
            return [answer for _ in batch]

        def close(self):
            pass

    monkeypatch.setattr(run, "make_generator", lambda *a, **k: Fixed())
    run.regenerate(RegenerateConfig(model=str(tiny_llama_dir), data=str(prep), out=str(tmp_path / "regen")),
                   progress=False)
    assert prompts and all(tokenizer.decode(p).startswith("<|begin_of_text|>") for p in prompts)
    regenerated = PreparedData(tmp_path / "regen")
    assert regenerated.chat_template == PreparedData(prep).chat_template
    assert "Sure.<|eot_id|>" in tokenizer.decode(regenerated[0].input_ids)
