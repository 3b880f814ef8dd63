"""The target model during speculative decoding: a transformers causal LM with a KV cache
that verifies a whole draft tree in one forward pass and keeps only the accepted path.

The tree goes in as a custom 4D attention mask (transformers passes a 4D mask through
unchanged, to sdpa and eager alike): each drafted token sees the cached prefix, its
ancestors and itself, at position prefix + depth. The aux hidden states the drafter
needs are read with `eyas.models.states`' forward pre-hooks (vLLM's layer-id convention:
id k is the input of layer k).

Sliding-window layers (Gemma-2/3's mix, Mistral's or Qwen2's windows) keep the cache
transformers' own forward keeps: `DynamicCache(config=...)` holds only the last window - 1
tokens of each sliding layer. Two things differ from plain decoding. The cache records the
whole verification pass until `commit` (transformers' `activate_past_recording`, made for
assisted decoding), so rejected rows never push out tokens the accepted ones still need.
And the tree mask is built per layer type, a sliding layer's row at position p seeing only
keys at positions > p - window (transformers' own rule); a model with several layer types
takes the masks as a dict keyed by type, as its own mask code builds them.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from eyas.errors import EyasError
from eyas.evaluate.tree import DraftTree
from eyas.models.states import hook_layer_inputs

LAYER_TYPES = ("full_attention", "sliding_attention")


class TargetSession:
    """One sequence at a time (batch 1): `prefill`, then `verify` / `commit` per step."""

    def __init__(self, model, aux_layer_ids: tuple[int, ...] = ()):
        self.model = model
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.aux_layer_ids = tuple(aux_layer_ids)
        self.capture_aux = False  # proposers that need no hidden states leave the hooks idle
        self._aux: list[torch.Tensor | None] = [None] * len(self.aux_layer_ids)
        self._handles = hook_layer_inputs(model, self.aux_layer_ids, self._keep)
        self.windows = attention_windows(model.config)
        self.cache: DynamicCache | None = None
        self.length = 0  # tokens seen (a sliding layer caches only its window's last ones)
        self._pending = 0  # rows of the last verification pass, not yet committed

    def _keep(self, slot: int, hidden: torch.Tensor) -> None:
        if self.capture_aux:
            self._aux[slot] = hidden  # [1, T, H]

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, mask):
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
        for layer in self.cache.layers:
            if layer.is_sliding:
                if not hasattr(layer, "activate_past_recording"):
                    raise EyasError("eyas eval of a sliding-window target needs a transformers whose sliding cache can "
                                    "keep a verification pass (DynamicSlidingWindowLayer.activate_past_recording, "
                                    "as in 5.19); upgrade transformers.")
                layer.activate_past_recording()  # a sliding layer keeps every row until `commit`
        T = len(prompt_ids)
        logits, aux = self._forward(prompt_ids, torch.arange(T), None)  # the model's own masks
        self.length = T
        self._keep_windows()
        return logits[-1], aux

    def verify(self, root: int, tree: DraftTree):
        """Run the root token and every drafted node in one pass.

        Returns logits [M + 1, V] (row 0: after the root, row i + 1: after node i) and the
        aux states [M + 1, L, H] of those rows. The cache then holds all M + 1 rows until
        `commit` keeps the accepted ones.
        """
        ids = torch.tensor([root, *tree.tokens], dtype=torch.long)
        self._pending = len(ids)
        positions = self.length + torch.tensor([0, *tree.depths()], dtype=torch.long)
        mask = None
        if len(tree):
            masks = {kind: self._tree_mask(tree, positions, window) for kind, window in self.windows.items()}
            mask = next(iter(masks.values())) if len(masks) == 1 else masks
        return self._forward(ids, positions, mask)

    def _tree_mask(self, tree: DraftTree, positions: torch.Tensor, window: int | None) -> torch.Tensor:
        """Additive mask [1, 1, M + 1, cached + M + 1] over the keys a layer of this kind sees:
        its cached prefix (all of it, or a window's last window - 1 tokens), then the rows."""
        cached = self.length if window is None else min(self.length, window - 1)
        keys = torch.cat([torch.arange(self.length - cached, self.length), positions])  # key positions
        visible = torch.cat([torch.ones(len(positions), cached, dtype=torch.bool), tree.ancestor_mask()], dim=1)
        if window is not None:
            visible &= positions[:, None] - keys[None, :] < window
        mask = torch.zeros(visible.shape, dtype=self.dtype)
        mask.masked_fill_(~visible, torch.finfo(self.dtype).min)
        return mask[None, None].to(self.device)

    def commit(self, rows: list[int]) -> None:
        """Keep the verified rows `rows` (0 = the root, then the accepted nodes, in path order)."""
        chain = rows == list(range(len(rows)))
        for layer in self.cache.layers:
            cached = layer.keys.shape[-2] - self._pending  # entries from before the verification pass
            if chain:  # a prefix of the rows: drop the tail
                end = cached + len(rows)
                layer.keys, layer.values = layer.keys[..., :end, :], layer.values[..., :end, :]
            else:
                keep = torch.cat([torch.arange(cached), cached + torch.tensor(rows, dtype=torch.long)]).to(self.device)
                layer.keys = layer.keys.index_select(-2, keep)  # [1, n_kv, cached + len(rows), d]
                layer.values = layer.values.index_select(-2, keep)
        self.length += len(rows)
        self._pending = 0
        self._keep_windows()

    def _keep_windows(self) -> None:
        """Cut each sliding layer back to the window - 1 tokens a later query can still see."""
        for layer in self.cache.layers:
            if layer.is_sliding:
                start = max(0, layer.keys.shape[-2] - (layer.sliding_window - 1))
                layer.keys, layer.values = layer.keys[..., start:, :], layer.values[..., start:, :]
                layer.cumulative_length = self.length


def attention_windows(config) -> dict[str, int | None]:
    """Layer type -> its window (None: full attention), read as transformers' `DynamicCache`
    reads the config; refuses other kinds of layer (chunked, linear attention, ...)."""
    text = config.get_text_config(decoder=True)
    layers = DynamicCache(config=config).layers
    types = getattr(text, "layer_types", None)
    if types is None:  # one kind for all layers, as transformers infers it
        kind = ("sliding_attention" if getattr(text, "sliding_window", None) is not None else
                "chunked_attention" if getattr(text, "attention_chunk_size", None) is not None else "full_attention")
        types = [kind] * len(layers)
    unknown = sorted(set(types) - set(LAYER_TYPES))
    if unknown:
        raise EyasError(f"eyas eval runs targets with full and sliding-window attention layers; this one also has "
                        f"{unknown}.")
    windows: dict[str, int | None] = {}
    for kind, layer in zip(types, layers):
        window = layer.sliding_window if layer.is_sliding else None
        if windows.setdefault(kind, window) != window:
            raise EyasError(f"eyas eval needs one window per layer type; this target's {kind} layers have several.")
    return windows or {"full_attention": None}  # no layers known yet: transformers' cache makes full ones
