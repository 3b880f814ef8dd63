"""MLA against GQA drafter training at the seed's shape, on one GPU (issue 25).

The seed's target is Kimi-K2.5, a DeepseekV3 text model: hidden 7168, 64 heads (DeepSeek-V3
has 128: `--heads 128`), target vocabulary 163840, MLA sizes q_lora_rank 1536, kv_lora_rank
512, qk_nope 128, qk_rope 64, v_head 128, and its YaRN rope. For it eyas builds two drafters
with DraftConfig.for_target, both with the draft vocabulary 32000: `--draft-attention mla`
(the target's latent attention, 64 heads, as the published kimi-k2.5-eagle3-mla drafter) and
`gqa` (a Llama layer of 64 heads x v_head_dim 128, as the published MHA kimi-k2.5-eagle3).
Each is trained by the trainer's own step (loop.train_step, flex TTT attention, 7 steps,
bf16 autocast) on in-memory random batches of 256-2048-token samples, 8192 tokens per step
(bench/speed_gpu.py's seed part, reused), then probed for the longest single sample whose
training step fits in memory (doubling from 8192 tokens). First, the compiled flex TTT
attention at MLA's head dims (q/k 192, v 128) is checked against the dense path, values and
gradients, on this GPU (`flex_check`).

Printed and written side by side: tokens/s, peak memory above what was resident, the
largest length that fits, parameters, and the KV cache bytes per token each drafter costs a
serving engine. Top-level `mla_over_gqa_tok_s`, `peak_gib_mla`, `peak_gib_gqa`,
`largest_fitting_tokens`.

  PYTHONPATH=src python3 -u bench/mla_gpu.py --out $OUT --commit SHA    # H200, ~3.5 min
  PYTHONPATH=src python3 -u bench/mla_gpu.py --smoke --out /tmp/mla     # CPU, tiny shapes
"""

from __future__ import annotations

import time

STARTED = time.monotonic()

import argparse
import json
import random
import sys
import traceback
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import speed_gpu  # noqa: E402
from common import Peak, free_memory, git, say, sync  # noqa: E402
from speed_gpu import InMemorySource, in_memory_run  # noqa: E402

SHAPES = {  # the target's text config (Kimi-K2.5's DeepseekV3Config fields)
    "seed": dict(hidden_size=7168, intermediate_size=18432, num_attention_heads=64, num_key_value_heads=64,
                 vocab_size=163840, num_hidden_layers=61, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                 qk_rope_head_dim=64, v_head_dim=128, max_position_embeddings=262144),
    "smoke": dict(hidden_size=192, intermediate_size=384, num_attention_heads=4, num_key_value_heads=4,
                  vocab_size=8192, num_hidden_layers=8, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16,
                  qk_rope_head_dim=8, v_head_dim=16, max_position_embeddings=262144),
}
ROPE = {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 64.0, "original_max_position_embeddings": 4096,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}  # Kimi-K2.5's
DRAFT_VOCAB = {"seed": 32000, "smoke": 1000}
TTT_STEPS = 7


def left(budget_s: float) -> float:
    return budget_s - (time.monotonic() - STARTED)


def target_shape(shape: str, heads: int | None) -> dict[str, Any]:
    s = dict(SHAPES[shape])
    if heads:
        s["num_attention_heads"] = s["num_key_value_heads"] = heads
    return s


def drafter_config(s: dict[str, Any], shape: str, attention: str):
    from transformers import DeepseekV3Config

    from eyas.draft.config import DraftConfig
    from eyas.models.identity import ModelIdentity

    config = DeepseekV3Config(**s, rope_parameters=dict(ROPE))
    N = s["num_hidden_layers"]
    identity = ModelIdentity(model=f"deepseek-v3-{shape}-shape", config_hash="random", tokenizer_hash="random",
                             num_layers=N, hidden_size=s["hidden_size"], vocab_size=s["vocab_size"])
    return DraftConfig.for_target(config, identity, (2, N // 2, N - 3, N), DRAFT_VOCAB[shape], attention=attention,
                                  ttt_steps=TTT_STEPS)


def make_run(draft, lengths: list[int], batch_tokens: int, device: torch.device, **options):
    """speed_gpu's in-memory trainer run for `draft` over samples of `lengths` (`options`: more
    TrainConfig fields)."""
    from eyas.train.config import TrainConfig
    from eyas.models.target_head import TargetHead

    H, V = draft.hidden_size, draft.vocab_size
    cfg = TrainConfig(out="(in memory)", store="(in memory)", draft_vocab=draft.draft_vocab_size, steps=1_000_000,
                      batch_tokens=batch_tokens, ttt_steps=TTT_STEPS, device=str(device), progress=False, **options)
    norm = torch.nn.RMSNorm(H, eps=1e-6).to(device)
    with torch.device(device):
        embed, lm_head = torch.randn(V, H) * 0.02, torch.randn(V, H) * 0.02
    source = InMemorySource(lengths, draft, device)
    run = in_memory_run(cfg, draft, TargetHead(embed, norm, lm_head), source, device)
    run.head = TargetHead(None, norm, lm_head)  # the drafter holds its own copy of the embeddings
    return run


def measure_speed(draft, args, device: torch.device) -> dict[str, Any]:
    """Warm-up steps (compiles), then timed trainer steps: real tokens/s and peak memory."""
    from eyas.train.loop import train_step

    rng = random.Random(1)
    lo, hi = (32, 128) if args.smoke else (256, 2048)
    lengths = [rng.randint(lo, hi) for _ in range(96)]
    with Peak(device) as peak:
        run = make_run(draft, lengths, args.batch_tokens, device)
        start = time.monotonic()
        for _ in range(args.warm_steps):
            train_step(run)
        sync(device)
        warm = time.monotonic() - start
        timed = speed_gpu.timed_steps(run, args.seconds, 200)
    timed = {k: timed[k] for k in ("tok_s", "steps", "tokens", "wall_s")}
    trainable = sum(p.numel() for p in run.model.parameters() if p.requires_grad)
    del run
    free_memory()
    return {**timed, **peak.report(), "warm_s_incl_compile": warm, "trainable_params": trainable}


def flex_check(device: torch.device) -> dict[str, Any]:
    """The compiled flex TTT attention against the dense path at MLA's head dims (q/k 192, v 128),
    7 steps: the largest differences in value and in any input's gradient. Flex runs in bf16, as
    training runs it (its float32 kernel at head dim 192 needs more shared memory than an H200
    has); the dense path runs in float32 on the same bf16 inputs, so the bound is bf16's rounding."""
    import eyas.draft.model as dm

    if device.type != "cuda":
        return {"skipped": "flex attention is used on CUDA only"}
    g = torch.Generator(device=device).manual_seed(0)
    T, steps, tol = 300, TTT_STEPS, 2e-2
    dims = [192, 192, 128] + [192, 128] * (steps - 1)  # q, k0, v0, then (k_j, v_j)
    leaves = [torch.randn(1, 4, T, d, device=device, generator=g).bfloat16().requires_grad_() for d in dims]
    out = {}
    for name, fn, dtype in (("flex", dm.ttt_attention_flex, torch.bfloat16), ("dense", dm.ttt_attention_dense, torch.float32)):
        x = [t.to(dtype) for t in leaves]
        y = fn(x[0], x[1], x[2], list(zip(x[3::2], x[4::2])), 0.07)
        grads = torch.autograd.grad((y.float() * torch.linspace(-1, 1, T, device=device)[:, None]).sum(), leaves)
        out[name] = (y.float(), [gr.float() for gr in grads])
    value = (out["flex"][0] - out["dense"][0]).abs().max().item()
    grad = max((a - b).abs().max().item() for a, b in zip(out["flex"][1], out["dense"][1]))
    pairs = [(out["flex"][0], out["dense"][0]), *zip(out["flex"][1], out["dense"][1])]
    return {"dtype": "bf16 flex against float32 dense", "max_abs_diff_value": value, "max_abs_diff_grad": grad,
            "tolerance": f"atol = rtol = {tol}", "ok": all(torch.allclose(a, b, atol=tol, rtol=tol) for a, b in pairs)}


def fits(draft, length: int, device: torch.device, **options) -> dict[str, Any]:
    """One training step on one sample of `length` tokens (`options`: more TrainConfig fields):
    did it fit, and its peak."""
    from eyas.train.loop import train_step

    run = None
    try:
        with Peak(device) as peak:
            run = make_run(draft, [length], length, device, **options)
            train_step(run)
            sync(device)
        return {"fits": True, **peak.report()}
    except torch.OutOfMemoryError as e:
        return {"fits": False, "error": str(e).splitlines()[0][:200]}
    finally:
        run = None
        free_memory()


def longest(draft, args, device: torch.device, budget_s: float) -> dict[str, Any]:
    """Double the sample length from --probe-from until a step no longer fits (or time runs out)."""
    tried, length, best = {}, args.probe_from, None
    while length <= args.probe_to:
        if left(budget_s) < args.probe_reserve:
            tried["stopped"] = "budget"
            break
        start = time.monotonic()
        result = fits(draft, length, device)
        tried[str(length)] = {**result, "s": round(time.monotonic() - start, 1)}
        say(f"  {draft.attention} {length} tokens: {'fits' if result['fits'] else 'out of memory'} "
            f"{result.get('peak_gib', '')}")
        if not result["fits"]:
            break
        best, length = length, 2 * length
    return {"largest_fitting_tokens": best, "tried": tried,
            "bounded_by": "probe_to" if best == args.probe_to else "memory or budget"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: proves the script runs")
    p.add_argument("--heads", type=int, default=None, help="the target's attention heads (default Kimi-K2.5's 64)")
    p.add_argument("--device", default=None, help="default cuda (cpu with --smoke)")
    p.add_argument("--batch-tokens", type=int, default=None, help="tokens per step (default 8192; 512 with --smoke)")
    p.add_argument("--seconds", type=float, default=None, help="timed seconds per drafter (default 20; 2 with --smoke)")
    p.add_argument("--warm-steps", type=int, default=3)
    p.add_argument("--probe-from", type=int, default=None, help="first probed length (default 8192; 128 with --smoke)")
    p.add_argument("--probe-to", type=int, default=None, help="last probed length (default 131072; 256 with --smoke)")
    p.add_argument("--probe-reserve", type=float, default=25.0, help="seconds a probe needs at least")
    p.add_argument("--minutes", type=float, default=3.6, help="budget: probes stop when it runs out")
    p.add_argument("--out", default=".", help="folder for mla_gpu.json")
    p.add_argument("--commit", default=None, help="recorded if git is not available where this runs")
    args = p.parse_args()
    shape = "smoke" if args.smoke else "seed"
    device = torch.device(args.device or ("cpu" if args.smoke else "cuda"))
    args.batch_tokens = args.batch_tokens or (512 if args.smoke else 8192)
    args.seconds = args.seconds or (2.0 if args.smoke else 20.0)
    args.probe_from = args.probe_from or (128 if args.smoke else 8192)
    args.probe_to = args.probe_to or (256 if args.smoke else 131072)
    if args.smoke:
        args.warm_steps = min(args.warm_steps, 1)
        args.probe_reserve = 0.0
    budget = args.minutes * 60
    machine = torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"
    record: dict[str, Any] = {
        "command": "python3 " + " ".join(sys.argv), "commit": git("rev-parse", "HEAD") or args.commit,
        "dirty": bool(git("status", "--porcelain")), "machine": machine, "torch": torch.__version__,
        "shape": {**target_shape(shape, args.heads), "rope": ROPE, "draft_vocab_size": DRAFT_VOCAB[shape],
                  "ttt_steps": TTT_STEPS, "batch_tokens": args.batch_tokens},
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from eyas.draft.mla_config import kv_cache_bytes_per_token
    from eyas.paths import atomic_write_json

    try:
        record["flex_check"] = flex_check(device)
    except Exception as e:  # reported, and the timing still runs: the figures say which path they measured
        record["flex_check"] = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:300]}"}
    say(f"flex TTT attention against dense (q/k 192, v 128): {record['flex_check']}")
    drafts = {a: drafter_config(target_shape(shape, args.heads), shape, a) for a in ("gqa", "mla")}
    for name, draft in drafts.items():
        say(f"{name}: {draft.num_attention_heads} heads, head_dim {draft.head_dim}, mla {draft.mla}")
        try:
            speed = measure_speed(draft, args, device)
        except Exception as e:
            speed = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
        record[name] = {"speed": speed, "kv_cache_bytes_per_token_bf16": kv_cache_bytes_per_token(draft),
                        "attention": draft.attention, "mla": draft.mla, "head_dim": draft.head_dim}
        say(f"{name}: {json.dumps(speed)[:400]}")
        atomic_write_json(out / "mla_gpu.json", record)
    g, m = record["gqa"]["speed"], record["mla"]["speed"]
    record["mla_over_gqa_tok_s"] = m["tok_s"] / g["tok_s"] if "tok_s" in m and "tok_s" in g else None
    record["peak_gib_mla"], record["peak_gib_gqa"] = m.get("peak_gib"), g.get("peak_gib")
    atomic_write_json(out / "mla_gpu.json", record)  # the headline first: the probes may be cut short
    for name, draft in drafts.items():
        record[name]["longest"] = longest(draft, args, device, budget)
        atomic_write_json(out / "mla_gpu.json", record)
    record["largest_fitting_tokens"] = {n: record[n]["longest"]["largest_fitting_tokens"] for n in drafts}
    record["kv_cache_bytes_per_token_bf16"] = {n: record[n]["kv_cache_bytes_per_token_bf16"] for n in drafts}
    record["elapsed_s"] = round(time.monotonic() - STARTED, 1)
    atomic_write_json(out / "mla_gpu.json", record)
    say(f"{'':24}{'gqa':>14}{'mla':>14}")
    for label, key in (("tokens/s", "tok_s"), ("peak GiB", "peak_gib"), ("trainable params", "trainable_params")):
        say(f"{label:24}{g.get(key, float('nan')):>14,.2f}{m.get(key, float('nan')):>14,.2f}")
    say(f"{'largest length (tokens)':24}{str(record['largest_fitting_tokens']['gqa']):>14}"
        f"{str(record['largest_fitting_tokens']['mla']):>14}")
    kv = record["kv_cache_bytes_per_token_bf16"]
    say(f"{'KV cache B/token (bf16)':24}{kv['gqa']:>14,}{kv['mla']:>14,}")
    say(f"mla_over_gqa_tok_s {record['mla_over_gqa_tok_s']}; written {out / 'mla_gpu.json'} "
        f"in {record['elapsed_s']} s")


if __name__ == "__main__":
    main()
