"""Target models: where they come from (`resolve`), how they load (`load`), what identifies
them across stages (`identity`) and where their decoder layers are (`layers`)."""

from eyas.models.identity import ModelIdentity, model_identity
from eyas.models.layers import DecoderParts, decoder_parts, resolve_layer_ids
from eyas.models.load import load_target, load_tokenizer
from eyas.models.resolve import resolve_model

__all__ = [
    "DecoderParts",
    "ModelIdentity",
    "decoder_parts",
    "load_target",
    "load_tokenizer",
    "model_identity",
    "resolve_layer_ids",
    "resolve_model",
]
