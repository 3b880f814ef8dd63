"""`eyas eval` end to end: load target and drafter (refusing a drafter made for another
model), run every method on the same prompts, write results.json, the table and the plot.

With `workers` > 1 (at most one a prompt), that many processes each load the target and
drafter and answer a share of the prompts, dealt round-robin over categories; every prompt's
answers are the same as in one process (temperature > 0 seeds each prompt by its index), only
the timings differ. A worker that dies ends the run with one line naming the prompts it held,
without a retry: what kills a worker (the out-of-memory killer, a crash, a user's kill) most
likely strikes again, and a rerun gives the same answers. The workers are killed when the run
ends, however it ends, and on Linux they die with it even when it is killed outright.
"""

from __future__ import annotations

import ctypes
import functools
import multiprocessing
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from dataclasses import asdict, replace
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from eyas import __version__
from eyas.data.exclusion import not_excluded
from eyas.data.long_prompts import load_prompt_set
from eyas.data.template import ChatTemplate
from eyas.device import parse_device, resolve_device
from eyas.draft import load_config, load_drafter
from eyas.draft.kinds import BLOCK, PARALLEL
from eyas.errors import EyasError
from eyas.evaluate.dflash import DFlash, DFlashSession
from eyas.evaluate.config import LOOKUP_DEPTH, EvalConfig
from eyas.evaluate.drafter import DrafterSession
from eyas.evaluate.generate import generate
from eyas.evaluate.peagle import PEagle
from eyas.evaluate.plot import plot_acceptance
from eyas.evaluate.prompts import stratified
from eyas.evaluate.proposers import Eagle3, PromptLookup, Proposer
from eyas.evaluate.report import (RATE_DEFINITION, TAU_DEFINITION, differing, format_breakdown, format_table,
                                  low_precision_note, summarize, tau_by)
from eyas.evaluate.static_target import StaticTargetSession
from eyas.evaluate.target import TargetSession
from eyas.export.exporter import speculative_tokens
from eyas.models import ModelIdentity, load_target, load_tokenizer, model_identity, resolve_model
from eyas.models.identity import text_config
from eyas.models.eos import eos_ids
from eyas.paths import atomic_write_json
from eyas.prompts import EvalPrompt, render
from eyas.timing import StepTimer
from eyas.train.checkpoint import data_of, unfinished_note

__all__ = ["EvalConfig", "evaluate"]  # EvalConfig lives in evaluate/config.py (torch-free)


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
    check_drafter(identity, load_config(path), f"The drafter {path}")
    param = next(model.parameters())
    drafter = load_drafter(path, model.get_input_embeddings().weight.detach().float().cpu())
    drafter.to(param.device).eval().requires_grad_(False)
    for weight in drafter.parameters():  # weights only: rotary frequencies stay float32, as in the target
        weight.data = weight.data.to(param.dtype)
    return drafter


def run_prompt(target: TargetSession, tokenizer, proposer: Proposer, prompt: EvalPrompt, max_new_tokens: int,
               eos: set[int], temperature: float, generator: torch.Generator | None,
               timer: StepTimer | None = None) -> list[dict]:
    """Answer every turn of `prompt` with `proposer`; later turns see its own earlier answers, so
    each turn's length is known, and checked against the target's positions, only when it comes."""
    messages = list(prompt.history)
    limit = position_limit(target.model.config)
    records = []
    for turn, question in enumerate(prompt.turns):
        messages.append({"role": "user", "content": question})
        ids = render(tokenizer, messages)
        check_fits(prompt, turn, len(ids), max_new_tokens, limit, target.model.config.name_or_path)
        g = generate(target, proposer, ids, max_new_tokens, eos, temperature, generator, timer)
        answer = tokenizer.decode([t for t in g.generated_ids if t not in eos], skip_special_tokens=True)
        messages.append({"role": "assistant", "content": answer})
        records.append({"prompt_id": prompt.id, "category": prompt.category, "turn": turn, "method": proposer.name,
                        "prompt_ids": g.prompt_ids,
                        "generated_ids": g.generated_ids, "accept_counts": g.accept_counts, "seconds": g.seconds,
                        "text": answer})
    return records


def run_methods(target: TargetSession, tokenizer, proposers: list[Proposer], prompts: list[EvalPrompt],
                max_new_tokens: int, eos: set[int], temperature: float = 0.0, seed: int = 0,
                progress: bool = True, warmup: bool = True, indices: list[int] | None = None,
                timer: StepTimer | None = None) -> list[dict]:
    """Every method on every prompt, interleaved per prompt so load changes hit all alike;
    first (with `warmup`) one short untimed generation per method. `indices` are the prompts'
    places in the whole set (sampling seeds follow them), when these are a worker's share.
    `timer` (benchmarks) sums every method's draft and verify seconds into one timer."""
    def generator(k: int) -> torch.Generator | None:
        return torch.Generator(device=target.device).manual_seed(seed + k) if temperature > 0 else None

    for p in proposers if warmup else []:
        generate(target, p, render(tokenizer, [{"role": "user", "content": prompts[0].turns[0]}]),
                 min(8, max_new_tokens), eos, temperature, generator(-1))
    records = []
    for i, prompt in zip(indices or range(len(prompts)), tqdm(prompts, desc="eval", unit="prompt", disable=not progress)):
        for p in proposers:  # a drafter's own draws restart per prompt too: any share of the prompts draws alike
            if getattr(p, "generator", None) is not None:
                p.generator.manual_seed(seed * 1_000_003 + i)
        for p in proposers:
            records += run_prompt(target, tokenizer, p, prompt, max_new_tokens, eos, temperature, generator(i),
                                  timer)
    return records


def cache_slots(cfg: EvalConfig) -> int:
    """The slots a static session's caches start with: a long prompt and its answer; a longer
    sequence grows them (recording the graphs again)."""
    return 2048 + cfg.max_new_tokens


def target_session(model, aux_ids: tuple[int, ...], cfg: EvalConfig) -> TargetSession | StaticTargetSession:
    """The target as `--decode` says: a static cache and CUDA graphs, or transformers' own cache."""
    if cfg.decode == "eager":
        return TargetSession(model, aux_ids)
    return StaticTargetSession(model, aux_ids, capacity=cache_slots(cfg))


def drafter_proposer(drafter, cfg: EvalConfig, generator: torch.Generator | None) -> Proposer:
    """How the drafter's kind drafts decides the proposer: step by step a chain or a tree, a
    block (DFlash) or parallel slots (P-EAGLE) in one pass, verified as a chain."""
    kind = drafter.config.kind
    if cfg.tree and not kind.drafts_trees:
        raise EyasError(f"{kind.a_title(True)} drafter proposes one block, verified as a chain; drop --tree.")
    how = {"capacity": cache_slots(cfg), "graphs": cfg.decode == "static"}
    if kind.drafting == BLOCK:
        return DFlash(DFlashSession(drafter, **how), cfg.steps, temperature=cfg.temperature, generator=generator)
    if kind.drafting == PARALLEL:
        return PEagle(DrafterSession(drafter, **how), cfg.steps, temperature=cfg.temperature, generator=generator)
    return Eagle3(DrafterSession(drafter, **how), cfg.steps, tree=cfg.tree, top_k=cfg.top_k,
                  max_nodes=cfg.draft_tokens, temperature=cfg.temperature, generator=generator)


def prompt_tokenizer(cfg: EvalConfig):
    """The tokenizer that renders eval's prompts: the target's, with the drafter's chat template
    when it recorded one (as its training data was rendered)."""
    tokenizer = load_tokenizer(cfg.model)
    if cfg.draft and (template := load_config(cfg.draft).chat_template):
        ChatTemplate.from_dict(template).apply(tokenizer)
    return tokenizer


def position_limit(config) -> int | None:
    """The positions the target was made for (None: it does not say)."""
    return getattr(text_config(config), "max_position_embeddings", None)


def check_fits(prompt: EvalPrompt, turn: int, n: int, max_new_tokens: int, limit: int | None, model: str) -> None:
    """Refuse turn `turn` of `prompt`, rendered as `n` tokens, when its answer could run past the
    target's positions, where its answers would be another model's."""
    if limit and n + max_new_tokens > limit:
        which = f"Prompt {prompt.id}" + (f" at turn {turn + 1} (after its earlier answers)" if turn else "")
        raise EyasError(f"{which} is {n} tokens; with --max-new-tokens {max_new_tokens} it needs "
                        f"{n + max_new_tokens} positions, more than the {limit} of {model}. Use shorter "
                        f"prompts (long:{limit - max_new_tokens} for long ones) or fewer new tokens.")


def check_positions(config, tokenizer, prompts: list[EvalPrompt], cfg: EvalConfig) -> None:
    """Before any decoding, refuse a prompt whose first turn and answer would run past the
    target's positions (a long prompt asks for its length plus the answer); later turns, whose
    length depends on the answers before them, are checked as they come (`run_prompt`)."""
    limit = position_limit(config)
    for p in prompts if limit else []:
        n = len(render(tokenizer, [*p.history, {"role": "user", "content": p.turns[0]}]))
        check_fits(p, 0, n, cfg.max_new_tokens, limit, cfg.model)


def _answer(cfg: EvalConfig, prompts: list[EvalPrompt], indices: list[int], progress: bool = True
            ) -> tuple[list[dict], dict]:
    """Load the target (and drafter) and answer `prompts` at `indices` with every method:
    (records, the target's identity)."""
    device = str(resolve_device(cfg.device))
    model, tokenizer = load_target(cfg.model, dtype=cfg.dtype, device=device)
    identity = model_identity(cfg.model, model.config, tokenizer, resolve_model(cfg.model))
    proposers: list[Proposer] = [Proposer()]
    if "prompt-lookup" in cfg.baselines:
        proposers.append(PromptLookup(cfg.steps))
    aux_ids: tuple[int, ...] = ()
    if cfg.draft:
        drafter = load_checked_drafter(cfg.draft, model, identity)
        if drafter.config.chat_template:  # prompts as the drafter's training data was rendered
            ChatTemplate.from_dict(drafter.config.chat_template).apply(tokenizer)
        aux_ids = drafter.config.aux_layer_ids
        gen = torch.Generator(device=device).manual_seed(cfg.seed) if cfg.temperature > 0 else None
        proposers.append(drafter_proposer(drafter, cfg, gen))
    check_positions(model.config, tokenizer, [prompts[i] for i in indices], cfg)
    target = target_session(model, aux_ids, cfg)
    eos = set(eos_ids(model.generation_config, tokenizer))
    records = run_methods(target, tokenizer, proposers, [prompts[i] for i in indices], cfg.max_new_tokens,
                          eos, cfg.temperature, cfg.seed, progress, indices=indices)
    target.close()
    return records, identity.to_dict()


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _die_with_parent(parent: int) -> None:
    """Have Linux SIGKILL this worker when the eval that started it dies, however it dies: a
    killed eval's workers would go on holding the GPU's memory. (The signal follows the parent
    thread that started the worker: `evaluate`'s, which waits for the workers.) Elsewhere
    nothing is set up, and the parent's clean-up is all there is."""
    if not sys.platform.startswith("linux"):
        return
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before the request took hold
        os._exit(1)


def _worker(cfg: EvalConfig, prompts: list[EvalPrompt], indices: list[int], threads: int, parent: int,
            results: Connection) -> None:
    """A worker process: answer `prompts` at `indices` and send back (records, the target's
    identity), or the exception that stopped it, its traceback in a note (for --debug)."""
    _die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the parent ends the workers
    # tqdm's default lock is a multiprocessing semaphore, which a killed worker would leave to
    # the resource tracker (a warning at exit); the worker's bars need no more than a thread lock.
    tqdm.set_lock(threading.RLock())
    torch.set_num_threads(threads)
    torch.manual_seed(cfg.seed)
    try:
        answer = _answer(cfg, prompts, indices, progress=False)
    except Exception as e:  # noqa: BLE001  (raised again by the parent)
        e.add_note(f"in eval worker process {os.getpid()}:\n{traceback.format_exc()}")
        answer = e
    results.send(answer)


def _lost(process: multiprocessing.process.BaseProcess, w: int, workers: int, ids: list[str]) -> EyasError:
    """The one line for a worker that died before sending its answers."""
    process.join()
    code = process.exitcode or 0
    try:
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
    except ValueError:
        how = f"was killed by signal {-code}"
    shown = ", ".join(ids[:10]) + (f" and {len(ids) - 10} more" if len(ids) > 10 else "")
    return EyasError(f"Worker {w + 1} of {workers} (pid {process.pid}) {how} while answering prompts {shown}; "
                     f"nothing was written. Run the same command again (a prompt's answers do not depend on its "
                     f"worker), with fewer --workers if the machine ran out of memory.")


def _answer_in_workers(cfg: EvalConfig, prompts: list[EvalPrompt], workers: int) -> tuple[list[dict], dict]:
    """`workers` processes (at most one a prompt) over the stratified shares; records put back
    in prompt order. Each sends its answers through its own pipe, so a worker that dies ends
    that pipe: the run stops at once, naming its prompts, and ends the other workers."""
    order = stratified(prompts)
    shares = [order[w::workers] for w in range(workers)]
    threads = max(1, (os.cpu_count() or 1) // workers)
    # spawn: a forked copy of a process that already ran torch can deadlock in its thread pools
    context = multiprocessing.get_context("spawn")
    started: list[tuple[multiprocessing.process.BaseProcess, Connection]] = []
    results: dict[int, tuple[list[dict], dict]] = {}
    try:
        for share in shares:
            receive, send = context.Pipe(duplex=False)
            process = context.Process(target=_worker, args=(cfg, prompts, share, threads, os.getpid(), send),
                                      name="eyas-eval-worker")
            process.start()
            send.close()  # the worker holds the only writer: its death ends the pipe
            started.append((process, receive))
        pending = {receive: w for w, (_, receive) in enumerate(started)}
        while pending:
            for receive in wait(list(pending)):
                w = pending.pop(receive)
                try:
                    answer = receive.recv()
                except EOFError:
                    raise _lost(started[w][0], w, workers, [prompts[i].id for i in shares[w]]) from None
                if isinstance(answer, BaseException):
                    raise answer
                results[w] = answer
    finally:
        for process, _ in started:
            process.kill()
            process.join()
    methods = len({r["method"] for r in results[0][0]})
    by_prompt: dict[int, list[dict]] = {}
    for w, share in enumerate(shares):
        at, records = 0, results[w][0]
        for i in share:  # a worker's records: prompt by prompt, each method's turns in turn
            n = methods * len(prompts[i].turns)
            by_prompt[i], at = records[at:at + n], at + n
    return [r for i in sorted(by_prompt) for r in by_prompt[i]], results[0][1]


def kept_out(cfg: EvalConfig, prompts: list[EvalPrompt], tokenizer: Callable[[], Any]) -> dict[str, Any] | None:
    """Whether the drafter's training data was kept free of these prompts: the eval prompt sets
    its data excluded (recorded from `prepare --exclude-prompts` through training) and the ids of
    the prompts that exclusion did not cover, said in one line, as tau on them may be tau on
    text the drafter trained on. None without a drafter; `checked` False where nothing says.
    `tokenizer` gives the one that rendered the prompts (long sets are built with it)."""
    if not cfg.draft:
        return None
    excluded = (data_of(cfg.draft) or {}).get("excluded_prompts")
    if not isinstance(excluded, list):
        return {"checked": False, "why": "the drafter's folder records no training data exclusions"}
    try:
        ids = not_excluded(prompts, excluded, tokenizer(), cfg.prompts)
    except EyasError as e:
        print(f"eyas eval: note: cannot tell whether the drafter's training data held these prompts: {e}",
              file=sys.stderr, flush=True)
        return {"checked": False, "excluded_prompts": excluded, "why": str(e)}
    if ids:
        shown = ", ".join(ids[:3]) + (", ..." if len(ids) > 3 else "")
        print(f"eyas eval: warning: {len(ids)} of {len(prompts)} prompts ({shown}) were not kept out of the drafter's "
              f"training data, which excluded {', '.join(excluded) or 'no eval prompts'}: its tau on them may be tau on "
              f"text it trained on. Prepare its data with --exclude-prompts {cfg.prompts} to measure new prompts.",
              file=sys.stderr, flush=True)
    return {"checked": True, "excluded_prompts": excluded, "not_excluded": ids}


def draft_depth(cfg: EvalConfig) -> tuple[int, str]:
    """Tokens drafted per step, and why: --steps, else the drafter's trained depth (what its
    export serves, `DraftConfig.depth`), else prompt lookup's default. The drafter's rule is
    export's (`speculative_tokens`), which refuses more than a block or parallel drafter drafts."""
    if cfg.draft:
        why = "--steps" if cfg.steps is not None else "the drafter's trained depth, its TTT steps, as its export serves"
        return speculative_tokens(load_config(cfg.draft), cfg.steps, "--steps"), why
    if cfg.steps is not None:
        return cfg.steps, "--steps"
    return LOOKUP_DEPTH, "prompt lookup's default"


def evaluate(cfg: EvalConfig) -> dict:
    cfg.check_paths()
    parse_device(cfg.device)
    depth, why = draft_depth(cfg)
    cfg = replace(cfg, steps=depth)
    print(f"eyas eval: drafting {depth} tokens a step{' (tree depth)' if cfg.tree else ''}: {why}", flush=True)
    if cfg.decode == "static" and resolve_device(cfg.device).type != "cuda":
        print(f"eyas eval: --decode static on {resolve_device(cfg.device).type}: preallocated caches, every pass eager "
              f"(CUDA graphs need a GPU)", flush=True)
    if cfg.draft and (note := unfinished_note(cfg.draft)):
        print(f"eyas eval: {note}", file=sys.stderr, flush=True)
    torch.manual_seed(cfg.seed)
    tokenizer = functools.cache(lambda: prompt_tokenizer(cfg))  # loaded once, and only if asked for
    prompts = load_prompt_set(cfg.prompts, tokenizer, cfg.limit)
    kept = kept_out(cfg, prompts, tokenizer)
    workers = min(cfg.workers, len(prompts))
    if workers < cfg.workers:
        print(f"eyas eval: --workers {cfg.workers} capped at {workers}, the number of prompts", file=sys.stderr,
              flush=True)
    if workers > 1:
        records, identity = _answer_in_workers(cfg, prompts, workers)
    else:
        records, identity = _answer(cfg, prompts, list(range(len(prompts))))
    summaries = summarize(records, {m: cfg.steps for m in {r["method"] for r in records} - {"plain"}},
                          greedy=cfg.temperature == 0)
    if workers > 1:  # timings taken while the workers shared the machine compare nothing
        for s in summaries.values():
            s.speedup = None
    breakdown = {"category": tau_by(records, "category"), "turn": tau_by(records, "turn")}
    results = {
        "eyas_version": __version__, "tau_definition": TAU_DEFINITION, "acceptance_definition": RATE_DEFINITION,
        "settings": asdict(cfg), "draft_depth": {"tokens": depth, "rule": why}, "target": identity,
        "summary": {k: s.to_dict() for k, s in summaries.items()}, "tau_by": breakdown, "records": records,
        **({"kept_out_of_training": kept} if kept is not None else {}),
    }
    out = Path(cfg.output)
    atomic_write_json(out, results)
    plot = Path(cfg.plot) if cfg.plot else out.with_suffix(".png")
    plot_acceptance(summaries, plot, f"{cfg.model} on {cfg.prompts} ({len(prompts)} prompts, T={cfg.temperature})")
    print(format_table(summaries))
    print(format_breakdown(breakdown))
    if workers > 1:
        print(f"(no speed-ups: {workers} worker processes shared the machine, so their timings are contended; "
              f"--workers 1 measures each method's speed-up in one process)")
    for line in differing(summaries):
        print(f"eyas eval: warning: {line} (greedy decoding: a lossless method gives the same answers"
              f"{low_precision_note(cfg.dtype)})", file=sys.stderr, flush=True)
    print(f"\nwrote {out} and {plot}")
    return results
