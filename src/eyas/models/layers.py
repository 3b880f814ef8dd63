"""Find a decoder-only model's layer stack and final norm without per-family code, and turn
`--layers` into the ids eyas captures.

Layer-id convention (vLLM's): id k < N is the input of decoder layer k (transformers'
`hidden_states[k]`, the pre-norm residual stream); id N is the last layer's output before
the final norm. Both are read with forward *pre*-hooks, so no family-specific code is needed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from eyas.errors import EyasError
from eyas.models.identity import text_config
from eyas.options import AUTO_LAYERS, SPREAD_LAYERS, aux_layer_count

_NORM_NAMES = ("norm", "final_layernorm", "ln_f", "final_norm", "norm_f")


@dataclass
class DecoderParts:
    layers: nn.ModuleList  # the N decoder layers, in order
    norm: nn.Module  # the final norm, whose input is id N

    @property
    def num_layers(self) -> int:
        return len(self.layers)


def decoder_parts(model: nn.Module) -> DecoderParts:
    """The decoder layers are the ModuleList of `num_hidden_layers` modules; the final norm
    sits beside them in the same parent module. The search starts at the text decoder
    (`get_decoder()`), so a multimodal wrapper's vision layers are never candidates."""
    n = text_config(model.config).num_hidden_layers
    root = model.get_decoder() if callable(getattr(model, "get_decoder", None)) else None
    root = root if isinstance(root, nn.Module) else model
    candidates = [
        (name, module) for name, module in root.named_modules()
        if isinstance(module, nn.ModuleList) and len(module) == n and name.split(".")[-1] in ("layers", "h", "blocks")
    ]
    if not candidates:
        raise EyasError(f"Cannot find the {n} decoder layers of {type(model).__name__}; eyas does not support it yet.")
    name, layers = min(candidates, key=lambda c: c[0].count("."))
    parent = root.get_submodule(name.rpartition(".")[0]) if "." in name else root
    for norm_name in _NORM_NAMES:
        norm = getattr(parent, norm_name, None)
        if isinstance(norm, nn.Module):
            return DecoderParts(layers=layers, norm=norm)
    raise EyasError(
        f"Cannot find the final norm of {type(model).__name__} next to {name}; eyas does not support it yet."
    )


def default_aux_ids(num_layers: int) -> tuple[int, ...]:
    ids = (2, num_layers // 2, num_layers - 3)
    if len(set(ids)) != 3 or min(ids) < 0:
        raise EyasError(f"The model has only {num_layers} layers, too few for the default ids; pass --layers.")
    return ids


def spread_aux_ids(count: int, num_layers: int) -> tuple[int, ...]:
    """`count` ids spread evenly from 2 to N-2, rounded: the peers' DFlash heads read target
    layers over the whole depth (SpecForge's Qwen3-8B recipe: outputs of layers 1, 9, 17, 25,
    33 of 36, which are ids 2, 10, 18, 26, 34 here)."""
    lo, hi = 2, num_layers - 2
    if count < 1 or hi < lo or count > hi - lo + 1:
        raise EyasError(f"--layers {SPREAD_LAYERS}{count}: a {num_layers}-layer model has "
                        f"{max(hi - lo + 1, 0)} ids from 2 to N-2 to spread over; ask for 1 to that many.")
    if count == 1:
        return (num_layers // 2,)
    return tuple(int(lo + i * (hi - lo) / (count - 1) + 0.5) for i in range(count))


def resolve_layer_ids(spec: str | list[int] | tuple[int, ...], num_layers: int) -> tuple[int, ...]:
    """Aux ids from `--layers` ("auto", "spread:K" or "2,15,27"), followed by id N, the label source."""
    if spec == AUTO_LAYERS:
        aux = default_aux_ids(num_layers)
    elif isinstance(spec, str) and spec.startswith(SPREAD_LAYERS):
        count = aux_layer_count(spec)
        if count is None:
            raise EyasError(f"--layers {spec!r}: write {SPREAD_LAYERS}K with K a whole number of layers.")
        aux = spread_aux_ids(count, num_layers)
    else:
        try:
            aux = tuple(int(x) for x in spec.split(",")) if isinstance(spec, str) else tuple(int(x) for x in spec)
        except ValueError:
            raise EyasError(f"--layers must be '{AUTO_LAYERS}', '{SPREAD_LAYERS}K' or comma-separated integers, "
                            f"not {spec!r}.") from None
    if not aux:
        raise EyasError("--layers names no layer.")
    bad = [k for k in aux if not 0 <= k < num_layers]
    if bad:
        raise EyasError(
            f"Layer id(s) {bad} out of range: aux ids must lie in 0..{num_layers - 1} for this {num_layers}-layer "
            f"model (id k is the input of decoder layer k; id {num_layers}, the last layer's output, is always added)."
        )
    if len(set(aux)) != len(aux):
        raise EyasError(f"Layer ids {list(aux)} repeat an id.")
    return tuple(sorted(aux)) + (num_layers,)
