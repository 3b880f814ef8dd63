"""`eyas train --lm-head`: the drafter's output head as a new one (own), the target's lm_head
rows of the draft vocabulary as a trained start (target), or those rows never trained (frozen,
as speculators' EAGLE-3 and DFlash and SpecForge's DFlash train). On a tiny Llama's store,
float32 on the CPU: the saved head is compared with the target's rows, and the chunked loss
with a frozen head gives the states the same gradient and the head none."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from eyas import distributed
from eyas.draft import load_config, load_drafter
from eyas.draft.loss import chunked_loss, chunk_bounds
from eyas.draft.objective import Objective
from eyas.errors import EyasError
from eyas.models import resolve_model
from eyas.models.target_head import load_target_head
from eyas.train import TrainConfig, train
from eyas.train.loop import _default_lm_head
from test_adversarial import cli, train_args
from test_store_damage import tiny_prepared, tiny_store  # noqa: F401

LR = 1e-3


def _train(capsys, store: Path, out: Path, *extra) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Train 2 steps; the saved head [Vd, H], the target's rows of its draft vocabulary, and the
    drafter's other weights."""
    code, err = cli(capsys, *train_args(store, out, "--steps", "2", "--lr", str(LR), "--warmup", "0", *extra))
    assert code == 0, err[-3000:]
    drafter = load_drafter(out)
    head = load_target_head(resolve_model(load_config(out).identity.model))
    draft_ids = torch.arange(len(drafter.d2t)) + drafter.d2t
    rows = head.lm_head_weight[draft_ids].float()
    return drafter.lm_head.weight.detach(), rows, {n: p.detach() for n, p in drafter.named_parameters()}


@pytest.mark.parametrize("drafter", ["eagle3", "dflash"])
def test_frozen_head_is_the_targets_rows_and_the_rest_trains(capsys, tmp_path, tiny_store, drafter):  # noqa: F811
    """--lm-head frozen: after 2 steps the head is exactly the target's rows while the layers
    train (they moved more than at lr 1e-9 from the same start); target: the head starts at the
    rows and moves by at most ~lr a step (Adam); own: a new head, nowhere near the rows."""
    extra = ("--drafter", "dflash", "--ttt-steps", "3") if drafter == "dflash" else ()
    frozen, rows, frozen_all = _train(capsys, tiny_store, tmp_path / "frozen", *extra, "--lm-head", "frozen")
    assert torch.equal(frozen, rows)
    moved, rows_again, _ = _train(capsys, tiny_store, tmp_path / "target", *extra, "--lm-head", "target")
    assert torch.equal(rows, rows_again)
    step = (moved - rows).abs().max().item()
    assert 0 < step <= 3 * 2 * LR, step
    own, _, _ = _train(capsys, tiny_store, tmp_path / "own", *extra, "--lm-head", "own")
    assert (own - rows).abs().max().item() > 100 * step
    default, _, _ = _train(capsys, tiny_store, tmp_path / "default", *extra)  # DFlash's: frozen; EAGLE-3's: own
    assert torch.equal(default, rows) if drafter == "dflash" else (default - rows).abs().max().item() > 100 * step
    _, _, still = _train(capsys, tiny_store, tmp_path / "still", *extra, "--lm-head", "frozen", "--lr", "1e-9")
    layers = [n for n in frozen_all if n.startswith(("layers.", "midlayer.", "fc")) and n.endswith("weight")]
    assert layers and max((frozen_all[n] - still[n]).abs().max().item() for n in layers) > LR / 10


def test_a_resume_keeps_the_head_setting_and_fsdp_refuses_frozen(capsys, tmp_path, tiny_store):  # noqa: F811
    """--resume with another --lm-head is refused in one line naming both; --fsdp with frozen too."""
    out = tmp_path / "run"
    code, err = cli(capsys, *train_args(tiny_store, out, "--lm-head", "frozen"))
    assert code == 0, err[-3000:]
    code, err = cli(capsys, *train_args(tiny_store, out, "--steps", "2", "--resume"))
    assert code == 2 and "lm-head 'own' (the run has 'frozen')" in err.splitlines()[-1], err[-2000:]
    with pytest.raises(EyasError, match=r"^--lm-head frozen keeps the target's head whole on every process"):
        TrainConfig(out="x", store="s", lm_head="frozen", fsdp=True)


def test_dflash_defaults_to_the_frozen_head_but_not_under_fsdp_and_an_old_run_resumes_with_own(
        capsys, tmp_path, tiny_store, tiny_llama_dir):  # noqa: F811
    """DFlash's default head is the target's rows, frozen, except under --fsdp (a new one, said in
    one line); a DFlash run recorded before the default changed (own) is refused on --resume in
    one line naming both, and resumes with --lm-head own."""
    head = load_target_head(tiny_llama_dir)
    sharded = TrainConfig(out="x", store="s", drafter="dflash", fsdp=True)
    assert _default_lm_head(sharded, head, distributed.Dist()) == "own"
    assert capsys.readouterr().out.strip() == ("eyas train: --lm-head own, not DFlash's default frozen: --fsdp "
                                               "shards the drafter")
    assert _default_lm_head(TrainConfig(out="x", store="s", drafter="dflash"), head, distributed.Dist()) == "frozen"
    assert capsys.readouterr().out.strip() == ("eyas train: --lm-head frozen, DFlash's default: the target's lm_head "
                                               "rows of the draft vocabulary")
    assert _default_lm_head(TrainConfig(out="x", store="s"), head, distributed.Dist()) == "own"  # EAGLE-3's
    assert capsys.readouterr().out == ""
    out, dflash = tmp_path / "old", ("--drafter", "dflash", "--ttt-steps", "3")
    train(TrainConfig(store=str(tiny_store), out=str(out), drafter="dflash", ttt_steps=3, steps=2, batch_tokens=64,
                      draft_vocab=64, eval_fraction=0.0, progress=False, device="cpu", lm_head="own"), stop_at=1)
    code, err = cli(capsys, *train_args(tiny_store, out, *dflash, "--steps", "2", "--resume"))
    assert code == 2 and "lm-head 'frozen' (the run has 'own')" in err.splitlines()[-1], err[-2000:]
    code, err = cli(capsys, *train_args(tiny_store, out, *dflash, "--steps", "2", "--resume", "--lm-head", "own"))
    assert code == 0, err[-3000:]


def test_a_frozen_head_in_the_chunked_loss_gets_no_gradient_and_the_states_the_same():
    """chunked_loss with lm_head not trained: the states' gradient equals the trained head's
    run (1e-6), the head gets none, and the loss is the same."""
    torch.manual_seed(0)
    N, H, Vd = 37, 16, 50
    x = torch.randn(N, H, requires_grad=True)
    weight = torch.randn(Vd, H, requires_grad=True)
    target = torch.randint(0, Vd, (N,))
    probs = torch.softmax(torch.randn(N, Vd), -1)
    row_weight = torch.rand(N)
    bounds = chunk_bounds(N, Vd)

    def chunk_probs(c: int) -> tuple[torch.Tensor, torch.Tensor]:
        lo, hi = bounds[c]
        return probs[lo:hi], torch.ones(hi - lo)

    trained = chunked_loss(x, weight, row_weight, target, chunk_probs, bounds, Objective())[0]
    trained.backward()
    gx, gw = x.grad.clone(), weight.grad
    x.grad = None
    frozen_w = weight.detach()
    frozen = chunked_loss(x, frozen_w, row_weight, target, chunk_probs, bounds, Objective())[0]
    frozen.backward()
    assert gw is not None and frozen_w.grad is None
    torch.testing.assert_close(frozen, trained, atol=0, rtol=0)
    torch.testing.assert_close(x.grad, gx, atol=1e-6, rtol=1e-6)
