"""Why a drafter is less accurate on MT-bench answers than on held-out ShareGPT/chitchat ones.

Two explanations predict the same headline gap (third GPU run: teacher-forced step 0 ~0.60 on
MT-bench answers, 0.76 held-out): MT-bench text is intrinsically harder for the target (it is
less sure of its own next token, and what the target itself hesitates over a drafter misses
more often), or the drafter is worse on that text at equal target certainty (a domain gap
that training on prompts more like MT-bench's would close). This script separates the two.

Answers: the target's own greedy float32 answers (first turns only) to
  - mt-bench: N questions per category (round-robin, as acceptance_gap.py picks them);
  - sharegpt, chitchat: prompts the drafter never saw, taken from the packed training source
    (`quality_gpu.py pack`) past the records the GPU run regenerated, spread evenly over the
    eligible records (English-looking, first user turn of at most --max-prompt-tokens). Which
    dataset a record came from is read back from the packaged datasets. `pack` puts every
    conversation's first window first, so records past the regenerated ones are later windows
    (a mid-conversation user turn asked on its own), as a third of the training records were;
  - sharegpt-trained (a control): ShareGPT conversation openers from the regenerated records,
    text the drafter was trained on (or held out): what this measurement gives on the kind of
    text behind training's own figures.
At every answer position j (the target at j predicts token j+1, the label), one
teacher-forced pass records:
  - the target's top-1 probability p1 and entropy (nats) at j;
  - whether the drafter's training-time-test forward (entry j-1, step k predicts token j+1+k)
    hits the label at steps 0..K-1, exactly as training scores it (a label outside the draft
    vocabulary is a miss);
  - whether copying from context (eyas's prompt lookup: the latest earlier occurrence of the
    longest suffix of up to 3 tokens, and the token that followed it) gives the label.
Per set: means, step-0 accuracy bucketed by p1 and each bucket's share of positions, and
MT-bench's accuracy predicted from another set's per-bucket accuracies reweighted by
MT-bench's bucket shares (how much of the gap the text's uncertainty explains). Intervals
resample whole answers (positions within an answer are not independent).

  HF_HUB_OFFLINE=1 PYTHONPATH=src python bench/mtbench_gap.py --drafter DIR --out bench/results/mtbench_gap_cpu.json
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import subprocess
import time
from pathlib import Path

import torch

BUCKETS = (0.0, 0.3, 0.5, 0.7, 0.9, 1.0 + 1e-9)  # p1 edges; the last bucket is [0.9, 1.0]
FINE = tuple(i / 10 for i in range(10)) + (1.0 + 1e-9,)  # tenths: the reweighting's robustness check
REGENERATED = 28_672  # records of the packed source the third GPU run regenerated (and trained on)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafter", required=True, help="drafter folder (config.json + model.safetensors)")
    p.add_argument("--out", required=True, help="JSON result path")
    p.add_argument("--model", default="packaged:smollm2-135m", help="target (default the packaged SmolLM2-135M-Instruct)")
    p.add_argument("--conversations", default=".carry/bench/b/conversations.jsonl.gz",
                   help="the packed training source, in pack's order (quality_gpu.py pack)")
    p.add_argument("--start", type=int, default=40_000,
                   help=f"first packed record eligible as an unseen prompt (the GPU run regenerated the first {REGENERATED:,})")
    p.add_argument("--mtbench-per-category", type=int, default=3, help="MT-bench questions per category (8 categories)")
    p.add_argument("--sharegpt", type=int, default=24, help="unseen ShareGPT prompts")
    p.add_argument("--chitchat", type=int, default=12, help="unseen chitchat prompts")
    p.add_argument("--trained-sharegpt", type=int, default=12,
                   help="control: ShareGPT conversation openers from the regenerated records, i.e. text the drafter "
                        "was trained on (95%%) or held out (5%%); tells what this measurement gives where training "
                        "reported 0.80 (train) / 0.76 (held-out); 0 to skip")
    p.add_argument("--max-prompt-tokens", type=int, default=300, help="longest first user turn taken from the source")
    p.add_argument("--min-prompt-tokens", type=int, default=4, help="shortest (drops 'continue', 'ok' and the like)")
    p.add_argument("--max-new-tokens", type=int, default=200, help="answer length cap (greedy, float32)")
    p.add_argument("--steps", type=int, default=7, help="TTT steps scored (step 0 .. steps-1)")
    p.add_argument("--bootstrap", type=int, default=1000, help="resamples of answers for the intervals")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    return p.parse_args()


# ---------------------------------------------------------------- prompts


def mtbench_prompts(per_category: int) -> list[tuple[object, str]]:
    """(first-turn EvalPrompt, category), round-robin over the sorted categories."""
    from eyas.evaluate.prompts import EvalPrompt, _mt_bench_file, load_prompts

    category = {str(q["question_id"]): q["category"] for q in map(json.loads, open(_mt_bench_file()))}
    by_cat: dict[str, list] = {}
    for prompt in load_prompts("mt-bench"):
        by_cat.setdefault(category[prompt.id], []).append(prompt)
    return [(EvalPrompt(p.id, p.turns[:1]), c) for k in range(per_category) for c in sorted(by_cat)
            for p in by_cat[c][k:k + 1]]


def source_index() -> tuple[dict[str, set[str]], set[str]]:
    """Each packaged dataset's user messages (to tell a packed record's dataset) and the
    messages that open a conversation (to tell a first window from a later one)."""
    from eyas.data.sources import BadRecord, iter_records, normalize

    users: dict[str, set[str]] = {}
    openers: set[str] = set()
    for name in ("sharegpt", "chitchat"):
        users[name] = set()
        for record in iter_records(f"packaged:{name}"):
            try:
                messages = [m["content"] for m in normalize(record) if m["role"] == "user"]
            except BadRecord:
                continue
            users[name].update(messages)
            openers.update(messages[:1])
    return users, openers


def english_looking(text: str) -> bool:
    letters = [c for c in text if c.isalpha()]
    return len(letters) >= 3 and sum(c.isascii() for c in letters) >= 0.95 * len(letters)


def packed_prompts(path: str, lo: int, hi: int, wanted: dict[str, int], tok, min_tokens: int, max_tokens: int,
                   index: tuple[dict[str, set[str]], set[str]], openers_only: bool = False) -> list[tuple[object, str, bool]]:
    """(EvalPrompt of the record's first user turn, dataset, opens a conversation) for packed
    records lo <= i < hi, spread evenly over the eligible ones."""
    from eyas.evaluate.prompts import EvalPrompt

    users, openers = index
    eligible: dict[str, list[tuple[int, str]]] = {name: [] for name in wanted}
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for i, line in enumerate(f):
            if not lo <= i < hi:
                continue
            first = next(m["content"] for m in json.loads(line)["messages"] if m["role"] == "user")
            names = [name for name in users if first in users[name]]
            if (len(names) == 1 and names[0] in eligible and english_looking(first)
                    and (first in openers or not openers_only)):
                eligible[names[0]].append((i, first))
    chosen = []
    for name, n in wanted.items():
        pool = eligible[name]
        lengths = [len(ids) for ids in tok([t for _, t in pool], add_special_tokens=False)["input_ids"]] if pool else []
        pool = [r for r, m in zip(pool, lengths) if min_tokens <= m <= max_tokens]
        picks = [pool[int(k * len(pool) / n)] for k in range(n)] if len(pool) >= n else pool
        chosen += [(EvalPrompt(f"packed:{i}", [text]), name, text in openers) for i, text in picks]
    return chosen


# ---------------------------------------------------------------- measurement


@torch.inference_mode()
def measure(record: dict, model, target, drafter, steps: int) -> dict[str, torch.Tensor]:
    """Per answer position j (P <= j <= L-2): p1, entropy, drafter hits [steps], copy hit,
    label in the draft vocabulary, target argmax equals the label (greedy consistency)."""
    from eyas.evaluate.proposers import PromptLookup

    seq = record["prompt_ids"] + record["generated_ids"]
    P, L = len(record["prompt_ids"]), len(seq)
    ids = torch.tensor(seq)
    logits = model(input_ids=ids[None]).logits[0].float()  # [L, V]
    target.capture_aux = True
    _, aux = target.prefill(ids)  # aux [L, A, H]
    ttt = drafter.forward_ttt(ids[None], aux.float()[None], steps)  # steps x [1, L, draft V]
    j = torch.arange(P, L - 1)  # answer positions with a label
    label = ids[j + 1]
    logp = torch.log_softmax(logits[j], -1)  # [n, V]
    p1 = logp.max(-1).values.exp()
    entropy = -(logp.exp() * logp).sum(-1)
    hits = torch.full((len(j), steps), False)
    for k, lg in enumerate(ttt):
        guess = drafter.draft_to_target(lg[0].argmax(-1))  # entry i predicts token i + 2 + k
        valid = j + 1 + k <= L - 1
        hits[valid, k] = guess[j[valid] - 1] == ids[j[valid] + 1 + k]
    lookup = PromptLookup(1, max_ngram=3)
    copy = torch.tensor([tuple(lookup.propose(seq[: q + 1], 1).tokens[:1]) == (seq[q + 1],) for q in j.tolist()])
    return {"p1": p1, "entropy": entropy, "hits": hits, "scored": (j[:, None] + 1 + torch.arange(steps)) <= L - 1,
            "copy": copy, "in_draft_vocab": drafter.t2d[label], "argmax_is_label": logits[j].argmax(-1) == label}


# ---------------------------------------------------------------- summaries


def bucket_of(p1: torch.Tensor, edges: tuple[float, ...]) -> torch.Tensor:
    return torch.bucketize(p1, torch.tensor(edges[1:-1]), right=True)


def per_bucket(answers: list[dict], edges: tuple[float, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Step-0 hits and positions per p1 bucket, summed over `answers`."""
    hits, count = torch.zeros(len(edges) - 1), torch.zeros(len(edges) - 1)
    for a in answers:
        b = bucket_of(a["p1"], edges)
        hits.index_add_(0, b, a["hits"][:, 0].float())
        count.index_add_(0, b, torch.ones(len(b)))
    return hits, count


def reweighted(mt: list[dict], ref: list[dict], edges: tuple[float, ...]) -> float:
    """MT-bench's step-0 accuracy predicted from `ref`'s per-bucket accuracy at MT-bench's bucket shares."""
    mh, mc = per_bucket(mt, edges)
    rh, rc = per_bucket(ref, edges)
    share = mc / mc.sum()
    acc = torch.where(rc > 0, rh / rc.clamp(min=1), torch.zeros(()))
    return float((share * acc).sum() / share[rc > 0].sum())  # buckets ref never fills are left out


def step0(answers: list[dict]) -> float:
    return float(sum(a["hits"][:, 0].sum() for a in answers) / sum(len(a["p1"]) for a in answers))


def interval(values: list[float]) -> list[float]:
    v = sorted(values)
    return [round(v[int(0.025 * len(v))], 4), round(v[int(0.975 * len(v)) - 1], 4)]


def summarize_set(answers: list[dict], steps: int) -> dict:
    cat = {k: torch.cat([a[k] for a in answers]) for k in ("p1", "entropy", "hits", "scored", "copy", "in_draft_vocab", "argmax_is_label")}
    n = len(cat["p1"])
    hits, count = per_bucket(answers, BUCKETS)
    return {
        "answers": len(answers), "positions": n,
        "mean_answer_tokens": round(sum(len(a["p1"]) + 1 for a in answers) / len(answers), 1),
        "mean_p1": round(float(cat["p1"].mean()), 4), "mean_entropy_nats": round(float(cat["entropy"].mean()), 4),
        "share_p1_below_0.5": round(float((cat["p1"] < 0.5).float().mean()), 4),
        "step_acc": [round(float(cat["hits"][:, k].sum() / cat["scored"][:, k].sum()), 4) for k in range(steps)],
        "copy_acc": round(float(cat["copy"].float().mean()), 4),
        "label_in_draft_vocab": round(float(cat["in_draft_vocab"].float().mean()), 4),
        "target_argmax_is_label": round(float(cat["argmax_is_label"].float().mean()), 4),
        "step0_by_p1": [{"p1": f"[{lo:.1f}, {min(hi, 1.0):.1f}{']' if hi > 1 else ')'}", "share": round(float(c / n), 4),
                         "positions": int(c), "step0_acc": round(float(h / c), 4) if c else None}
                        for lo, hi, h, c in zip(BUCKETS, BUCKETS[1:], hits.tolist(), count.tolist())],
    }


def compare(mt: list[dict], ref: list[dict], resamples: int, gen: torch.Generator) -> dict:
    """MT-bench against `ref`: the gap, and how much of it MT-bench's p1 mix predicts."""
    def draw(xs: list[dict]) -> list[dict]:
        return [xs[i] for i in torch.randint(len(xs), (len(xs),), generator=gen).tolist()]

    acc_mt, acc_ref = step0(mt), step0(ref)
    pred = {name: reweighted(mt, ref, edges) for name, edges in (("buckets", BUCKETS), ("tenths", FINE))}
    boot = {"gap": [], "explained": []}
    for _ in range(resamples):
        m, r = draw(mt), draw(ref)
        a_m, a_r, p = step0(m), step0(r), reweighted(m, r, BUCKETS)
        boot["gap"].append(a_r - a_m)
        boot["explained"].append((a_r - p) / (a_r - a_m) if a_r != a_m else float("nan"))
    return {
        "step0_mtbench": round(acc_mt, 4), "step0_ref": round(acc_ref, 4), "gap": round(acc_ref - acc_mt, 4),
        "gap_95": interval(boot["gap"]),
        "mtbench_predicted_from_ref": {k: round(v, 4) for k, v in pred.items()},
        "share_of_gap_explained_by_p1": {k: round((acc_ref - v) / (acc_ref - acc_mt), 3) for k, v in pred.items()},
        "share_explained_95": interval([x for x in boot["explained"] if x == x]),
    }


# ---------------------------------------------------------------- main


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    from eyas.data.template import ChatTemplate
    from eyas.evaluate.proposers import Proposer
    from eyas.evaluate.run import eos_ids, load_checked_drafter, run_methods
    from eyas.evaluate.target import TargetSession
    from eyas.models import load_target, model_identity

    t0 = time.monotonic()
    model, tok = load_target(args.model, dtype="float32", device="cpu")
    drafter = load_checked_drafter(args.drafter, model, model_identity(args.model, model.config, tok))
    if drafter.config.chat_template:  # prompts rendered as the drafter's training data was, as eyas eval does
        ChatTemplate.from_dict(drafter.config.chat_template).apply(tok)
    target = TargetSession(model, drafter.config.aux_layer_ids)
    sets: dict[str, list[tuple[object, dict]]] = {"mt-bench": [], "sharegpt": [], "chitchat": []}
    for prompt, category in mtbench_prompts(args.mtbench_per_category):
        sets["mt-bench"].append((prompt, {"category": category}))
    index = source_index()
    lengths = (tok, args.min_prompt_tokens, args.max_prompt_tokens, index)
    for prompt, name, opener in packed_prompts(args.conversations, args.start, 1 << 62,
                                               {"sharegpt": args.sharegpt, "chitchat": args.chitchat}, *lengths):
        sets[name].append((prompt, {"opens_conversation": opener}))
    if args.trained_sharegpt:  # the control: conversation openers the drafter was trained on (or held out, 5%)
        sets["sharegpt-trained"] = [(p, {"opens_conversation": o}) for p, _, o in packed_prompts(
            args.conversations, 0, REGENERATED, {"sharegpt": args.trained_sharegpt}, *lengths, openers_only=True)]
    print({k: len(v) for k, v in sets.items()}, f"prompts chosen at {time.monotonic() - t0:.0f} s", flush=True)

    answers: dict[str, list[dict]] = {}
    per_answer = []
    for name, items in sets.items():
        records = run_methods(target, tok, [Proposer()], [p for p, _ in items], args.max_new_tokens, eos_ids(model, tok), progress=False)
        answers[name] = []
        for (prompt, meta), r in zip(items, records):
            m = measure(r, model, target, drafter, args.steps)
            answers[name].append(m | meta)
            per_answer.append({"set": name, "id": prompt.id, **meta, "prompt": prompt.turns[0][:100],
                               "positions": len(m["p1"]), "mean_p1": round(float(m["p1"].mean()), 4),
                               "step0_acc": round(float(m["hits"][:, 0].float().mean()), 4),
                               "copy_acc": round(float(m["copy"].float().mean()), 4), "answer": r["text"][:160]})
        print(name, json.dumps(summarize_set(answers[name], args.steps)), f"{time.monotonic() - t0:.0f} s", flush=True)

    gen = torch.Generator().manual_seed(0)
    mt = answers["mt-bench"]
    by_cat: dict[str, list[dict]] = {}
    for a in mt:
        by_cat.setdefault(a["category"], []).append(a)
    result = {
        "command": "python bench/mtbench_gap.py " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()),
        "commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip(),
        "drafter": args.drafter,
        "drafter_sha256": hashlib.sha256(Path(args.drafter, "model.safetensors").read_bytes()).hexdigest(),
        "definitions": {
            "position": "answer position j: the target at j predicts token j+1 (its own greedy float32 token); "
                        "the first answer token (from the prompt's last position) is not drafted and not counted",
            "p1": "the target's top-1 probability at j (float32 softmax); entropy in nats",
            "step_acc": "teacher-forced drafter hit at TTT step k (entry j-1 predicts token j+1+k); a label outside the draft vocabulary is a miss",
            "copy_acc": "share of positions where prompt lookup (latest earlier match of the longest suffix of up to 3 tokens) proposes the label",
            "predicted": "MT-bench step 0 predicted from a reference set's per-p1-bucket accuracies at MT-bench's bucket shares",
        },
        "sets": {name: summarize_set(a, args.steps) for name, a in answers.items()},
        "mtbench_by_category": {c: {"positions": sum(len(a["p1"]) for a in xs),
                                    "mean_p1": round(float(torch.cat([a["p1"] for a in xs]).mean()), 4),
                                    "step0_acc": round(step0(xs), 4),
                                    "copy_acc": round(float(torch.cat([a["copy"] for a in xs]).float().mean()), 4)}
                                for c, xs in sorted(by_cat.items())},
        "mtbench_against": {ref: compare(mt, answers[ref], args.bootstrap, gen) for ref in answers if ref != "mt-bench"}
                           | {"sharegpt+chitchat": compare(mt, answers["sharegpt"] + answers["chitchat"], args.bootstrap, gen)},
        "answers": per_answer,
        "seconds": round(time.monotonic() - t0, 1),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1, ensure_ascii=False))
    print(json.dumps({k: v for k, v in result.items() if k != "answers"}, indent=1))


if __name__ == "__main__":
    main()
