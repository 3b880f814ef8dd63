"""Multi-head latent attention (MLA, DeepSeek-V2) for the drafter's one layer, as vLLM's
`Eagle3DeepseekV3ForCausalLM` and SGLang's Kimi/DeepSeek EAGLE-3 head compute it.

For a DeepseekV2/V3 target (Kimi-K2/K2.5 nest one) a drafter with the target's own attention
accepts better than a Llama layer, and its KV cache per token is the target's latent
(kv_lora_rank + qk_rope_head_dim values) instead of 2 x heads x head_dim.

The layer reads the EAGLE-3 input x = cat([input_layernorm(embed), hidden_norm(hidden)]) (2H):
    c_q  = q_a_layernorm(q_a_proj(x))                     [q_lora_rank]   (or q = q_proj(x))
    q    = q_b_proj(c_q) per head = [q_nope | q_rope]     [nH, nope + rope]
    c_kv, k_rope = kv_a_proj_with_mqa(x)                  [kv_lora_rank], [rope] shared by all heads
    c_kv = kv_a_layernorm(c_kv)
    k_nope, v = kv_b_proj(c_kv) per head                  [nH, nope], [nH, v_head_dim]
    q_rope, k_rope rotated with interleaved pairs (vLLM's is_neox_style=False)
    scores = (q_nope.k_nope + q_rope.k_rope) * (nope + rope)^-0.5 * mscale^2 (YaRN)
`qkv` expands keys and values per head (training, where compute matters); `latent_qkv` is the
absorbed form served at decode (the cache holds [c_kv | k_rope] once for all heads, the query
absorbs W_UK and the output W_UV), the same scores by associativity.
"""

from __future__ import annotations


import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from eyas.draft.layers import RMSNorm
from eyas.draft.mla_config import softmax_scale

def rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, h, T, r]; cos, sin [B, T, r] as the Llama rotary gives them (the r/2 angles twice).
    Pairs (x0, x1), (x2, x3), ... are each rotated by one angle, the layout of DeepSeek's weights."""
    cos, sin = cos[..., : x.shape[-1] // 2].unsqueeze(1), sin[..., : x.shape[-1] // 2].unsqueeze(1)
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack([even * cos - odd * sin, odd * cos + even * sin], dim=-1).flatten(-2)


class MLAAttention(nn.Module):
    """The drafter's attention as MLA; weight names are DeepSeek's (both engines load them)."""

    def __init__(self, cfg):
        super().__init__()
        m = cfg.mla
        self.n_heads, self.q_lora = cfg.num_attention_heads, m["q_lora_rank"]
        self.kv_lora, self.nope, self.rope_dim, self.v_dim = (
            m["kv_lora_rank"], m["qk_nope_head_dim"], m["qk_rope_head_dim"], m["v_head_dim"])
        self.qk_dim = self.nope + self.rope_dim
        self.scale = softmax_scale(self.qk_dim, cfg.rope_parameters)
        H2, nH = 2 * cfg.hidden_size, self.n_heads
        if self.q_lora:
            self.q_a_proj = nn.Linear(H2, self.q_lora, bias=False)
            self.q_a_layernorm = RMSNorm(self.q_lora, eps=cfg.rms_norm_eps)
            self.q_b_proj = nn.Linear(self.q_lora, nH * self.qk_dim, bias=False)
        else:
            self.q_proj = nn.Linear(H2, nH * self.qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(H2, self.kv_lora + self.rope_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(self.kv_lora, eps=cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(self.kv_lora, nH * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(nH * self.v_dim, cfg.hidden_size, bias=False)

    def _parts(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [B, T, 2H] -> q_nope [B, nH, T, nope], q_rope [B, nH, T, r] (rotated),
        c_kv [B, 1, T, kv_lora] (normed), k_rope [B, 1, T, r] (rotated)."""
        B, T, _ = x.shape
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora else self.q_proj(x)
        q = q.view(B, T, self.n_heads, self.qk_dim).transpose(1, 2)
        q_nope, q_rope = q.split([self.nope, self.rope_dim], dim=-1)
        c_kv, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora, self.rope_dim], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv)[:, None]
        return q_nope, rotate_interleaved(q_rope, cos, sin), c_kv, rotate_interleaved(k_rope[:, None], cos, sin)

    def _up(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj split per head: W_UK [nH, nope, kv_lora], W_UV [nH, v, kv_lora]."""
        w = self.kv_b_proj.weight.view(self.n_heads, self.nope + self.v_dim, self.kv_lora)
        return w[:, : self.nope], w[:, self.nope :]

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [B, T, 2H] -> q, k [B, nH, T, nope + r] and v [B, nH, T, v]: keys and values per head.

        Under autograd the projections are recomputed in backward (activation checkpointing):
        they cost ~3% of a training step's FLOPs, while their intermediates (the up-projections'
        outputs, the rotations' inputs) would hold more memory per token than the attention's
        own q, k and v, which attention keeps anyway."""
        if torch.is_grad_enabled():
            return checkpoint(self._expanded, x, cos, sin, use_reentrant=False)
        return self._expanded(x, cos, sin)

    def _expanded(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        q_nope, q_rope, c_kv, k_rope = self._parts(x, cos, sin)
        B, _, T, _ = c_kv.shape
        kv = self.kv_b_proj(c_kv[:, 0]).view(B, T, self.n_heads, self.nope + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(-1, self.n_heads, -1, -1)], dim=-1)
        return torch.cat([q_nope, q_rope], dim=-1), k, v.contiguous()

    def merge_heads(self, out: torch.Tensor) -> torch.Tensor:
        """out [B, nH, T, v] (attention over `qkv`'s values) -> o_proj's input [B, T, nH*v]."""
        return out.transpose(1, 2).flatten(2)

    def latent_qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """The absorbed form: q [B, nH, T, kv_lora + r] (q_nope through W_UK), the cache entry
        k [B, 1, T, kv_lora + r] = [c_kv | k_rope], and v [B, 1, T, kv_lora] = c_kv (a view).
        Attention over them with `scale` gives `qkv`'s scores; `merge_latent` applies W_UV."""
        q_nope, q_rope, c_kv, k_rope = self._parts(x, cos, sin)
        w_uk, _ = self._up()
        q = torch.cat([torch.einsum("bhtn,hnc->bhtc", q_nope, w_uk), q_rope], dim=-1)
        k = torch.cat([c_kv, k_rope], dim=-1)
        return q, k, k[..., : self.kv_lora]

    def merge_latent(self, out: torch.Tensor) -> torch.Tensor:
        """out [B, nH, T, kv_lora] (attention over latent values) -> o_proj's input [B, T, nH*v]."""
        _, w_uv = self._up()
        return self.merge_heads(torch.einsum("bhtc,hvc->bhtv", out, w_uv))

    # What decoding caches: the latent, once for all heads.
    cache_qkv, merge_cached = latent_qkv, merge_latent
