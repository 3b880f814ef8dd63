"""Load a target model and its tokenizer for capture, training and evaluation."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

from eyas.errors import EyasError
from eyas.models.identity import text_config
from eyas.models.resolve import resolve_model

DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
}


def parse_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise EyasError(f"Unknown dtype {name!r}; choose one of {', '.join(DTYPES)}.") from None


def load_tokenizer(spec: str):
    """The target's tokenizer; a chat template is required later, not here."""
    folder = resolve_model(spec)
    try:
        return AutoTokenizer.from_pretrained(folder)
    except OSError as e:
        raise EyasError(f"Could not load a tokenizer for {spec!r}: {e}") from e


def auto_model_class(config):
    """transformers' auto class that builds `config`'s text-generating model: the causal LM, or
    for a multimodal wrapper (`*ForConditionalGeneration` nesting a `text_config`) the
    image-text-to-text model, whose text decoder eyas then runs on text alone."""
    for auto in (AutoModelForCausalLM, AutoModelForImageTextToText):
        if type(config) in auto._model_mapping:
            return auto
    raise EyasError(f"transformers has no text-generating model for {type(config).__name__}; eyas needs a "
                    f"causal LM or an image-text-to-text wrapper around one.")


def exact_attention(config, attn: str | None = None) -> str | None:
    """The attention implementation that computes what `config` says, given the one asked for
    (None: transformers' default for the family, sdpa where supported). A config that soft-caps
    its attention scores (Gemma-2's `attn_logit_softcapping`) gets eager attention: sdpa drops
    the cap without a word, and the captured states and the decodes would be another model's."""
    if getattr(text_config(config), "attn_logit_softcapping", None) is None:
        return attn
    if attn not in (None, "eager"):
        raise EyasError(f"{type(config).__name__} soft-caps its attention scores (attn_logit_softcapping), which "
                        f"attention {attn!r} does not compute; run it with eager attention.")
    return "eager"


def load_target(spec: str, dtype: str = "float32", device: str = "cpu", attn: str | None = None):
    """Return `(model, tokenizer)`, the model in eval mode with gradients off. `attn=None`
    lets transformers pick its best attention for the family (sdpa where supported), unless
    that would not compute what the config says (see `exact_attention`)."""
    folder = resolve_model(spec)
    try:
        config = AutoConfig.from_pretrained(folder)
        attn = exact_attention(config, attn)
        extra = {"attn_implementation": attn} if attn else {}
        model = auto_model_class(config).from_pretrained(folder, dtype=parse_dtype(dtype), **extra)
    except (OSError, ValueError) as e:
        raise EyasError(f"Could not load model {spec!r}: {e}") from e
    model.to(device).eval().requires_grad_(False)
    return model, load_tokenizer(spec)
