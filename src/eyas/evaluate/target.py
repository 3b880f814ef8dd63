"""The target model during speculative decoding: a transformers causal LM with a KV cache
that verifies a whole draft tree in one forward pass and keeps only the accepted path.

The tree goes in as a custom 4D attention mask (transformers passes a 4D mask through
unchanged, to sdpa and eager alike): each drafted token sees the cached prefix, its
ancestors and itself, at position prefix + depth. The aux hidden states the drafter
needs are read with forward pre-hooks on the decoder layers (vLLM's layer-id convention:
id k is the input of layer k).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from eyas.errors import EyasError
from eyas.evaluate.tree import DraftTree
from eyas.models import decoder_parts


class TargetSession:
    """One sequence at a time (batch 1): `prefill`, then `verify` / `commit` per step."""

    def __init__(self, model, aux_layer_ids: tuple[int, ...] = ()):
        self.model = model
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.aux_layer_ids = tuple(aux_layer_ids)
        self.capture_aux = False  # proposers that need no hidden states leave the hooks idle
        self._aux: list[torch.Tensor | None] = [None] * len(self.aux_layer_ids)
        self._handles = []
        layers = decoder_parts(model).layers
        for slot, k in enumerate(self.aux_layer_ids):
            self._handles.append(layers[k].register_forward_pre_hook(self._hook(slot), with_kwargs=True))
        self.cache: DynamicCache | None = None
        self.length = 0  # tokens in the cache

    def _hook(self, slot: int):
        def hook(module, args, kwargs):
            if self.capture_aux:
                self._aux[slot] = args[0] if args else kwargs["hidden_states"]  # [1, T, H]
        return hook

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor | None):
        """input_ids, position_ids [T] -> logits [T, V] float32, aux [T, L, H] or None."""
        out = self.model(
            input_ids=input_ids[None].to(self.device), position_ids=position_ids[None].to(self.device),
            attention_mask=mask, past_key_values=self.cache, use_cache=True,
        )
        aux = torch.stack([a[0] for a in self._aux], dim=1) if self.capture_aux and self.aux_layer_ids else None
        self._aux = [None] * len(self.aux_layer_ids)
        return out.logits[0].float(), aux

    def prefill(self, prompt_ids: torch.Tensor):
        """prompt_ids [T] -> logits of the last position [V], aux states [T, L, H] or None."""
        self.cache = DynamicCache(config=self.model.config)
        if any(getattr(layer, "is_sliding", False) for layer in self.cache.layers):
            raise EyasError("eyas eval does not support sliding-window attention models yet.")
        T = len(prompt_ids)
        logits, aux = self._forward(prompt_ids, torch.arange(T), None)
        self.length = T
        return logits[-1], aux

    def verify(self, root: int, tree: DraftTree):
        """Run the root token and every drafted node in one pass.

        Returns logits [M + 1, V] (row 0: after the root, row i + 1: after node i) and the
        aux states [M + 1, L, H] of those rows. The cache then holds all M + 1 rows until
        `commit` keeps the accepted ones.
        """
        ids = torch.tensor([root, *tree.tokens], dtype=torch.long)
        positions = self.length + torch.tensor([0, *tree.depths()], dtype=torch.long)
        mask = None
        if len(tree):
            visible = torch.cat([torch.ones(len(tree) + 1, self.length, dtype=torch.bool), tree.ancestor_mask()], dim=1)
            mask = torch.zeros(visible.shape, dtype=self.dtype)
            mask.masked_fill_(~visible, torch.finfo(self.dtype).min)
            mask = mask[None, None].to(self.device)  # [1, 1, M + 1, prefix + M + 1], additive
        return self._forward(ids, positions, mask)

    def commit(self, rows: list[int]) -> None:
        """Keep the verified rows `rows` (0 = the root, then the accepted nodes, in path order)."""
        end = self.length + len(rows)
        if rows == list(range(len(rows))):  # a chain prefix: drop the tail
            for layer in self.cache.layers:
                layer.keys, layer.values = layer.keys[..., :end, :], layer.values[..., :end, :]
        else:
            keep = torch.cat([torch.arange(self.length), self.length + torch.tensor(rows, dtype=torch.long)])
            keep = keep.to(self.device)
            for layer in self.cache.layers:
                layer.keys = layer.keys.index_select(-2, keep)  # [1, n_kv, end, d]
                layer.values = layer.values.index_select(-2, keep)
        self.length = end
