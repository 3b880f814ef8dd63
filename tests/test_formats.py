"""Each on-disk format (prepared data, store, drafter checkpoint) is written and read by one
owner and records its version: what is written reads back the same; a folder laid out as eyas
wrote it before versions were recorded (the same files without the version field) still loads;
one from a newer eyas is refused in one line that names its version and the one supported."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eyas import __version__
from eyas.capture.run import capture
from eyas.capture.config import CaptureConfig
from eyas.cli import main
from eyas.data import prepared as prepared_format
from eyas.data.prepare import prepare
from eyas.data.config import PrepareConfig
from eyas.data.prepared import PreparedData, write_prepared
from eyas.data.template import ChatTemplate
from eyas.draft import DraftConfig, Eagle3Drafter
from eyas.draft.checkpoint import (CONFIG, NOT_SAVED, WEIGHTS, drafter_state, load_config, load_drafter, save_drafter,
                                   saved_names)
from eyas.draft.config import CONFIG_VERSION
from eyas.errors import EyasError
from eyas.models import load_tokenizer, model_identity
from eyas.store import Store, StoreWriter
from eyas.store import format as store_format
from eyas.store.format import manifest_header
from eyas.store.repair import repair_store

CONVERSATIONS = [{"messages": [{"role": "user", "content": f"question {i}?"},
                               {"role": "assistant", "content": f"the answer is {i} and more words {i}"}]}
                 for i in range(6)]


def _edit_json(path: Path, edit) -> None:
    record = json.loads(path.read_text())
    edit(record)
    path.write_text(json.dumps(record))


def _refused(version: int, supported: int, what: str) -> str:
    """The one line a newer folder gets."""
    return (rf"{what} format version {version}, but this eyas \({__version__}\) reads version {supported}"
            rf"( and earlier)? \(it was written by a newer eyas: upgrade eyas to read it\)\.$")


@pytest.fixture(scope="module")
def tiny_prepared(tmp_path_factory, tiny_llama_dir) -> Path:
    root = tmp_path_factory.mktemp("formats")
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in CONVERSATIONS))
    prepare(PrepareConfig(model=str(tiny_llama_dir), data=[str(data)], out=str(root / "prepared"), max_len=64),
            progress=False)
    return root / "prepared"


@pytest.fixture(scope="module")
def tiny_store(tiny_llama_dir, tiny_prepared) -> Path:
    out = tiny_prepared.parent / "store"
    capture(CaptureConfig(model=str(tiny_llama_dir), data=str(tiny_prepared), out=str(out), dtype="fp32"),
            progress=False)
    return out


@pytest.fixture(scope="module")
def tiny_drafter(tiny_llama_dir, tmp_path_factory) -> Path:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_llama_dir)
    identity = model_identity(str(tiny_llama_dir), config, load_tokenizer(str(tiny_llama_dir)))
    cfg = DraftConfig.for_target(config, identity, (2, 4, 5, config.num_hidden_layers), 64,
                                 chat_template=ChatTemplate("{{ messages }}", "tokenizer").to_dict())
    g = torch.Generator().manual_seed(0)
    model = Eagle3Drafter(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.startswith(NOT_SAVED):
                p.copy_(torch.randn(p.shape, generator=g))
    model.set_vocab(torch.randperm(cfg.vocab_size, generator=g)[:64].sort().values)
    out = tmp_path_factory.mktemp("formats-drafter") / "drafter"
    save_drafter(model, out)
    return out


def _same_samples(a: PreparedData, b: PreparedData) -> bool:
    return len(a) == len(b) and all(torch.equal(x.input_ids, y.input_ids) and torch.equal(x.loss_mask, y.loss_mask)
                                    and x.source_index == y.source_index for x, y in zip(a, b))


# ------------------------------------------------------------ prepared data

def test_prepared_data_round_trips_through_its_owner(tiny_prepared, tmp_path):
    data = PreparedData(tiny_prepared)
    assert data.meta["format"] == "eyas-prepared" and data.meta["format_version"] == prepared_format.FORMAT_VERSION
    (tmp_path / "again").mkdir()
    write_prepared(tmp_path / "again", list(data), data.conversations(), data.identity, data.chat_template,
                   data.meta["source"], data.max_len, data.meta["summary"])
    again = PreparedData(tmp_path / "again")
    assert _same_samples(again, data) and again.conversations() == data.conversations()
    assert (again.identity, again.chat_template, again.max_len, again.fingerprint) == \
        (data.identity, data.chat_template, data.max_len, data.fingerprint)
    assert again.meta == data.meta  # the whole record, rebuilt from the accessors


def test_prepared_data_without_a_version_still_loads(tiny_prepared, tmp_path):
    old = tmp_path / "old"
    shutil.copytree(tiny_prepared, old)
    _edit_json(old / prepared_format.META, lambda m: [m.pop("format"), m.pop("format_version")])
    data, now = PreparedData(old), PreparedData(tiny_prepared)
    assert _same_samples(data, now)
    assert (data.identity, data.chat_template, data.max_len, data.fingerprint) == \
        (now.identity, now.chat_template, now.max_len, now.fingerprint)


def test_prepared_data_from_a_newer_eyas_is_refused(tiny_prepared, tmp_path, tiny_llama_dir):
    new = tmp_path / "new"
    shutil.copytree(tiny_prepared, new)
    version = prepared_format.FORMAT_VERSION + 1
    _edit_json(new / prepared_format.META, lambda m: m.update(format_version=version))
    with pytest.raises(EyasError, match=_refused(version, prepared_format.FORMAT_VERSION, "prepared data")) as e:
        PreparedData(new)
    assert "\n" not in str(e.value) and str(new) in str(e.value)
    with pytest.raises(EyasError, match=_refused(version, prepared_format.FORMAT_VERSION, "prepared data")):
        capture(CaptureConfig(model=str(tiny_llama_dir), data=str(new), out=str(tmp_path / "store"), dtype="fp32"),
                progress=False)
    assert not (tmp_path / "store" / store_format.MANIFEST).exists()
    _edit_json(new / prepared_format.META, lambda m: m.update(format_version="1"))  # not a version at all
    with pytest.raises(EyasError, match=r"prepared data format version '1', but this eyas .* reads version 1\.$"):
        PreparedData(new)


# ------------------------------------------------------------ store

def test_store_round_trips_its_header_and_samples(tiny_store, tmp_path):
    store = Store(tiny_store)
    header = manifest_header(store.identity, store.layer_ids, "fp32", store.hidden_size, "fingerprint",
                             ChatTemplate("{{ messages }}", "a.jinja"))
    writer = StoreWriter(tmp_path / "s", header)
    for pos in range(len(store)):
        s = store.sample(pos)
        writer.add(int(s["index"]), s["input_ids"], s["loss_mask"], s["hidden"])
    writer.close(expected_samples=len(store))
    again = Store(tmp_path / "s")
    again.verify()
    m = again.manifest
    assert {k: m[k] for k in header} == header and m["chat_template"]["source"] == "a.jinja"
    assert m["format"] == store_format.FORMAT and m["format_version"] == store_format.FORMAT_VERSION and m["complete"]
    for pos in range(len(store)):
        a, b = store.sample(pos), again.sample(pos)
        assert all(torch.equal(a[k], b[k]) for k in ("input_ids", "loss_mask", "hidden", "index"))


def test_a_store_without_a_version_still_loads_and_resumes(tiny_store, tiny_prepared, tiny_llama_dir, tmp_path):
    old = tmp_path / "old"
    shutil.copytree(tiny_store, old)
    _edit_json(old / store_format.MANIFEST, lambda m: m.pop("format_version"))
    store = Store(old)
    store.verify()
    assert len(store) == len(Store(tiny_store)) and torch.equal(store.sample(1)["hidden"], Store(tiny_store).sample(1)["hidden"])
    manifest = capture(CaptureConfig(model=str(tiny_llama_dir), data=str(tiny_prepared), out=str(old), dtype="fp32"),
                       progress=False)  # nothing left to do
    assert manifest["shards"] == Store(tiny_store).manifest["shards"] and manifest["complete"]


def test_a_store_from_a_newer_eyas_is_refused_by_every_reader(tiny_store, tiny_prepared, tiny_llama_dir, tmp_path,
                                                              capsys):
    new = tmp_path / "new"
    shutil.copytree(tiny_store, new)
    version = store_format.FORMAT_VERSION + 1
    _edit_json(new / store_format.MANIFEST, lambda m: m.update(format_version=version))
    before = (new / store_format.MANIFEST).read_bytes()
    refused = _refused(version, store_format.FORMAT_VERSION, "store")
    with pytest.raises(EyasError, match=refused):
        Store(new)
    with pytest.raises(EyasError, match=refused):  # a resumed capture
        capture(CaptureConfig(model=str(tiny_llama_dir), data=str(tiny_prepared), out=str(new), dtype="fp32"),
                progress=False)
    with pytest.raises(EyasError, match=refused):  # a repair would rewrite it in the old layout
        repair_store(new)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        main(["inspect", str(new), "--verify"])
    err = capsys.readouterr().err.strip()
    assert exit_.value.code != 0 and len(err.splitlines()) == 1 and f"store format version {version}" in err
    assert (new / store_format.MANIFEST).read_bytes() == before and not list(new.glob("*.dropped"))


# ------------------------------------------------------------ drafter checkpoint

def test_drafter_checkpoint_round_trips_exactly_what_it_saves(tiny_drafter, tmp_path):
    model = load_drafter(tiny_drafter)
    saved = json.loads((tiny_drafter / CONFIG).read_text())
    assert saved["eyas"]["config_version"] == model.config.version == 1  # the oldest that holds it
    on_disk = load_file(tiny_drafter / WEIGHTS)
    assert {k: v.shape for k, v in on_disk.items()} == saved_names(model)
    assert not any(k.startswith(NOT_SAVED) for k in on_disk)
    save_drafter(model, tmp_path / "again")
    again = load_drafter(tmp_path / "again")
    assert load_config(tmp_path / "again") == load_config(tiny_drafter) == model.config
    assert again.config.chat_template == model.config.chat_template
    back = load_file(tmp_path / "again" / WEIGHTS)
    assert back.keys() == on_disk.keys() and all(torch.equal(back[k], on_disk[k]) for k in on_disk)


def test_a_drafter_without_a_version_still_loads(tiny_drafter, tmp_path):
    old = tmp_path / "old"
    shutil.copytree(tiny_drafter, old)
    _edit_json(old / CONFIG, lambda c: c["eyas"].pop("config_version"))
    assert load_config(old) == load_config(tiny_drafter)
    a, b = drafter_state(load_drafter(old)), drafter_state(load_drafter(tiny_drafter))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_drafter_from_a_newer_eyas_is_refused(tiny_drafter, tmp_path, capsys):
    new = tmp_path / "new"
    shutil.copytree(tiny_drafter, new)
    version = CONFIG_VERSION + 1
    _edit_json(new / CONFIG, lambda c: c["eyas"].update(config_version=version))
    refused = _refused(version, CONFIG_VERSION, "drafter")
    with pytest.raises(EyasError, match=refused) as e:
        load_drafter(new)
    assert str(e.value).startswith(f"{new / CONFIG}: ")
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        main(["export", str(new), "--to", "vllm", "--out", str(tmp_path / "x")])
    err = capsys.readouterr().err.strip()
    assert exit_.value.code != 0 and len(err.splitlines()) == 1 and f"drafter format version {version}" in err
    assert not (tmp_path / "x" / CONFIG).exists()
