"""The pieces of the target that training (and teacher-forced eval, and the import's
embedding check) need: input embeddings (the drafter's, frozen), and the target's output
head, which turns the stored id-N state into the target's logits (labels).

They are read straight from the model folder's safetensors, never by building the whole
target: the module names come from a weightless (meta-device) copy of the model, so any
architecture transformers knows works without per-family code, and only the embeddings,
the final norm and lm_head are read from disk.

The output head is more than `norm(h) @ lm_head.T`: families transform the logits in their
CausalLM `forward` (Granite divides them by `logits_scaling`, Cohere multiplies by
`logit_scale`, Gemma-2/3 soft-cap them with tanh, Falcon-H1 multiplies by
`lm_head_multiplier`, MiniCPM3 scales the hidden state before lm_head), and labels without
that are a distribution several times too sharp or too flat with the same argmax, which no
accuracy shows. So the logits come from the family's own `forward`, run on the weightless
copy with its decoder stubbed out: the decoder "returns" the normed id-N state, lm_head is
the real weight, and whatever the family does around them is its own code.
"""

from __future__ import annotations

import copy
import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors import safe_open
from transformers import AutoConfig
from transformers.modeling_outputs import BaseModelOutputWithPast

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
class _Decoded(BaseModelOutputWithPast):
    """What the stubbed decoder returns: the hidden states it was given as `last_hidden_state`,
    and None for any other field a family's forward reads (router logits, image states, ...)."""

    def __getattr__(self, name: str):  # reached only for names the dataclass does not have
        if name.startswith("_"):
            raise AttributeError(name)
        return None


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.to(weight.dtype), weight, bias)


class _OutputHead:
    """The family's CausalLM `forward` on a weightless copy of the model whose decoder returns
    its `inputs_embeds` unchanged and whose lm_head is a plain product with the weight (rows)
    given per call: what the family does between its decoder and its logits, and nothing else.
    Holds no tensors (the copy is on the meta device), so every device and dtype shares it."""

    def __init__(self, skeleton: nn.Module, decoder: nn.Module, lm_head: nn.Module):
        self.skeleton, self.lm_head = skeleton.eval(), lm_head
        decoder.forward = lambda *args, inputs_embeds=None, **kwargs: _Decoded(last_hidden_state=inputs_embeds)

    def __call__(self, normed: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """normed [..., H] (after the final norm) -> logits [..., len(weight)]."""
        self.lm_head.forward = functools.partial(_linear, weight=weight, bias=bias)
        flat = normed.reshape(1, -1, normed.shape[-1])  # the [B, T, H] a forward expects
        logits = self.skeleton(inputs_embeds=flat, use_cache=False).logits
        return logits.reshape(*normed.shape[:-1], logits.shape[-1])


@dataclass
class TargetHead:
    embed_weight: torch.Tensor  # [V, H]
    norm: nn.Module  # the target's final norm, frozen
    lm_head_weight: torch.Tensor  # [V, H]
    lm_head_bias: torch.Tensor | None = None  # [V], for the few families whose lm_head has one
    # What the family does around lm_head (see the module docstring); None: nothing, the plain
    # norm + lm_head of a Llama-style head built in memory (tests, benchmarks).
    output: _OutputHead | None = None

    def to(self, device: torch.device | str) -> "TargetHead":
        """Norm and lm_head on `device`, where labels are computed; the embeddings stay where
        they are: they only seed the drafter's own frozen copy. On CUDA lm_head is held in
        bf16: labels are computed under bf16 autocast there, which casts it to bf16 for every
        product anyway (the same values), so float32 would only hold 2 more bytes a weight
        (1 GiB at Llama-3-8B's head, 2.2 GiB at 163840 x 7168) and re-cast it every step."""
        dtype = torch.bfloat16 if torch.device(device).type == "cuda" else self.lm_head_weight.dtype
        bias = self.lm_head_bias.to(device, dtype) if self.lm_head_bias is not None else None
        return TargetHead(self.embed_weight, copy.deepcopy(self.norm).to(device),
                          self.lm_head_weight.to(device, dtype), bias, self.output)

    def logits_are_the_product(self) -> bool:
        """Whether the family's logits are `normed @ lm_head.T` alone (no bias, no scaling or
        soft-cap), probed on random states: only then can a plain head hold its rows."""
        if self.lm_head_bias is not None:
            return False
        if self.output is None:
            return True
        weight = self.lm_head_weight[:8].float()  # [8, H]
        probe = torch.randn(4, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight.device)
        return torch.allclose(self.output(probe, weight, None).float(), probe @ weight.T, rtol=1e-4, atol=1e-5)

    def logits(self, last_hidden: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """last_hidden [..., H] (layer id N, pre-norm) -> the target's logits [..., V], exactly
        as its own forward computes them; with `rows` (target ids [Vd]) only those columns
        [..., Vd], from those rows of lm_head alone (the draft vocabulary's logits without the
        full [..., V] product). Restricting is exact where the family transforms each logit on
        its own, as every family tests/test_target_families.py builds does."""
        return self.restricted(rows)(last_hidden)

    def restricted(self, rows: torch.Tensor | None) -> Callable[[torch.Tensor], torch.Tensor]:
        """`logits(., rows)` with the rows of lm_head taken once, for a caller that asks many times
        (the loss, a chunk of pairs at a time)."""
        weight = self.lm_head_weight if rows is None else self.lm_head_weight[rows]
        bias = self.lm_head_bias if rows is None or self.lm_head_bias is None else self.lm_head_bias[rows]

        @torch.no_grad()
        def logits(last_hidden: torch.Tensor) -> torch.Tensor:
            normed = self.norm(last_hidden)
            return _linear(normed, weight, bias) if self.output is None else self.output(normed, weight, bias)

        return logits


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


def _output_head(skeleton: nn.Module, norm_name: str, lm_head: nn.Module | None, what: str) -> _OutputHead:
    """The family's forward around lm_head (see `_OutputHead`), tried once on a few fixed
    states: a family whose forward needs more than the decoder's output and lm_head (its own
    weights, which the meta copy lacks, or input ids) is refused here, never given labels that
    are silently not its own."""
    decoder_name = norm_name.split(".")[0]  # the child the forward runs for hidden states
    if lm_head is None or "." not in norm_name:
        raise EyasError(f"{what}: eyas cannot find its lm_head and the decoder around its final norm, so it cannot "
                        f"compute its labels; it does not support this model family.")
    head = _OutputHead(skeleton, skeleton.get_submodule(decoder_name), lm_head)
    hidden = lm_head.weight.shape[-1]
    # Fixed values: drawing random ones would move the caller's random stream.
    states, weight = torch.linspace(-1, 1, 6 * hidden).view(2, 3, hidden), torch.linspace(-1, 1, 5 * hidden).view(5, -1)
    try:
        probe = head(states, weight, None)
    except Exception as e:  # noqa: BLE001 - any failure of the family's own code means "cannot reproduce"
        raise EyasError(f"{what}: its forward computes logits from more than its decoder's output and lm_head "
                        f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}), which eyas cannot "
                        f"reproduce for labels; it does not support this model family.") from e
    if probe.shape != (2, 3, 5) or probe.device.type != "cpu":
        raise EyasError(f"{what}: its forward's logits are not one per lm_head row ({tuple(probe.shape)} on "
                        f"{probe.device.type}), which eyas cannot reproduce for labels; it does not support this "
                        f"model family.")
    return head


@functools.lru_cache(maxsize=1)
def load_target_head(folder: str | Path) -> TargetHead:
    """Load embeddings, final norm and lm_head (float32, CPU) of the model in `folder`, with its
    family's own output transform; the last one stays cached, so runs in one process (tests,
    notebooks) read it once."""
    folder = Path(folder)
    config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        skeleton = auto_model_class(config).from_config(config)
    module_names = {id(m): n for n, m in skeleton.named_modules(remove_duplicate=False)}
    embed_name = module_names[id(skeleton.get_input_embeddings())] + ".weight"
    head = skeleton.get_output_embeddings()
    norm = decoder_parts(skeleton).norm
    norm_prefix = module_names[id(norm)]
    output = _output_head(skeleton, norm_prefix, head, f"{folder} ({type(skeleton).__name__})")

    files = _weight_files(folder)
    stored = _stored_names(skeleton, files)
    embed_key = _find(stored, embed_name)
    if embed_key is None:
        raise EyasError(f"{folder}: no tensor {embed_name} (the input embeddings) in its safetensors.")
    embed = _read(files, embed_key)
    head_key = _find(stored, module_names[id(head)] + ".weight")
    if head_key is not None:
        lm_head = _read(files, head_key)
    elif getattr(text_config(config), "tie_word_embeddings", False) or getattr(config, "tie_word_embeddings", False):
        lm_head = embed
    else:
        raise EyasError(f"{folder}: no lm_head weight in its safetensors and the embeddings are not tied.")
    bias = None
    if getattr(head, "bias", None) is not None:
        bias_key = _find(stored, module_names[id(head)] + ".bias")
        if bias_key is None:
            raise EyasError(f"{folder}: no tensor {module_names[id(head)]}.bias (lm_head's bias) in its safetensors.")
        bias = _read(files, bias_key)

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
    return TargetHead(embed, norm, lm_head, bias, output)
