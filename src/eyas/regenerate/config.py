"""Every option of `eyas regenerate`, in one typed config: the CLI is generated from it, the
recipe's `regenerate:` keys are checked against it, and `regenerate` (regenerate/run.py) reads it."""

from __future__ import annotations

from dataclasses import dataclass

from eyas.vllm.options import VLLM_GROUP, EngineOptions
from eyas.options import check_rules, device_option, nested, option, seed_option
from eyas.validate import COUNT, POSITIVE, Number


@dataclass(kw_only=True)
class RegenerateConfig:
    model: str = option("target model (the one the data was prepared for)")
    data: str = option("prepared folder (from eyas prepare)")
    out: str = option("new prepared folder (resumed if it exists)")
    backend: str = option("hf (transformers) or vllm", "hf", choices=("hf", "vllm"))
    temperature: float = option("sampling temperature; 0 = greedy", 0.0, rule=Number(lo=0, required=True))
    max_new_tokens: int = option("longest answer per turn", 1024, rule=COUNT)
    group_size: int | None = option(
        "conversations generated together, and saved together for resume (default: 4096 on a GPU, whose batches the "
        "cache budget bounds; 64 on the CPU)", None, rule=COUNT)
    minutes: float | None = option(
        "stop after the group that ends past this many minutes; the output holds what is done, and the same "
        "command continues", None, rule=POSITIVE)
    pack: bool = option(
        "join the regenerated conversations into samples of up to the data's max_len, as `prepare --pack` does: "
        "each conversation is answered on its own (cheap), and training sees long chats", False)
    seed: int = seed_option("sampling seed (with --temperature > 0)")
    device: str = device_option("hf backend only (vLLM places the model itself)")
    model_dtype: str | None = option(
        "dtype the target runs in (hf: float32 on cpu, bf16 on cuda; vllm: the checkpoint's)", None)
    vllm: EngineOptions = nested(EngineOptions, VLLM_GROUP)

    def __post_init__(self) -> None:
        check_rules(self)
