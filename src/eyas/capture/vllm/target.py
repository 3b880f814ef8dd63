"""What both vLLM modes need to know about the target before any engine work: its folder,
identity and layer ids, computed from its config and tokenizer alone (a 1T-parameter
target's weights are never loaded in this process)."""

from __future__ import annotations

from dataclasses import dataclass

from eyas.errors import EyasError
from eyas.models import load_tokenizer, model_identity, resolve_layer_ids, resolve_model
from eyas.models.identity import ModelIdentity


@dataclass(frozen=True)
class Target:
    folder: str
    config: object  # transformers PretrainedConfig
    identity: ModelIdentity
    layer_ids: tuple[int, ...]  # aux ids, then N


def describe_target(model: str, layers: str = "auto") -> Target:
    """Raise `EyasError` for a model that cannot be read or a layer id out of range."""
    from transformers import AutoConfig

    folder = resolve_model(model)
    try:
        config = AutoConfig.from_pretrained(folder)
    except (OSError, ValueError) as e:
        raise EyasError(f"Could not read the config of model {model!r}: {e}") from e
    identity = model_identity(model, config, load_tokenizer(model))
    return Target(folder, config, identity, resolve_layer_ids(layers, identity.num_layers))


def check_vllm_can_load(target: Target, engine_args: dict) -> None:
    """Fail before starting an engine when vLLM has no implementation of the architecture."""
    from vllm import ModelRegistry

    if engine_args.get("model_impl", "auto") not in ("auto", "vllm"):
        return  # the user chose vLLM's transformers backend (or another): let vLLM judge
    archs = list(getattr(target.config, "architectures", None) or [])
    supported = ModelRegistry.get_supported_archs()
    if not any(a in supported for a in archs):
        raise EyasError(
            f"vLLM cannot load {target.identity.model}: its architecture {archs or '(none in config.json)'} is not "
            f"one of vLLM's models. Use --backend hf, or try vLLM's transformers backend with "
            f"--engine-arg model_impl=transformers."
        )
