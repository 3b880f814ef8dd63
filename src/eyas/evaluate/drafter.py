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
from eyas.models.slots import SlotCache
from eyas.evaluate.tree import DraftTree
from eyas.models.graphs import Recorder, bucket

EXTEND_ROWS = 32  # the most entries a commit replays as a graph (a step's accepted tokens and its own)


class DrafterSession:
    """On CUDA, a greedy chain (all its steps), a tree's levels, a commit of up to EXTEND_ROWS
    entries and a P-EAGLE block each replay a CUDA graph (models/graphs.py); the prompt's
    commit and sampled chains run eagerly, as everything does on the CPU. Every pass writes its entries
    into one `SlotCache` (entry i at slot i; drafted entries after the committed ones, where
    the next commit overwrites them) and reads all of it through a mask."""

    def __init__(self, drafter: Eagle3Drafter, capacity: int = 2048, graphs: bool | None = None):
        self.m = drafter
        self.device = drafter.fc.weight.device
        self.cache = SlotCache(capacity)
        self.graphs = Recorder(self.device, graphs is not False, f"the {drafter.config.kind.name} drafter")
        self._slot_ids = torch.arange(capacity, device=self.device)  # [capacity], read by the graphs
        self.length = 0  # committed entries
        self.hidden: torch.Tensor | None = None  # [H] output of the last committed entry
        self.logits: torch.Tensor | None = None  # [Vd] its draft-vocabulary logits

    def reset(self) -> None:
        self.length = 0
        self.hidden = self.logits = None

    def _reserve(self, entries: int) -> None:
        """Room for `entries` more after the committed ones."""
        if self.cache.reserve(self.length + entries):
            self._slot_ids = torch.arange(self.cache.capacity, device=self.device)
            self.graphs.drop()

    def _layer(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
               visible: torch.Tensor) -> torch.Tensor:
        """One pass of the decoder layers for new entries, written at `slots`.

        tokens [n], hidden [n, H], positions and slots [n] (device); visible [n, W] bool over
        the cache's first W slots (all of them in a recorded pass), the new ones included.
        Returns outputs [n, H].
        """
        m = self.m
        x, residual = m.midlayer.pre_attention(m.embed_tokens(tokens)[None], hidden[None])
        cos, sin = m.rope(x, positions[None])
        self.cache.aim(slots, visible.shape[-1])
        layers = [m.midlayer, *m.stack]
        for n, layer in enumerate(layers):
            attn = layer.self_attn
            q, k, v = attn.cache_qkv(x, cos, sin)  # q [1, nH, n, d]; k, v [1, nH or 1 (MLA's latent), n, d]
            k, v = self.cache.update(k, v, n)  # [1, ., W, d]
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=attn.scale, enable_gqa=True)
            h = layer.post_attention(attn.merge_cached(out), residual)  # [1, n, H]
            if n + 1 < len(layers):
                x, residual = layers[n + 1].pre_attention(h)
        return h[0]

    def _rows(self, start: torch.Tensor, n: int, width: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Entries start .. start + n - 1 (start [1], device), each seeing every slot up to its
        own: their slots [n] and visibility [n, width] (None: the whole cache, as recorded)."""
        slots = start + torch.arange(n, device=self.device)
        return slots, self._slot_ids[None, :width] <= slots[:, None]

    def _commit(self, tokens: torch.Tensor, aux: torch.Tensor, start: torch.Tensor, last: torch.Tensor,
                width: int | None = None):
        """Entries for tokens [n] and the target's aux [n, L, H] from slot `start` [1]; the
        outputs of entry `last` [1]: logits [Vd] and the next step's hidden [H]."""
        slots, visible = self._rows(start, len(tokens), width)
        h = self._layer(tokens, self.m.combine(aux), slots, slots, visible)
        return self.m.outputs(h.index_select(0, last)[0])

    @torch.inference_mode()
    def extend(self, tokens: torch.Tensor, aux: torch.Tensor) -> None:
        """Commit entries: tokens [n] are the tokens at positions S + 1 .. S + n, aux
        [n, L, H] the target's aux states at S .. S + n - 1."""
        n = len(tokens)
        rows = bucket(n, EXTEND_ROWS)
        self._reserve(rows or n)
        tokens, aux = tokens.to(self.device), aux.to(device=self.device, dtype=self.m.fc.weight.dtype)
        start, last = torch.tensor([self.length], device=self.device), torch.tensor([n - 1], device=self.device)
        out = None
        if rows:  # padding entries after the real ones: later commits overwrite them
            pad = rows - n
            inputs = {"tokens": torch.cat([tokens, tokens.new_zeros(pad)]), "aux": torch.cat([aux, aux.new_zeros(pad, *aux.shape[1:])]),
                      "start": start, "last": last}
            out = self.graphs.run(("extend", rows), inputs, lambda s: self._commit(s["tokens"], s["aux"], s["start"],
                                                                                  s["last"]))
        logits, hidden = [t.clone() for t in out] if out is not None else \
            self._commit(tokens, aux, start, last, self.length + n)
        self.logits, self.hidden = logits, hidden
        self.length += n

    def _block(self, start: torch.Tensor, n: int, width: int | None = None) -> torch.Tensor:
        """P-EAGLE's n masked entries from slot `start` -> their logits [n, Vd]."""
        m = self.m
        slots, visible = self._rows(start, n, width)
        h = self._layer(torch.full((n,), m.config.mask_token_id, device=self.device), m.mask_state().expand(n, -1),
                        slots, slots, visible)
        return m.outputs(h)[0]

    @torch.inference_mode()
    def parallel_block(self, depth: int) -> torch.Tensor:
        """P-EAGLE (draft/peagle.py): [depth, Vd], slot 0's logits (the last committed entry's) and
        those of depth-1 masked entries (the mask token and `mask_state()` at the next positions,
        causal among themselves) from one pass of the layer; they are never committed."""
        n = depth - 1
        if n == 0:
            return self.logits[None]
        self._reserve(n)
        start = torch.tensor([self.length], device=self.device)
        out = self.graphs.run(("block", n), {"start": start}, lambda s: self._block(s["start"], n))
        return torch.cat([self.logits[None], out.clone() if out is not None else self._block(start, n, self.length + n)])

    def _to_target(self, draft_ids: torch.Tensor) -> list[int]:
        return self.m.draft_to_target(draft_ids).tolist()

    def _greedy_chain(self, start: torch.Tensor, logits: torch.Tensor, hidden: torch.Tensor, depth: int,
                      width: int | None = None) -> torch.Tensor:
        """`depth` argmax drafts from the last committed entry's logits [Vd] and hidden [H],
        each fed at the slot and position after the last: target ids [depth]."""
        drafted = []
        for d in range(1, depth + 1):
            token = self.m.draft_to_target(logits.argmax(-1, keepdim=True))  # [1]
            drafted.append(token)
            if d == depth:
                break
            slots, visible = self._rows(start + (d - 1), 1, width)
            h = self._layer(token, hidden[None], slots, slots, visible)
            logits, hidden = self.m.outputs(h[0])
        return torch.cat(drafted)

    @torch.inference_mode()
    def chain(self, depth: int, temperature: float = 0.0, generator: torch.Generator | None = None) -> DraftTree:
        """`depth` tokens, each the argmax (temperature 0) or a sample of the drafter's
        distribution at `temperature`; sampled nodes carry that distribution."""
        self._reserve(depth)
        start = torch.tensor([self.length], device=self.device)
        if temperature <= 0:
            inputs = {"start": start, "logits": self.logits, "hidden": self.hidden}
            out = self.graphs.run(("chain", depth), inputs, lambda s: self._greedy_chain(s["start"], s["logits"],
                                                                                      s["hidden"], depth))
            if out is None:
                out = self._greedy_chain(start, self.logits, self.hidden, depth, self.length + depth)
            return DraftTree.chain(out.tolist())
        tree = DraftTree()
        logits, hidden = self.logits, self.hidden
        for d in range(1, depth + 1):
            draft_id, dense = pick(self.m, logits, temperature, generator)
            tree.add(self._to_target(draft_id)[0], d - 2, dense)
            if d == depth:
                break
            slots, visible = self._rows(start + (d - 1), 1, self.length + depth)
            h = self._layer(self.m.draft_to_target(draft_id), hidden[None], slots, slots, visible)
            logits, hidden = self.m.outputs(h[0])
        return tree

    def _tree_nodes(self, start: torch.Tensor, logits: torch.Tensor, hidden: torch.Tensor, depth: int, k: int,
                    length: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every node an EAGLE-2 tree of `depth` levels and `k` children per fed node proposes,
        in creation order: the k best children of the last committed entry (logits [Vd], hidden
        [H]), then per level the k children of each of the k best-scored nodes of the level
        before (k * k candidates), each fed level one pass of k entries after slot `start` [1].
        Fixed shapes and no host reads, so a GPU replays it as one graph. `length` (the host's
        committed count, eager only) narrows each pass to the slots it sees; None reads the
        whole cache, as recorded. Returns target ids [N], parents [N] (-1: the root) and scores
        [N] (cumulative log-probabilities), N = k + (depth - 1) * k * k."""
        m, dev = self.m, self.device
        score, ids = torch.log_softmax(logits.float(), -1).topk(k)  # [k]: the frontier's scores, as fed next
        tok = m.draft_to_target(ids)  # [k]: the frontier's target ids
        tokens, parents, scores = [tok], [torch.full((k,), -1, device=dev)], [score]
        frontier = torch.arange(k, device=dev)  # its node numbers
        fed_total = k * (depth - 1)
        ancestors = torch.zeros(k, max(fed_total, 1), dtype=torch.bool, device=dev)  # [k, fed]: a row's fed ancestors
        hid = hidden[None].expand(k, -1)  # [k, H]: each frontier node's parent output
        rows = torch.arange(k, device=dev)
        first = k
        for d in range(1, depth):
            fed = k * (d - 1)
            slots = start + fed + rows  # [k]
            slot_ids = self._slot_ids[None, :None if length is None else length + fed + k]  # [1, W]
            rel = slot_ids - start  # [1, W]
            seen = ancestors.gather(1, rel.clamp(0, fed_total - 1).expand(k, -1)) & (rel >= 0) & (rel < fed)
            visible = (rel < 0) | seen | (slot_ids == slots[:, None])  # [k, W]
            h = self._layer(tok, hid, (start - 1 + d).expand(k), slots, visible)
            level_logits, fed_back = m.outputs(h)  # [k, Vd], [k, H]
            lp, ids = torch.log_softmax(level_logits.float(), -1).topk(k)  # [k, k]
            cand = (score[:, None] + lp).flatten()  # [k * k]
            level = m.draft_to_target(ids.flatten())  # [k * k]
            tokens.append(level)
            parents.append(frontier[:, None].expand(k, k).flatten())
            scores.append(cand)
            best = cand.topk(k).indices  # [k]: the next frontier, of this level's candidates
            row = best // k  # each one's parent, as a row of this level
            ancestors = ancestors.index_select(0, row).scatter(1, (fed + row)[:, None], True)
            hid, tok, score = fed_back.index_select(0, row), level.index_select(0, best), cand.index_select(0, best)
            frontier = first + best
            first += k * k
        return torch.cat(tokens), torch.cat(parents), torch.cat(scores)

    @torch.inference_mode()
    def tree(self, depth: int, top_k: int, max_nodes: int) -> DraftTree:
        """EAGLE-2 dynamic tree: expand the `top_k` most probable frontier nodes per level
        (score: the drafter's cumulative log-probability), each proposing its `top_k` best
        children; after `depth` levels keep the `max_nodes` best nodes (ancestors included).
        The levels run on the device (one graph on a GPU, `_tree_nodes`); the host reads the
        nodes once and picks the kept ones."""
        k = min(top_k, len(self.logits))
        self._reserve(k * (depth - 1))
        start = torch.tensor([self.length], device=self.device)
        inputs = {"start": start, "logits": self.logits, "hidden": self.hidden}
        out = self.graphs.run(("tree", depth, k), inputs, lambda s: self._tree_nodes(s["start"], s["logits"],
                                                                                 s["hidden"], depth, k))
        if out is None:
            out = self._tree_nodes(start, self.logits, self.hidden, depth, k, self.length)
        tokens, parents, scores = (t.tolist() for t in out)
        keep = set(sorted(range(len(tokens)), key=lambda n: -scores[n])[:max_nodes])
        for n in list(keep):
            keep |= _ancestors(parents, n)
        order = sorted(keep)  # creation order: parents first
        index = {n: i for i, n in enumerate(order)}
        out_tree = DraftTree()
        for n in order:
            out_tree.add(tokens[n], index[parents[n]] if parents[n] >= 0 else -1)
        return out_tree


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
