"""The DFlash drafter: one forward pass proposes a whole block.

A block sits right after the committed context: slot 0 holds the last committed token
(vLLM's bonus token) at position P, slots 1..K hold `mask_token_id` at P+1..P+K, and slot s
predicts the token at P+s. The block's queries attend, without a causal mask, to each other
and to the context: every draft layer projects its own keys and values from the same
context states `hidden_norm(fc(aux))` (the target's aux states at positions < P), with the
layer's `k_norm` and rotary position. In the layers of `causal_layers` (speculators'
sliding-window layers, imported or trained with --causal-layers) slot s sees only slots 0..s of
the block. Layers are Qwen3-style (per-head `q_norm`/`k_norm`), then `norm` and `lm_head` over
the draft vocabulary. Weight names are vLLM's (`layers.i.*`, `fc`, `hidden_norm`, `norm`, `lm_head`,
`d2t`; models/qwen3_dflash.py), and speculators' too; the embeddings are the target's, frozen,
and never saved.

Training runs the blocks of many anchors at once. Row i's block is anchored at P = i+1: its
context is the aux states at 0..i, slot 0 holds token i+1, and slot k+1 predicts the
target's distribution at position i+1+k -- the alignment of training-time test step k at
row i, so the TTT objective, its labels and its per-step metrics serve unchanged (K = block
size - 1 steps). The trainer draws the anchor rows per sample and step (train/anchors.py);
the blocks of a batch's N anchors run as [B, S*N] queries over the T context keys and the
S*N block keys, with the mask `block_mask` builds.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask

from eyas.draft.base import Drafter
from eyas.draft.config import DraftConfig
from eyas.draft.flex import compiled
from eyas.draft.layers import GatedMLP, RMSNorm, apply_rotary_pos_emb
from eyas.draft.loss import LOSS_CHUNK
from eyas.draft.model import frozen_embedding


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


class DFlashDrafter(Drafter):
    def __init__(self, cfg: DraftConfig, embed_weight: torch.Tensor | None = None):
        super().__init__()
        self.config = cfg
        H = cfg.hidden_size
        self.embed_tokens = frozen_embedding(cfg, embed_weight)
        self.fc = nn.Linear(len(cfg.aux_layer_ids) * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, eps=cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.add_head(cfg)

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

    def forward_ttt_states(self, input_ids: torch.Tensor, aux_hidden: torch.Tensor, steps: int | None = None,
                           rows: torch.Tensor | None = None, shard=None):
        """The blocks anchored at `rows` [B, T] bool (default every row; see the module docstring).
        input_ids [B, T], aux_hidden [B, T, L_aux, H]. Returns `steps` normed outputs [B, T, H]:
        entry k at an anchored row i is slot k+1, which predicts the target's distribution at
        position i+1+k; rows that anchor no block hold zeros, and entries whose slot lies past
        the end are garbage: the caller scores neither (as for EAGLE-3). No context parallelism:
        a block attends to its own slots, which a shard's end would cut."""
        if shard is not None:
            raise ValueError("DFlash drafters do not train with context parallelism")
        K = steps or self.config.ttt_steps
        S = K + 1
        B, T = input_ids.shape
        anchor, valid = anchor_table(rows if rows is not None else input_ids.new_ones(B, T, dtype=torch.bool))
        N = anchor.shape[1]
        ctx = self.context(aux_hidden)  # [B, T, H]
        first = F.pad(input_ids, (0, 1)).gather(1, anchor + 1)  # [B, N]: slot 0 holds token i+1
        x = self.block_embeds(first, S).flatten(1, 2)  # [B, S*N, H]: slot-major
        cos_c, sin_c = self.rotary(ctx, torch.arange(T, device=input_ids.device).expand(B, T))
        slots = torch.arange(S, device=input_ids.device)[None, :, None]
        cos_b, sin_b = self.rotary(x, (anchor[:, None, :] + 1 + slots).flatten(1))  # slot s of row i at i+1+s
        causal = self.config.causal_layers
        masks = {c: block_mask(anchor, S, T, c) for c in {i in causal for i in range(len(self.layers))}}
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = attn.query(h, cos_b, sin_b)  # [B, nH, S*N, d]
            kb, vb = attn.key_value(h, cos_b, sin_b)  # [B, nKV, S*N, d]
            kc, vc = attn.key_value(ctx, cos_c, sin_c)  # [B, nKV, T, d]
            k = attn.repeat(torch.cat([kc, kb], dim=2))  # [B, nH, T + S*N, d]
            v = attn.repeat(torch.cat([vc, vb], dim=2))
            out = block_attention(q, k, v, masks[i in causal])  # [B, nH, S*N, d]
            x = layer.finish(x, out.transpose(1, 2).flatten(2))
        normed = self.norm(x.view(B, S, N, -1)[:, 1:]).transpose(1, 2)  # [B, N, K, H]
        b, n = valid.nonzero(as_tuple=True)
        states = normed.new_zeros(B, T, K, normed.shape[-1]).index_put((b, anchor[b, n]), normed[b, n])
        return list(states.unbind(2))

    @classmethod
    def step_bytes(cls, cfg: DraftConfig, rows: int, length: int, anchors: int | None, device: torch.device) -> int:
        """The bytes the largest tensors of a forward and backward take at once, on a micro-batch
        of `rows` samples of up to `length` tokens, each anchoring N = min(anchors, length)
        blocks of S slots (`anchors`: the rows --anchors gives such a sample), counting only these: every layer keeps, for the backward, about 6
        hidden-wide and 4 MLP-wide values per block token (rows x S x N; bf16 on CUDA, else
        float32); the slots' states scattered to [rows, length, K, H] and their gathered copy
        and gradient; one loss chunk's draft-vocab logits and float32 temporaries (draft/loss.py
        never holds more); off CUDA, the dense block mask [rows, S*N, length + S*N] of one byte
        an entry, which each layer's attention keeps again in float32 (a CPU step measured 1 + 4
        bytes an entry with one layer, 1 + 4 x 3 with three, within 20%; flex attention on CUDA
        builds no such mask)."""
        slots, layers, blocks = cfg.ttt_steps + 1, cfg.num_hidden_layers, min(anchors or length, length)
        tokens = rows * slots * blocks  # block tokens
        width = 2 if device.type == "cuda" else 4
        activations = layers * tokens * (6 * cfg.hidden_size + 4 * cfg.intermediate_size) * width
        pairs = cfg.ttt_steps * rows * blocks
        states = (rows * length * cfg.ttt_steps + 2 * pairs) * cfg.hidden_size * width
        loss = 5 * 4 * min(pairs, max(1, LOSS_CHUNK // cfg.draft_vocab_size)) * cfg.draft_vocab_size
        mask = 0 if device.type == "cuda" else tokens * (length + slots * blocks) * (1 + 4 * layers)
        return activations + states + loss + mask


def anchor_table(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """rows [B, T] bool, the rows anchoring a block -> anchors [B, N] long (ascending, 0 where
    padded) and valid [B, N] bool; N is the most anchors a row holds (at least 1)."""
    B, T = rows.shape
    position = torch.arange(T, device=rows.device).expand(B, T)
    ordered = torch.where(rows, position, position + T).sort(1).values[:, : max(1, int(rows.sum(1).max()))]
    valid = ordered < T
    return torch.where(valid, ordered, 0), valid


def block_mask(anchor: torch.Tensor, S: int, T: int, causal: bool = False):
    """The visibility of the blocks of anchors [B, N] over T context positions: query (s, n) sees
    context positions <= anchor n and the S block entries of anchor n (`causal`: slots 0..s of
    them). A flex BlockMask on CUDA (built once per batch, for every layer of its kind), else a
    dense [B, 1, S*N, T + S*N] bool mask."""
    if anchor.is_cuda:
        return _block_mask_flex(anchor, S, T, causal)
    return block_mask_dense(anchor, S, T, causal)[:, None]


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask) -> torch.Tensor:
    """q [B, nH, S*N, d] (slot-major block queries), k/v [B, nH, T + S*N, d] (context, then the
    block slot-major), `mask` from `block_mask`: compiled flex attention on CUDA, dense elsewhere."""
    if isinstance(mask, torch.Tensor):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return compiled("dflash-block")(q, k, v, block_mask=mask)


def block_mask_dense(anchor: torch.Tensor, S: int, T: int, causal: bool = False) -> torch.Tensor:
    """[B, S*N, T + S*N] bool: the visibility `block_attention` applies."""
    N = anchor.shape[1]
    q = torch.arange(S * N, device=anchor.device)
    n = q % N  # each query's anchor
    kv = torch.arange(T + S * N, device=anchor.device)
    context = (kv < T) & (kv <= anchor[:, n, None])  # [B, S*N, T + S*N]
    block = (kv >= T) & ((kv - T) % N == n[:, None])  # [S*N, T + S*N]
    if causal:  # slot-major: the entry's slot is (kv - T) // N, the query's q // N
        block &= (kv - T) // N <= (q // N)[:, None]
    return context | block


def _block_mask_flex(anchor: torch.Tensor, S: int, T: int, causal: bool = False):
    """The flex BlockMask of `block_mask_dense`. The mask reads the batch's sizes from tensors,
    not Python ints, so the compiled attention guards on no length: batches of every length
    and anchor count share its compiled variants."""
    B, N = anchor.shape
    context, anchors = (torch.tensor(v, device=anchor.device) for v in (T, N))

    def mask(b, h, q_idx, kv_idx):
        n = q_idx % anchors
        before = (kv_idx < context) & (kv_idx <= anchor[b, n])
        own = (kv_idx >= context) & ((kv_idx - context) % anchors == n)
        if causal:
            own = own & ((kv_idx - context) // anchors <= q_idx // anchors)
        return before | own

    return create_block_mask(mask, B=B, H=None, Q_LEN=S * N, KV_LEN=T + S * N, device=anchor.device)
