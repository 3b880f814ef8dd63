"""Every option of `eyas eval`, in one typed config: the CLI is generated from it, the recipe's
`eval:` keys are checked against it, and `evaluate` (or, with --teacher-forced, the
teacher-forced scorer) reads it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from eyas.errors import EyasError
from eyas.options import check_rules, device_option, option, seed_option
from eyas.paths import check_confined, check_writable, remove_leftovers
from eyas.validate import COUNT, Number

BASELINES = ("prompt-lookup",)
DECODES = ("static", "eager")


def parse_baselines(text: str) -> tuple[str, ...]:
    """`--baseline prompt-lookup,...` (or none) -> the baselines besides plain decoding."""
    return tuple(b.strip() for b in text.split(",") if b.strip() and b.strip() != "none")


LOOKUP_DEPTH = 7  # prompt lookup's tokens per step when no drafter sets the depth


@dataclass(kw_only=True)
class EvalConfig:
    model: str = option("the target: packaged:smollm2-135m, a .gguf, a folder or a hub id")
    draft: str | None = option("drafter checkpoint folder (from `eyas train`); without it only baselines run", None)
    prompts: str = option("mt-bench (80 questions, both turns), a JSONL file of {'prompt'}, {'turns'} or "
                          "{'messages'} lines, or long[:L1,L2[:N]]: N prompts (4) of at most each L tokens of "
                          "context (8k,32k,64k), built from the packaged ShareGPT, tau reported by length",
                          "mt-bench")
    limit: int | None = option("use only the first N prompts", None, rule=COUNT)
    max_new_tokens: int = option("per answer", 256, rule=COUNT)
    steps: int | None = option(
        "draft tokens per step (chain), tree depth with --tree; also prompt lookup's length (default: the depth the "
        f"drafter was trained to draft, its --ttt-steps, which `eyas export` serves; {LOOKUP_DEPTH} without --draft)",
        None, rule=COUNT)
    tree: bool = option("draft a dynamic tree instead of a chain", False)
    top_k: int = option("tree: children per expanded node", 10, rule=COUNT)
    draft_tokens: int = option("tree: drafted nodes verified per step", 60, rule=COUNT)
    temperature: float = option("0 is greedy", 0.0, rule=Number(lo=0, required=True))
    baselines: tuple[str, ...] = option("comma-separated baselines besides plain decoding: prompt-lookup, or none",
                                        BASELINES, flag="--baseline", parse=parse_baselines,
                                        metavar="BASELINE")
    decode: str = option("static: the target and drafter on preallocated caches, each step one CUDA graph replay on a "
                         "GPU; eager: transformers' growing cache and no graphs (the same answers, slower: for "
                         "comparison, or a target whose forward cannot be recorded)", "static", choices=DECODES)
    dtype: str = option("float32, bfloat16 or float16", "float32")
    device: str = device_option()  # eyas.device.resolve_device
    seed: int = seed_option("sampling seed for T > 0")
    output: str = option("results file", "results.json")
    plot: str | None = option("PNG of per-position acceptance (default: the output path with .png)", None)
    workers: int = option("processes sharing the prompts, dealt round-robin over categories; the same answers as "
                          "one process, the timings contended", 1, rule=COUNT)
    teacher_forced: str | None = option(
        "instead of decoding: the drafter's accuracy per TTT step on this prepared folder (or hidden-state store, "
        "whose states are used as captured), scored as the trainer scores its held-out samples", None,
        metavar="PREPARED")
    held_out: bool = option("with --teacher-forced: only the samples the drafter's training run held out (--draft "
                            "is that run's folder)", False)

    def __post_init__(self) -> None:
        unknown = [b for b in self.baselines if b not in BASELINES]
        if unknown:
            raise EyasError(f"Unknown baseline(s) {unknown}; choose from none, {', '.join(BASELINES)}.")
        check_rules(self)
        if self.teacher_forced and not self.draft:
            raise EyasError("--teacher-forced scores a drafter: give --draft.")
        if self.held_out and not self.teacher_forced:
            raise EyasError("--held-out goes with --teacher-forced PREPARED.")

    def check_paths(self) -> None:
        """Before any work: the outputs can be written, and neither is one of the inputs."""
        plot = self.plot or str(Path(self.output).with_suffix(".png"))
        inputs = {"--prompts": self.prompts, "--model": self.model, "--draft": self.draft,
                  "--teacher-forced": self.teacher_forced}
        for option_, path in [("--output", self.output)] + ([] if self.teacher_forced else [("--plot", plot)]):
            check_writable(path, option_)
            check_confined(path, inputs, option_)
            remove_leftovers(Path(path).expanduser().parent, [Path(path).name])  # a killed run's half-written file
