"""A one-minute check of the GPU-only code paths on a tiny random Llama, before a long
bench spends device time on them: the static-cache greedy path (each decode step a CUDA
graph) against `model.generate`, the compiled TTT step loss against the eager one, the
compiled flex TTT attention of a context-parallel shard against the dense path, a few
online training steps through the real trainer (compiled loss, flex attention) and every
decoding method of `eyas eval` on both decoding paths (eager, and CUDA graphs), the tree's
recorded levels against its eager ones.

  PYTHONPATH=src:tests python3 bench/gpu_smoke.py --work /tmp/smoke
"""

from __future__ import annotations

import argparse
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
    args = p.parse_args()
    work, dev = Path(args.work), args.device
    work.mkdir(parents=True, exist_ok=True)
    from tiny import build_model, build_tokenizer, corpus

    texts = [t for line in open(args.texts) for t in json.loads(line)["turns"]] if args.texts else corpus()
    build_tokenizer(work / "tok", texts=texts)
    folder = build_model(work / "llama", "llama", tokenizer_dir=work / "tok")
    checks = {}
    t0 = time.monotonic()
    checks["static_greedy_equals_generate"] = static_greedy(folder, dev)
    checks["compiled_loss_equals_eager"] = compiled_loss(dev)
    checks["shard_flex_equals_dense"] = shard_flex(dev)
    checks["train_and_eval"] = train_and_eval(folder, work, dev, texts)
    print(json.dumps(checks, indent=1, default=str))
    passed = all(v is True for k, v in checks.items() if k != "train_and_eval")
    print(f"gpu smoke: {'ok' if passed and isinstance(checks['train_and_eval'], dict) else 'FAILED'} "
          f"in {time.monotonic() - t0:.0f} s")


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
    for loss in LOSSES:  # each loss the compiled chunk computes equals its eager form
        eager = chunk_loss(logits, probs, weight, inside, loss)
        fused = fused_chunk_loss(True)(logits, probs, weight, inside, loss, 3.0)
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


if __name__ == "__main__":
    main()
