"""Target models, and what every stage needs of one: where it comes from (`resolve`), how it
loads and in which dtype (`load`), what identifies it across stages (`identity`), where its
decoder layers are (`layers`), its states at the layer ids (`states`), its embeddings, final
norm and lm_head (`target_head`) and the ids that end an answer (`eos`)."""

from eyas.lazy import lazy_exports

__all__ = [
    "DecoderParts",
    "ModelIdentity",
    "TargetHead",
    "TargetStates",
    "decoder_parts",
    "load_target",
    "load_target_head",
    "load_tokenizer",
    "model_dtype",
    "model_identity",
    "resolve_layer_ids",
    "resolve_model",
]
__getattr__ = lazy_exports(__name__, {
    "eyas.models.identity": ("ModelIdentity", "model_identity"),
    "eyas.models.layers": ("DecoderParts", "decoder_parts", "resolve_layer_ids"),
    "eyas.models.dtype": ("model_dtype",),
    "eyas.models.load": ("load_target", "load_tokenizer"),
    "eyas.models.resolve": ("resolve_model",),
    "eyas.models.states": ("TargetStates",),
    "eyas.models.target_head": ("TargetHead", "load_target_head"),
})
