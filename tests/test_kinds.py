"""A drafter kind is one record (draft/kinds.py): registering a toy fourth kind in this test,
and changing no module, gives a kind that trains, checkpoints, evaluates losslessly and whose
export is refused by its own record. Also: no stage outside draft/ compares a kind's name.

The toy is EAGLE-3 with one learned scale per aux state before `fc`, so its weights differ
from EAGLE-3's (a checkpoint of it is not an EAGLE-3 checkpoint) while it drafts step by step."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from safetensors.torch import load_file

from eyas.draft import kinds
from eyas.draft.model import Eagle3Drafter
from eyas.draft.vllm_config import eagle3 as eagle3_config
from eyas.errors import EyasError
from test_adversarial import cli, train_args
from test_store_damage import tiny_prepared, tiny_store  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]


class ScaledAuxDrafter(Eagle3Drafter):
    """EAGLE-3 whose aux states are each scaled by a learned factor before `fc`."""

    def __init__(self, cfg, embed_weight: torch.Tensor | None = None):
        super().__init__(cfg, embed_weight)
        self.aux_scale = nn.Parameter(torch.ones(len(cfg.aux_layer_ids)))

    def combine(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        return super().combine(aux_hidden * self.aux_scale.to(aux_hidden.dtype)[:, None])


TOY = kinds.Kind(name="toy", title="Toy", summary="EAGLE-3 with learned aux scales", module=ScaledAuxDrafter,
                 vllm_config=eagle3_config, attentions=(kinds.GQA,), formats=())


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread):
    """Tiny models: see conftest's one_thread."""


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setitem(kinds.KINDS, TOY.name, TOY)
    return TOY


def test_a_registered_kind_trains_evaluates_losslessly_and_is_refused_export(toy, tmp_path, capsys, tiny_llama_dir,
                                                                          tiny_store):  # noqa: F811
    from eyas.draft.checkpoint import load_drafter
    from eyas.evaluate.config import EvalConfig
    from eyas.evaluate.run import evaluate
    from eyas.export.config import ExportConfig
    from eyas.export.exporter import export_drafter

    out = tmp_path / "run"
    got, _ = cli(capsys, *train_args(tiny_store, out, "--drafter", "toy", "--steps", "3", "--ttt-steps", "2",
                                     "--lr", "1e-2"))
    assert got == 0
    drafter = load_drafter(out)
    assert type(drafter) is ScaledAuxDrafter and drafter.config.kind is toy
    scale = load_file(out / "model.safetensors")["aux_scale"]
    assert not torch.equal(scale, torch.ones_like(scale))  # trained: its own weight had a gradient

    results = evaluate(EvalConfig(model=str(tiny_llama_dir), draft=str(out), limit=2, max_new_tokens=12,
                                  steps=2, baselines=(), output=str(tmp_path / "eval" / "results.json"),
                                  plot=str(tmp_path / "eval" / "plot.png")))
    drafted = {m: s for m, s in results["summary"].items() if m != "plain"}
    assert drafted and all(s["identical"] == s["answers"] > 0 for s in drafted.values())

    with pytest.raises(EyasError, match="No engine serves a Toy drafter"):
        export_drafter(ExportConfig(ckpt=str(out), to="vllm", out=str(tmp_path / "export")))
    assert not (tmp_path / "export").exists()


def test_a_kind_refuses_what_its_record_does_not_take(toy):
    from eyas.train.config import TrainConfig

    with pytest.raises(EyasError, match="--draft-layers is for --drafter eagle3 or dflash, not toy"):
        TrainConfig(store="s", out="o", drafter="toy", draft_layers=2)
    with pytest.raises(EyasError, match="--causal-layers is for --drafter dflash, not toy"):
        TrainConfig(store="s", out="o", drafter="toy", causal_layers="all")
    with pytest.raises(EyasError, match="--draft-attention mla is for --drafter eagle3 or peagle"):
        TrainConfig(store="s", out="o", drafter="toy", draft_attention="mla")
    with pytest.raises(EyasError, match=r"--drafter must be one of eagle3, dflash, peagle, toy \(got 'nope'\)"):
        TrainConfig(store="s", out="o", drafter="nope")
    with pytest.raises(EyasError, match="is registered already"):
        kinds.register(TOY)


def test_no_stage_outside_draft_compares_a_kind_name():
    """Stages ask the kind's record; a name compared elsewhere is a kind nobody registered."""
    src = ROOT / "src" / "eyas"
    pattern = re.compile(r'== ?"(eagle3|dflash|peagle)"|kind in \(')
    found = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}" for path in sorted(src.rglob("*.py"))
             if path.parent.name != "draft" for n, line in enumerate(path.read_text().splitlines(), 1)
             if pattern.search(line)]
    assert not found, found
