"""Write an eyas drafter checkpoint in the layout a serving engine loads, and say how to serve it."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import Any, Mapping

import torch
from transformers import AutoConfig

from eyas.draft import kinds
from eyas.draft.checkpoint import load_config
from eyas.draft.config import DraftConfig
from eyas.errors import EyasError
from eyas.export.config import ExportConfig
from eyas.export.layouts import Layout, layout_for
from eyas.export.weights import build_drafter, owned_out, read_tensors, write_folder
from eyas.models import load_tokenizer, model_identity
from eyas.models.dtype import ENGINE_DTYPE
from eyas.models.load import parse_dtype
from eyas.models.resolve import MODEL_CONFIG, resolve_model
from eyas.paths import check_confined
from eyas.train.checkpoint import unfinished_note
from eyas.vllm.preflight import preflight_where_installed
from eyas.vllm.serve import serve_launcher


def export_drafter(export: ExportConfig) -> dict[str, Any]:
    """Export the drafter in `export.ckpt` as `export.to` (vllm, speculators or sglang) into
    `export.out`; return a summary."""
    ckpt = export.ckpt
    check_confined(export.out, {"the checkpoint": ckpt, "--target": export.target})
    if note := unfinished_note(ckpt):
        print(f"eyas export: {note}", file=sys.stderr, flush=True)
    cfg = load_config(ckpt)
    layout = layout_for(cfg, export.to)
    num_speculative_tokens = speculative_tokens(cfg, export.num_speculative_tokens)
    state = read_tensors(ckpt)
    build_drafter(cfg, state, str(ckpt))
    layout.check(cfg)
    out = Path(export.out).resolve()
    serving = serving_info(cfg, export.target, num_speculative_tokens)
    if layout.engine == "vllm":
        check_vllm_serves(cfg, serving["target"])
    tensors = export_tensors(cfg, state, layout, export.dtype)
    config = layout.config(cfg, serving)
    with owned_out(out, export.force, Path(ckpt), "export"):
        size = write_folder(out, config, tensors)
    return {
        "format": layout.name, "out": str(out), "tensors": len(tensors), "bytes": size,
        "aux_layer_ids": written_layer_ids(config),
        "serve_command": serve_command(layout.engine, serving["target"], out, num_speculative_tokens,
                                       cfg.kind.vllm_method),
    }


def planned_serve_command(export: ExportConfig, check: bool = True) -> str:
    """The serve command for exporting `export.ckpt` to `export.out`, without writing anything;
    `check=False` skips vLLM's pre-flight (the recipe's report: its export stage ran it already)."""
    cfg = load_config(export.ckpt)
    layout = layout_for(cfg, export.to)
    num_speculative_tokens = speculative_tokens(cfg, export.num_speculative_tokens)
    serving = serving_info(cfg, export.target, num_speculative_tokens)
    if check and layout.engine == "vllm":
        check_vllm_serves(cfg, serving["target"])
    return serve_command(layout.engine, serving["target"], Path(export.out).resolve(), num_speculative_tokens,
                         cfg.kind.vllm_method)


def speculative_tokens(cfg: DraftConfig, asked: int | None, flag: str = "--num-speculative-tokens") -> int:
    """Draft tokens per step: as asked (`flag`), else the drafter's trained depth
    (`DraftConfig.depth`). `eyas eval --steps` passes here too, so that eval measures what the
    engines serve. A block (DFlash) or parallel (P-EAGLE) drafter drafts at most its trained depth
    in its one pass: more is refused, not quietly cut to it."""
    k = asked if asked is not None else cfg.depth
    if k < 1:
        raise EyasError(f"{flag} must be at least 1.")
    if cfg.kind.drafting != kinds.STEPS and k > cfg.depth:
        raise EyasError(f"{flag} {k}: {cfg.kind.a_title()} drafter drafts at most its trained depth, {cfg.depth} "
                        f"tokens, in one pass; give {flag} {cfg.depth} or less, or train one with --ttt-steps {k}.")
    return k


def check_vllm_serves(cfg: DraftConfig, target: str) -> None:
    """Refuse a drafter the installed vLLM cannot serve with its target (see vllm/preflight.py);
    without vLLM or the target's config here, say that the command is unchecked."""
    try:
        config = AutoConfig.from_pretrained(target)
    except (OSError, ValueError) as e:
        print(f"eyas: note: the serve command was not checked: the target's config is not readable here ({e})",
              file=sys.stderr)
        return
    preflight_where_installed(config, target, cfg.layer_ids, ENGINE_DTYPE, "export --to sglang if SGLang serves this target")


def export_tensors(cfg: DraftConfig, state: dict[str, torch.Tensor], layout: Layout, dtype: str) -> dict[str, torch.Tensor]:
    """Rename to the layout's names and cast floating tensors (`d2t`/`t2d` keep their integer/bool types)."""
    cast = None if dtype == "keep" else parse_dtype(dtype)
    full_vocab = cfg.draft_vocab_size == cfg.vocab_size
    if full_vocab and state["d2t"].any():
        raise EyasError("The draft vocabulary is the whole target vocabulary but reordered (d2t is not all zero); "
                        "engines assume the identity mapping then.")
    out = {}
    for name, t in state.items():
        if name in ("d2t", "t2d") and full_vocab and not layout.full_vocab_mapping:
            continue  # vLLM has no draft-to-target table when the vocabularies are the same
        if cast is not None and t.is_floating_point():
            t = t.to(cast)
        out[layout.export_name(name)] = t
    return out


def serving_info(cfg: DraftConfig, target: str | None, num_speculative_tokens: int) -> dict[str, Any]:
    """The target as a serving engine should be given it, checked against the drafter's record when
    the user names one explicitly."""
    if target is not None:
        check_target(cfg, target)
    spec = target or cfg.identity.model
    try:
        path = resolve_model(spec)
    except EyasError:
        if target is not None:
            raise
        path = spec  # recorded as a path that no longer exists here; the user may serve it elsewhere
    config = Path(path) / MODEL_CONFIG
    architectures = (json.loads(config.read_text()).get("architectures") or []) if config.is_file() else []
    return {"target": path, "target_architectures": architectures, "num_speculative_tokens": num_speculative_tokens}


def check_target(cfg: DraftConfig, target: str) -> None:
    folder = resolve_model(target)
    given = model_identity(target, AutoConfig.from_pretrained(folder), load_tokenizer(target), folder)
    given.check_same(cfg.identity, "The drafter")


def written_layer_ids(config: dict[str, Any]) -> dict[str, list[int]]:
    """The aux ids as each engine will read them from `config` (for the summary)."""
    ids = {}
    if "eagle_aux_hidden_state_layer_ids" in config:
        ids["vllm (input of layer k)"] = config["eagle_aux_hidden_state_layer_ids"]
    if "eagle_config" in config:
        ids["sglang (output of layer k)"] = config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    return ids


def serve_command(engine: str, target: str, drafter: str | Path, num_speculative_tokens: int,
                  method: Mapping[str, Any] | None = None) -> str:
    """The command line that serves `target` with the exported drafter, drafting k tokens a step,
    `method` the kind's fields of vLLM's --speculative-config (draft/kinds.py `vllm_method`;
    default: the default kind's)."""
    k = num_speculative_tokens
    method = method or kinds.get(kinds.DEFAULT).vllm_method
    if engine == "vllm":
        spec = json.dumps({**method, "model": str(drafter), "num_speculative_tokens": k})
        return shlex.join([*serve_launcher(target), "--speculative-config", spec])
    return shlex.join([
        "python", "-m", "sglang.launch_server", "--model-path", target, "--speculative-algorithm", "EAGLE3",
        "--speculative-draft-model-path", str(drafter), "--speculative-num-steps", str(k),
        "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", str(k + 1),
    ])
