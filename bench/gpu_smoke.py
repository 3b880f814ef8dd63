"""A one-minute check of the GPU-only code paths on a tiny random Llama, before a long
bench spends device time on them: the static-cache greedy path (each decode step a CUDA
graph) against `model.generate`, the compiled TTT step loss against the eager one, the
compiled flex TTT attention of a context-parallel shard against the dense path, a few
online training steps through the real trainer (compiled loss, flex attention) and every
decoding method of `eyas eval` on both decoding paths (eager, and CUDA graphs), the tree's
recorded levels against its eager ones, and DFlash's decoding loop on the static path (CUDA
graphs) against the training forward the held-out scorer runs on the sequences it decodes
(`dflash_loop`: its docstring says what to read).

  PYTHONPATH=src:tests python3 bench/gpu_smoke.py --work /tmp/smoke [--texts QUESTIONS.jsonl] [--checks dflash_loop]
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", default="/tmp/smoke")
    p.add_argument("--device", default="cuda")
    p.add_argument("--texts", help="a JSONL of MT-bench questions to train the tiny tokenizer on where the packaged "
                                   "chitchat corpus is not installed (the GPU machine)")
    p.add_argument("--checks", help="the checks to run, comma-separated, named as the output names them (default: "
                                    "all). On the CPU shard_flex_equals_dense cannot run: flex has no backward there")
    args = p.parse_args()
    work, dev = Path(args.work), args.device
    work.mkdir(parents=True, exist_ok=True)
    from tiny import build_model, build_tokenizer, corpus

    texts = [t for line in open(args.texts) for t in json.loads(line)["turns"]] if args.texts else corpus()
    build_tokenizer(work / "tok", texts=texts)
    folder = build_model(work / "llama", "llama", tokenizer_dir=work / "tok")
    run = {"static_greedy_equals_generate": lambda: static_greedy(folder, dev),
           "compiled_loss_equals_eager": lambda: compiled_loss(dev),
           "shard_flex_equals_dense": lambda: shard_flex(dev),
           "train_and_eval": lambda: train_and_eval(folder, work, dev, texts),
           "dflash_loop": lambda: dflash_loop(folder, dev, texts)}
    t0 = time.monotonic()
    checks = {name: run[name]() for name in (args.checks.split(",") if args.checks else run)}
    print(json.dumps(checks, indent=1, default=str))
    # A check passes as True, or as a dict of figures saying "ok": true; train_and_eval's figures
    # come only when its assertions held.
    failed = [k for k, v in checks.items()
              if not (v is True or isinstance(v, dict) and v.get("ok", k == "train_and_eval"))]
    print(f"gpu smoke: {'FAILED (' + ', '.join(failed) + ')' if failed else 'ok'} in {time.monotonic() - t0:.0f} s")


def static_greedy(folder: Path, dev: str) -> bool:
    from eyas.regenerate.generate import HFGenerator

    gen = HFGenerator(str(folder), dtype="float32", device=dev, cache_tokens=600)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 400, (int(n),), generator=g).tolist() for n in torch.randint(3, 60, (9,), generator=g)]
    budgets = [int(b) for b in torch.randint(4, 90, (9,), generator=g)]
    fast = gen.generate(prompts, budgets, 0.0, 0)
    recorded = gen.greedy.graphs.replays > 0 or dev == "cpu"
    return recorded and fast == gen.sample(prompts, budgets, 0.0, 0)


def compiled_loss(dev: str) -> bool:
    from eyas.draft.loss import chunk_loss, fused_chunk_loss
    from eyas.draft.objective import LOSSES

    g = torch.Generator(device=dev).manual_seed(0)
    logits = torch.randn(1200, 2000, device=dev, generator=g).bfloat16()
    probs = torch.softmax(3 * torch.randn(1200, 2000, device=dev, generator=g), -1)
    weight = torch.rand(1200, device=dev, generator=g)
    inside = torch.rand(1200, device=dev, generator=g) * 0.5 + 0.5
    target = torch.where(torch.rand(1200, device=dev, generator=g) < 0.1, -1, probs.argmax(-1))  # -1: outside
    for loss in LOSSES:  # each loss the compiled chunk computes equals its eager form
        eager = chunk_loss(logits, probs, target, weight, inside, loss)
        fused = fused_chunk_loss(True)(logits, probs, target, weight, inside, loss, 3.0)
        for a, b in zip(fused, eager):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    return True


def shard_flex(dev: str) -> bool | dict:
    """A shard's queries (positions 256..639 of 1,024) against every step-0 key plus two later
    steps' same-position keys: the compiled flex path (its block mask's rows shifted) equals
    the dense path in value and in every input's gradient, in float32 (to 1e-3 relative)."""
    from eyas.draft.model import ttt_attention_dense, ttt_attention_flex

    g = torch.Generator(device=dev).manual_seed(1)
    shape = lambda n, h: (1, h, n, 64)  # noqa: E731
    q = torch.randn(*shape(384, 8), device=dev, generator=g).requires_grad_()
    k0, v0 = (torch.randn(*shape(1024, 2), device=dev, generator=g).requires_grad_() for _ in range(2))
    extra = [tuple(torch.randn(*shape(384, 2), device=dev, generator=g).requires_grad_() for _ in range(2))
             for _ in range(2)]
    inputs = [q, k0, v0, *[t for kv in extra for t in kv]]
    results = []
    for fn in (ttt_attention_flex, ttt_attention_dense):
        out = fn(q, k0, v0, extra, offset=256)
        results.append([out, *torch.autograd.grad(out.pow(2).sum(), inputs)])
    worst = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(*results))
    return True if worst < 1e-3 else {"largest_relative_difference": worst}


def train_and_eval(folder: Path, work: Path, dev: str, texts: list[str]) -> dict:
    from eyas.data.config import PrepareConfig
    from eyas.data.prepare import prepare
    from eyas.evaluate.drafter import DrafterSession
    from eyas.prompts import EvalPrompt
    from eyas.evaluate.proposers import Eagle3, PromptLookup, Proposer
    from eyas.evaluate.report import summarize
    from eyas.evaluate.run import load_checked_drafter, run_methods
    from eyas.models.eos import eos_ids
    from eyas.evaluate.static_target import StaticTargetSession
    from eyas.evaluate.target import TargetSession
    from eyas.models import load_target, model_identity
    from eyas.train import TrainConfig, train

    data = work / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": texts[i]},
                                                     {"role": "assistant", "content": texts[i + 1]}]}) + "\n"
                            for i in range(0, min(len(texts), 400) - 1)))
    prepare(PrepareConfig(model=str(folder), data=[str(data)], out=str(work / "prepared"), max_len=128), progress=False)
    final = train(TrainConfig(out=str(work / "drafter"), online=True, model=str(folder), data=str(work / "prepared"),
                              steps=6, batch_tokens=1024, device=dev, progress=False, fc_norm=True, norm_output=True,
                              eval_every=3, save_every=100, log_every=2))
    model, tok = load_target(str(folder), dtype="float32", device=dev)
    drafter = load_checked_drafter(str(work / "drafter"), model, model_identity(str(folder), model.config, tok))
    eos = set(eos_ids(model.generation_config, tok))
    records, replays = [], 0
    for target in (TargetSession(model, drafter.config.aux_layer_ids),
                   StaticTargetSession(model, drafter.config.aux_layer_ids, capacity=16)):  # grows, records again
        proposers = [Proposer(), PromptLookup(7), Eagle3(DrafterSession(drafter, capacity=16), 7),
                     Eagle3(DrafterSession(drafter, capacity=16), 7, tree=True, top_k=10, max_nodes=60)]
        records += run_methods(target, tok, proposers, [EvalPrompt("0", [texts[0], texts[1]])], 24, eos,
                               progress=False)
        replays += getattr(target, "graphs", None).replays if isinstance(target, StaticTargetSession) else 0
    plain = [r["generated_ids"] for r in records if r["method"] == "plain"]
    identical = all(r["generated_ids"] == plain[r["turn"]] for r in records)
    taus = {m: round(s.tau, 3) for m, s in summarize(records, {"eagle3-chain": 7}).items()}
    assert identical, "a speculative method or the graph path changed the greedy output"
    assert replays > 0 or dev == "cpu", "the static path recorded no graph"
    same_trees, tree_replays = tree_graph(drafter)
    assert same_trees, "the tree recorded as a graph is not the tree its eager levels draft"
    assert tree_replays > 0 or dev == "cpu", "the tree's levels recorded no graph"
    return {"train_eval": final.get("eval"), "tau": taus, "identical_to_plain": identical, "target_replays": replays,
            "tree_graph_equals_eager": same_trees, "tree_replays": tree_replays}


def tree_graph(drafter) -> tuple[bool, int]:
    """The tree's levels replayed as one graph draft the tree its levels launched from Python
    do (tokens and parents), draft after draft as the committed context grows past the
    capacity the graphs were first recorded for. Returns (the same trees, graph replays)."""
    from eyas.evaluate.drafter import DrafterSession

    torch.manual_seed(0)
    dev = drafter.fc.weight.device
    layers = len(drafter.config.aux_layer_ids)
    width = drafter.fc.weight.shape[1] // layers
    sessions = [DrafterSession(drafter, capacity=16, graphs=g) for g in (False, True)]
    for n in (9, 3, 1, 5, 12):
        tokens = torch.randint(0, drafter.config.vocab_size, (n,))
        aux = torch.randn(n, layers, width, device=dev)
        trees = []
        for session in sessions:
            session.extend(tokens, aux)
            tree = session.tree(7, top_k=10, max_nodes=60)
            trees.append((tree.tokens, tree.parents))
        if trees[0] != trees[1]:
            return False, sessions[1].graphs.replays
    return True, sessions[1].graphs.replays


DFLASH_K = 7  # drafts per block: eyas's default block of 8
DFLASH_NEW = 64  # the most tokens an answer takes
DFLASH_TOLERANCE = 1e-4  # atol and rtol of a drafted block's logits against the training forward's row


def dflash_loop(folder: Path, dev: str, texts: list[str]) -> dict:
    """eval's DFlash loop on the static path against training's forward over the sequences it
    decodes, every row anchoring a block as the held-out scorer runs it (`eyas.train.loop.score`
    with every row anchored): the CUDA-only paths between held-out accuracy and decoded
    acceptance, which tests/test_on_policy.py proves equal in float32 on the CPU.

    A DFlash drafter of blocks of 8 for the tiny target (`dflash_drafter`), trained on the
    target's own greedy answers to 12 prompts. The loop (`StaticTargetSession` +
    `DFlash(DFlashSession)`, float32, each pass a CUDA graph, both caches grown from 16 slots)
    decodes 6 prompts, 4 of them trained on, keeping every block's logits. Training's forward
    then runs over those sequences on the device, (a) in float32 (flex attention on CUDA, the
    trainer's path; float32 labels) and (b) under the trainer's bf16 autocast, labels too, as
    `score` runs it.

    Read: `blocks` (i) every drafted block against (a)'s row: the largest difference over
    DFLASH_TOLERANCE (atol and rtol, as the CPU test: float32 kernels that add in another
    order move logits by ~1e-6 of them, a wrong mask, position or stale graph buffer by ~1,
    bf16 by ~1e-2) and the argmax agreement; `walk` (ii) the chains the walk over (a), and
    over (b), counts reaching and accepting each step, and tau_walk, against `loop`'s (its
    chains up to the first whose depth the token budget cut); `bf16_argmax_differs_per_step`
    (iii) the share of scored pairs where (b)'s draft is not (a)'s; `acc_per_step` the
    teacher-forced accuracy `score` reports. "ok" needs (i) within tolerance and (ii) exact
    for (a), the answers equal to plain greedy decoding's, every kind of chain (none, part and
    whole accepted), and on CUDA both sessions replaying graphs; (b) is reported, not judged.
    `committed_states_max_abs_diff`: the target's aux states the loop committed against the
    whole-sequence forward's (a store's) that (a) and (b) read."""
    import contextlib
    import dataclasses

    from eyas.draft.loss import CHAINS_ACCEPTING, CHAINS_REACHING
    from eyas.evaluate.dflash import DFlashSession
    from eyas.evaluate.generate import generate
    from eyas.evaluate.proposers import Proposer
    from eyas.evaluate.static_target import StaticTargetSession
    from eyas.models.eos import eos_ids
    from eyas.models.states import TargetStates
    from eyas.models.target_head import load_target_head
    from eyas.prompts import render
    from eyas.train.labels import make_labels
    from eyas.train.loop import _autocast
    from eyas.train.metrics import summarize

    t0, K = time.monotonic(), DFLASH_K
    states = TargetStates(str(folder), device=dev)  # float32; its model decodes too
    head = load_target_head(folder)
    eos = set(eos_ids(states.model.generation_config, states.tokenizer))
    prompts = [render(states.tokenizer, [{"role": "user", "content": t}]) for t in texts[:14]]
    target = StaticTargetSession(states.model, states.layer_ids[:-1], capacity=16)  # grows, records graphs again
    plain = [generate(target, Proposer(), p, DFLASH_NEW, eos).generated_ids for p in prompts]

    def batch(prompts: list[list[int]], answers: list[list[int]]):
        """Right-padded input_ids [B, T], the answers' mask [B, T] and the target's states
        [B, T, L + 1, H] from one forward over the whole sequences (as a store holds them)."""
        seqs = [p + a for p, a in zip(prompts, answers)]
        T = max(map(len, seqs))
        ids = torch.tensor([s + [0] * (T - len(s)) for s in seqs])
        position = torch.arange(T)
        real = position < torch.tensor([len(s) for s in seqs])[:, None]
        mask = real & (position >= torch.tensor([len(p) for p in prompts])[:, None])
        return ids.to(dev), mask.to(dev), states.states(ids, real.long()).clone()  # out of inference mode

    drafter = dflash_drafter(states, head, *(t.cpu() for t in batch(prompts[:12], plain[:12]))).to(dev).eval()
    proposer, decoded, runs = kept_dflash(DFlashSession(drafter, capacity=16, graphs=True)), prompts[8:], []
    for p in decoded:
        g = generate(target, proposer, p, DFLASH_NEW, eos)
        runs.append((g, proposer.blocks, proposer.depths, torch.cat(proposer.aux)))
    target.close()
    ids, mask, hidden = batch(decoded, [g.generated_ids for g, *_ in runs])

    walked, rows_match, committed = [], True, 0.0
    for b, (p, (g, blocks, depths, aux)) in enumerate(zip(decoded, runs)):
        row, chains = len(p) - 1, []  # (row, accepted, depth); the prefill's token is read by the row before it
        for a, depth in zip(g.accept_counts, depths):
            chains.append((row, a, depth))
            row += a + 1
        rows_match &= [r for r, _ in blocks] == [r for r, _, d in chains if d]
        # The walk drafts K wherever the sample goes on, the loop fewer where the token budget ends:
        # the sample is scored as it stood when the first such chain was drafted.
        cut = next((r for r, _, d in chains if d < K), None)
        if cut is not None:
            mask[b, cut + 2:] = False
        walked += [a for r, a, _ in chains if cut is None or r < cut]
        committed = max(committed, (aux - hidden[b, : len(aux), :-1]).abs().max().item())
    loop = chain_counts(walked, K)
    draft_ids = drafter.d2t + torch.arange(len(drafter.d2t), device=dev)  # target ids, as training's `_draft_ids`

    def forward(cast, head) -> tuple:
        """The held-out scorer's forward, every row anchoring a block -> labels, the walk's
        figures (as `loop`'s), logits (K x [B, T, Vd] float32)."""
        with torch.no_grad(), cast:
            labels = make_labels(head, hidden[:, :, -1], mask, draft_ids, ids)
            stats = drafter(ids, hidden[:, :, :-1], labels, torch.ones(K, device=dev))[1]
            logits = [lg.float() for lg in drafter.forward_ttt(ids, hidden[:, :, :-1], K)]
        got = {k: stats[:, c].long().tolist() for k, c in (("chains_reaching", CHAINS_REACHING),
                                                            ("chains_accepting", CHAINS_ACCEPTING))}
        summary = summarize(stats)
        figures = {"counts_the_loop": all(got[k] == loop[k] for k in got), "tau_walk": summary.get("tau_walk"), **got}
        figures.update({k: summary.get(k) for k in ("accept_walk_per_step", "acc_per_step", "greedy_path")})
        return labels, figures, logits

    # (a)'s labels from a float32 head (`TargetHead.to` holds lm_head in bf16 on CUDA), (b)'s as `score`'s.
    fp32_head = dataclasses.replace(head, norm=copy.deepcopy(head.norm).to(dev),
                                    lm_head_weight=head.lm_head_weight.to(dev))
    labels, fp32, fp32_logits = forward(contextlib.nullcontext(), fp32_head)
    _, bf16, bf16_logits = forward(_autocast(torch.device(dev)), head.to(dev))
    live = torch.stack([block for _, blocks, _, _ in runs for _, block in blocks])  # [blocks, K, Vd]
    ref = torch.stack([torch.stack([lg[b, row] for lg in fp32_logits]) for b, r in enumerate(runs) for row, _ in r[1]])
    T = ids.shape[1]
    differs = [(fp32_logits[k][:, : T - 1 - k].argmax(-1) != bf16_logits[k][:, : T - 1 - k].argmax(-1))
               [labels.trained[:, 1 + k:]].float().mean().item() for k in range(K)]
    graphs = {"target_replays": target.graphs.replays, "drafter_replays": proposer.session.graphs.replays,
              "recorded": target.graphs.enabled and proposer.session.graphs.enabled}
    diff = (live - ref).abs()
    out = {"blocks": {"count": len(live), "rows_are_the_chains": rows_match, "max_abs_diff": diff.max().item(),
                      "largest_logit": round(ref.abs().max().item(), 3),
                      "over_tolerance": round((diff / (DFLASH_TOLERANCE * (1 + ref.abs()))).max().item(), 4),
                      "argmax_agreement": round((live.argmax(-1) == ref.argmax(-1)).float().mean().item(), 5)},
           "loop": loop, "walk": {"float32": fp32, "bf16_autocast": bf16},
           "bf16_argmax_differs_per_step": [round(x, 5) for x in differs],
           "committed_states_max_abs_diff": committed,
           "identical_to_plain": all(g.generated_ids == a for (g, *_), a in zip(runs, plain[8:])), "graphs": graphs,
           "seconds": round(time.monotonic() - t0, 1)}
    out["ok"] = bool(rows_match and out["blocks"]["over_tolerance"] <= 1 and fp32["counts_the_loop"]
                 and out["identical_to_plain"] and all(loop["accepted_none_part_whole"])
                 and (dev == "cpu" or graphs["recorded"] and graphs["target_replays"] and graphs["drafter_replays"]))
    return out


def dflash_drafter(states, head, ids: torch.Tensor, mask: torch.Tensor, hidden: torch.Tensor) -> torch.nn.Module:
    """A DFlash drafter of blocks of DFLASH_K + 1 for the target `states` reads (two layers, the
    first causal as speculators' imports have them, the second seeing the whole block as
    eyas's own), trained on the samples input_ids, answer mask [B, T] and states [B, T, L + 1, H]
    (the CPU's: there it needs no compiling, a few seconds) on 16 anchors a sample a step, enough
    for chains accepted whole, in part and not at all; its draft vocabulary is half the
    target's, the answers' most frequent tokens."""
    from eyas.draft import DraftConfig
    from eyas.draft.build import new_drafter
    from eyas.draft.loss import step_counts
    from eyas.train.anchors import anchor_rows
    from eyas.train.labels import make_labels

    K, identity, vd = DFLASH_K, states.identity, states.identity.vocab_size // 2
    draft_ids = torch.bincount(ids[mask], minlength=identity.vocab_size).topk(vd).indices.sort().values
    torch.manual_seed(0)
    drafter = new_drafter(DraftConfig.for_target(
        states.model.config, identity, states.layer_ids, vd, drafter="dflash", ttt_steps=K, num_hidden_layers=2,
        causal_layers=(0,), mask_token_id=identity.vocab_size - 1), head.embed_weight)
    drafter.set_vocab(draft_ids)
    labels = make_labels(head, hidden[:, :, -1], mask, draft_ids, ids)
    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=3e-3)
    for step in range(150):
        rows = anchor_rows(mask, K, 16, (0, step))
        loss = drafter(ids, hidden[:, :, :-1], labels, 1 / step_counts(mask, K, rows)[0].expand(K), rows)[0]
        opt.zero_grad()
        loss.backward()
        opt.step()
    return drafter


def kept_dflash(session):
    """eval's DFlash proposer (chains of DFLASH_K), keeping for the answer it last drafted along
    each block (row drafted from, slot logits [K, Vd]), each step's depth and the aux states it
    committed."""
    from eyas.evaluate.dflash import DFlash

    class Kept(DFlash):
        def start(self, prompt_ids, first, aux):
            self.blocks, self.depths, self.aux = [], [], [aux.clone()]
            super().start(prompt_ids, first, aux)

        def propose(self, sequence, budget):
            tree = super().propose(sequence, budget)
            self.depths.append(len(tree.tokens))
            return tree

        def update(self, emitted, aux):
            self.aux.append(aux.clone())
            super().update(emitted, aux)

    proposer, block = Kept(session, DFLASH_K), session.block

    def drafted(last: int) -> torch.Tensor:
        proposer.blocks.append((session.length - 1, block(last)))
        return proposer.blocks[-1][1]

    session.block = drafted
    return proposer


def chain_counts(accepted: list[int], K: int) -> dict:
    """A draft -> verify loop's chains (drafts accepted by each) -> its tau, the chains reaching and
    accepting each step (reaching: the accepted drafts and the first rejected one), the share
    accepting each step (eval's acceptance at position k + 1), and how many accept none, some, all K."""
    n = max(len(accepted), 1)
    accepting = [sum(a > k for a in accepted) for k in range(K)]
    return {"tau": round(1 + sum(accepted) / n, 4), "chains": len(accepted),
            "chains_reaching": [sum(min(a + 1, K) > k for a in accepted) for k in range(K)],
            "chains_accepting": accepting, "accept_per_step": [round(c / n, 4) for c in accepting],
            "accepted_none_part_whole": [sum(a == 0 for a in accepted), sum(0 < a < K for a in accepted),
                                         sum(a == K for a in accepted)]}


if __name__ == "__main__":
    main()
