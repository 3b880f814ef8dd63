"""Context parallelism (draft/context.py): a long sample split over 2 and 4 gloo processes
gives the loss, statistics and gradients of one process holding it whole (float32; sums in
another order, so rtol 1e-5), also where the loss follows decoding's chains along the sample
(on-policy weights), which a shard cannot walk alone."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from eyas.distributed import GLOO_SETTLE_S
from eyas.draft import Eagle3Drafter
from eyas.draft.context import Shard, shard_length
from eyas.draft.loss import CHAINS_REACHING, step_counts
from eyas.draft.objective import Objective
from eyas.models.target_head import TargetHead
from eyas.train.labels import make_labels

V, H, VD, K, B, T = 97, 32, 41, 4, 2, 45  # T divides by neither 2 nor 4: the last shard is padded


def sample(**options):
    """A drafter of 2 layers with large random weights, a target head and one batch of 2 long
    samples that mostly follow the target's greedy path (so decoding's chains are walked)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from test_ttt import tiny_config

    torch.manual_seed(0)
    drafter = Eagle3Drafter(tiny_config(num_hidden_layers=2, ttt_steps=K, **options), torch.randn(V, H))
    for p in drafter.parameters():
        if p.requires_grad:
            p.data.normal_(0, 0.3)
    draft_ids = torch.randperm(V)[:VD].sort().values
    drafter.set_vocab(draft_ids)
    head = TargetHead(torch.randn(V, H), torch.nn.RMSNorm(H, eps=1e-5), torch.randn(V, H) * 0.5)
    input_ids = torch.randint(0, V, (B, T))
    hidden = torch.randn(B, T, 4, H)
    loss_mask = torch.rand(B, T) < 0.7
    greedy = head.logits(hidden[:, :-1, -1]).argmax(-1)  # [B, T-1]: the target's next token
    follow = torch.rand(B, T - 1) < 0.8
    input_ids[:, 1:] = torch.where(follow, greedy, input_ids[:, 1:])
    loss_mask[1, 30:] = False  # sample 1 is padding after 30 tokens
    input_ids[1, 30:] = 0
    weights = 0.8 ** torch.arange(K) / step_counts(loss_mask, K)
    return drafter, head, draft_ids, input_ids, hidden, loss_mask, weights


def loss_and_grads(drafter, head, draft_ids, input_ids, hidden, loss_mask, weights, shard: Shard | None = None,
                   on_policy: bool = False):
    """The drafter's loss, statistics (decoding's chains walked) and gradients on the whole
    sample, or on `shard`'s part."""
    halo = K + 1  # step k at row i reads token i+1+k and is scored at label i+1+k, trained by mask i+2+k
    if shard is not None:
        input_ids, loss_mask = shard.slice(input_ids, halo), shard.slice(loss_mask, halo)
        hidden, last = shard.slice(hidden), shard.slice(hidden[:, :, -1], halo)
    else:
        last = hidden[:, :, -1]
    labels = make_labels(head, last, loss_mask, draft_ids, input_ids)
    drafter.zero_grad()
    loss, stats, _ = drafter(input_ids, hidden[:, :, :-1], labels, weights, objective=Objective(on_policy=on_policy),
                             shard=shard)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in drafter.named_parameters() if p.requires_grad}
    return loss.detach(), stats, grads


@pytest.mark.parametrize("world,checkpoint_steps,on_policy", [(2, "0", "1"), (4, "1", "0")])
def test_context_parallel_equals_one_process(world, checkpoint_steps, on_policy, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = [str(world), str(tmp_path / "cp.pt"), checkpoint_steps, on_policy]
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
                    str(Path(__file__).resolve())] + args, check=True, env=env, timeout=600)
    split = torch.load(tmp_path / "cp.pt")
    loss, stats, grads = loss_and_grads(*sample(), on_policy=on_policy == "1")
    torch.testing.assert_close(split["loss"], loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(split["stats"], stats, rtol=1e-5, atol=1e-5)  # counts exactly, sums to rounding
    assert stats[:, 2].sum() > 0 and split["grads"].keys() == grads.keys()
    assert stats[0, CHAINS_REACHING] > 0  # decoding's chains were walked
    for name, g in grads.items():
        assert g.abs().sum() > 0, name
        torch.testing.assert_close(split["grads"][name], g, rtol=1e-5, atol=1e-6)


def test_shard_slices_pad_the_last_shard_and_give_the_others_a_halo():
    length = shard_length(T, 4)
    assert length == 12
    x = torch.arange(T)[None]
    shards = [Shard(None, r, 4, length) for r in range(4)]
    assert [s.slice(x, 3).shape[1] for s in shards] == [15, 15, 15, 12]
    assert torch.equal(shards[1].slice(x, 3)[0], torch.arange(12, 27))
    assert torch.equal(shards[3].slice(x)[0], torch.tensor([36, 37, 38, 39, 40, 41, 42, 43, 44, 0, 0, 0]))
    assert shard_length(300, 2, align=128) == 256


def _run(world: int, out: str, checkpoint_steps: str, on_policy: str) -> None:
    """One of `world` processes: its shard's loss, statistics and gradients, summed over all."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    assert dist.get_world_size() == world
    drafter, *rest = sample()
    drafter.checkpoint_steps = checkpoint_steps == "1"
    shard = Shard(dist.group.WORLD, rank, world, shard_length(T, world))
    loss, stats, grads = loss_and_grads(drafter, *rest, shard=shard, on_policy=on_policy == "1")
    for t in [loss, stats, *grads.values()]:
        dist.all_reduce(t)
    if rank == 0:
        torch.save({"loss": loss, "stats": stats, "grads": grads}, out)
    time.sleep(GLOO_SETTLE_S)  # as eyas.distributed.shutdown: gloo's destructor holds the GIL
    dist.destroy_process_group()


if __name__ == "__main__":
    _run(int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4])
