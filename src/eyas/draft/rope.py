"""The drafter's rotary settings, taken from the target's text config.

The drafter is one Llama layer. It follows the target's full-attention layers: the layers
whose positions reach as far as the drafter's. A setting it cannot reproduce is an error,
not a library's silent default. A setting it reproduces by a choice is recorded as `source`
in the checkpoint.
"""

from __future__ import annotations

from typing import Any

from eyas.errors import EyasError

# Keys M-RoPE adds to a 1-D rope: text-only positions are the same on every axis, so
# M-RoPE reduces to the plain rope over the whole head.
_MROPE_KEYS = ("mrope_section", "mrope_interleaved")
FULL = "full_attention"
# The rope types the drafter computes (draft/layers.py), named as transformers names them.
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3", "proportional")


def drafter_rope(text_config) -> tuple[dict[str, Any], str]:
    """-> (rope_parameters for the drafter's Llama layer, where they came from)."""
    name = type(text_config).__name__
    rope = getattr(text_config, "rope_parameters", None)
    source = "the target's rope_parameters"
    if rope is None and getattr(text_config, "rope_theta", None) is not None:  # configs older than transformers 5
        rope = {**(getattr(text_config, "rope_scaling", None) or {}), "rope_theta": text_config.rope_theta}
        source = "the target's rope_theta and rope_scaling"
    if not rope:
        raise EyasError(f"{name} states no rotary settings (rope_parameters or rope_theta) for the drafter to follow.")
    rope = dict(rope)
    if all(isinstance(v, dict) for v in rope.values()):  # per layer type, e.g. Gemma-3
        if FULL not in rope:
            raise EyasError(f"{name} gives rope settings per layer type {sorted(rope)} but none for {FULL}, "
                            f"the layers the drafter follows.")
        others = {k: v for k, v in rope.items() if k != FULL}
        rope = dict(rope[FULL])
        source = f"the target's {FULL} layers" + (f" (not its {', '.join(sorted(others))} layers)" if others else "")
    dropped = [k for k in _MROPE_KEYS if k in rope]
    for key in dropped:
        del rope[key]
    if dropped:
        source += "; M-RoPE as plain 1-D rope (text positions are equal on every axis)"
    rope_type = rope["rope_type"] = rope.pop("rope_type", None) or rope.pop("type", None) or "default"
    if rope_type not in ROPE_TYPES:
        raise EyasError(f"{name}'s rope_type {rope_type!r} has no Llama equivalent for the drafter "
                        f"(it takes {', '.join(ROPE_TYPES)}).")
    if "rope_theta" not in rope:
        raise EyasError(f"{name}'s rope settings {rope} have no rope_theta.")
    return rope, source
