"""What both vLLM modes need to know about the target before any engine work: its folder,
identity and layer ids, computed from its config and tokenizer alone (a 1T-parameter
target's weights are never loaded in this process)."""

from __future__ import annotations

from dataclasses import dataclass

from transformers import AutoConfig

from eyas.errors import EyasError
from eyas.models import load_tokenizer, model_identity, resolve_layer_ids, resolve_model
from eyas.models.identity import ModelIdentity
from eyas.options import AUTO_LAYERS


@dataclass(frozen=True)
class Target:
    folder: str
    config: object  # transformers PretrainedConfig
    identity: ModelIdentity
    layer_ids: tuple[int, ...]  # aux ids, then N


def read_target(model: str) -> tuple[str, object, ModelIdentity]:
    """(folder, config, identity) of `model`, with no layer ids: what a stage that reads no
    hidden states (regenerate) checks its data against. Raises `EyasError` for a model that
    cannot be read."""
    folder = resolve_model(model)
    try:
        config = AutoConfig.from_pretrained(folder)
    except (OSError, ValueError) as e:
        raise EyasError(f"Could not read the config of model {model!r}: {e}") from e
    return folder, config, model_identity(model, config, load_tokenizer(model), folder)


def describe_target(model: str, layers: str = AUTO_LAYERS) -> Target:
    """Raise `EyasError` for a model that cannot be read or a layer id out of range."""
    folder, config, identity = read_target(model)
    return Target(folder, config, identity, resolve_layer_ids(layers, identity.num_layers))
