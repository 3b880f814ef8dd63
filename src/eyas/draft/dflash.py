"""The DFlash drafter: one forward pass proposes a whole block.

A block sits right after the committed context: slot 0 holds the last committed token
(vLLM's bonus token) at position P, slots 1..K hold `mask_token_id` at P+1..P+K, and slot s
predicts the token at P+s. The block's queries attend, without a causal mask, to each other
and to the context: every draft layer projects its own keys and values from the same
context states `hidden_norm(fc(aux))` (the target's aux states at positions < P), with the
layer's `k_norm` and rotary position. Layers are Qwen3-style (per-head `q_norm`/`k_norm`),
then `norm` and `lm_head` over the draft vocabulary. Weight names are vLLM's
(`layers.i.*`, `fc`, `hidden_norm`, `norm`, `lm_head`, `d2t`; models/qwen3_dflash.py); the
embeddings are the target's, frozen, and never saved.

Training scores every position as an anchor at once. Row i's block is anchored at P = i+1:
its context is the aux states at 0..i, slot 0 holds token i+1, and slot k+1 predicts the
target's distribution at position i+1+k -- the alignment of training-time test step k at
row i, so the TTT objective, its labels and its per-step metrics serve unchanged (K =
block size - 1 steps). Anchoring every row is the expectation of sampling anchors per
sequence, and costs the same per query as the EAGLE-3 chain: block slots x tokens.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask

from eyas.draft.config import DraftConfig
from eyas.draft.layers import GatedMLP, RMSNorm, RotaryEmbedding, apply_rotary_pos_emb
from eyas.draft.model import FLEX_PAD, Eagle3Drafter, _compiled_flex, frozen_embedding


class DFlashAttention(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        H = cfg.hidden_size
        self.q_proj = nn.Linear(H, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(H, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(H, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, H, bias=False)
        self.q_norm = RMSNorm(self.head_dim, eps=cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, eps=cfg.rms_norm_eps)

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        """[B, T, n*d] -> [B, n, T, d]"""
        B, T, _ = x.shape
        return x.view(B, T, n, self.head_dim).transpose(1, 2)

    def query(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B, T, H] (normed) -> q [B, nH, T, d], in the projection's dtype (the norm's float32
        weight would lift it out of bf16 under autocast, and attention wants one dtype)"""
        q = self.q_proj(x)
        q = self.q_norm(self._heads(q, self.n_heads)).to(q.dtype)
        return apply_rotary_pos_emb(q, q, cos.to(q.dtype), sin.to(q.dtype))[0]

    def key_value(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [B, T, H] (normed block input or context states) -> k, v [B, nKV, T, d]"""
        k = self.k_proj(x)
        k = self.k_norm(self._heads(k, self.n_kv)).to(k.dtype)
        return apply_rotary_pos_emb(k, k, cos.to(k.dtype), sin.to(k.dtype))[0], self._heads(self.v_proj(x), self.n_kv)

    def repeat(self, kv: torch.Tensor) -> torch.Tensor:
        """[B, nKV, T, d] -> [B, nH, T, d] (GQA)"""
        return kv.repeat_interleave(self.n_heads // self.n_kv, dim=1)


class DFlashLayer(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.self_attn = DFlashAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)

    def finish(self, x: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """x [B, T, H] the layer's input, attn_out [B, T, nH*d] -> the layer's output [B, T, H]."""
        h = x + self.self_attn.o_proj(attn_out)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDrafter(nn.Module):
    set_vocab = Eagle3Drafter.set_vocab
    draft_to_target = Eagle3Drafter.draft_to_target

    def __init__(self, cfg: DraftConfig, embed_weight: torch.Tensor | None = None):
        super().__init__()
        self.config = cfg
        H = cfg.hidden_size
        self.embed_tokens = frozen_embedding(cfg, embed_weight)
        self.fc = nn.Linear(len(cfg.aux_layer_ids) * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, eps=cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(H, eps=cfg.rms_norm_eps)
        self.lm_head = nn.Linear(H, cfg.draft_vocab_size, bias=False)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_parameters, cfg.max_position_embeddings)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))  # target = draft + d2t[draft]
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))  # target ids in the draft vocab

    @property
    def block_size(self) -> int:
        return self.config.ttt_steps + 1

    def context(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """aux_hidden [..., L_aux, H] -> the context states every layer reads [..., H]."""
        return self.hidden_norm(self.fc(aux_hidden.flatten(-2)))

    def block_embeds(self, first: torch.Tensor, slots: int) -> torch.Tensor:
        """first [B, T] (slot 0's token per row) -> block inputs [B, slots, T, H]: that token, then masks."""
        mask = first.new_full((first.shape[0], slots - 1, first.shape[1]), self.config.mask_token_id)
        return self.embed_tokens(torch.cat([first[:, None], mask], dim=1))

    def forward_ttt_states(self, input_ids: torch.Tensor, aux_hidden: torch.Tensor, steps: int | None = None):
        """Every row i anchors a block (see the module docstring). input_ids [B, T], aux_hidden
        [B, T, L_aux, H]. Returns `steps` normed outputs [B, T, H]: entry k is slot k+1, which
        predicts the target's distribution at position i+1+k (entries whose slot lies past
        the end are garbage and must be masked by the caller, as for EAGLE-3)."""
        K = steps or self.config.ttt_steps
        S = K + 1
        B, T = input_ids.shape
        ctx = self.context(aux_hidden)  # [B, T, H]
        x = self.block_embeds(F.pad(input_ids, (0, 1))[:, 1:], S).flatten(1, 2)  # [B, S*T, H]: slot-major
        pos = torch.arange(T, device=input_ids.device)
        cos_c, sin_c = self.rotary(ctx, pos.expand(B, T))
        cos_b, sin_b = self.rotary(x, (pos + 1 + torch.arange(S, device=pos.device)[:, None]).flatten().expand(B, S * T))
        for layer in self.layers:
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = attn.query(h, cos_b, sin_b)  # [B, nH, S*T, d]
            kb, vb = attn.key_value(h, cos_b, sin_b)  # [B, nKV, S*T, d]
            kc, vc = attn.key_value(ctx, cos_c, sin_c)  # [B, nKV, T, d]
            k = attn.repeat(torch.cat([kc, kb], dim=2))  # [B, nH, (1+S)*T, d]
            v = attn.repeat(torch.cat([vc, vb], dim=2))
            out = block_attention(q, k, v, T, S)  # [B, nH, S*T, d]
            x = layer.finish(x, out.transpose(1, 2).flatten(2))
        normed = self.norm(x.view(B, S, T, -1)[:, 1:])  # [B, K, T, H]
        return list(normed.unbind(1))

    def forward_ttt(self, input_ids: torch.Tensor, aux_hidden: torch.Tensor, steps: int | None = None):
        """K logits tensors [B, T, Vd], aligned as `forward_ttt_states`."""
        return [self.lm_head(n) for n in self.forward_ttt_states(input_ids, aux_hidden, steps)]


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, T: int, S: int) -> torch.Tensor:
    """q [B, nH, S*T, d] (slot-major block queries), k/v [B, nH, (1+S)*T, d] (context, then the
    block slot-major). Query (s, t) sees context positions <= t and all S block entries of row t:
    flex attention with a block-sparse mask on CUDA, a dense mask elsewhere."""
    if q.is_cuda:
        return _block_attention_flex(q, k, v, T, S)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=block_mask_dense(T, S, q.device))


def block_mask_dense(T: int, S: int, device: torch.device) -> torch.Tensor:
    """[S*T, (1+S)*T] bool: the visibility `block_attention` applies."""
    t = torch.arange(S * T, device=device) % T  # each query's row
    kv = torch.arange((1 + S) * T, device=device)
    ctx = (kv[None] < T) & (kv[None] <= t[:, None])
    block = (kv[None] >= T) & (kv[None] % T == t[:, None])
    return ctx | block


def _block_attention_flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, T: int, S: int) -> torch.Tensor:
    """The same attention with rows padded to T' (a multiple of FLEX_PAD), so block masks are
    built once per padded length; padded rows and keys are never seen by a real query."""
    pad = -T % FLEX_PAD
    Tp = T + pad
    B, nH, _, d = q.shape

    def padded(x: torch.Tensor, parts: int) -> torch.Tensor:
        return F.pad(x.view(B, nH, parts, T, d), (0, 0, 0, pad)).view(B, nH, parts * Tp, d)

    out = _compiled_flex()(padded(q, S), padded(k, 1 + S), padded(v, 1 + S), block_mask=_block_mask(Tp, S, q.device))
    return out.view(B, nH, S, Tp, d)[:, :, :, :T].reshape(B, nH, S * T, d)


@functools.lru_cache(maxsize=256)
def _block_mask(T: int, S: int, device: torch.device):
    def mask(b, h, q_idx, kv_idx):
        t = q_idx % T
        return ((kv_idx < T) & (kv_idx <= t)) | ((kv_idx >= T) & (kv_idx % T == t))

    return create_block_mask(mask, B=None, H=None, Q_LEN=S * T, KV_LEN=(1 + S) * T, device=device)
