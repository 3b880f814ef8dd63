"""The drafter's own layers: RMSNorm, the gated MLP, the rotary embedding and its application.

eyas owns these so that a drafter means the same thing whatever transformers version is
installed. They compute exactly what transformers' Llama modules computed when eyas built
its drafters from them (tests/test_draft_layers.py holds them to those modules and to
checkpoints trained before the change), and their parameter names are the Llama ones
(`weight`, `gate_proj`, `up_proj`, `down_proj`), so checkpoints and exports are unchanged.

Rotary frequencies follow each rope type's published recipe as transformers 5 computes it
(`modeling_rope_utils`), written out here: that table's functions are private, and their
signatures changed between transformers 4 and 5.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from eyas.draft.rope import ROPE_TYPES
from eyas.errors import EyasError

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu}


class RMSNorm(nn.Module):
    """x / rms(x) over the last axis, in float32, cast back to x's dtype before the weight."""

    def __init__(self, size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), without biases (the Llama MLP)."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str = "silu"):
        super().__init__()
        if act not in ACTIVATIONS:
            raise EyasError(f"The drafter's hidden_act {act!r} is not one of {', '.join(ACTIVATIONS)}.")
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.act = ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[..., d] -> [-x[d/2:], x[:d/2]]"""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """q, k [B, h, T, d]; cos, sin [B, T, d] -> q and k rotated (rotate-half pairs (i, i + d/2))."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class RotaryEmbedding(nn.Module):
    """cos, sin [B, T, d] for position_ids [B, T], from the drafter's rope_parameters.

    The frequencies are buffers that are not saved. `dynamic` and `longrope` pick theirs by
    the longest position of each call (past max_position_embeddings, or past
    original_max_position_embeddings); transformers' module also remembers the longest
    length seen, which changes later calls only for positions beyond those lengths."""

    def __init__(self, head_dim: int, rope_parameters: dict[str, Any], max_position_embeddings: int):
        super().__init__()
        self.rope = standard_rope(rope_parameters, max_position_embeddings)
        self.head_dim, self.max_position_embeddings = head_dim, max_position_embeddings
        inv_freq, self.attention_scaling = rope_frequencies(self.rope, head_dim, max_position_embeddings)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = self._frequencies(position_ids, x.device)
        freqs = position_ids[..., None].float() * inv_freq.to(device=x.device, dtype=torch.float)  # [B, T, d/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)

    def _frequencies(self, position_ids: torch.Tensor, device: torch.device) -> torch.Tensor:
        kind = self.rope["rope_type"]
        if kind not in ("dynamic", "longrope"):
            return self.inv_freq
        seq_len = torch.max(position_ids) + 1
        if kind == "dynamic" and seq_len > self.max_position_embeddings:
            return rope_frequencies(self.rope, self.head_dim, self.max_position_embeddings, seq_len, device)[0]
        original = self.rope.get("original_max_position_embeddings")
        if kind == "longrope" and seq_len > original:
            return rope_frequencies(self.rope, self.head_dim, self.max_position_embeddings, original + 1, device)[0]
        return self.inv_freq


def standard_rope(rope: dict[str, Any], max_position_embeddings: int) -> dict[str, Any]:
    """The settings with the defaults every rope type assumes filled in."""
    rope = dict(rope)
    rope["rope_type"] = rope.get("rope_type", rope.get("type", "default"))
    rope.setdefault("rope_theta", 10000.0)
    if rope["rope_type"] in ("llama3", "yarn", "longrope"):
        rope.setdefault("original_max_position_embeddings", max_position_embeddings)
    if rope["rope_type"] not in ROPE_TYPES:
        raise EyasError(f"rope_type {rope['rope_type']!r} is not one the drafter computes ({', '.join(ROPE_TYPES)}).")
    return rope


def _exponents(end: int, dim: int, device=None) -> torch.Tensor:
    """[0, 2, 4, .. < end] / dim, float32"""
    return torch.arange(0, end, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim


def rope_frequencies(rope: dict[str, Any], head_dim: int, max_position_embeddings: int,
                     seq_len: int | torch.Tensor | None = None, device=None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [n], the factor on cos and sin) of a `standard_rope`; `seq_len` is
    the length a dynamic or longrope call covers."""
    kind, base = rope["rope_type"], rope["rope_theta"]
    dim = int(head_dim * rope.get("partial_rotary_factor", 1.0))
    if kind == "default":  # the whole head, whatever partial_rotary_factor says (as transformers' Llama)
        return 1.0 / (base ** _exponents(head_dim, head_dim, device)), 1.0
    if kind == "linear":
        return 1.0 / (base ** _exponents(dim, dim, device)) / rope["factor"], 1.0
    if kind == "proportional":  # rotates the first partial_rotary_factor of the head; the rest get frequency 0
        angles = int(rope.get("partial_rotary_factor", 1.0) * head_dim // 2)
        inv_freq = 1.0 / (base ** _exponents(2 * angles, head_dim, device))
        if head_dim // 2 > angles:
            inv_freq = torch.cat((inv_freq, torch.zeros(head_dim // 2 - angles, dtype=torch.float32, device=device)))
        return inv_freq / rope.get("factor", 1.0), 1.0
    if kind == "dynamic":
        return _dynamic(rope, base, dim, max_position_embeddings, seq_len, device), 1.0
    if kind == "yarn":
        return _yarn(rope, base, dim, max_position_embeddings, device)
    if kind == "longrope":
        return _longrope(rope, base, dim, max_position_embeddings, seq_len, device)
    return _llama3(rope, base, dim, device), 1.0


def _dynamic(rope, base: float, dim: int, max_pos: int, seq_len, device) -> torch.Tensor:
    """NTK-aware scaling: the base grows with the length past max_position_embeddings."""
    factor = rope["factor"]
    if seq_len is None:
        seq_len = max_pos
    elif isinstance(seq_len, torch.Tensor):
        seq_len = torch.maximum(seq_len, torch.tensor(max_pos, dtype=seq_len.dtype, device=seq_len.device))
    else:
        seq_len = max(seq_len, max_pos)
    base = base * ((factor * seq_len / max_pos) - (factor - 1)) ** (dim / (dim - 2))
    return 1.0 / (base ** _exponents(dim, dim, device))


def _yarn_mscale(scale: float, mscale: float = 1) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(rope, base: float, dim: int, max_pos: int, device) -> tuple[torch.Tensor, float]:
    """YaRN: interpolated low frequencies, extrapolated high ones, a linear ramp between, and
    cos/sin scaled by the attention factor."""
    original = rope["original_max_position_embeddings"]
    factor = rope.get("factor") or max_pos / original
    attention = rope.get("attention_factor")
    if attention is None:
        mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
        attention = (float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim))
                     if mscale and mscale_all_dim else _yarn_mscale(factor))
    beta_fast, beta_slow = rope.get("beta_fast") or 32, rope.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(device=device, dtype=torch.float) / dim)
    extrapolated = 1 - ramp.to(device=device, dtype=torch.float)  # the share of each frequency kept as it is
    inv_freq = 1.0 / (factor * pos_freqs) * (1 - extrapolated) + 1.0 / pos_freqs * extrapolated
    return inv_freq, attention


def _longrope(rope, base: float, dim: int, max_pos: int, seq_len, device) -> tuple[torch.Tensor, float]:
    """LongRoPE: per-frequency factors, the long ones past original_max_position_embeddings."""
    original = rope["original_max_position_embeddings"]
    factor = rope.get("factor") or max_pos / original
    attention = rope.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    key = "long_factor" if seq_len and seq_len > original else "short_factor"
    ext = torch.tensor(rope[key], dtype=torch.float32, device=device)
    return 1.0 / (ext * base ** _exponents(dim, dim, device)), attention


def _llama3(rope, base: float, dim: int, device) -> torch.Tensor:
    """Llama 3.1: long wavelengths divided by `factor`, short ones kept, a smooth blend between."""
    inv_freq = 1.0 / (base ** _exponents(dim, dim, device))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    original = rope["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < original / high) * ~(wavelen > original / low)
    return torch.where(medium, smoothed, scaled)
