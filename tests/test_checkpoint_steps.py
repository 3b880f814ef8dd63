"""`eyas train --checkpoint-steps`: each TTT step's activations are recomputed in backward
instead of kept. The loss, statistics and gradients equal the plain step's (float32, 1e-6),
for EAGLE-3 of one and of two layers, with MLA, and for P-EAGLE; what the step keeps for backward
shrinks; a run trained with it reaches the plain run's weights; DFlash refuses it."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from eyas.draft.peagle import PEagleDrafter
from eyas.draft.loss import step_counts
from eyas.errors import EyasError
from eyas.train import TrainConfig, train
from eyas.train.labels import make_labels
from test_ttt import K, make_setup, tiny_config
from test_train import FAST, derive_store


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread):
    """Tiny models: see conftest's one_thread."""


def _step(drafter, head, draft_ids, input_ids, hidden, loss_mask, checkpoint_steps: bool):
    """The objective's loss, statistics and every trainable parameter's gradient, and the bytes
    autograd kept for backward outside recomputed regions."""
    drafter.checkpoint_steps = checkpoint_steps
    labels = make_labels(head, hidden[:, :, -1], loss_mask, draft_ids)
    weights = torch.tensor([0.8 ** k for k in range(K)]) / step_counts(loss_mask, K)
    kept = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        kept.append(t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss, stats, _ = drafter(input_ids, hidden[:, :, :3], labels, weights)
    params = [p for p in drafter.parameters() if p.requires_grad]
    return loss, stats, torch.autograd.grad(loss, params), sum(kept)


@pytest.mark.parametrize("layers, kind", [(1, "eagle3"), (2, "eagle3"), (1, "peagle"), (1, "mla")])
def test_recomputed_steps_equal_the_kept_ones(layers, kind):
    drafter, head, draft_ids, input_ids, hidden, loss_mask = make_setup(num_hidden_layers=layers)
    if kind == "mla":  # latent attention, which recomputes its own projections inside each step
        from test_mla import mla_drafter

        drafter = mla_drafter()
        drafter.set_vocab(draft_ids)
    if kind == "peagle":
        cfg = tiny_config(num_hidden_layers=layers, mask_token_id=5, drafter="peagle")
        peagle = PEagleDrafter(cfg, drafter.embed_tokens.weight.detach())
        peagle.load_state_dict(drafter.state_dict(), strict=False)
        peagle.mask_hidden.data.normal_(0, 0.3)
        drafter = peagle
    plain = _step(drafter, head, draft_ids, input_ids, hidden, loss_mask, False)
    again = _step(drafter, head, draft_ids, input_ids, hidden, loss_mask, True)
    torch.testing.assert_close(again[0], plain[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(again[1], plain[1], atol=1e-6, rtol=1e-6)
    for a, b in zip(again[2], plain[2]):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    assert again[3] < 0.6 * plain[3], (again[3], plain[3])  # what crosses steps stays; each step's inside goes


def test_a_run_with_recomputed_steps_reaches_the_same_weights(smollm2_store, tmp_path):
    store = derive_store(smollm2_store, tmp_path / "store", n=4, length=48)
    common = dict(store=str(store), steps=3, **FAST)
    train(TrainConfig(out=str(tmp_path / "plain"), **common))
    train(TrainConfig(out=str(tmp_path / "recomputed"), checkpoint_steps=True, **common))
    a, b = load_file(tmp_path / "plain" / "model.safetensors"), load_file(tmp_path / "recomputed" / "model.safetensors")
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(b[key], a[key], atol=1e-6, rtol=0)


def test_dflash_refuses_it_in_one_line(tmp_path):
    with pytest.raises(EyasError, match="--checkpoint-steps recomputes the TTT steps") as e:
        TrainConfig(out=str(tmp_path / "o"), store=str(tmp_path / "s"), drafter="dflash", checkpoint_steps=True)
    assert "\n" not in str(e.value)
