"""The transformers capture backend: the target's states at the layer ids, read by
`eyas.models.states` (forward pre-hooks that stop at the final norm), per sample."""

from __future__ import annotations

import torch

from eyas.data.prepared import PreparedSample
from eyas.models.states import TargetStates


class HFCapturer(TargetStates):
    """Runs a transformers causal LM and returns the states at `layer_ids` for each sample."""

    def capture(self, batch: list[PreparedSample]) -> list[torch.Tensor]:
        """One padded forward for the batch -> per sample [T_i, L, H] on the device."""
        lengths = [len(s.input_ids) for s in batch]
        T = max(lengths)
        input_ids = torch.zeros(len(batch), T, dtype=torch.long)
        attention_mask = torch.zeros(len(batch), T, dtype=torch.long)
        for b, s in enumerate(batch):
            input_ids[b, : lengths[b]] = s.input_ids
            attention_mask[b, : lengths[b]] = 1
        out = self.states(input_ids, attention_mask)
        return [out[b, : lengths[b]] for b in range(len(batch))]
