"""Refuse, before any engine process starts, a target the installed vLLM cannot run with
EAGLE-3 aux hidden states: for capture (`--backend vllm`) and for serving an exported drafter.

Each check asks vLLM's own code, so it follows the installed release instead of a list eyas
keeps: its model registry and model class (is the architecture there, does it import, does
it implement `SupportsEagle3`, does it collect aux states on the shared path that takes id
0), vLLM's architecture-config convertor (MLA or not, head size), the platform's attention
selector (does the backend it picks take that head size) and vLLM's own model config, built
here as the engine builds it first (a wrapper's image processor, max_model_len). Starting
an engine to learn the same costs minutes and ends in a worker crash.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import re
import sys
import textwrap
from pathlib import Path
from typing import Any

from eyas.errors import EyasError
from eyas.models.dtype import ENGINE_DTYPE
from eyas.vllm import engine

# The --engine-arg model_impl values that run vLLM's own model class, the one these checks ask
# (vLLM's default first).
VLLM_MODEL_IMPLS = ("auto", "vllm")


def preflight(config: Any, model: str, layer_ids: tuple[int, ...] | None, dtype: str, instead: str,
              engine_args: dict[str, Any] | None = None, folder: str | None = None, here: bool = True) -> None:
    """Raise `EyasError` (one sentence ending in `instead`, what to do) when vLLM cannot run
    `model` (transformers `config`, read from `folder`, by default `model` itself) with
    EAGLE-3 aux states at `layer_ids` (aux ids then N). `here`: the engine runs on this
    machine's platform (not a command printed to run on another)."""
    if (engine_args or {}).get("model_impl", VLLM_MODEL_IMPLS[0]) not in VLLM_MODEL_IMPLS:
        return  # the user chose vLLM's transformers backend (or another): let vLLM judge
    engine.vllm_environment()  # before vLLM is first imported
    version = engine.installed_vllm_version()
    arch, cls = model_class(config, model, version, instead)
    from vllm.model_executor.models.interfaces import supports_eagle3

    if not supports_eagle3(cls):
        raise EyasError(f"vLLM {version}'s {arch} has no EAGLE-3 aux hidden-state support (it does not implement "
                        f"SupportsEagle3); {instead}, or upgrade vLLM to a release whose {arch} supports EAGLE-3.")
    if layer_ids and 0 in layer_ids[:-1]:
        check_layer_id_0(cls, f"vLLM {version}'s {arch}", instead)
    check_router(config, model)
    check_head_size(config, model, dtype, instead, here)
    check_weight_names(folder or model, model, config, cls, f"vLLM {version}'s {arch}", instead)
    check_model_config(folder or model, model, f"vLLM {version}'s {arch}", dtype, instead, engine_args)


def preflight_where_installed(config: Any, model: str, layer_ids: tuple[int, ...] | None, dtype: str, instead: str,
                              engine_args: dict[str, Any] | None = None, folder: str | None = None) -> None:
    """`preflight` for a command printed here and run elsewhere: without vLLM on this machine
    (a training or client machine), say that the command is unchecked instead of refusing."""
    try:
        engine.installed_vllm_version()
    except EyasError as e:
        print(f"eyas: note: the command was not checked against vLLM here ({e})", file=sys.stderr)
        return
    preflight(config, model, layer_ids, dtype, instead, engine_args, folder, here=False)


def model_class(config: Any, model: str, version: str, instead: str) -> tuple[str, type]:
    """The first of the config's architectures that vLLM registers, and its class (imported
    here, as the engine would import it)."""
    from vllm import ModelRegistry

    archs = list(getattr(config, "architectures", None) or [])
    arch = next((a for a in archs if a in ModelRegistry.get_supported_archs()), None)
    if arch is None:
        raise EyasError(
            f"vLLM cannot load {model}: its architecture {archs or '(none in config.json)'} is not one of vLLM "
            f"{version}'s models; {instead}, or try vLLM's transformers backend with --engine-arg model_impl=transformers."
        )
    try:
        return arch, ModelRegistry.models[arch].load_model_cls()
    except Exception as e:  # what the engine's workers would hit too, minutes later
        raise EyasError(f"vLLM {version} cannot import its {arch} here ({type(e).__name__}: {e}), so its engine "
                        f"would fail the same way; {instead}, or {install_hint(e, arch)}.") from None


def install_hint(e: Exception, arch: str) -> str:
    """How to add what an import of vLLM's model class missed. torchvision gets the exact
    build: the README's vLLM install removes the one pip pulls in (it can break `import vllm`),
    and only the build made for the installed torch imports beside it."""
    missing = getattr(e, "name", None) if isinstance(e, ModuleNotFoundError) else None
    if missing != "torchvision":
        return f"install what vLLM's {arch} needs" + (f" (the package {missing})" if missing else "")
    import torch

    version = torch.__version__.split("+")[0]
    build = (torch.__version__.split("+") + [""])[1] or "cpu"
    major, minor = (int(x) for x in version.split(".")[:2])
    return (f"install the torchvision built for torch {torch.__version__} (pip install --index-url "
            f"https://download.pytorch.org/whl/{build} torchvision=={major - 2}.{minor + 15}.*)")


def check_layer_id_0(cls: type, name: str, instead: str) -> None:
    """Id 0 is the embedding output, before any residual exists. vLLM's shared aux path
    (`EagleModelMixin`, reached through the default `set_aux_hidden_state_layers`) handles
    that; a class that overrides it collects aux states its own way, and DeepSeek-V2's crashes."""
    from vllm.model_executor.models.interfaces import SupportsEagle3

    if cls.set_aux_hidden_state_layers is not SupportsEagle3.set_aux_hidden_state_layers:
        raise EyasError(f"{name} collects aux hidden states with its own code, outside the shared path that handles "
                        f"layer id 0 (the embedding output, where DeepSeek-V2-style forwards crash on a missing "
                        f"residual); use aux layer ids of 1 or more, or {instead}.")


def check_router(config: Any, model: str) -> None:
    """DeepSeek-style MoE routers: vLLM reads `topk_method` and `scoring_func` with defaults
    (no bias, softmax) that transformers' DeepseekV3 never uses, and transformers' config
    does not write them; a silent fallback would capture a different model."""
    text = config.get_text_config()
    if getattr(text, "n_routed_experts", None) is None or getattr(text, "kv_lora_rank", None) is None:
        return
    missing = [k for k in ("topk_method", "scoring_func") if getattr(text, k, None) is None]
    if missing:
        raise EyasError(
            f"The config of {model} does not set {' and '.join(missing)} for its DeepSeek-style MoE router, so vLLM "
            f"would route with softmax and no e_score_correction_bias while transformers' DeepseekV3 routes with "
            f"sigmoid and noaux_tc; add \"topk_method\": \"noaux_tc\" and \"scoring_func\": \"sigmoid\" to its "
            f"{'text_config' if text is not config else 'config.json'} if that is how it was trained."
        )


def check_head_size(config: Any, model: str, dtype: str, instead: str, here: bool = True) -> None:
    """The head size against the attention backend the platform picks. On a GPU the selector
    raises itself when no backend fits; on the CPU it returns its one backend without asking,
    and the engine dies at the first request (`Unsupported CPU attention configuration:
    head_dim=16`), so the backend's own list decides (the CPU MLA kernel: 576 only). For a
    command run elsewhere (not `here`) a plain head size only this platform's backend lacks is
    a note: a GPU's backends take sizes the CPU kernel is not built for."""
    import torch
    import vllm.config  # noqa: F401  (first: vLLM's arch-config convertor cannot be imported before it)
    import vllm.envs as envs
    from vllm.platforms import current_platform
    from vllm.transformers_utils.config import get_hf_text_config
    from vllm.transformers_utils.model_arch_config_convertor import (
        MODEL_ARCH_CONFIG_CONVERTORS,
        ModelArchConfigConvertorBase,
    )
    from vllm.utils.import_utils import resolve_obj_by_qualname
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.selector import AttentionSelectorConfig

    text = get_hf_text_config(config)
    convertor = MODEL_ARCH_CONFIG_CONVERTORS.get(config.model_type, ModelArchConfigConvertorBase)(config, text)
    mla, head_size = convertor.is_deepseek_mla() and not envs.VLLM_MLA_DISABLE, convertor.get_head_size()
    run_dtype = {ENGINE_DTYPE: torch.bfloat16, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
                 "float16": torch.float16, "fp32": torch.float32, "float32": torch.float32}.get(dtype, torch.bfloat16)
    selector = AttentionSelectorConfig(head_size=head_size, dtype=run_dtype, kv_cache_dtype=None, block_size=None,
                                       use_mla=mla)
    kind = "MLA head size" if mla else "attention head size"
    # The backend the engine is asked for where the AMX MLA kernels cannot run (engine.with_reference_cpu_mla).
    engine_dtype = engine.resolved_dtype(text, engine.vllm_dtype(dtype))
    chosen = AttentionBackendEnum.CPU_MLA if mla and engine.amx_mla_takes_only_bf16(engine_dtype) else None
    try:
        backend = resolve_obj_by_qualname(current_platform.get_attn_backend_cls(chosen, selector,
                                                                                 num_heads=text.num_attention_heads))
    except (ValueError, NotImplementedError) as e:
        raise EyasError(f"vLLM has no attention backend on {current_platform.device_name} for {model}'s {kind} "
                        f"{head_size} ({e}); {instead}.") from None
    if not backend.supports_head_size(head_size):
        what = " (kv_lora_rank + qk_rope_head_dim)" if mla else " (head_dim)"
        refusal = (f"vLLM's {backend.get_name()} attention on {current_platform.device_name} takes {kind}s "
                   f"{backend.get_supported_head_sizes()} only, and {model}'s is {head_size}{what}")
        if here or mla:
            raise EyasError(f"{refusal}; {instead}.")
        print(f"eyas: note: {refusal}: a server on such a machine would stop at its first request.", file=sys.stderr)


def check_model_config(folder: str, model: str, name: str, dtype: str, instead: str,
                       engine_args: dict[str, Any] | None) -> None:
    """The engine's first step, in this process: vLLM's `ModelConfig` for the folder. For a
    multimodal wrapper it sets up the model's input processing (image processor, tokenizer's
    media tokens) even for text-only prompts, and fails here as the engine would, minutes
    later (on these machines: no torchvision for the processors that need it)."""
    from vllm.engine.arg_utils import EngineArgs

    known = {f.name for f in dataclasses.fields(EngineArgs)}
    args = {k: v for k, v in (engine_args or {}).items() if k in known and k not in ("model", "dtype")}
    run_dtype = engine.vllm_dtype(dtype)
    try:
        EngineArgs(model=folder, dtype=run_dtype, **args).create_model_config()
    except Exception as e:  # whatever vLLM raises, the engine would raise too
        text = str(e).split("Value error, ", 1)[-1]  # a pydantic ValidationError's own line
        cause = text.split(". ")[0].split("\n")[0]
        raise EyasError(f"{name} cannot set up {model} here ({type(e).__name__}: {cause}), so its engine would "
                        f"fail the same way after starting; {instead}.") from None


def checkpoint_names(folder: str) -> list[str]:
    """Tensor names of a safetensors checkpoint, from its index or the files' headers (no
    tensor is read); [] for another format or a folder that is not here."""
    from safetensors import safe_open

    path = Path(folder)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return list(json.loads(index.read_text())["weight_map"])
    names = []
    for file in sorted(path.glob("*.safetensors")) if path.is_dir() else []:
        with safe_open(str(file), "pt") as f:
            names += list(f.keys())
    return names


def check_weight_names(folder: str, model: str, config: Any, cls: type, name: str, instead: str) -> None:
    """The checkpoint's tensor names as vLLM's loader will see them: renamed by the class's own
    `hf_to_vllm_mapper`, the text decoder's layers must sit in a `...layers.N.` container
    (vLLM's decoders build theirs so), and, for a class that loads through
    `AutoWeightsLoader` without skip lists, each name must start with a module the class
    sets up. transformers' `save_pretrained` can write a wrapper in a layout transformers
    reads back but vLLM does not (Kimi-K2.5: `language_model.model.blocks.N`); the engine
    would load for minutes and stop on the first such name."""
    names = checkpoint_names(folder)
    if not names:
        return
    mapper = getattr(cls, "hf_to_vllm_mapper", None)
    mapped = {n: mapper.map_name(n) if mapper is not None else n for n in names}
    kept = [m for m in mapped.values() if m is not None]
    problems, renames = [], []
    containers = layer_containers(kept, config.get_text_config().num_hidden_layers)
    if containers and not any(c.endswith("layers.") for c in containers):
        found = containers[0]
        wanted = found[: found.rstrip(".").rfind(".") + 1] + "layers."  # the same place, named as vLLM names it
        problems.append(f"its text decoder's layers are stored as {found}N.* where vLLM reads ...layers.N.*")
        renames.append(f"{found}* -> {wanted}*")
    children = auto_loader_children(cls)
    for stray in sorted({m.split(".")[0] for m in kept} - children) if children else []:
        example = next(n for n, m in mapped.items() if m is not None and m.split(".")[0] == stray)
        problems.append(f"it has no module {stray!r} for the tensors {stray}.* (e.g. {example})")
        inner = example.split(".")[1] if example.count(".") > 1 else None
        renames.append(f"{stray}.{inner}.* -> {inner}.*" if inner in children else
                       f"{stray}.* -> a name under one of {sorted(c for c in children if not c.startswith('_'))}")
    if problems:
        raise EyasError(
            f"{name} cannot load {model} as its tensors are named ({'; '.join(problems)}), and its engine would stop "
            f"on the first such name after starting; transformers' save_pretrained writes some wrappers so, and reads "
            f"back the layout vLLM reads as well: write a copy of the checkpoint with its tensors renamed "
            f"({', '.join(renames)}: safetensors load_file, rename the keys, save_file; the other files as they are) "
            f"and pass that folder, "
            f"or {instead}."
        )


def layer_containers(names: list[str], layers: int) -> list[str]:
    """Prefixes `P` such that `P{i}.` starts some name for every i < `layers`: where the
    checkpoint keeps a stack of `layers` layers (the text decoder's, or a deep vision tower's)."""
    seen: dict[str, set[int]] = {}
    for n in names:
        for m in re.finditer(r"\.(\d+)\.", n):
            seen.setdefault(n[: m.start() + 1], set()).add(int(m.group(1)))
    return sorted(p for p, ids in seen.items() if set(range(layers)) <= ids)


def auto_loader_children(cls: type) -> set[str]:
    """The attribute names vLLM's class sets in its `__init__`s (its modules among them), when
    its `load_weights` walks them with `AutoWeightsLoader` and no skip or ignore lists (which
    then refuses any other first name); empty when that cannot be read off its source."""
    try:
        if "AutoWeightsLoader(self)" not in inspect.getsource(cls.load_weights):
            return set()
        out = set()
        for klass in cls.__mro__:
            init = klass.__dict__.get("__init__")
            if init is None or not klass.__module__.startswith("vllm."):
                continue
            for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(init)))):
                if isinstance(node, (ast.Assign, ast.AnnAssign)):
                    for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                        if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) \
                                and target.value.id == "self":
                            out.add(target.attr)
        return out
    except (OSError, TypeError, SyntaxError):
        return set()
