"""The speculative decoding loop, the same for every method:

    prefill -> first token
    repeat: draft (proposer) -> verify all drafted tokens in one target pass -> accept a path
            -> emit the accepted tokens plus one token of the target's own -> keep their KV

Each verification step records how many drafted tokens it accepted; the acceptance length
is tau = 1 + accepted draft tokens per verification step. Drafts never run past
`max_new_tokens`, so the output is never cut except at an end-of-sequence token (a step
that accepts a drafted end token emits no bonus token after it).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from eyas.device import synchronize
from eyas.evaluate.accept import accept_greedy, accept_sampled, sample_or_argmax
from eyas.evaluate.proposers import Proposer
from eyas.evaluate.target import TargetSession
from eyas.timing import StepTimer, timed


@dataclass
class Generation:
    prompt_ids: list[int]
    generated_ids: list[int]  # every emitted token, the first one (from the prefill) included
    accept_counts: list[int]  # per verification step: drafted tokens accepted
    seconds: float


@torch.inference_mode()
def generate(target: TargetSession, proposer: Proposer, prompt_ids: list[int], max_new_tokens: int,
             eos_ids: set[int], temperature: float = 0.0, generator: torch.Generator | None = None,
             timer: StepTimer | None = None) -> Generation:
    """With `timer`, each step's drafting (propose and update) and verification are timed apart."""
    synchronize(target.device)
    t0 = time.perf_counter()
    target.capture_aux = proposer.needs_aux
    logits, aux = target.prefill(torch.tensor(prompt_ids))
    out = [sample_or_argmax(logits, temperature, generator)]
    proposer.start(prompt_ids, out[0], aux)
    counts: list[int] = []
    while out[-1] not in eos_ids and len(out) < max_new_tokens:
        with timed(timer, "draft"):
            tree = proposer.propose(prompt_ids + out, max_new_tokens - len(out) - 1)
        with timed(timer, "verify"):
            logits, aux = target.verify(out[-1], tree)
        if temperature > 0:
            path, bonus = accept_sampled(tree, logits, temperature, generator)
        else:
            path, bonus = accept_greedy(tree, logits)
        emitted = [tree.tokens[n] for n in path] + [bonus]
        ends = [i for i, t in enumerate(emitted) if t in eos_ids]
        if ends:
            emitted = emitted[: ends[0] + 1]
        rows = [0] + [n + 1 for n in path]
        target.commit(rows)
        counts.append(min(len(path), len(emitted)))
        out += emitted
        if out[-1] not in eos_ids:
            with timed(timer, "draft"):
                proposer.update(emitted, None if aux is None else aux[rows])
    synchronize(target.device)
    return Generation(list(prompt_ids), out, counts, time.perf_counter() - t0)
