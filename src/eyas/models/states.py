"""A target's hidden states at eyas's layer ids (see layers.py), read with forward pre-hooks:
one implementation for capture, online training and eval. Never `output_hidden_states=True`,
which keeps every layer's states alive.

When id N (the final norm's input) is asked for, its hook stops the forward there: the norm
and lm_head (a [T, V] matmul) are never computed.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.utils.hooks import RemovableHandle

from eyas.errors import EyasError
from eyas.models.identity import model_identity
from eyas.models.layers import decoder_parts, resolve_layer_ids
from eyas.models.load import load_target
from eyas.models.resolve import resolve_model
from eyas.options import AUTO_LAYERS


def hook_layer_inputs(model, layer_ids: tuple[int, ...],
                      sink: Callable[[int, torch.Tensor], None]) -> list[RemovableHandle]:
    """Call `sink(slot, hidden [B, T, H])` with the state at `layer_ids[slot]` whenever a forward
    reaches it: id k < N is the input of decoder layer k, id N the final norm's input once the
    last decoder layer has run (a family may call the same norm module earlier too: NanoChat
    normalises its embeddings with it before the first layer)."""
    parts = decoder_parts(model)
    last_ran = [False]  # since the final norm last took id N

    def after_last_layer(module, args, output):
        last_ran[0] = True

    def hook_for(slot: int, k: int):
        def hook(module, args, kwargs):
            if k == parts.num_layers:
                if not last_ran[0]:
                    return
                last_ran[0] = False
            hidden = args[0] if args else kwargs["hidden_states"]
            if hidden.dim() != 3:
                raise EyasError(f"{type(model).__name__} passes states of shape {tuple(hidden.shape)} between its "
                                f"layers, not [batch, tokens, hidden] (several residual streams): eyas cannot capture "
                                f"them; it does not support this model family.")
            sink(slot, hidden)
        return hook

    handles = [(parts.norm if k == parts.num_layers else parts.layers[k]).register_forward_pre_hook(
        hook_for(slot, k), with_kwargs=True) for slot, k in enumerate(layer_ids)]
    if parts.num_layers in layer_ids:
        handles.append(parts.layers[-1].register_forward_hook(after_last_layer))
    return handles


class _StopForward(Exception):
    """Raised by the final-norm pre-hook: everything needed has been read."""


class TargetStates:
    """A transformers causal LM that returns its states at `layer_ids` for a padded batch."""

    def __init__(self, model: str, layers: str = AUTO_LAYERS, dtype: str = "float32", device: str = "cpu"):
        self.model, self.tokenizer = load_target(model, dtype=dtype, device=device)
        self.device = torch.device(device)
        self.identity = model_identity(model, self.model.config, self.tokenizer, resolve_model(model))
        self.num_layers = decoder_parts(self.model).num_layers
        self.layer_ids = resolve_layer_ids(layers, self.num_layers)
        self.hidden_size = self.identity.hidden_size
        self._out: torch.Tensor | None = None  # [B, T, L, H] filled by the hooks
        hook_layer_inputs(self.model, self.layer_ids, self._keep)

    def _keep(self, slot: int, hidden: torch.Tensor) -> None:
        if self._out is None:  # a forward outside `states` (e.g. generation)
            return
        self._out[:, :, slot].copy_(hidden)
        if self.layer_ids[slot] == self.num_layers:
            raise _StopForward

    @torch.inference_mode()
    def states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """input_ids, attention_mask [B, T] (right-padded) -> states [B, T, L, H] on the device."""
        B, T = input_ids.shape
        self._out = torch.empty(B, T, len(self.layer_ids), self.hidden_size, dtype=self.model.dtype, device=self.device)
        try:
            self.model(input_ids=input_ids.to(self.device), attention_mask=attention_mask.to(self.device), use_cache=False)
        except _StopForward:
            pass
        out, self._out = self._out, None
        return out

    def close(self) -> None:
        self.model = None
