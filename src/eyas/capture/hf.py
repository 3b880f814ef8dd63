"""The transformers capture backend: forward pre-hooks on the decoder layers and the
final norm, never `output_hidden_states=True` (which keeps every layer alive).

The final norm's pre-hook also stops the forward: the norm and lm_head (a [T, V] matmul)
are never computed.
"""

from __future__ import annotations

import torch

from eyas.data.prepared import PreparedSample
from eyas.models import decoder_parts, load_target, model_identity, resolve_layer_ids


class _StopForward(Exception):
    """Raised by the final-norm pre-hook: everything needed has been captured."""


class HFCapturer:
    """Runs a transformers causal LM and returns the states at `layer_ids` for each sample."""

    def __init__(self, model: str, layers: str = "auto", dtype: str = "float32", device: str = "cpu"):
        self.model, self.tokenizer = load_target(model, dtype=dtype, device=device)
        self.device = torch.device(device)
        self.identity = model_identity(model, self.model.config, self.tokenizer)
        parts = decoder_parts(self.model)
        self.layer_ids = resolve_layer_ids(layers, parts.num_layers)
        self.hidden_size = self.identity.hidden_size
        self._out: torch.Tensor | None = None  # [B, T, L, H] filled by the hooks
        for slot, k in enumerate(self.layer_ids):
            module = parts.norm if k == parts.num_layers else parts.layers[k]
            module.register_forward_pre_hook(self._hook(slot, last=k == parts.num_layers), with_kwargs=True)

    def _hook(self, slot: int, last: bool):
        def hook(module, args, kwargs):
            if self._out is None:  # a forward outside capture_padded (e.g. generation)
                return None
            hidden = args[0] if args else kwargs["hidden_states"]  # [B, T, H]
            self._out[:, :, slot].copy_(hidden)
            if last:
                raise _StopForward
        return hook

    @torch.inference_mode()
    def capture_padded(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """input_ids, attention_mask [B, T] (right-padded) -> states [B, T, L, H] on the device."""
        B, T = input_ids.shape
        self._out = torch.empty(B, T, len(self.layer_ids), self.hidden_size, dtype=self.model.dtype, device=self.device)
        try:
            self.model(input_ids=input_ids.to(self.device), attention_mask=attention_mask.to(self.device), use_cache=False)
        except _StopForward:
            pass
        out, self._out = self._out, None
        return out

    def capture(self, batch: list[PreparedSample]) -> list[torch.Tensor]:
        """One padded forward for the batch -> per sample [T_i, L, H] on the device."""
        lengths = [len(s.input_ids) for s in batch]
        T = max(lengths)
        input_ids = torch.zeros(len(batch), T, dtype=torch.long)
        attention_mask = torch.zeros(len(batch), T, dtype=torch.long)
        for b, s in enumerate(batch):
            input_ids[b, : lengths[b]] = s.input_ids
            attention_mask[b, : lengths[b]] = 1
        out = self.capture_padded(input_ids, attention_mask)
        return [out[b, : lengths[b]] for b in range(len(batch))]

    def close(self) -> None:
        self.model = None
