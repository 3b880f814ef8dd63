"""--optimizer muon: which weights Muon takes, and its update against a plain reference."""

import math

import pytest
import torch

from eyas.draft.build import new_drafter
from eyas.errors import EyasError
from eyas.train.config import TrainConfig
from eyas.train.optim import build_optimizers, muon_split
from test_mla import SIZES
from test_ttt import H, V, tiny_config

KINDS = {"eagle3": {}, "eagle3-mla": {"attention": "mla", "mla": dict(SIZES), "num_key_value_heads": 4,
                       "head_dim": SIZES["qk_rope_head_dim"]},
         "dflash": {"drafter": "dflash", "num_hidden_layers": 2, "mask_token_id": V - 1},
         "peagle": {"drafter": "peagle", "mask_token_id": V - 1}}


@pytest.mark.parametrize("kind", KINDS)
def test_muon_takes_the_weight_matrices_and_adamw_the_rest(kind):
    """Every trainable parameter lands in exactly one optimizer; Muon gets the 2-D projection
    matrices (fc and the layers'), AdamW the draft head, the norms and vectors; the frozen
    embedding in neither."""
    model = new_drafter(tiny_config(**KINDS[kind]), torch.randn(V, H))
    muon, adamw = muon_split(model)
    names = {n for n, _ in muon} | {n for n, _ in adamw}
    assert not {n for n, _ in muon} & {n for n, _ in adamw}
    assert names == {n for n, p in model.named_parameters() if p.requires_grad}
    assert all(p.ndim == 2 for _, p in muon) and any(n.endswith("fc.weight") for n, _ in muon)
    assert any("o_proj" in n for n, _ in muon) and any("down_proj" in n for n, _ in muon)
    assert any(n.endswith("lm_head.weight") for n, _ in adamw) and not any("lm_head" in n for n, _ in muon)
    assert all(p.ndim == 1 or "lm_head" in n for n, p in adamw)
    assert not any("embed" in n for n in names)
    opts = build_optimizers(model, "muon", 1e-3, 0.1)
    assert [type(o).__name__ for o in opts] == ["Muon", "AdamW"]
    assert [len(o.param_groups[0]["params"]) for o in opts] == [len(muon), len(adamw)]
    (adam,) = build_optimizers(model, "adamw", 1e-3, 0.1)
    assert len(adam.param_groups[0]["params"]) == len(names)


def newton_schulz(g: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """The quintic Newton-Schulz iteration of the Muon paper (coefficients 3.4445, -4.775,
    2.0315), on the wide orientation, from the Frobenius-normalised matrix."""
    a, b, c = 3.4445, -4.775, 2.0315
    x = g / (g.norm() + eps)
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    for _ in range(steps):
        s = x @ x.T
        x = a * x + (b * s + c * s @ s) @ x
    return x.T if tall else x


def test_muon_updates_match_a_plain_reference():
    """Three steps of `--optimizer muon` on a real drafter's matrices equal a plain Muon written
    out here in float32 (Nesterov momentum 0.95, Newton-Schulz orthogonalisation, the step scaled
    by 0.2 * sqrt(max(rows, cols)) to AdamW's RMS, decoupled weight decay), within 3% of each
    matrix's move in norm; the AdamW side equals torch's AdamW with the same betas (1e-6)."""
    torch.manual_seed(0)
    model = new_drafter(tiny_config(), torch.randn(V, H))
    lr, wd, mu = 2e-2, 0.1, 0.95
    opts = build_optimizers(model, "muon", lr, wd)
    muon, adamw = muon_split(model)
    ref = {n: p.detach().clone() for n, p in muon}
    start = {n: p.clone() for n, p in ref.items()}
    plain = {n: p.clone() for n, p in ref.items()}  # the same without Nesterov's look-ahead
    buf = {n: torch.zeros_like(p) for n, p in muon}
    adam_ref = [torch.nn.Parameter(p.detach().clone()) for _, p in adamw]
    adam = torch.optim.AdamW(adam_ref, lr=lr, betas=(0.9, 0.95), weight_decay=wd)
    for _ in range(3):
        grads = {n: torch.randn_like(p) for n, p in model.named_parameters() if p.requires_grad}
        for n, p in model.named_parameters():
            if p.requires_grad:
                p.grad = grads[n].clone()
        for o in opts:
            o.step()
        for n in ref:
            buf[n] = mu * buf[n] + grads[n]
            update = newton_schulz(grads[n] + mu * buf[n])
            scale = lr * 0.2 * math.sqrt(max(ref[n].shape))
            ref[n] = ref[n] * (1 - lr * wd) - scale * update
            plain[n] = plain[n] * (1 - lr * wd) - scale * newton_schulz(buf[n])
        for q, (n, _) in zip(adam_ref, adamw):
            q.grad = grads[n].clone()
        adam.step()
    for n, p in muon:  # torch's Newton-Schulz runs in bfloat16, ~1.3% off in norm here: 3% allowed
        move, err, off = ref[n] - start[n], p.detach() - ref[n], plain[n] - ref[n]
        assert err.norm() <= 0.03 * move.norm(), n
        assert off.norm() > 0.1 * move.norm(), n  # the check can tell: no Nesterov is far off
    for q, (n, p) in zip(adam_ref, adamw):
        torch.testing.assert_close(p.detach(), q.detach(), atol=1e-6, rtol=0)


def test_muon_refuses_fsdp():
    """Muon on FSDP's sharded matrices gives other updates than on whole ones: refused, not run."""
    with pytest.raises(EyasError, match="--optimizer muon does not take --fsdp"):
        TrainConfig(store="s", out="o", optimizer="muon", fsdp=True)
    assert TrainConfig(store="s", out="o", optimizer="muon").optimizer == "muon"
    with pytest.raises(EyasError, match="optimizer"):
        TrainConfig(store="s", out="o", optimizer="sgd")
