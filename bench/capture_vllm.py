"""Benchmark: `eyas capture --backend vllm` against vLLM's plain prefill, same prompts, one run.

  plain   vllm.LLM without extraction, generate(max_tokens=1): prefill only, no hidden states
          leave the engine
  eyas    the real capture loop (`eyas.capture.run.capture`, backend vllm): the same engine
          settings plus extract_hidden_states, eyas's connector, the spool hand-off, checks,
          and the store writer, until the store is closed and verified

Both engines stay up, and the plain engine prefills each batch right before eyas captures it
(same batches, same order), so load that drifts on a shared machine hits both alike. The
plain time is subtracted from the capture's wall time; engine start-up is left out of both.
Prints tokens/s of each and eyas/plain.

  python bench/capture_vllm.py                          # 200 ShareGPT conversations, SmolLM2
  python bench/capture_vllm.py --model ./llama --data prepared --model-dtype bf16
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path


def start_plain(model: str, dtype: str, engine_args: dict):
    from eyas.vllm.engine import base_kwargs, start_llm
    from eyas.models import resolve_model

    kwargs = {**base_kwargs(resolve_model(model), dtype, extra=engine_args), "enable_prefix_caching": False}
    return start_llm(kwargs, model)


def run(args) -> dict:
    from vllm import SamplingParams

    from eyas.capture.config import CaptureConfig
    from eyas.capture.run import capture
    from eyas.vllm import CaptureVLLMOptions
    from eyas.vllm.engine import parse_engine_args, stop_llm
    from eyas.data.config import PrepareConfig
    from eyas.data.prepare import prepare
    from eyas.data.prepared import PreparedData
    from eyas.store import Store

    work = Path(tempfile.mkdtemp(prefix="eyas-bench-"))
    data = args.data or str(work / "prepared")
    if not args.data:
        prepare(PrepareConfig(model=args.model, data=["packaged:sharegpt"], out=data, max_len=args.max_len,
                              limit=args.limit), progress=False)
    tokens = PreparedData(data).offsets[-1].item()
    engine_args = parse_engine_args(args.engine_arg)
    plain = start_plain(args.model, args.model_dtype, engine_args)
    timing = {"plain": 0.0, "startup": 0.0}
    t = time.perf_counter()
    first: list[float] = []  # when the first batch arrived: engine start-up ends there

    def plain_first(batch) -> None:
        first[:] = first or [time.perf_counter()]
        t0 = time.perf_counter()
        plain.generate([{"prompt_token_ids": s.input_ids.tolist()} for s in batch],
                       SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
        timing["plain"] += time.perf_counter() - t0

    capture(CaptureConfig(model=args.model, data=data, out=str(work / "store"), backend="vllm", dtype=args.store_dtype,
                          model_dtype=args.model_dtype, batch_tokens=args.batch_tokens,
                          vllm=CaptureVLLMOptions(engine_args=engine_args)),
            progress=False, on_batch=plain_first)
    timing["startup"] = first[0] - t if first else 0.0
    Store(work / "store").verify()
    eyas = time.perf_counter() - t - timing["startup"] - timing["plain"]
    stop_llm(plain)
    return {
        "samples": len(PreparedData(data)), "tokens": tokens, "model_dtype": args.model_dtype,
        "store_dtype": args.store_dtype, "batch_tokens": args.batch_tokens,
        "plain_prefill_tok_s": round(tokens / timing["plain"]), "eyas_capture_tok_s": round(tokens / eyas),
        "ratio": round(timing["plain"] / eyas, 3),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="packaged:smollm2-135m")
    p.add_argument("--data", help="prepared folder (default: prepare --limit ShareGPT conversations)")
    p.add_argument("--limit", type=int, default=200)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--model-dtype", default="float32")
    p.add_argument("--store-dtype", default="bf16")
    p.add_argument("--batch-tokens", type=int, default=8192)
    p.add_argument("--engine-arg", action="append", default=["enforce_eager=true"])
    result = run(p.parse_args())
    print(f"{result['tokens']:,} tokens in {result['samples']} samples: plain vLLM prefill "
          f"{result['plain_prefill_tok_s']:,} tok/s, eyas capture --backend vllm into the store "
          f"{result['eyas_capture_tok_s']:,} tok/s, ratio {result['ratio']:.3f} (target >= 0.85; "
          f"engine start-up excluded)")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
