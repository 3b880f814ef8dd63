"""The EAGLE-3 drafter during decoding: its own KV cache over the committed context, chain
drafting, and EAGLE-2-style dynamic trees.

Cache entry i pairs the token at i + 1 with the target's aux states at i (rotary position
i), exactly as training-time test step 0 does; its output predicts token i + 2. A drafted
node at depth d is fed at position (context length - 1) + d with its parent's output as
hidden state, and attends to the whole context plus its own ancestors: training-time test
steps 1..k, decoded. Drafted entries are thrown away after each draft; the target's states
for the accepted tokens replace them (`extend`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from eyas.draft import Eagle3Drafter
from eyas.evaluate.tree import DraftTree


Cache = list[tuple[torch.Tensor, torch.Tensor]]  # per decoder layer: keys, values [1, nH, S, d]


class DrafterSession:
    def __init__(self, drafter: Eagle3Drafter):
        self.m = drafter
        self.cache: Cache | None = None  # per layer, the committed context's keys and values (MLA: its latent)
        self.hidden: torch.Tensor | None = None  # [H] output of the last context entry
        self.logits: torch.Tensor | None = None  # [Vd] its draft-vocabulary logits

    @property
    def length(self) -> int:
        return 0 if self.cache is None else self.cache[0][0].shape[-2]

    def reset(self) -> None:
        self.cache = self.hidden = self.logits = None

    def _layer(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, cache: Cache | None,
               visible: torch.Tensor) -> tuple[torch.Tensor, Cache]:
        """One pass of the decoder layers for new entries.

        tokens [n], hidden [n, H], positions [n]; cache: per layer, keys/values [1, nH, S, d]
        already cached; visible [n, S + n] bool. Returns outputs [n, H] and the cache with the
        new entries appended.
        """
        m = self.m
        device = m.fc.weight.device
        x, residual = m.midlayer.pre_attention(m.embed_tokens(tokens.to(device))[None], hidden[None])
        cos, sin = m.rope(x, positions[None].to(device))
        grown, layers = [], [m.midlayer, *m.stack]
        for n, layer in enumerate(layers):
            attn = layer.self_attn
            q, k, v = attn.cache_qkv(x, cos, sin)  # q [1, nH, n, d]; k, v [1, nH or 1 (MLA's latent), n, d]
            if cache is not None:
                k, v = torch.cat([cache[n][0], k], dim=-2), torch.cat([cache[n][1], v], dim=-2)
            grown.append((k, v))
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible.to(device), scale=attn.scale,
                                                 enable_gqa=True)
            h = layer.post_attention(attn.merge_cached(out), residual)  # [1, n, H]
            if n + 1 < len(layers):
                x, residual = layers[n + 1].pre_attention(h)
        return h[0], grown

    @torch.inference_mode()
    def extend(self, tokens: torch.Tensor, aux: torch.Tensor) -> None:
        """Commit entries: tokens [n] are the tokens at positions S + 1 .. S + n, aux
        [n, L, H] the target's aux states at S .. S + n - 1."""
        S, n = self.length, len(tokens)
        hidden = self.m.combine(aux.to(self.m.fc.weight.dtype))  # [n, H]
        visible = torch.ones(n, S + n, dtype=torch.bool).tril(S)
        h, self.cache = self._layer(tokens, hidden, torch.arange(S, S + n), self.cache, visible)
        logits, hidden = self.m.outputs(h[-1])
        self.logits, self.hidden = logits, hidden

    @torch.inference_mode()
    def parallel_block(self, depth: int) -> torch.Tensor:
        """P-EAGLE (draft/peagle.py): [depth, Vd], slot 0's logits (the last committed entry's) and
        those of depth-1 masked entries (the mask token and `mask_state()` at the next positions,
        causal among themselves) from one pass of the layer; nothing is cached."""
        m, S, n = self.m, self.length, depth - 1
        if n == 0:
            return self.logits[None]
        visible = torch.ones(n, S + n, dtype=torch.bool).tril(S)
        h, _ = self._layer(torch.full((n,), m.config.mask_token_id), m.mask_state().expand(n, -1),
                           torch.arange(S, S + n), self.cache, visible)
        return torch.cat([self.logits[None], m.outputs(h)[0]])

    def _to_target(self, draft_ids: torch.Tensor) -> list[int]:
        return self.m.draft_to_target(draft_ids).tolist()

    @torch.inference_mode()
    def chain(self, depth: int, temperature: float = 0.0, generator: torch.Generator | None = None) -> DraftTree:
        """`depth` tokens, each the argmax (temperature 0) or a sample of the drafter's
        distribution at `temperature`; sampled nodes carry that distribution."""
        tree = DraftTree()
        logits, hidden, cache = self.logits, self.hidden, self.cache
        S = self.length
        for d in range(1, depth + 1):
            draft_id, dense = pick(self.m, logits, temperature, generator)
            tree.add(self._to_target(draft_id)[0], d - 2, dense)
            if d == depth:
                break
            visible = torch.ones(1, S + d, dtype=torch.bool)
            h, cache = self._layer(self.m.draft_to_target(draft_id), hidden[None], torch.tensor([S - 1 + d]),
                                   cache, visible)
            logits, hidden = self.m.outputs(h[0])
        return tree

    @torch.inference_mode()
    def tree(self, depth: int, top_k: int, max_nodes: int) -> DraftTree:
        """EAGLE-2 dynamic tree: expand the `top_k` most probable frontier nodes per level
        (score: the drafter's cumulative log-probability), each proposing its `top_k` best
        children; after `depth` levels keep the `max_nodes` best nodes (ancestors included)."""
        S = self.length
        k_eff = min(top_k, len(self.logits))
        lp, ids = torch.log_softmax(self.logits.float(), -1).topk(k_eff)
        tokens, parents = self._to_target(ids), [-1] * k_eff
        scores = lp.tolist()
        frontier = list(range(k_eff))  # nodes to feed next
        hidden_of: dict[int, torch.Tensor] = {-1: self.hidden}
        fed: list[int] = []  # node per drafted cache entry
        cache = self.cache
        for d in range(1, depth):
            visible = torch.zeros(len(frontier), S + len(fed) + len(frontier), dtype=torch.bool)
            visible[:, :S] = True
            for r, node in enumerate(frontier):
                anc = _ancestors(parents, node)
                visible[r, [S + j for j, f in enumerate(fed) if f in anc]] = True
                visible[r, S + len(fed) + r] = True
            hid = torch.stack([hidden_of[parents[n]] for n in frontier])  # [F, H]
            h, cache = self._layer(torch.tensor([tokens[n] for n in frontier]), hid,
                                   torch.full((len(frontier),), S - 1 + d), cache, visible)
            fed += frontier
            logits, fed_back = self.m.outputs(h)  # [F, Vd], [F, H]
            for r, node in enumerate(frontier):
                hidden_of[node] = fed_back[r]
            lp, ids = torch.log_softmax(logits.float(), -1).topk(k_eff)  # [F, k]
            cand = (torch.tensor([scores[n] for n in frontier], device=lp.device)[:, None] + lp).flatten()
            first = len(tokens)
            tokens += self._to_target(ids.flatten())
            parents += [frontier[i // k_eff] for i in range(len(cand))]
            scores += cand.tolist()
            frontier = [first + i for i in cand.topk(min(k_eff, len(cand))).indices.tolist()]
        keep = set(sorted(range(len(tokens)), key=lambda n: -scores[n])[:max_nodes])
        for n in list(keep):
            keep |= _ancestors(parents, n)
        order = sorted(keep)  # creation order: parents first
        index = {n: i for i, n in enumerate(order)}
        out = DraftTree()
        for n in order:
            out.add(tokens[n], index[parents[n]] if parents[n] >= 0 else -1)
        return out


def pick(m, logits: torch.Tensor, temperature: float, generator: torch.Generator | None):
    """logits [Vd] -> the draft id [1]: the argmax (temperature 0, proposal None) or a sample of
    the drafter's distribution at `temperature`, returned as the proposal over the target vocab [V]."""
    if temperature <= 0:
        return logits.argmax(-1, keepdim=True), None
    q = torch.softmax(logits.float() / temperature, dim=-1)  # [Vd]
    draft_id = torch.multinomial(q, 1, generator=generator)
    dense = torch.zeros(m.config.vocab_size, dtype=q.dtype, device=q.device)
    dense[m.draft_to_target(torch.arange(len(q), device=q.device))] = q
    return draft_id, dense


def _ancestors(parents: list[int], node: int) -> set[int]:
    out = set()
    while parents[node] >= 0:
        node = parents[node]
        out.add(node)
    return out
