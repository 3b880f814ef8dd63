"""Every option of `eyas capture`, in one typed config: the CLI is generated from it, the
recipe's `capture:` keys are checked against it, and `capture` (capture/run.py) reads it."""

from __future__ import annotations

from dataclasses import dataclass

from eyas.vllm.options import CAPTURE_DESCRIPTION, VLLM_GROUP, CaptureVLLMOptions
from eyas.device_flag import TORCHRUN_NOTE
from eyas.errors import EyasError
from eyas.options import batch_tokens_option, check_rules, device_option, layers_option, nested, option
from eyas.validate import Number

BACKENDS = ("hf", "vllm")


@dataclass(kw_only=True)
class CaptureConfig:
    model: str = option("target model: folder, .gguf, packaged:smollm2-135m or hub id")
    data: str | None = option("prepared folder (from eyas prepare); required unless --print-serve-command", None)
    out: str | None = option("store folder (created, or resumed if it exists); required unless --print-serve-command",
                             None)
    backend: str = option("hf (transformers) or vllm", "hf", choices=BACKENDS)
    layers: str = layers_option()
    dtype: str = option("store dtype (fp8 halves it)", "bf16", choices=("bf16", "fp16", "fp32", "fp8"))
    device: str = device_option(f"{TORCHRUN_NOTE}; hf backend only (vLLM places the model itself)")
    model_dtype: str | None = option("dtype the target runs in (default float32 on cpu, bf16 on cuda)", None)
    batch_tokens: int = batch_tokens_option("padded tokens per forward")
    chat_template: str | None = option(
        "not needed: the template `prepare` used is recorded with --data; if given, it must be that one", None,
        metavar="FILE")
    shard_mb: float = option("target shard size in MiB", 1024, rule=Number(lo=0, lo_open=True, required=True))
    vllm: CaptureVLLMOptions = nested(CaptureVLLMOptions, VLLM_GROUP, CAPTURE_DESCRIPTION)

    def __post_init__(self) -> None:
        check_rules(self)
        if self.backend == "vllm":
            self.vllm.check_together()
        if not self.serve_command_only:
            missing = [f"--{k}" for k in ("data", "out") if not getattr(self, k)]
            if missing:
                raise EyasError(f"missing {', '.join(missing)} (see eyas capture --help)")

    @property
    def serve_command_only(self) -> bool:
        """--backend vllm --print-serve-command: print the server's command, capture nothing."""
        return self.backend == "vllm" and self.vllm.print_serve_command
