"""Every option of `eyas prepare`, in one typed config: the CLI is generated from it, the
recipe's `prepare:` keys are checked against it, and `prepare` (data/prepare.py) reads it."""

from __future__ import annotations

from dataclasses import dataclass

from eyas.errors import EyasError
from eyas.options import check_rules, option
from eyas.validate import COUNT, Number


@dataclass(kw_only=True)
class PrepareConfig:
    model: str | None = option("target model: folder, .gguf, packaged:smollm2-135m or hub id", None)
    data: list[str] | None = option(
        "source(s): FILE.json(l), FILE.parquet, FILE.arrow, a save_to_disk folder, packaged:sharegpt, "
        "packaged:chitchat or packaged:synthetic:N:SEED; mix several as SRC@WEIGHT", None)
    out: str | None = option("output folder for the prepared samples", None)
    max_len: int = option("truncate samples to this many tokens", 2048, rule=Number(lo=2, integer=True, required=True))
    limit: int | None = option("keep at most this many samples", None, rule=COUNT)
    window: int | None = option(
        "cut conversations into windows of this many user turns, a sample each (e.g. 2, as MT-bench)", None,
        rule=COUNT, metavar="TURNS")
    pack: bool = option(
        "join consecutive conversations into one sample of up to --max-len tokens, as one long chat (long-context "
        "training): one that does not open on a user turn starts a sample, one ending on an unanswered user turn "
        "ends one", False)
    exclude_prompts: list[str] | None = option(
        "drop conversations sharing 8 words in a row with these eval prompts (mt-bench, a prompt file or a long "
        "spec as eval's --prompts; repeatable)", None, repeat=True, metavar="PROMPTS")
    strict: bool = option("stop at the first bad record instead of skipping it", False)
    chat_template: str | None = option("a Jinja chat template to use instead of the tokenizer's", None,
                                       metavar="FILE")
    workers: int | None = option(
        "processes that tokenize (default: up to 8 of the machine's cores; 1 tokenizes in this process); the "
        "result does not depend on it", None, rule=COUNT)
    show: int | None = option("print sample N of DIR with trained tokens highlighted", None, metavar="N")
    dir: str | None = option("prepared folder to read (with --show)", None, positional=True)

    def __post_init__(self) -> None:
        check_rules(self)
        if self.show is not None:
            if not self.dir:
                raise EyasError("--show N needs the prepared folder: eyas prepare --show N DIR")
            return
        missing = [f"--{k}" for k in ("model", "data", "out") if not getattr(self, k)]
        if missing:
            raise EyasError(f"missing {', '.join(missing)} (see eyas prepare --help)")
