"""Target models: where they come from (`resolve`), how they load (`load`), what identifies
them across stages (`identity`) and where their decoder layers are (`layers`)."""

from eyas.lazy import lazy_exports

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
__getattr__ = lazy_exports(__name__, {
    "eyas.models.identity": ("ModelIdentity", "model_identity"),
    "eyas.models.layers": ("DecoderParts", "decoder_parts", "resolve_layer_ids"),
    "eyas.models.load": ("load_target", "load_tokenizer"),
    "eyas.models.resolve": ("resolve_model",),
})
