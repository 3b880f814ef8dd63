"""The drafter checkpoint: an HF-style folder that eval, export and a resumed training read.

drafter/
  config.json          `DraftConfig.to_hf_dict()`: the fields vLLM's EAGLE-3 loader reads, and
                       eyas's own under `eyas` (with `config_version`, see draft/config.py)
  model.safetensors    exactly the tensors vLLM's EAGLE-3 loader reads: every parameter and
                       buffer of the drafter but those named by `NOT_SAVED`

The file names and what is saved are stated only here.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save

from eyas.draft.build import new_drafter
from eyas.draft.config import DraftConfig
from eyas.draft.model import Eagle3Drafter
from eyas.errors import EyasError
from eyas.paths import atomic_write_bytes, atomic_write_json

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
DRAFTER_FILES = (CONFIG, WEIGHTS)
# Not saved: the target's frozen embeddings (the engine shares the target's) and rotary caches
# (recomputed from the config).
NOT_SAVED = ("embed_tokens.", "rotary.")


def drafter_state(model: Eagle3Drafter) -> dict[str, torch.Tensor]:
    """The saved tensors: everything but the target's frozen embeddings and rotary caches."""
    return {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items() if not k.startswith(NOT_SAVED)}


def saved_names(model: torch.nn.Module) -> dict[str, torch.Size]:
    """The names and shapes of the tensors a checkpoint of `model` holds (a meta-device model will do)."""
    return {k: v.shape for k, v in model.state_dict().items() if not k.startswith(NOT_SAVED)}


def save_config(cfg: DraftConfig, folder: str | Path) -> None:
    atomic_write_json(Path(folder) / CONFIG, cfg.to_hf_dict())


def load_config(folder: str | Path) -> DraftConfig:
    """The config of the drafter in `folder`; a missing, damaged or too new one is one line naming it."""
    path = Path(folder) / CONFIG
    try:
        raw = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise EyasError(f"{folder} is not a drafter checkpoint: no {CONFIG}.") from None
    except NotADirectoryError:
        raise EyasError(f"{folder} is a file; give the drafter's folder ({CONFIG} + {WEIGHTS}).") from None
    except (ValueError, RecursionError):
        raise EyasError(f"{path} is cut off or is not JSON; train or export the drafter again.") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("eyas", {}), dict):
        raise EyasError(f"{path} is not a drafter config (a JSON object with an `eyas` block).")
    return DraftConfig.from_hf_dict(raw, str(path))


def save_drafter(model: Eagle3Drafter, folder: str | Path) -> None:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(folder / WEIGHTS, save(drafter_state(model), metadata={"format": "pt"}))
    save_config(model.config, folder)


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file; a missing, cut-off or damaged file is one line naming it."""
    try:
        return load_file(path)
    except FileNotFoundError:
        raise EyasError(f"{path.parent} has no {path.name}.") from None
    except Exception as e:  # safetensors' own errors: a bad header, a file shorter than its header says
        raise EyasError(f"{path} is damaged or not a safetensors file ({type(e).__name__}: "
                        f"{(str(e).splitlines() or [''])[0][:200]}).") from None


def check_finite(state: dict[str, torch.Tensor], what: str) -> None:
    """Refuse weights holding NaN or inf (a diverged run, a damaged file): a drafter with them
    drafts garbage that eval would score and an engine would serve without a word."""
    for name, t in state.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise EyasError(f"{what}: the tensor {name} holds NaN or inf values, so the drafter is damaged or its "
                            f"training diverged; train it again, or use an earlier checkpoint.")


def load_drafter(folder: str | Path, embed_weight: torch.Tensor | None = None) -> Eagle3Drafter:
    """Rebuild a drafter; pass the target's input embeddings [V, H] to make it usable."""
    cfg = load_config(folder)
    model = new_drafter(cfg, embed_weight)
    state = read_safetensors(Path(folder) / WEIGHTS)
    check_finite(state, f"{folder}/{WEIGHTS}")
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.startswith(NOT_SAVED)]
    if missing or unexpected:
        raise EyasError(f"{folder}/{WEIGHTS} does not match its config: missing {missing}, unexpected {unexpected}.")
    return model
