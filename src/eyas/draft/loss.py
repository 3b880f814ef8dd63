"""The training-time-test loss every kind trains with, computed by the drafter's own forward
(draft/base.py): a distance from the drafter's distribution to the target's (soft
cross-entropy, or one of the LK losses that aim at the acceptance rate itself), weighted per
step, and per-step metric sums.

Alignment (position i of a sample, step k = 0..K-1): the drafter reads token i+1+k and
predicts the target's next-token distribution at position j = i+1+k, i.e. the target's
guess for token j+1. The pair counts ("is trained") iff token j+1 exists and is an
assistant token. Labels are the target's softmax restricted to the draft vocabulary;
positions whose target argmax lies outside it add no loss but count as misses, so the
reported accuracy is the share of trained positions where the drafter's top-1 token
equals the target's (greedy) token. Beside it, each trained pair's acceptance at
temperature 1: sum_v min(p_v, q_v) with p the target's full-vocabulary distribution (its
mass outside the draft vocabulary is out of the drafter's reach), the chance that
speculative sampling accepts the drafter's sampled token. A kind drafting blocks (DFlash) is scored only at the
rows [B, T] that anchor one: entry k of row i is its slot k+1, aligned the same way.

Memory: neither the drafter's logits nor the target's distribution are ever held for all
scored pairs at once. `chunked_loss` runs the drafter's head, the target's head over the
draft vocabulary and the loss a chunk of pairs at a time, and computes each chunk's gradient
as it goes (each loss's gradient in the logits has a closed form, known in the forward),
keeping only the [N, H] input gradient and the head's: the memory of a step no longer grows
with pairs x vocabulary, so a DFlash step can anchor densely.

The losses (draft/objective.py `LOSSES`), per pair, with p the target's distribution over the draft vocabulary,
q the drafter's, and alpha = sum_v min(p_v, q_v) the chance that speculative sampling accepts
the drafter's token (1 - alpha is their total variation):
- soft-ce: -sum_v p_v log q_v (its gradient is KL's);
- hard-ce: -log q_t, t the target's greedy token (its argmax over its whole vocabulary, which is
  argmax_v p_v wherever it lies in the draft vocabulary): cross-entropy against the target's
  greedy token, speculators' DFlash default. Where t lies outside the draft vocabulary the pair
  adds no loss and counts as a miss, as under every loss (the drafter cannot draft t);
- lk-hybrid (LK^lambda, arXiv 2602.23881): lambda KL(p || q) + (1 - lambda)(1 - alpha), with
  lambda = exp(-eta alpha) computed without gradient: KL's strong pull while the two barely
  overlap, the acceptance rate itself once they do;
- lk-alpha (LK^alpha, same paper): -log(alpha + LK_EPS), the acceptance rate with TV's
  gradient scaled by 1 / alpha; it is cross-entropy when p is one token.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from eyas.draft.context import Shard
from eyas.draft.flex import limited
from eyas.draft.objective import Objective
from eyas.draft.reach import accepted_lengths, chain_reach, reached_pairs

# Columns of the per-step statistics: summed over trained positions; then, where the labels
# know the samples' greedy path, the trained positions on it (the sample's next token is the
# target's greedy token), and over the chains greedy decoding drafts along the samples
# (draft/reach.py): the chains reaching step k, and those whose step-k draft is accepted.
LOSS, CORRECT, COUNT, IN_VOCAB, ACCEPT, GREEDY_PATH, CHAINS_REACHING, CHAINS_ACCEPTING = range(8)
STATS = 8
LOSS_CHUNK = 1 << 27  # [pairs, Vd] logits a loss chunk holds (512 MiB a float32 temporary)
LK_EPS = 1e-6  # keeps lk-alpha finite where the two distributions do not overlap at all


@dataclass
class Labels:
    hidden: torch.Tensor  # [B, T, Ht] the target's last state (id N) at each position j
    teacher: Callable[[torch.Tensor], torch.Tensor]  # [n, Ht] -> [n, Vd]: the target's logits over the draft vocab
    target_draft: torch.Tensor  # [B, T] long: draft id of the target's argmax at j, -1 if outside
    trained: torch.Tensor  # [B, T] bool: position j is trained (token j+1 is an assistant token)
    full_lse: torch.Tensor  # [B, T] float32: log-sum-exp of the target's logits over its whole vocabulary at j
    greedy: torch.Tensor | None = None  # [B, T] bool: the sample's token j+1 is the target's greedy token at j

    def distribution(self, *index) -> tuple[torch.Tensor, torch.Tensor]:
        """At `hidden[index]` (every position when no index is given): the target's distribution
        over the draft vocab [..., Vd] float32, and the share of its whole mass that the draft
        vocab holds [...], both from the draft vocabulary's own logits."""
        logits = self.teacher(self.hidden[index]).float()
        lse = torch.logsumexp(logits, -1)
        return torch.exp(logits - lse[..., None]), torch.exp(lse - self.full_lse[index]).clamp_max(1.0)

    def probs(self, *index) -> torch.Tensor:
        return self.distribution(*index)[0]

    @property
    def inside(self) -> torch.Tensor:
        """[B, T]: the target's mass inside the draft vocabulary at every position."""
        return self.distribution()[1]


def trained_positions(loss_mask: torch.Tensor) -> torch.Tensor:
    """loss_mask [B, T] (assistant tokens) -> [B, T]: positions whose next token is trained."""
    trained = torch.zeros_like(loss_mask)
    trained[:, :-1] = loss_mask[:, 1:]
    return trained


def step_counts(loss_mask: torch.Tensor, steps: int, rows: torch.Tensor | None = None) -> torch.Tensor:
    """[steps] float: trained pairs at each TTT step (of the rows [B, T] bool that anchor a
    block, when given); known before any forward, so processes can agree on the loss
    normaliser first."""
    trained = trained_positions(loss_mask)
    return torch.stack([_at_rows(trained[:, 1 + k :], rows).sum() for k in range(steps)]).float()


def _at_rows(pairs: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """pairs [B, T-1-k] (label positions 1+k.. of step k) -> those whose row i is in `rows`."""
    return pairs if rows is None else pairs & rows[:, : pairs.shape[1]]


def ttt_loss(lm_head: nn.Linear, states: list[torch.Tensor], labels: Labels, weights: torch.Tensor,
             rows: torch.Tensor | None = None, objective: Objective = Objective(), shard: Shard | None = None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """states: K normed outputs [B, R, H] (a drafter's `forward_ttt_states`; R = T, the labels'
    positions, except on a context-parallel shard, whose labels reach past its rows), weights [K]
    (each step's weight over its normaliser), rows [B, T] bool: the rows anchoring a block,
    the only ones scored; `objective`: the pairs' loss, and with its `dpace_alpha` each pair's
    weight is further its D-PACE weight (`dpace_weights`), from the drafter's own current
    probabilities; with its `on_policy` only the pairs that greedy decoding with the drafter as
    it now is reaches weigh (`chains`, draft/reach.py); every trained pair is still measured.
    Where the labels know the samples' greedy path (made with their input_ids) and every row is
    scored, the statistics also count the chains greedy decoding drafts along them.

    Returns the loss (sum_k weights[k] * summed pair loss of step k), per-step statistics
    [K, STATS] (loss sum, correct, trained, target argmax in draft vocab, acceptance at T=1)
    and the per-row loss [B] (to name a sample whose loss is not finite).
    """
    K = len(weights)
    B, T = labels.trained.shape
    device = labels.trained.device
    # Step k at position i is scored iff its label position j = i+1+k is trained. Only those
    # pairs go through the heads and the loss (prompts, padding and the steps' overhang are
    # ~30% of a batch); a pair whose target token lies outside the draft vocabulary weighs 0
    # in the loss and still has its acceptance measured. One nonzero for all steps, the
    # per-step counts and the chunks' spans are the micro-batch's three host syncs.
    # A context-parallel shard's labels run `halo` positions past its states' rows (draft/context.py).
    R = states[0].shape[1] if states else T  # rows with states
    pairs = torch.zeros(K, B, T, dtype=torch.bool, device=device)
    for k in range(min(K, T - 1)):
        n = min(T - 1 - k, R)
        pairs[k, :, :n] = _at_rows(labels.trained[:, 1 + k : 1 + k + n], rows)
    where = pairs.nonzero()  # [N, 3]: (k, b, i), ordered by step
    # Gathering from each step's states, empty slices included, keeps every weight in the
    # graph when nothing is scored: backward and DDP need a gradient for each.
    counts = pairs.flatten(1).sum(1)  # [K]
    x = torch.cat([s[w[:, 1], w[:, 2]] for s, w in zip(states, where.split(counts.tolist()))])  # [N, H]
    # The pairs sharing a label position (b, j) -- one per step (EAGLE-3), per anchor (DFlash)
    # -- go next to each other, so that a chunk computes the target's distribution once per
    # position it holds rather than once per pair.
    key = where[:, 1] * T + where[:, 2] + 1 + where[:, 0]  # [N]: b * T + j
    order = torch.argsort(key, stable=True)
    x, (step, b, i), key = x[order], where[order].unbind(1), key[order]
    positions, inverse = torch.unique_consecutive(key, return_inverse=True)  # [U], [N]
    j = i + 1 + step  # label positions
    target = labels.target_draft[b, j]  # [N], -1 outside the draft vocabulary
    in_vocab = target >= 0
    bounds = chunk_bounds(len(key), lm_head.weight.shape[0])
    edges = torch.tensor([e for lo, hi in bounds for e in (lo, hi - 1)], dtype=torch.long, device=device)
    spans = inverse[edges].view(-1, 2).tolist()  # per chunk, its first and last position in `positions`

    def probs(c: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Chunk c's target distributions [n, Vd] and their mass inside the draft vocab [n],
        computed once per label position."""
        (lo, hi), (u0, u1) = bounds[c], spans[c]
        at = positions[u0 : u1 + 1]
        p, inside = labels.distribution(at // T, at % T)
        return p[inverse[lo:hi] - u0], inside[inverse[lo:hi] - u0]

    row_weight = weights[step] * in_vocab  # [N]
    walk = None  # (accepted, reach) [B, T] each: the chains greedy decoding drafts along the samples
    if objective.on_policy:
        if rows is not None:
            raise ValueError("on-policy pairs follow chains drafted from every row; a kind trained on anchored "
                             "blocks scores sampled rows")
        if labels.greedy is None:
            raise ValueError("on-policy pairs need labels made with the samples' input_ids (make_labels)")
        walk = chains(greedy_drafts(x, lm_head.weight, bounds) == target, labels, pairs, (step, b, i), shard)
        row_weight = row_weight * reached_pairs(walk[1], K)[step, b, i]
    if objective.dpace_alpha is not None:
        q = torch.zeros(K, B, T, device=device)
        q[step, b, i] = target_probability(x.detach(), lm_head.weight, target, bounds)
        row_weight = row_weight * dpace_weights(q, pairs, objective.dpace_alpha)[step, b, i]
    loss, value, correct, accept = chunked_loss(x, lm_head.weight, row_weight, target, probs, bounds, objective)
    value = torch.where(in_vocab, value, 0.0)  # a pair out of the drafter's reach adds no loss
    zeros = torch.zeros(K, device=device)
    reaching = accepting = on_path = zeros
    if labels.greedy is not None:
        on_path = zeros.index_add(0, step, labels.greedy[b, j].float())
    if walk is None and labels.greedy is not None and rows is None:
        walk = chains(correct, labels, pairs, (step, b, i), shard)
    if walk is not None:
        accepted, reach = walk
        k = torch.arange(K, device=device)[:, None, None]
        reaching = (k < reach[None]).flatten(1).sum(1).float()  # [K]
        accepting = ((k < accepted[None]) & (reach[None] > 0)).flatten(1).sum(1).float()
    stats = torch.stack([zeros.index_add(0, step, value), zeros.index_add(0, step, correct.float()), counts.float(),
                         zeros.index_add(0, step, in_vocab.float()), zeros.index_add(0, step, accept), on_path,
                         reaching, accepting], dim=1)
    return loss, stats, torch.zeros(B, device=device).index_add(0, b, value)


def chunk_bounds(pairs: int, vocab: int) -> list[tuple[int, int]]:
    """The loss's chunks of `pairs` rows over a head of `vocab` outputs: LOSS_CHUNK logits each."""
    size = max(1, LOSS_CHUNK // vocab)
    return [(lo, min(pairs, lo + size)) for lo in range(0, pairs, size)]


def dpace_weights(q: torch.Tensor, pairs: torch.Tensor, alpha: float) -> torch.Tensor:
    """D-PACE (arXiv 2605.18810; speculators' DFlash default): q [K, B, T] the drafter's
    probability of the target's token at step k of row i (0 where that token is outside the
    draft vocabulary), pairs [K, B, T] bool the trained pairs -> weights [K, B, T]. Step k
    passes with s_k = (1 - alpha) q_k + alpha (1 where untrained), is reached and passed with
    P_k = prod_{k' <= k} s_k', and weighs w_k = m_k sum_{k' >= k} m_k' P_k': what getting it
    right is worth to the acceptance length of the steps from it on. Weights follow the
    drafter as it learns and carry no gradient."""
    m = pairs.float()
    passed = torch.where(pairs, (1 - alpha) * q + alpha, torch.ones_like(q)).cumprod(0)  # P [K, B, T]
    return m * (m * passed).flip(0).cumsum(0).flip(0)


@torch.no_grad()
def greedy_drafts(x: torch.Tensor, weight: torch.Tensor, bounds: list[tuple[int, int]]) -> torch.Tensor:
    """x [N, H] the drafter's states, weight [Vd, H] its lm_head -> its greedy draft ids [N], a
    chunk of rows (`bounds`) at a time."""
    drafted = torch.empty(x.shape[0], dtype=torch.long, device=x.device)
    for _, (lo, hi), _, logits in _head_chunks(x, _head_weight(weight), bounds):
        drafted[lo:hi] = logits.argmax(-1)
    return drafted


@torch.no_grad()
def chains(correct: torch.Tensor, labels: Labels, pairs: torch.Tensor,
           at: tuple[torch.Tensor, ...], shard: Shard | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """correct [N] (the drafter's greedy token is the target's) at the scored pairs `at` =
    (step, b, i), each [N], of `pairs` [K, B, T] -> the drafts a chain from each row would
    have accepted and the steps greedy decoding reaches from it, [B, T] each (draft/reach.py):
    a step passes where the drafter is right and the sample goes on with the target's token.
    On a context-parallel `shard` the chains are walked along the whole sample (a chain's
    start depends on every row before it) and the shard's rows of them returned."""
    step, b, i = at
    passes = torch.zeros_like(pairs)
    passes[step, b, i] = correct & labels.greedy[b, i + 1 + step]
    accepted = accepted_lengths(passes)
    if shard is None:
        return accepted, chain_reach(accepted, labels.trained, pairs.shape[0])
    R, T = shard.length, accepted.shape[1]
    whole = shard.whole(torch.stack([accepted[:, :R], labels.trained[:, :R].long()], dim=-1))  # [B, total, 2]
    reach = chain_reach(whole[..., 0], whole[..., 1].bool(), pairs.shape[0])
    return shard.own(whole[..., 0], T), shard.own(reach, T)


@torch.no_grad()
def target_probability(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                       bounds: list[tuple[int, int]]) -> torch.Tensor:
    """x [N, H], weight [Vd, H] (the drafter's lm_head), target [N] draft ids (-1: outside the
    draft vocabulary) -> the drafter's probability of each target [N] float32 (0 for -1), a
    chunk of rows (`bounds`) at a time."""
    out = torch.zeros(x.shape[0], dtype=torch.float32, device=x.device)
    for _, (lo, hi), _, logits in _head_chunks(x, _head_weight(weight), bounds):
        t = target[lo:hi, None]
        out[lo:hi] = logits.float().log_softmax(-1).gather(1, t.clamp_min(0))[:, 0].exp() * (t[:, 0] >= 0)
    return out


def _head_weight(weight: torch.Tensor) -> torch.Tensor:
    """The head's weight in the dtype its products run in: the autocast dtype under autocast
    (cast once for every chunk, where autocast would cast it for each product)."""
    device = weight.device.type
    return weight.to(torch.get_autocast_dtype(device)) if torch.is_autocast_enabled(device) else weight


def _head_chunks(x: torch.Tensor, w: torch.Tensor, bounds: list[tuple[int, int]]):
    """Yields (c, (lo, hi), x[lo:hi] in w's dtype [n, H], the head's logits there [n, Vd]) for
    each chunk c of `bounds`."""
    for c, (lo, hi) in enumerate(bounds):
        xc = x[lo:hi].to(w.dtype)
        with torch.autocast(x.device.type, enabled=False):
            yield c, (lo, hi), xc, F.linear(xc, w)


def chunked_loss(x: torch.Tensor, weight: torch.Tensor, row_weight: torch.Tensor, target: torch.Tensor,
                 probs: Callable[[int], tuple[torch.Tensor, torch.Tensor]], bounds: list[tuple[int, int]],
                 objective: Objective) -> tuple[torch.Tensor, ...]:
    """x [N, H] (drafter states), weight [Vd, H] (its lm_head), row_weight [N], target [N] (the
    target's argmax in draft ids), probs(c) -> [n, Vd] float32 and [n] (the target's
    distribution over the draft vocabulary at the rows of chunk c of `bounds`, and the share of
    its mass the draft vocabulary holds there) -> loss = sum_n row_weight[n] * value[n] (differentiable in x
    and weight), value [N] float32 (each pair's `objective.loss`), correct [N] bool (drafter's
    argmax == target) and accept [N] float32 (acceptance at T=1), holding one chunk's logits at
    a time."""
    need_grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    return _ChunkedLoss.apply(x, weight, row_weight, target, probs, bounds, objective, need_grad)


class _ChunkedLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, row_weight, target, probs, bounds, objective, need_grad):
        w = _head_weight(weight)  # [Vd, H]
        value = torch.zeros(x.shape[0], dtype=torch.float32, device=x.device)
        accept = torch.zeros(x.shape[0], dtype=torch.float32, device=x.device)
        correct = torch.zeros(x.shape[0], dtype=torch.bool, device=x.device)
        grad_x = torch.zeros_like(x) if need_grad else None
        frozen = not ctx.needs_input_grad[1]  # --lm-head frozen: no head gradient to make
        grad_w = None if not need_grad or frozen else torch.zeros_like(weight, dtype=torch.float32)
        pair_loss = fused_chunk_loss(x.is_cuda)
        for c, (lo, hi), xc, logits in _head_chunks(x, w, bounds):
            p, inside = probs(c)  # [n, Vd] float32, [n], under the caller's autocast as the target head expects
            value[lo:hi], accept[lo:hi], g = pair_loss(logits, p, target[lo:hi], row_weight[lo:hi], inside,
                                                       objective.loss, objective.lk_eta)
            correct[lo:hi] = logits.argmax(-1) == target[lo:hi]
            if need_grad:
                g = g.to(w.dtype)  # [n, Vd]: d loss / d logits, in the logits' dtype, as autograd has it
                with torch.autocast(x.device.type, enabled=False):
                    grad_x[lo:hi] = (g @ w).to(x.dtype)
                    if grad_w is not None:
                        grad_w += (g.T @ xc).float()
        ctx.weight_dtype = weight.dtype
        ctx.save_for_backward(grad_x, grad_w)
        ctx.mark_non_differentiable(value, correct, accept)
        return (row_weight * value).sum(), value, correct, accept

    @staticmethod
    def backward(ctx, grad_loss, _value, _correct, _accept):
        grad_x, grad_w = ctx.saved_tensors
        return (grad_x * grad_loss.to(grad_x.dtype),
                None if grad_w is None else (grad_w * grad_loss).to(ctx.weight_dtype),
                None, None, None, None, None, None)


def chunk_loss(logits: torch.Tensor, probs: torch.Tensor, target: torch.Tensor, row_weight: torch.Tensor,
               inside: torch.Tensor, loss: str = "soft-ce", eta: float = 3.0
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [n, Vd] (any float dtype), probs [n, Vd] float32, target [n] (the target's greedy
    token in draft ids, -1 outside the draft vocabulary), row_weight [n], inside [n] (the
    target's mass in the draft vocabulary) -> each pair's `loss` [n] float32 (the module
    docstring defines them), its acceptance at T=1 [n] (sum_v min(inside p_v, q_v)), and the
    loss's gradient in the logits times row_weight [n, Vd] float32, in closed form: with q =
    softmax(logits), soft CE's (and KL's) is q sum(p) - p, hard CE's q - onehot(target), and
    alpha's is q (1[q < p] - sum_v 1[q_v < p_v] q_v) (torch.minimum's subgradient; ties have
    measure zero)."""
    logq = logits.float().log_softmax(-1)
    q = logq.exp()
    accept = torch.minimum(q, probs * inside[:, None]).sum(-1)
    if loss == "soft-ce":
        value, grad = -(probs * logq).sum(-1), _kl_grad(q, probs)
    elif loss == "hard-ce":
        value, grad = hard_cross_entropy(logq, q, target)
    else:
        below = (q < probs).float()
        alpha = torch.minimum(q, probs).sum(-1)  # [n]
        alpha_grad = q * (below - (q * below).sum(-1, keepdim=True))
        if loss == "lk-alpha":
            value, grad = -torch.log(alpha + LK_EPS), -alpha_grad / (alpha + LK_EPS)[:, None]
        else:  # lk-hybrid
            lam = torch.exp(-eta * alpha)  # [n], held constant
            kl = (torch.xlogy(probs, probs) - probs * logq).sum(-1)
            value = lam * kl + (1 - lam) * (1 - alpha)
            grad = lam[:, None] * _kl_grad(q, probs) - (1 - lam)[:, None] * alpha_grad
    return value, accept, grad * row_weight[:, None]


def _kl_grad(q: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Soft CE's (and KL's) gradient in the logits [n, Vd]: q sum(p) - p. Only the losses that use it
    make this pass over the chunk (eager, on the CPU, nothing removes an unused one)."""
    return q * p.sum(-1, keepdim=True) - p


def hard_cross_entropy(logq: torch.Tensor, q: torch.Tensor, target: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """logq, q [n, Vd] the drafter's log-probabilities and probabilities, target [n] draft ids
    (-1: outside the draft vocabulary) -> -log q_target [n] and its gradient in the logits, q -
    onehot(target) [n, Vd]: soft CE's with p one-hot at the target's token, gathered rather than
    summed over the vocabulary. A pair at -1 gets 0 and no gradient, whatever its weight."""
    known = target >= 0
    at = target.clamp_min(0)[:, None]  # [n, 1]
    value = torch.where(known, -logq.gather(1, at)[:, 0], 0.0)
    weight = known.to(q.dtype)[:, None]  # [n, 1]
    return value, (q * weight).scatter_add(1, at, -weight)


@functools.cache
def fused_chunk_loss(cuda: bool):
    """`chunk_loss`; on CUDA compiled, to fuse the float32 passes that eager makes over [n, Vd]
    (cast, log-softmax, product, sums): for a small head they move more bytes than its matrix
    products."""
    return limited(torch.compile(chunk_loss, dynamic=True)) if cuda else chunk_loss


def simulated_acceptance(acc: list[float]) -> float:
    """tau_sim = 1 + sum_k prod_{j<=k} acc_j: the acceptance length of a chain draft whose
    step-k token is accepted with probability acc_k given the earlier ones were."""
    tau, run = 1.0, 1.0
    for a in acc:
        run *= a
        tau += run
    return tau
