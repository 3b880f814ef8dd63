"""`eyas eval` end to end: load target and drafter (refusing a drafter made for another
model), run every method on the same prompts, write results.json, the table and the plot."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from eyas import __version__
from eyas.data.template import ChatTemplate
from eyas.draft import load_drafter
from eyas.errors import EyasError
from eyas.evaluate.drafter import DrafterSession
from eyas.evaluate.generate import generate
from eyas.evaluate.plot import plot_acceptance
from eyas.evaluate.prompts import EvalPrompt, load_prompts, render
from eyas.evaluate.proposers import Eagle3, PromptLookup, Proposer
from eyas.evaluate.report import RATE_DEFINITION, TAU_DEFINITION, format_table, summarize
from eyas.evaluate.target import TargetSession
from eyas.models import ModelIdentity, load_target, model_identity
from eyas.paths import atomic_write_json

BASELINES = ("prompt-lookup",)


@dataclass(kw_only=True)
class EvalConfig:
    model: str
    draft: str | None = None
    prompts: str = "mt-bench"
    limit: int | None = None
    max_new_tokens: int = 256
    steps: int = 7
    tree: bool = False
    top_k: int = 10
    draft_tokens: int = 60
    temperature: float = 0.0
    baselines: tuple[str, ...] = ("prompt-lookup",)
    dtype: str = "float32"
    device: str = "cpu"
    seed: int = 0
    output: str = "results.json"
    plot: str | None = None  # default: the output path with .png

    def __post_init__(self) -> None:
        unknown = [b for b in self.baselines if b not in BASELINES]
        if unknown:
            raise EyasError(f"Unknown baseline(s) {unknown}; choose from none, {', '.join(BASELINES)}.")
        for name in ("max_new_tokens", "steps", "top_k", "draft_tokens"):
            if getattr(self, name) < 1:
                raise EyasError(f"--{name.replace('_', '-')} must be at least 1.")
        if self.temperature < 0:
            raise EyasError("--temperature must be >= 0 (0 is greedy).")
        if self.limit is not None and self.limit < 1:
            raise EyasError("--limit must be at least 1.")


def check_drafter(identity: ModelIdentity, drafter_cfg, where: str) -> None:
    """Refuse a drafter made for another target: hidden size, tokenizer, config, layers."""
    made_for = drafter_cfg.identity
    if drafter_cfg.hidden_size != identity.hidden_size or made_for.hidden_size != identity.hidden_size:
        raise EyasError(f"{where} has hidden size {drafter_cfg.hidden_size} (made for {made_for.model}), but the "
                        f"model {identity.model} has hidden size {identity.hidden_size}.")
    identity.check_same(made_for, where)
    if drafter_cfg.label_layer_id != identity.num_layers or max(drafter_cfg.aux_layer_ids) >= identity.num_layers:
        raise EyasError(f"{where} reads layer ids {list(drafter_cfg.layer_ids)}, which do not fit the "
                        f"{identity.num_layers}-layer model {identity.model}.")


def load_checked_drafter(path: str, model, identity: ModelIdentity) -> torch.nn.Module:
    from eyas.draft import DraftConfig

    check_drafter(identity, DraftConfig.load(path), f"The drafter {path}")
    param = next(model.parameters())
    drafter = load_drafter(path, model.get_input_embeddings().weight.detach().float().cpu())
    drafter.to(param.device).eval().requires_grad_(False)
    for weight in drafter.parameters():  # weights only: rotary frequencies stay float32, as in the target
        weight.data = weight.data.to(param.dtype)
    return drafter


def eos_ids(model, tokenizer) -> set[int]:
    ids = model.generation_config.eos_token_id
    ids = set(ids if isinstance(ids, list) else [] if ids is None else [ids])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    if not ids:
        raise EyasError("The model defines no end-of-sequence token; eyas eval cannot tell when an answer ends.")
    return ids


def run_prompt(target: TargetSession, tokenizer, proposer: Proposer, prompt: EvalPrompt, max_new_tokens: int,
               eos: set[int], temperature: float, generator: torch.Generator | None) -> list[dict]:
    """Answer every turn of `prompt` with `proposer`; later turns see its own earlier answers."""
    messages = list(prompt.history)
    records = []
    for turn, question in enumerate(prompt.turns):
        messages.append({"role": "user", "content": question})
        ids = render(tokenizer, messages)
        g = generate(target, proposer, ids, max_new_tokens, eos, temperature, generator)
        answer = tokenizer.decode([t for t in g.generated_ids if t not in eos], skip_special_tokens=True)
        messages.append({"role": "assistant", "content": answer})
        records.append({"prompt_id": prompt.id, "turn": turn, "method": proposer.name, "prompt_ids": g.prompt_ids,
                        "generated_ids": g.generated_ids, "accept_counts": g.accept_counts, "seconds": g.seconds,
                        "text": answer})
    return records


def run_methods(target: TargetSession, tokenizer, proposers: list[Proposer], prompts: list[EvalPrompt],
                max_new_tokens: int, eos: set[int], temperature: float = 0.0, seed: int = 0,
                progress: bool = True, warmup: bool = True) -> list[dict]:
    """Every method on every prompt, interleaved per prompt so load changes hit all alike;
    first (with `warmup`) one short untimed generation per method."""
    def generator(k: int) -> torch.Generator | None:
        return torch.Generator(device=target.device).manual_seed(seed + k) if temperature > 0 else None

    for p in proposers if warmup else []:
        generate(target, p, render(tokenizer, [{"role": "user", "content": prompts[0].turns[0]}]),
                 min(8, max_new_tokens), eos, temperature, generator(-1))
    records = []
    for i, prompt in enumerate(tqdm(prompts, desc="eval", unit="prompt", disable=not progress)):
        for p in proposers:
            records += run_prompt(target, tokenizer, p, prompt, max_new_tokens, eos, temperature, generator(i))
    return records


def drafter_proposer(drafter, cfg: EvalConfig, generator: torch.Generator | None) -> Proposer:
    """The drafter's kind decides how it drafts: EAGLE-3 a chain or tree step by step, DFlash
    a block in one pass (verified as a chain)."""
    if drafter.config.drafter == "dflash":
        if cfg.tree:
            raise EyasError("A DFlash drafter proposes one block, verified as a chain; drop --tree.")
        from eyas.evaluate.dflash import DFlash, DFlashSession

        return DFlash(DFlashSession(drafter), cfg.steps, temperature=cfg.temperature, generator=generator)
    return Eagle3(DrafterSession(drafter), cfg.steps, tree=cfg.tree, top_k=cfg.top_k, max_nodes=cfg.draft_tokens,
                  temperature=cfg.temperature, generator=generator)


def evaluate(cfg: EvalConfig) -> dict:
    torch.manual_seed(cfg.seed)
    prompts = load_prompts(cfg.prompts, cfg.limit)
    model, tokenizer = load_target(cfg.model, dtype=cfg.dtype, device=cfg.device)
    identity = model_identity(cfg.model, model.config, tokenizer)
    proposers: list[Proposer] = [Proposer()]
    if "prompt-lookup" in cfg.baselines:
        proposers.append(PromptLookup(cfg.steps))
    aux_ids: tuple[int, ...] = ()
    if cfg.draft:
        drafter = load_checked_drafter(cfg.draft, model, identity)
        if drafter.config.chat_template:  # prompts as the drafter's training data was rendered
            ChatTemplate.from_dict(drafter.config.chat_template).apply(tokenizer)
        aux_ids = drafter.config.aux_layer_ids
        gen = torch.Generator(device=cfg.device).manual_seed(cfg.seed) if cfg.temperature > 0 else None
        proposers.append(drafter_proposer(drafter, cfg, gen))
    target = TargetSession(model, aux_ids)
    records = run_methods(target, tokenizer, proposers, prompts, cfg.max_new_tokens, eos_ids(model, tokenizer),
                          cfg.temperature, cfg.seed)
    target.close()
    summaries = summarize(records, {p.name: cfg.steps for p in proposers[1:]})
    results = {
        "eyas_version": __version__, "tau_definition": TAU_DEFINITION, "acceptance_definition": RATE_DEFINITION,
        "settings": asdict(cfg), "target": identity.to_dict(),
        "summary": {k: s.to_dict() for k, s in summaries.items()}, "records": records,
    }
    out = Path(cfg.output)
    atomic_write_json(out, results)
    plot = Path(cfg.plot) if cfg.plot else out.with_suffix(".png")
    plot_acceptance(summaries, plot, f"{cfg.model} on {cfg.prompts} ({len(prompts)} prompts, T={cfg.temperature})")
    print(format_table(summaries))
    print(f"\nwrote {out} and {plot}")
    return results
