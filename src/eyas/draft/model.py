"""The EAGLE-3 drafter: `fc` fuses the target's aux states, one Llama-style decoder layer
whose attention reads `cat([embed(token), hidden])` (2H), a final norm, and `lm_head` over
the draft vocabulary. Weight names are vLLM's (`midlayer.*`, `fc`, `norm`, `lm_head`,
`d2t`, `t2d`); the embeddings are the target's, frozen, and never saved.

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
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from eyas.draft.config import DraftConfig
from eyas.draft.mla import MLAAttention


def _llama_config(cfg: DraftConfig) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size, hidden_act=cfg.hidden_act,
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps, max_position_embeddings=cfg.max_position_embeddings,
        rope_parameters=dict(cfg.rope_parameters), mlp_bias=False, attention_bias=False,
    )


class DraftAttention(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.scale = cfg.head_dim ** -0.5
        self.q_proj = nn.Linear(2 * cfg.hidden_size, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * cfg.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * cfg.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=False)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [B, T, 2H] -> q [B, nH, T, d], k and v [B, nH, T, d] (kv heads repeated for GQA)."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        rep = self.n_heads // self.n_kv
        return q, k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)

    def merge_heads(self, out: torch.Tensor) -> torch.Tensor:
        """out [B, nH, T, d] -> o_proj's input [B, T, nH*d]."""
        return out.transpose(1, 2).flatten(2)

    # What decoding caches: the same keys and values (MLA caches its latent instead, draft/mla.py).
    cache_qkv, merge_cached = qkv, merge_heads


class DraftLayer(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.norm_before_residual = cfg.norm_before_residual
        self.input_layernorm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.hidden_norm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.self_attn = MLAAttention(cfg) if cfg.attention == "mla" else DraftAttention(cfg)
        self.post_attention_layernorm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.mlp = LlamaMLP(_llama_config(cfg))

    def pre_attention(self, embeds: torch.Tensor, hidden: torch.Tensor):
        """embeds, hidden [B, T, H] -> attention input [B, T, 2H] and the residual [B, T, H]."""
        h = self.hidden_norm(hidden)
        residual = h if self.norm_before_residual else hidden
        return torch.cat([self.input_layernorm(embeds), h], dim=-1), residual

    def post_attention(self, attn_out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """attn_out [B, T, nH*d] -> the layer's pre-norm output [B, T, H] (next step's hidden)."""
        h = self.self_attn.o_proj(attn_out) + residual
        return h + self.mlp(self.post_attention_layernorm(h))


def frozen_embedding(cfg: DraftConfig, embed_weight: torch.Tensor | None) -> nn.Embedding:
    """The target's input embeddings [V, H], never trained (nor saved: see draft/checkpoint.py)."""
    embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
    embed.requires_grad_(False)
    if embed_weight is not None:
        embed.weight.data.copy_(embed_weight)
    return embed


class Eagle3Drafter(nn.Module):
    def __init__(self, cfg: DraftConfig, embed_weight: torch.Tensor | None = None):
        super().__init__()
        self.config = cfg
        H = cfg.hidden_size
        self.embed_tokens = frozen_embedding(cfg, embed_weight)
        if cfg.fc_norm:  # one RMSNorm per aux state: the target's layers differ in scale by 10x and more
            self.fc_norm = nn.ModuleList(LlamaRMSNorm(H, eps=cfg.rms_norm_eps) for _ in cfg.aux_layer_ids)
        if cfg.norm_before_fc:  # one RMSNorm over the concatenated aux states (vLLM's and speculators' `input_norm`)
            self.input_norm = LlamaRMSNorm(len(cfg.aux_layer_ids) * H, eps=cfg.rms_norm_eps)
        self.fc = nn.Linear(len(cfg.aux_layer_ids) * H, H, bias=False)
        self.midlayer = DraftLayer(cfg)
        self.norm = LlamaRMSNorm(H, eps=cfg.rms_norm_eps)
        self.lm_head = nn.Linear(H, cfg.draft_vocab_size, bias=False)
        self.rotary = LlamaRotaryEmbedding(_llama_config(cfg))
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))  # target = draft + d2t[draft]
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))  # target ids in the draft vocab

    def set_vocab(self, draft_to_target: torch.Tensor) -> None:
        """draft_to_target [Vd] int64: the target id of each draft id (ascending)."""
        self.d2t.copy_(draft_to_target - torch.arange(len(draft_to_target), device=draft_to_target.device))
        self.t2d.zero_()
        self.t2d[draft_to_target] = True

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

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

    def forward_ttt(self, input_ids: torch.Tensor, aux_hidden: torch.Tensor, steps: int | None = None):
        """Training-time test over whole sequences: a list of `steps` logits tensors [B, T, Vd]
        (see `forward_ttt_states` for the alignment)."""
        return [self.lm_head(normed) for normed in self.forward_ttt_states(input_ids, aux_hidden, steps)]

    def step_inputs(self, k: int, tokens: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Step k's inputs: the embeddings of tokens [B, T] and the hidden states [B, T, H] (the
        target's at k = 0, then the previous step's outputs); P-EAGLE overrides it."""
        return self.embed_tokens(tokens), hidden

    def forward_ttt_states(self, input_ids: torch.Tensor, aux_hidden: torch.Tensor, steps: int | None = None):
        """Training-time test over whole sequences, up to the final norm.

        input_ids [B, T]: the sample's tokens; aux_hidden [B, T, L_aux, H]: target states.
        Step k at position i reads token i+1+k and, as hidden, the target's state at i (k=0)
        or the drafter's own step-(k-1) output; it predicts the target's distribution at
        position i+1+k. Its query sees step-0 keys at positions <= i and the position-i key
        of each step 1..k. Returns a list of `steps` normed outputs [B, T, H], whose
        `lm_head` gives the logits (training applies it only where a position is scored);
        entries whose input token lies past the end are garbage and must be masked by the caller.
        """
        steps = steps or self.config.ttt_steps
        B, T = input_ids.shape
        hidden = self.combine(aux_hidden)  # [B, T, H]
        padded = F.pad(input_ids, (0, steps))  # [B, T + steps]
        base_pos = torch.arange(T, device=input_ids.device).expand(B, T)
        k0 = v0 = None
        extra: list[tuple[torch.Tensor, torch.Tensor]] = []
        states = []
        for k in range(steps):
            x, residual = self.midlayer.pre_attention(*self.step_inputs(k, padded[:, 1 + k : 1 + k + T], hidden))
            cos, sin = self.rope(x, base_pos + k)
            q, kk, vv = self.midlayer.self_attn.qkv(x, cos, sin)  # [B, nH, T, d], v [B, nH, T, d_v]
            if k == 0:
                k0, v0 = kk, vv
            else:
                extra.append((kk, vv))
            attn = self.midlayer.self_attn
            out = ttt_attention(q, k0, v0, extra, attn.scale)  # [B, nH, T, d_v]
            normed, hidden = self.normed_outputs(self.midlayer.post_attention(attn.merge_heads(out), residual))
            states.append(normed)
        return states


def ttt_attention(q: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor,
                  extra: list[tuple[torch.Tensor, torch.Tensor]], scale: float | None = None) -> torch.Tensor:
    """Exact TTT attention without a per-position loop: flex attention with a block-sparse
    mask on CUDA, dense scores elsewhere. Same inputs and output as `ttt_attention_dense`."""
    if q.is_cuda:
        return ttt_attention_flex(q, k0, v0, extra, scale)
    return ttt_attention_dense(q, k0, v0, extra, scale)


def ttt_attention_dense(q: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor,
                        extra: list[tuple[torch.Tensor, torch.Tensor]], scale: float | None = None) -> torch.Tensor:
    """q, k0 [B, nH, T, d], v0 [B, nH, T, d_v]; extra: (k_j, v_j) for steps 1..k. Scores against
    step-0 keys are causal [B, nH, T, T]; each later step contributes one same-position score
    [B, nH, T, 1]; one softmax runs over all T + k of them. `scale` defaults to d^-0.5.
    """
    T = q.shape[-2]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    scores = (q @ k0.transpose(-1, -2)).float().mul(scale).masked_fill(~causal, float("-inf"))
    if extra:
        diag = torch.stack([(q * kj).sum(-1) for kj, _ in extra], dim=-1).float() * scale  # [B, nH, T, k]
        scores = torch.cat([scores, diag], dim=-1)
    probs = scores.softmax(-1).to(q.dtype)
    out = probs[..., :T] @ v0
    for j, (_, vj) in enumerate(extra):
        out = out + probs[..., T + j : T + j + 1] * vj
    return out


def ttt_attention_flex(q: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor,
                       extra: list[tuple[torch.Tensor, torch.Tensor]], scale: float | None = None) -> torch.Tensor:
    """The same attention as one flex-attention call over the keys of all steps laid end to
    end ([B, nH, (1+k)T', d]); the block mask skips every block that is neither causal step-0
    nor on a same-position diagonal, so the cost is ~T^2/2 + kT, never (1+k)T^2.

    Positions are padded to T' (a multiple of FLEX_PAD): building a block mask costs more
    than the attention itself, and batches come in every length, so masks are built once per
    padded length and reused. Real queries never see a padded key (step-0 keys only up to
    their own position, later steps only at it); the padded queries' rows are dropped."""
    T = q.shape[-2]
    pad = -T % FLEX_PAD
    k = torch.cat([F.pad(kj, (0, 0, 0, pad)) for kj in (k0, *(kj for kj, _ in extra))], dim=2)
    v = torch.cat([F.pad(vj, (0, 0, 0, pad)) for vj in (v0, *(vj for _, vj in extra))], dim=2)
    out = _compiled_flex()(F.pad(q, (0, 0, 0, pad)), k, v, block_mask=_ttt_block_mask(T + pad, 1 + len(extra), q.device),
                           scale=scale)
    return out[..., :T, :]


FLEX_PAD = 128  # flex attention's block size


@functools.cache
def _compiled_flex():
    """TTT's compiled flex attention, with a compile cache of its own (see draft/flex.py)."""
    from eyas.draft.flex import compiled

    return compiled("eagle3-ttt")


@functools.lru_cache(maxsize=512)
def _ttt_block_mask(T: int, steps: int, device: torch.device):
    from torch.nn.attention.flex_attention import create_block_mask

    def mask(b, h, q_idx, kv_idx):  # kv_idx = step * T + position
        step, pos = kv_idx // T, kv_idx % T
        return ((step == 0) & (pos <= q_idx)) | ((step > 0) & (pos == q_idx))

    return create_block_mask(mask, B=None, H=None, Q_LEN=T, KV_LEN=steps * T, device=device)
