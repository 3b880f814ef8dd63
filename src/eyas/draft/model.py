"""The EAGLE-3 drafter: `fc` fuses the target's aux states, one Llama-style decoder layer
whose attention reads `cat([embed(token), hidden])` (2H), optionally further plain Llama
layers after it (`stack`, `--draft-layers`; vLLM's llama_eagle3 builds the same: layer 0 reads
2H, the others H), a final norm, and `lm_head` over the draft vocabulary. Weight names are
vLLM's (`midlayer.*`, `fc`, `norm`, `lm_head`, `d2t`, `t2d`; `stack.i.*` is its `layers.{i+1}.*`);
the embeddings are the target's, frozen, and never saved.

The layer is split into `pre_attention` / `attn.qkv` / `post_attention` so that training
(training-time test over whole sequences) and decoding (KV cache, trees) share every
weight-touching line and differ only in how attention is computed.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import AuxRequest, BlockMask
from torch.utils.checkpoint import checkpoint

from eyas.draft.base import Drafter
from eyas.draft.config import DraftConfig
from eyas.draft.context import Shard
from eyas.draft.flex import compiled, limited
from eyas.draft.layers import GatedMLP, RMSNorm, apply_rotary_pos_emb
from eyas.draft.mla import MLAAttention



class DraftAttention(nn.Module):
    def __init__(self, cfg: DraftConfig, width: int | None = None):
        """`width`: the input's, 2H for the first layer (`cat([embed, hidden])`), H after it."""
        super().__init__()
        width = 2 * cfg.hidden_size if width is None else width
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.scale = cfg.head_dim ** -0.5
        self.q_proj = nn.Linear(width, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(width, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(width, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=False)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [B, T, width] -> q [B, nH, T, d], k and v [B, nKV, T, d]. The kv heads are not repeated:
        attention maps query head h to kv head h // (nH / nKV) itself (GQA), so training keeps
        nKV-head keys for backward instead of nH-head copies (4x less at Llama-3's 32/8)."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q, k, v

    def merge_heads(self, out: torch.Tensor) -> torch.Tensor:
        """out [B, nH, T, d] -> o_proj's input [B, T, nH*d]."""
        return out.transpose(1, 2).flatten(2)

    # What decoding caches: the same keys and values (MLA caches its latent instead, draft/mla.py).
    cache_qkv, merge_cached = qkv, merge_heads


class StackedLayer(nn.Module):
    """A plain pre-norm Llama decoder layer: a layer after the first (`--draft-layers`), as
    vLLM's llama_eagle3 runs its layers 1.. (the input norm over the residual stream, attention
    over H)."""

    def __init__(self, cfg: DraftConfig, attention: nn.Module | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.self_attn = DraftAttention(cfg, cfg.hidden_size) if attention is None else attention
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)

    def pre_attention(self, hidden: torch.Tensor):
        """hidden [B, T, H] (the residual stream) -> attention input [B, T, H] and the residual."""
        return self.input_layernorm(hidden), hidden

    def post_attention(self, attn_out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """attn_out [B, T, nH*d] -> the layer's pre-norm output [B, T, H] (next step's hidden)."""
        h = self.self_attn.o_proj(attn_out) + residual
        return h + self.mlp(self.post_attention_layernorm(h))


class DraftLayer(StackedLayer):
    """The first layer: its attention reads cat([input_layernorm(embed), hidden_norm(hidden)])."""

    def __init__(self, cfg: DraftConfig):
        super().__init__(cfg, MLAAttention(cfg) if cfg.attention == "mla" else DraftAttention(cfg))
        self.norm_before_residual = cfg.norm_before_residual
        self.hidden_norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def pre_attention(self, embeds: torch.Tensor, hidden: torch.Tensor):
        """embeds, hidden [B, T, H] -> attention input [B, T, 2H] and the residual [B, T, H]."""
        h = self.hidden_norm(hidden)
        residual = h if self.norm_before_residual else hidden
        return torch.cat([self.input_layernorm(embeds), h], dim=-1), residual


def frozen_embedding(cfg: DraftConfig, embed_weight: torch.Tensor | None) -> nn.Embedding:
    """The target's input embeddings [V, H], never trained (nor saved: see draft/checkpoint.py)."""
    embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
    embed.requires_grad_(False)
    if embed_weight is not None:
        embed.weight.data.copy_(embed_weight)
    return embed


class Eagle3Drafter(Drafter):
    # Set by training (`--checkpoint-steps`): each TTT step's activations are recomputed in
    # backward instead of kept, so a step keeps only what crosses steps (keys, values, states).
    checkpoint_steps = False

    def __init__(self, cfg: DraftConfig, embed_weight: torch.Tensor | None = None):
        super().__init__()
        self.config = cfg
        H = cfg.hidden_size
        self.embed_tokens = frozen_embedding(cfg, embed_weight)
        if cfg.fc_norm:  # one RMSNorm per aux state: the target's layers differ in scale by 10x and more
            self.fc_norm = nn.ModuleList(RMSNorm(H, eps=cfg.rms_norm_eps) for _ in cfg.aux_layer_ids)
        if cfg.norm_before_fc:  # one RMSNorm over the concatenated aux states (vLLM's and speculators' `input_norm`)
            self.input_norm = RMSNorm(len(cfg.aux_layer_ids) * H, eps=cfg.rms_norm_eps)
        self.fc = nn.Linear(len(cfg.aux_layer_ids) * H, H, bias=False)
        self.midlayer = DraftLayer(cfg)
        self.stack = nn.ModuleList(StackedLayer(cfg) for _ in range(cfg.num_hidden_layers - 1))
        self.add_head(cfg)

    def rope(self, x: torch.Tensor, position_ids: torch.Tensor):
        """cos, sin for position_ids [B, T]."""
        return self.rotary(x, position_ids)

    def combine(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """aux_hidden [..., L_aux, H] (the target's aux states) -> [..., H]."""
        if self.config.fc_norm:
            aux_hidden = torch.stack([norm(aux_hidden[..., i, :]) for i, norm in enumerate(self.fc_norm)], dim=-2)
        flat = aux_hidden.flatten(-2)  # [..., L_aux * H]
        return self.fc(self.input_norm(flat) if self.config.norm_before_fc else flat)

    def outputs(self, prenorm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """prenorm [..., H] (the layer's output) -> draft-vocab logits [..., Vd] and the hidden
        state the next step reads [..., H]."""
        normed, following = self.normed_outputs(prenorm)
        return self.lm_head(normed), following

    def normed_outputs(self, prenorm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """prenorm [..., H] -> the normed output (lm_head's input) and the hidden state the next
        step reads: the pre-norm output, or the normed one (norm_output)."""
        normed = self.norm(prenorm)
        return normed, normed if self.config.norm_output else prenorm

    def step_inputs(self, k: int, tokens: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Step k's inputs: the embeddings of tokens [B, T] and the hidden states [B, T, H] (the
        target's at k = 0, then the previous step's outputs); P-EAGLE overrides it."""
        return self.embed_tokens(tokens), hidden

    def forward_ttt_states(self, input_ids: torch.Tensor, aux_hidden: torch.Tensor, steps: int | None = None,
                           rows: torch.Tensor | None = None, shard: Shard | None = None):
        """Training-time test over whole sequences, up to the final norm (at every row: `rows`,
        when given, restricts only the scoring).

        input_ids [B, T]: the sample's tokens; aux_hidden [B, T, L_aux, H]: target states.
        Step k at position i reads token i+1+k and, as hidden, the target's state at i (k=0)
        or the drafter's own step-(k-1) output; it predicts the target's distribution at
        position i+1+k. Its query sees step-0 keys at positions <= i and the position-i key
        of each step 1..k. Returns a list of `steps` normed outputs [B, T, H], whose
        `lm_head` gives the logits (training applies it only where a position is scored);
        entries whose input token lies past the end are garbage and must be masked by the caller.

        With a context-parallel `shard` (draft/context.py), aux_hidden holds the shard's T
        positions and input_ids [B, T + h] those and the h <= steps tokens after them.
        """
        steps = steps or self.config.ttt_steps
        B, T = aux_hidden.shape[:2]
        hidden = self.combine(aux_hidden)  # [B, T, H]
        padded = F.pad(input_ids, (0, T + steps - input_ids.shape[1]))  # [B, T + steps]
        base_pos = torch.arange(T, device=input_ids.device).expand(B, T) + (shard.start if shard else 0)
        # Per layer: its step-0 keys and values, then the later steps' (same-position) ones.
        seen: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(1 + len(self.stack))]
        states = []
        recompute = self.checkpoint_steps and torch.is_grad_enabled()
        for k in range(steps):
            # `seen` as it is now: a recomputation in backward must see what this step saw.
            args = (k, padded[:, 1 + k : 1 + k + T], hidden, base_pos + k, [tuple(kv) for kv in seen], shard)
            normed, hidden, new = (checkpoint(self._ttt_step, *args, use_reentrant=False) if recompute
                                   else self._ttt_step(*args))
            for layer_seen, kv in zip(seen, new):
                layer_seen.append(kv)
            states.append(normed)
        return states

    def _ttt_step(self, k: int, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                  seen: list[tuple[tuple[torch.Tensor, torch.Tensor], ...]], shard: Shard | None = None):
        """Step k through every layer: tokens [B, T] (read at step k), hidden [B, T, H], positions
        [B, T], `seen` each layer's keys and values of the earlier steps -> the normed output
        [B, T, H], the hidden state step k+1 reads, and each layer's (k, v) of this step. Under
        context parallelism step 0's are every shard's, gathered once for all steps (its
        backward then reduce-scatters once, the gradients of every step summed), the later
        steps' the shard's own."""
        layers = [self.midlayer, *self.stack]
        offset = shard.start if shard is not None else 0  # the queries' first position
        pre, stacked_pre, mid, post = _step_parts(tokens.is_cuda and COMPILE_STEP_PARTS)
        x, residual = pre(self.midlayer, *self.step_inputs(k, tokens, hidden))
        cos, sin = self.rope(x, positions)
        new = []
        for n, layer in enumerate(layers):
            attn = layer.self_attn
            q, kk, vv = attn.qkv(x, cos, sin)  # q [B, nH, T, d], k/v [B, nKV, T, d(_v)]
            if shard is not None and not seen[n]:
                kk, vv = shard.gather(kk, vv)  # [B, nKV, world * T, .]
            new.append((kk, vv))
            (k0, v0), *extra = [*seen[n], (kk, vv)]
            out = attn.merge_heads(ttt_attention(q, k0, v0, extra, attn.scale, offset))  # [B, T, nH*d_v]
            if n + 1 < len(layers):  # the residual stream [B, T, H] into the next layer
                x, residual = stacked_pre(layers[n + 1], mid(layer, out, residual))
            else:
                normed, hidden = post(self, layer, out, residual)
        return normed, hidden, new


def _pre_attention(layer: DraftLayer, embeds: torch.Tensor, hidden: torch.Tensor):
    return layer.pre_attention(embeds, hidden)


def _stacked_pre_attention(layer: StackedLayer, hidden: torch.Tensor):
    return layer.pre_attention(hidden)


def _mid_attention(layer: StackedLayer, attn_out: torch.Tensor, residual: torch.Tensor):
    return layer.post_attention(attn_out, residual)


def _post_attention(drafter: Eagle3Drafter, layer: StackedLayer, attn_out: torch.Tensor, residual: torch.Tensor):
    return drafter.normed_outputs(layer.post_attention(attn_out, residual))


# On CUDA the parts of a TTT step around attention (norms, concatenation, o_proj, MLP, final
# norm) run compiled, as speculators compiles its whole step. Eager RMSNorm keeps float32
# copies of its input for backward and the MLP each pointwise output; compiled, the fused
# kernels keep their inputs and recompute the rest (40% fewer bytes kept for backward, 182 ->
# 110 MiB at H 1024, I 3584, 2 x 256 tokens, 7 steps, measured on the CPU with the same
# partition; ~4 GB at the 8B shape), and the pointwise passes between the matrix products run
# as one kernel each. A switch, so that bench/peers.py can measure what it brings.
COMPILE_STEP_PARTS = True


@functools.cache
def _step_parts(compiled: bool):
    """The parts around attention: the first layer's pre-attention, a stacked layer's, a layer's
    post-attention that feeds the next layer, and the last layer's with the final norm."""
    parts = (_pre_attention, _stacked_pre_attention, _mid_attention, _post_attention)
    return tuple(limited(torch.compile(part, dynamic=True)) for part in parts) if compiled else parts


def ttt_attention(q: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor,
                  extra: list[tuple[torch.Tensor, torch.Tensor]], scale: float | None = None,
                  offset: int = 0) -> torch.Tensor:
    """Exact TTT attention without a per-position loop: flex attention with a block-sparse
    mask on CUDA, dense scores elsewhere. Same inputs and output as `ttt_attention_dense`
    (`offset`: the queries are a context-parallel shard's, at positions offset..)."""
    if q.is_cuda:
        return ttt_attention_flex(q, k0, v0, extra, scale, offset)
    return ttt_attention_dense(q, k0, v0, extra, scale, offset)


def ttt_attention_dense(q: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor,
                        extra: list[tuple[torch.Tensor, torch.Tensor]], scale: float | None = None,
                        offset: int = 0) -> torch.Tensor:
    """q [B, nH, T, d], k0 [B, nKV, S, d], v0 [B, nKV, S, d_v] (S = T unless the queries are a
    shard's: query i sits at position offset + i); extra: (k_j, v_j) [B, nKV, T, .] for steps
    1..k (nKV divides nH: GQA). Scores against step-0 keys are causal [B, nH, T, S]; each later
    step contributes one same-position score [B, nH, T, 1]; one softmax runs over all S + k of
    them. `scale` defaults to d^-0.5.
    """
    T, S, heads = q.shape[-2], k0.shape[-2], q.shape[1]
    k0, v0 = _per_query_head(k0, heads), _per_query_head(v0, heads)
    extra = [(_per_query_head(kj, heads), _per_query_head(vj, heads)) for kj, vj in extra]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    causal = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(diagonal=offset)
    scores = (q @ k0.transpose(-1, -2)).float().mul(scale).masked_fill(~causal, float("-inf"))
    if extra:
        diag = torch.stack([(q * kj).sum(-1) for kj, _ in extra], dim=-1).float() * scale  # [B, nH, T, k]
        scores = torch.cat([scores, diag], dim=-1)
    probs = scores.softmax(-1).to(q.dtype)
    out = probs[..., :S] @ v0
    for j, (_, vj) in enumerate(extra):
        out = out + probs[..., S + j : S + j + 1] * vj
    return out


def _per_query_head(t: torch.Tensor, heads: int) -> torch.Tensor:
    """[B, nKV, T, d] -> [B, heads, T, d]: kv head j serves query heads j*rep .. j*rep+rep-1."""
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


def ttt_attention_flex(q: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor,
                       extra: list[tuple[torch.Tensor, torch.Tensor]], scale: float | None = None,
                       offset: int = 0) -> torch.Tensor:
    """The same attention as one causal flex-attention call over the step-0 keys, which also
    returns its log-sum-exp, merged with the later steps' same-position keys (`merge_same_position`).

    Laying all steps' keys end to end in one flex call would cost a 128-wide block per query
    block for each later step (of which only the diagonal is used), and each step would
    concatenate, and keep for backward, copies of all earlier steps' keys and values: memory
    quadratic in the TTT steps, ~4x the step-0 keys and values at 7 steps. Here every step's
    keys and values are kept once.

    Positions are padded to T' (a multiple of FLEX_PAD): building a block mask costs more
    than the attention itself, and batches come in every length, so masks are built once per
    padded length and reused. Real queries never see a padded key (causal); the padded
    queries' rows are dropped. A context-parallel shard's queries (at positions offset..)
    attend to every shard's keys: the shards are whole blocks, so only the mask's rows move."""
    T, S = q.shape[-2], k0.shape[-2]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    pad, kv_pad = -T % FLEX_PAD, -S % FLEX_PAD
    if offset % FLEX_PAD:
        raise ValueError(f"a context-parallel shard starts at {offset}, not on a {FLEX_PAD}-position block")
    qp = F.pad(q, (0, 0, 0, pad)) if pad else q
    kp, vp = (F.pad(t, (0, 0, 0, kv_pad)) if kv_pad else t for t in (k0, v0))
    mask = causal_block_mask(T + pad, q.device, S + kv_pad, offset)
    out0, aux = _compiled_flex()(qp, kp, vp, block_mask=mask, scale=scale,
                                 return_aux=AuxRequest(lse=True), enable_gqa=kp.shape[1] != qp.shape[1])
    # the padded q's real rows (a view: flex keeps qp for backward anyway, so q is not kept twice)
    return merge_same_position(out0[..., :T, :], aux.lse[..., :T], qp[..., :T, :], extra, scale)


def merge_same_position(out0: torch.Tensor, lse0: torch.Tensor, q: torch.Tensor,
                        extra: list[tuple[torch.Tensor, torch.Tensor]], scale: float) -> torch.Tensor:
    """Attention over step-0 keys (out0 [B, nH, T, d_v], its log-sum-exp lse0 [B, nH, T]) joined
    with one same-position key per later step (extra: (k_j [B, nKV, T, d], v_j [B, nKV, T, d_v]))
    into the softmax over all T + k scores: step-0's share is exp(lse0) / Z, step j's
    exp(q.k_j * scale) / Z. Query heads are grouped by kv head (GQA), so k_j and v_j are read
    in place rather than repeated per query head."""
    if not extra:
        return out0
    B, nH, T, d = q.shape
    nkv = extra[0][0].shape[1]
    qg = q.view(B, nkv, nH // nkv, T, d)  # [B, nKV, rep, T, d]
    diag = torch.stack([(qg * kj.unsqueeze(2)).sum(-1, dtype=torch.float32) for kj, _ in extra], dim=-1)
    diag = diag.view(B, nH, T, len(extra)) * scale  # [B, nH, T, k]
    weights = torch.cat([lse0.float().unsqueeze(-1), diag], dim=-1).softmax(-1)  # [B, nH, T, 1 + k]
    out = out0 * weights[..., :1]  # float32 [B, nH, T, d_v]
    for j, (_, vj) in enumerate(extra):
        w = weights[..., 1 + j : 2 + j].view(B, nkv, nH // nkv, T, 1)
        out = out + (w * vj.unsqueeze(2)).view(B, nH, T, vj.shape[-1])
    return out.to(out0.dtype)


FLEX_PAD = 128  # flex attention's block size


@functools.cache
def _compiled_flex():
    """TTT's compiled flex attention, with a compile cache of its own (see draft/flex.py)."""
    return compiled("eagle3-ttt")


@functools.lru_cache(maxsize=512)
def causal_block_mask(T: int, device: torch.device, S: int | None = None, offset: int = 0) -> BlockMask:
    """The causal flex block mask of `ttt_attention_flex` for T query positions against S keys
    (S = T by default; all multiples of FLEX_PAD), the queries at positions offset.. (a
    context-parallel shard's), cached per shape (`cache_info()` tells a benchmark how often it
    was built).

    Built from its blocks: query block i, at key block g = offset / FLEX_PAD + i, reads key
    blocks 0..g-1 whole and block g through the mask. `create_block_mask` would evaluate the
    mask at every (query, key) pair first, T * S int64 values: 128 GiB at 131,072 positions,
    more than the step itself."""
    S = T if S is None else S
    n, m, first = T // FLEX_PAD, S // FLEX_PAD, offset // FLEX_PAD
    at = torch.arange(first, first + n, device=device, dtype=torch.int32)  # [n]: each query block's own key block
    below = torch.arange(m, device=device, dtype=torch.int32).expand(n, m).contiguous().view(1, 1, n, m)
    diagonal = torch.zeros_like(below)  # row i: key block at[i], partial (the rest unread)
    diagonal[..., 0] = at
    return BlockMask.from_kv_blocks(torch.ones(1, 1, n, device=device, dtype=torch.int32), diagonal,
                                    at.view(1, 1, n), below, BLOCK_SIZE=FLEX_PAD,
                                    mask_mod=lambda b, h, q_idx, kv_idx: kv_idx <= q_idx + offset,
                                    seq_lengths=(T, S))
