"""Why a drafter's live acceptance on MT-bench is lower than its held-out accuracy.

Runs eyas's lossless chain decoding on MT-bench questions (stratified over categories),
then runs the drafter's training-time-test forward over the very answers it produced and
puts three figures side by side:
  - live: the share of verification steps whose first drafted token was accepted;
  - teacher-forced step-0 accuracy at those same draft starts (must equal live: the
    decoding loop and training compute the same thing; `start_mismatch` counts starts
    where the whole accepted run differs from the teacher-forced one);
  - teacher-forced accuracy at every answer position, per TTT step (the drafter's accuracy
    on MT-bench text, to hold against its held-out accuracy on the training data).
The first two differ from the third by where drafting starts (after a rejection, at
harder positions); the third differs from held-out accuracy by the prompts' domain.

  PYTHONPATH=src python bench/acceptance_gap.py --drafter DIR --questions 8 --out results/acceptance_gap.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafter", required=True)
    p.add_argument("--model", default="packaged:smollm2-135m")
    p.add_argument("--questions", type=int, default=8)
    p.add_argument("--steps", type=int, default=7)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", required=True)
    args = p.parse_args()

    from eyas.evaluate.drafter import DrafterSession
    from eyas.evaluate.prompts import _mt_bench_file, load_prompts
    from eyas.evaluate.proposers import Eagle3
    from eyas.evaluate.run import eos_ids, load_checked_drafter, run_methods
    from eyas.evaluate.target import TargetSession
    from eyas.models import load_target, model_identity

    model, tok = load_target(args.model, dtype="float32", device=args.device)
    drafter = load_checked_drafter(args.drafter, model, model_identity(args.model, model.config, tok))
    target = TargetSession(model, drafter.config.aux_layer_ids)
    category = {str(q["question_id"]): q["category"] for q in map(json.loads, open(_mt_bench_file()))}
    by_cat: dict[str, list] = {}
    for prompt in load_prompts("mt-bench"):
        by_cat.setdefault(category[prompt.id], []).append(prompt)
    chosen = [by_cat[c][k] for k in range(10) for c in sorted(by_cat) if k < len(by_cat[c])][: args.questions]
    t0 = time.monotonic()
    records = run_methods(target, tok, [Eagle3(DrafterSession(drafter), args.steps)], chosen, args.max_new_tokens,
                          eos_ids(model, tok))
    K = args.steps
    every = torch.zeros(K, 2)  # correct, counted: teacher-forced step k at every answer position
    live_first = forced_first = starts = mismatch = 0
    target.capture_aux = True
    for r in records:
        seq = r["prompt_ids"] + r["generated_ids"]
        P, L = len(r["prompt_ids"]), len(seq)
        with torch.inference_mode():
            _, aux = target.prefill(torch.tensor(seq))
            logits = drafter.forward_ttt(torch.tensor(seq)[None], aux[None], K)
        ids = torch.tensor(seq)
        # Entry i, step k predicts token i + 2 + k; answer tokens after the first (which the
        # prefill emits, undrafted) are P + 1 .. L - 1.
        hit = [drafter.draft_to_target(lg[0].argmax(-1)) == _shifted(ids, 2 + k) for k, lg in enumerate(logits)]
        for k in range(K):
            lo, hi = P - 1, L - 2 - k
            if hi > lo:
                every[k, 0] += hit[k][lo:hi].sum()
                every[k, 1] += hi - lo
        pos = P + 1  # the token a draft's first position proposes
        for accepted in r["accept_counts"]:
            if pos >= L:
                break
            run = 0
            while run < K and pos + run < L and bool(hit[run][pos - 2]):
                run += 1
            mismatch += run != min(accepted, L - pos)
            live_first += accepted > 0
            forced_first += bool(hit[0][pos - 2])
            starts += 1
            pos += accepted + 1
    steps = sum(len(r["accept_counts"]) for r in records)
    result = {
        "command": "python bench/acceptance_gap.py " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()),
        "drafter": args.drafter, "questions": [p.id for p in chosen], "answers": len(records),
        "seconds": round(time.monotonic() - t0, 1),
        "tau_live": sum(sum(a + 1 for a in r["accept_counts"]) for r in records) / steps,
        "draft_starts": starts, "live_first_accepted": live_first / starts,
        "forced_step0_at_starts": forced_first / starts, "start_mismatch": mismatch,
        "forced_acc_every_position": [round(c / n, 4) for c, n in every.tolist()],
        "answer_positions": int(every[0, 1]),
    }
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


def _shifted(ids: torch.Tensor, s: int) -> torch.Tensor:
    """ids shifted left by s, padded with -1 (never a token), so position i holds ids[i + s]."""
    return torch.cat([ids[s:], ids.new_full((s,), -1)])


if __name__ == "__main__":
    main()
