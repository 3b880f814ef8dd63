"""Save and load drafter checkpoints: an HF-style folder of `config.json` and
`model.safetensors` holding exactly the tensors vLLM's EAGLE-3 loader reads."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save

from eyas.draft.build import new_drafter
from eyas.draft.config import DraftConfig
from eyas.draft.model import Eagle3Drafter
from eyas.errors import EyasError
from eyas.paths import atomic_write_bytes

WEIGHTS = "model.safetensors"
_NOT_SAVED = ("embed_tokens.", "rotary.")


def drafter_state(model: Eagle3Drafter) -> dict[str, torch.Tensor]:
    """The saved tensors: everything but the target's frozen embeddings and rotary caches."""
    return {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items() if not k.startswith(_NOT_SAVED)}


def save_drafter(model: Eagle3Drafter, folder: str | Path) -> None:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(folder / WEIGHTS, save(drafter_state(model), metadata={"format": "pt"}))
    model.config.save(folder)


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file; a missing, cut-off or damaged file is one line naming it."""
    try:
        return load_file(path)
    except FileNotFoundError:
        raise EyasError(f"{path.parent} has no {path.name}.") from None
    except Exception as e:  # safetensors' own errors: a bad header, a file shorter than its header says
        raise EyasError(f"{path} is damaged or not a safetensors file ({type(e).__name__}: "
                        f"{(str(e).splitlines() or [''])[0][:200]}).") from None


def load_drafter(folder: str | Path, embed_weight: torch.Tensor | None = None) -> Eagle3Drafter:
    """Rebuild a drafter; pass the target's input embeddings [V, H] to make it usable."""
    cfg = DraftConfig.load(folder)
    model = new_drafter(cfg, embed_weight)
    state = read_safetensors(Path(folder) / WEIGHTS)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.startswith(_NOT_SAVED)]
    if missing or unexpected:
        raise EyasError(f"{folder}/{WEIGHTS} does not match its config: missing {missing}, unexpected {unexpected}.")
    return model
