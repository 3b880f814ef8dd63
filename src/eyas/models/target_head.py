"""The three pieces of the target that training (and teacher-forced eval, and the import's
embedding check) need: input embeddings (the drafter's, frozen), final norm and lm_head
(which turn the stored id-N state into labels).

They are read straight from the model folder's safetensors, never by building the whole
target: the module names come from a weightless (meta-device) copy of the model, so any
architecture transformers knows works without per-family code, and only three tensors
are read from disk.
"""

from __future__ import annotations

import copy
import functools
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
from safetensors import safe_open
from transformers import AutoConfig

from eyas.errors import EyasError
from eyas.models.identity import text_config
from eyas.models.layers import decoder_parts
from eyas.models.load import auto_model_class
from eyas.paths import plain_name

try:  # transformers 5's loading internals, which rename stored tensors at load time
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
except ImportError:
    get_model_conversion_mapping = None


@dataclass
class TargetHead:
    embed_weight: torch.Tensor  # [V, H]
    norm: nn.Module  # the target's final norm, frozen
    lm_head_weight: torch.Tensor  # [V, H]

    def to(self, device: torch.device | str) -> "TargetHead":
        """Norm and lm_head on `device`, where labels are computed; the embeddings stay where
        they are: they only seed the drafter's own frozen copy. On CUDA lm_head is held in
        bf16: labels are computed under bf16 autocast there, which casts it to bf16 for every
        product anyway (the same values), so float32 would only hold 2 more bytes a weight
        (1 GiB at Llama-3-8B's head, 2.2 GiB at 163840 x 7168) and re-cast it every step."""
        dtype = torch.bfloat16 if torch.device(device).type == "cuda" else self.lm_head_weight.dtype
        return TargetHead(self.embed_weight, copy.deepcopy(self.norm).to(device),
                          self.lm_head_weight.to(device, dtype))

    @torch.no_grad()
    def logits(self, last_hidden: torch.Tensor) -> torch.Tensor:
        """last_hidden [..., H] (layer id N, pre-norm) -> the target's logits [..., V]."""
        return self.norm(last_hidden).to(self.lm_head_weight.dtype) @ self.lm_head_weight.T


def _weight_files(folder: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (single file or sharded with an index)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return {k: folder / plain_name(f, str(index)) for k, f in json.loads(index.read_text())["weight_map"].items()}
    single = folder / "model.safetensors"
    if not single.is_file():
        raise EyasError(f"{folder} has no model.safetensors(.index.json): training reads the target's weights from it.")
    with safe_open(str(single), framework="pt") as f:
        return {k: single for k in f.keys()}


def _stored_names(skeleton: nn.Module, files: dict[str, Path]) -> dict[str, str]:
    """Module-tree name -> stored tensor name, renamed the way
    transformers renames at load time (multimodal wrappers are saved in an older layout,
    e.g. `language_model.model.*` for the module `model.language_model.*`)."""
    if get_model_conversion_mapping is None:  # no transformers 5 loading internals: names are taken as stored
        return {k: k for k in files}
    transforms = get_model_conversion_mapping(skeleton)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    return {rename_source_key(k, renamings, converters)[0]: k for k in files}


def _find(stored: dict[str, str], name: str) -> str | None:
    """The stored tensor for parameter `name`; checkpoints sometimes nest the language model
    differently from the module tree, so fall back to a unique match on the name's tail."""
    if name in stored:
        return stored[name]
    tail = ".".join(name.split(".")[-3:])
    matches = [v for k, v in stored.items() if k == tail or k.endswith("." + tail)]
    return matches[0] if len(matches) == 1 else None


def _read(files: dict[str, Path], key: str) -> torch.Tensor:
    with safe_open(str(files[key]), framework="pt") as f:
        return f.get_tensor(key).float()


@functools.lru_cache(maxsize=1)
def load_target_head(folder: str | Path) -> TargetHead:
    """Load embeddings, final norm and lm_head (float32, CPU) of the model in `folder`; the
    last one stays cached, so runs in one process (tests, notebooks) read it once."""
    folder = Path(folder)
    config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        skeleton = auto_model_class(config).from_config(config)
    module_names = {id(m): n for n, m in skeleton.named_modules(remove_duplicate=False)}
    embed_name = module_names[id(skeleton.get_input_embeddings())] + ".weight"
    head = skeleton.get_output_embeddings()
    norm = decoder_parts(skeleton).norm
    norm_prefix = module_names[id(norm)]

    files = _weight_files(folder)
    stored = _stored_names(skeleton, files)
    embed_key = _find(stored, embed_name)
    if embed_key is None:
        raise EyasError(f"{folder}: no tensor {embed_name} (the input embeddings) in its safetensors.")
    embed = _read(files, embed_key)
    head_key = _find(stored, module_names[id(head)] + ".weight") if head is not None else None
    if head_key is not None:
        lm_head = _read(files, head_key)
    elif getattr(text_config(config), "tie_word_embeddings", False) or getattr(config, "tie_word_embeddings", False):
        lm_head = embed
    else:
        raise EyasError(f"{folder}: no lm_head weight in its safetensors and the embeddings are not tied.")

    norm = copy.deepcopy(norm).to_empty(device="cpu")
    state = {}
    for pname in norm.state_dict():
        key = _find(stored, f"{norm_prefix}.{pname}")
        if key is None:
            raise EyasError(f"{folder}: no tensor {norm_prefix}.{pname} (the final norm) in its safetensors.")
        state[pname] = _read(files, key)
    norm.load_state_dict(state)
    norm.float().eval().requires_grad_(False)
    if embed.shape != lm_head.shape:
        raise EyasError(f"{folder}: embeddings {tuple(embed.shape)} and lm_head {tuple(lm_head.shape)} differ in shape.")
    return TargetHead(embed, norm, lm_head)
