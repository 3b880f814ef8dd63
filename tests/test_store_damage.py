"""Stores that defend themselves (issue 13): a resume never overwrites a recorded shard, a
manifest that disagrees with the files is reported and can be repaired, names read from a
manifest stay inside the store, `train` checks the structure before its first step, and
randomly damaged stores make `inspect --verify` and `train` fail in one line, never a traceback.

All on a tiny random Llama: a store of a dozen short samples in several shards."""

from __future__ import annotations

import hashlib
import json
import random
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file

from eyas.capture.run import capture
from eyas.capture.config import CaptureConfig
from eyas.cli import main
from eyas.data.prepare import prepare
from eyas.data.config import PrepareConfig
from eyas.errors import EyasError
from eyas.store import Store, StoreWriter
from eyas.store.format import write_safetensors

N_SAMPLES = 12


def conversations(n: int) -> list[dict]:
    rng = random.Random(0)
    words = "the a cat dog runs sees big small red blue house tree".split()
    return [{"messages": [{"role": "user", "content": " ".join(rng.choices(words, k=4)) + "?"},
                          {"role": "assistant", "content": " ".join(rng.choices(words, k=rng.randint(3, 12)))}]}
            for _ in range(n)]


@pytest.fixture(scope="module")
def tiny_prepared(tmp_path_factory, tiny_llama_dir) -> Path:
    root = tmp_path_factory.mktemp("damage")
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in conversations(N_SAMPLES)))
    prepare(PrepareConfig(model=str(tiny_llama_dir), data=[str(data)], out=str(root / "prepared"), max_len=64),
            progress=False)
    return root / "prepared"


def capture_into(model: Path, prepared: Path, out: Path) -> dict:
    """bf16, ~40 tokens a shard: a dozen samples land in several shards."""
    return capture(CaptureConfig(model=str(model), data=str(prepared), out=str(out), dtype="bf16", batch_tokens=256,
                                 shard_mb=40 * 4 * 64 * 2 / 2**20), progress=False)


@pytest.fixture(scope="module")
def tiny_store(tmp_path_factory, tiny_llama_dir, tiny_prepared) -> Path:
    out = tmp_path_factory.mktemp("damage-store") / "store"
    capture_into(tiny_llama_dir, tiny_prepared, out)
    assert len(Store(out).manifest["shards"]) >= 4
    return out


def digests(store: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in store.glob("shard-*.safetensors")}


def edit_manifest(store: Path, edit) -> None:
    m = json.loads((store / "manifest.json").read_text())
    edit(m)
    (store / "manifest.json").write_text(json.dumps(m))


def drop_entry(m: dict, i: int) -> None:
    """What a user does by hand to drop a shard: remove its entry and fix the totals."""
    shard = m["shards"].pop(i)
    m["num_samples"] -= shard["num_samples"]
    m["num_tokens"] -= shard["num_tokens"]
    m["complete"] = False


def cli(capsys, *argv: str) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exit_:
        main(list(argv))
    return exit_.value.code, capsys.readouterr().err


def train_args(store: Path, out: Path) -> list[str]:
    return ["train", "--store", str(store), "--out", str(out), "--steps", "1", "--batch-tokens", "64",
            "--ttt-steps", "1", "--draft-vocab", "64", "--eval-fraction", "0", "--no-progress", "--device", "cpu"]


def test_a_resume_never_overwrites_a_recorded_shard(tmp_path, tiny_store, tiny_prepared, tiny_llama_dir):
    store = tmp_path / "store"
    shutil.copytree(tiny_store, store)
    edit_manifest(store, lambda m: drop_entry(m, 1))  # its file stays on disk
    before = digests(store)
    with pytest.raises(EyasError, match=r"shard-00001.safetensors is on disk but not in the manifest.*--repair"):
        capture_into(tiny_llama_dir, tiny_prepared, store)
    assert digests(store) == before  # nothing overwritten
    dropped = store / "shard-00001.safetensors"
    dropped.rename(tmp_path / dropped.name)  # the user moves it away: now the resume goes ahead
    del before[dropped.name]
    capture_into(tiny_llama_dir, tiny_prepared, store)
    after = digests(store)
    assert all(after[name] == digest for name, digest in before.items())  # every recorded shard intact
    new = sorted(set(after) - set(before))
    assert new and all(name > max(before) for name in new)  # named past the highest, not by a count
    result = Store(store)
    result.verify()
    assert result.manifest["complete"] and sorted(result.sample_indices().tolist()) == list(range(N_SAMPLES))


def test_a_manifest_that_disagrees_with_the_files_is_reported(tmp_path, tiny_store, capsys):
    cases = {
        "listed twice": lambda m: m["shards"].append(dict(m["shards"][0])),
        "totals": lambda m: m.update(num_samples=m["num_samples"] + 1),
        "listed in the manifest but missing": lambda m: (m["shards"][2].update(file="shard-00042.safetensors")),
    }
    for problem, edit in cases.items():
        store = tmp_path / problem.replace(" ", "-")
        shutil.copytree(tiny_store, store)
        edit_manifest(store, edit)
        code, err = cli(capsys, "inspect", str(store), "--verify")
        assert code == 2 and problem in err, err


def test_inspect_repair_rebuilds_the_manifest_from_the_shards_that_verify(tmp_path, tiny_store, tiny_prepared,
                                                                          tiny_llama_dir, capsys):
    store = tmp_path / "store"
    shutil.copytree(tiny_store, store)
    edit_manifest(store, lambda m: drop_entry(m, 0))
    damaged = store / "shard-00002.safetensors"
    data = bytearray(damaged.read_bytes())
    header_end = 8 + int.from_bytes(data[:8], "little")
    start, end = json.loads(data[8:header_end])["hidden"]["data_offsets"]
    data[header_end + (start + end) // 2] ^= 0x01  # a low mantissa bit inside the hidden states: only the sha256 can tell
    damaged.write_bytes(bytes(data))
    code, err = cli(capsys, "inspect", str(store), "--repair", "--verify")
    assert code == 3 and "holds only" in err and "eyas capture" in err, err  # sound now, but two shards short
    result = Store(store)
    names = [s["file"] for s in result.manifest["shards"]]
    # Dropped, both: the one no entry lists (nothing says what it should hold), the corrupted one.
    assert "shard-00000.safetensors" not in names and "shard-00002.safetensors" not in names
    assert (store / "shard-00000.safetensors.dropped").is_file() and (store / "shard-00002.safetensors.dropped").is_file()
    capture_into(tiny_llama_dir, tiny_prepared, store)  # recaptures the dropped shards' samples
    result = Store(store)
    result.verify()
    assert result.manifest["complete"] and sorted(result.sample_indices().tolist()) == list(range(N_SAMPLES))
    assert cli(capsys, "inspect", str(store), "--verify")[0] == 0


def test_verify_fails_on_an_empty_and_on_an_incomplete_store_and_says_what_to_run(tmp_path, tiny_store,
                                                                                 tiny_llama_dir, capsys):
    """Exit 3 (sound but unfinished) for a store a capture left before its first shard and for
    one it left part-way; exit 2 stays for damage; exit 0 only for a whole, complete store."""
    empty = tmp_path / "empty"
    header = {k: v for k, v in Store(tiny_store).manifest.items()
              if k in ("target", "layer_ids", "dtype", "hidden_size", "prepared", "chat_template")}
    StoreWriter(empty, header).close()  # what a capture that failed before its first shard leaves
    partial = tmp_path / "partial"
    shutil.copytree(tiny_store, partial)
    edit_manifest(partial, lambda m: drop_entry(m, len(m["shards"]) - 1))
    (partial / Store(tiny_store).manifest["shards"][-1]["file"]).unlink()
    aux = ",".join(str(k) for k in Store(tiny_store).layer_ids[:-1])
    for store, held in ((empty, "holds no sample"), (partial, "holds only")):
        code, err = cli(capsys, "inspect", str(store), "--verify")
        assert code == 3, err
        assert err.startswith(f"eyas inspect: error: the store {held}") and len(err.strip().splitlines()) == 1
        assert f"eyas capture --model {tiny_llama_dir} --data PREPARED --out {store} --layers {aux} --dtype bf16" in err
        assert cli(capsys, "inspect", str(store))[0] == 0  # a summary alone still succeeds
    shard = partial / Store(partial).manifest["shards"][0]["file"]
    shard.write_bytes(shard.read_bytes()[:-1])
    assert cli(capsys, "inspect", str(partial), "--verify")[0] == 2  # damage before incompleteness
    assert cli(capsys, "inspect", str(tiny_store), "--verify")[0] == 0


def test_a_shard_a_killed_writer_was_recording_is_settled(tmp_path, tiny_store):
    """Killed between naming a shard and recording it: the next writer keeps the whole file
    (its sha256 matches the pending entry) and forgets an entry whose file never arrived."""
    store = tmp_path / "store"
    shutil.copytree(tiny_store, store)
    m = json.loads((store / "manifest.json").read_text())
    last = m["shards"][-1]
    drop_entry(m, len(m["shards"]) - 1)
    m["pending"] = [last, {**last, "file": "shard-00077.safetensors"}]
    (store / "manifest.json").write_text(json.dumps(m))
    header = {k: m[k] for k in ("target", "layer_ids", "dtype", "hidden_size", "prepared")}
    writer = StoreWriter(store, header)
    writer.close()
    settled = Store(store)
    assert "pending" not in settled.manifest and settled.manifest["shards"][-1] == last
    settled.verify()


@pytest.mark.parametrize("name", ["../../x.safetensors", "/tmp/x.safetensors", "..", "sub/shard-00000.safetensors"])
def test_names_in_a_manifest_stay_inside_the_store(tmp_path, tiny_store, tiny_prepared, tiny_llama_dir, capsys, name):
    store = tmp_path / "store"
    shutil.copytree(tiny_store, store)
    outside = tmp_path / "x.safetensors"
    shutil.copy(store / "shard-00000.safetensors", outside)  # a valid shard, where a path could reach it
    edit_manifest(store, lambda m: m["shards"][0].update(file=name))
    for argv in (["inspect", str(store), "--verify"], train_args(store, tmp_path / "run")):
        code, err = cli(capsys, *argv)
        assert code == 2 and "not a plain file name" in err and repr(name) in err, err
    with pytest.raises(EyasError, match="not a plain file name"):
        capture_into(tiny_llama_dir, tiny_prepared, store)


def rewrite_shard(store: Path, i: int, change) -> None:
    """Change shard i's tensors and re-record its sha256, as a buggy writer would have."""
    m = json.loads((store / "manifest.json").read_text())
    path = store / m["shards"][i]["file"]
    tensors = {k: v.clone() for k, v in load_file(path).items()}  # not views of the file rewritten below
    change(tensors)
    with open(path, "wb") as f:
        m["shards"][i]["sha256"] = write_safetensors(f, tensors, {"format": "eyas-store",
                                                                 "layer_ids": ",".join(map(str, m["layer_ids"]))})
    m["shards"][i]["bytes"] = path.stat().st_size
    (store / "manifest.json").write_text(json.dumps(m))


@pytest.mark.parametrize("problem,change", [
    ("outside the vocabulary", lambda t: t["input_ids"].__setitem__(0, 10**6)),
    ("offsets are not increasing", lambda t: t["offsets"].__setitem__(1, 0)),
    ("stored twice", lambda t: t["sample_index"].__setitem__(0, 0 if t["sample_index"][0] != 0 else 1)),
    ("hidden is not BF16", lambda t: t.__setitem__("hidden", t["hidden"].float())),
])
def test_train_checks_the_structure_before_its_first_step(tmp_path, tiny_store, capsys, problem, change):
    store = tmp_path / "store"
    shutil.copytree(tiny_store, store)
    rewrite_shard(store, 2, change)
    code, err = cli(capsys, *train_args(store, tmp_path / "run"))
    assert code == 2 and problem in err, err
    assert not (tmp_path / "run" / "checkpoints").exists()  # stopped before any step


# --- randomly damaged stores ------------------------------------------------------------------

WRONG = [None, -1, 0, "x", [], {}, 10**15, 1.5, True, "../../x.safetensors"]


def damage(store: Path, kind: str, rng: random.Random) -> None:
    shards = sorted(store.glob("shard-*.safetensors"))
    shard = rng.choice(shards)
    manifest = store / "manifest.json"
    if kind == "truncate_shard":
        data = shard.read_bytes()
        shard.write_bytes(data[: rng.randrange(len(data))])
    elif kind == "flip_shard":
        data = bytearray(shard.read_bytes())
        header_end = 8 + int.from_bytes(data[:8], "little")
        at = rng.randrange(header_end) if rng.random() < 0.6 else rng.randrange(len(data))
        data[at] ^= rng.randrange(1, 256)
        shard.write_bytes(bytes(data))
    elif kind == "edit_shard_header":  # a digit of a shape or byte range: same size, still valid JSON
        data = bytearray(shard.read_bytes())
        header_end = 8 + int.from_bytes(data[:8], "little")
        at = rng.choice([i for i in range(8, header_end) if chr(data[i]).isdigit()])
        data[at] = ord(rng.choice([d for d in "0123456789" if ord(d) != data[at]]))
        shard.write_bytes(bytes(data))
    elif kind == "truncate_manifest":
        text = manifest.read_bytes()
        manifest.write_bytes(text[: rng.randrange(len(text))])
    elif kind == "flip_manifest":
        data = bytearray(manifest.read_bytes())
        data[rng.randrange(len(data))] ^= rng.randrange(1, 256)
        manifest.write_bytes(bytes(data))
    elif kind == "edit_manifest":
        m = json.loads(manifest.read_text())
        where = rng.choice([m, m["target"], rng.choice(m["shards"])])
        where[rng.choice(sorted(where))] = rng.choice(WRONG)
        manifest.write_text(json.dumps(m))
    elif kind in ("remove_entry", "duplicate_entry"):
        m = json.loads(manifest.read_text())
        i = rng.randrange(len(m["shards"]))
        if kind == "remove_entry":
            drop_entry(m, i) if rng.random() < 0.5 else m["shards"].pop(i)
        else:
            m["shards"].insert(i, dict(m["shards"][i]))
        manifest.write_text(json.dumps(m))
    elif kind == "delete_shard":
        shard.unlink()
    elif kind == "copy_shard":
        shutil.copy(shard, store / "shard-00099.safetensors")
    elif kind == "swap_shards":
        other = rng.choice([s for s in shards if s != shard])
        a, b = shard.read_bytes(), other.read_bytes()
        shard.write_bytes(b)
        other.write_bytes(a)


KINDS = ["truncate_shard", "flip_shard", "edit_shard_header", "truncate_manifest", "flip_manifest", "edit_manifest", "remove_entry",
         "duplicate_entry", "delete_shard", "copy_shard", "swap_shards"]
# Damage only to fields that say nothing about the data may leave a store that verifies.
MAY_VERIFY = {"flip_manifest", "edit_manifest"}


def snapshot(root: Path, skip: Path) -> dict[str, tuple[int, int]]:
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")
            if p.is_file() and skip not in p.parents}


@pytest.mark.parametrize("seed", range(3))
def test_randomly_damaged_stores_fail_in_one_line_never_a_traceback(tmp_path, tiny_store, capsys, seed):
    rng = random.Random(seed)
    for case, kind in enumerate(["intact"] + KINDS):
        root = tmp_path / f"{case}-{kind}"
        store, run = root / "store", root / "run"
        shutil.copytree(tiny_store, store)
        if kind != "intact":
            damage(store, kind, rng)
        before = snapshot(tmp_path, run)
        for argv in (["inspect", str(store), "--verify"], train_args(store, run)):
            code, err = cli(capsys, *argv)  # any exception but SystemExit fails the test with its traceback
            lines = err.strip().splitlines()
            assert code in ((0, 2, 3) if argv[0] == "inspect" else (0, 2)), (kind, code, err)
            assert "Traceback" not in err, (kind, err)
            if code:
                assert lines[-1].startswith(f"eyas {argv[0]}: error: "), (kind, err)
            if kind == "intact" or (argv[0] == "inspect" and kind not in MAY_VERIFY):
                assert code == (0 if kind == "intact" else 2), (kind, err)
        assert snapshot(tmp_path, run) == before, kind  # neither wrote anything outside train's --out
        shutil.rmtree(root)
