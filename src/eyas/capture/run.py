"""The capture run loop, shared by every backend: resume, batch, capture, write."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from tqdm import tqdm

from eyas.capture.batching import token_budget_batches
from eyas.capture.vllm import make_vllm_backend  # light: vLLM itself is imported only when used
from eyas.data.prepared import PreparedData
from eyas.errors import EyasError
from eyas.store import StoreWriter


def make_hf_backend(model: str, layers: str, model_dtype: str, device: str, **_: Any):
    from eyas.capture.hf import HFCapturer

    return HFCapturer(model, layers=layers, dtype=model_dtype, device=device)


BACKENDS: dict[str, Callable[..., Any]] = {"hf": make_hf_backend, "vllm": make_vllm_backend}


def default_model_dtype(device: str) -> str:
    return "float32" if device == "cpu" else "bf16"


def capture(model: str, data: str | Path, out: str | Path, backend: str = "hf", layers: str = "auto",
            dtype: str = "bf16", device: str = "cpu", model_dtype: str | None = None, batch_tokens: int = 8192,
            shard_mb: float = 1024, progress: bool = True, **backend_options: Any) -> dict[str, Any]:
    """Capture every prepared sample of `data` not yet in the store at `out`; return the manifest."""
    if backend not in BACKENDS:
        raise EyasError(f"Unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}.")
    if batch_tokens < 1:
        raise EyasError("--batch-tokens must be positive.")
    prepared = PreparedData(data)
    engine = BACKENDS[backend](model=model, layers=layers, model_dtype=model_dtype or default_model_dtype(device),
                               device=device, **backend_options)
    engine.identity.check_same(prepared.identity, f"The prepared data in {data}")
    header = {
        "target": engine.identity.to_dict(), "layer_ids": list(engine.layer_ids), "dtype": dtype,
        "hidden_size": engine.hidden_size, "prepared": prepared.meta["fingerprint"],
    }
    writer = StoreWriter(out, header, shard_bytes=int(shard_mb * (1 << 20)))
    lengths = [prepared.length(i) for i in range(len(prepared))]
    todo = [i for i in range(len(prepared)) if i not in writer.done]
    bar = tqdm(total=sum(lengths[i] for i in todo), unit="tok", unit_scale=True, desc=f"capture ({backend})",
               disable=not progress)
    try:
        for batch in token_budget_batches(todo, lengths, batch_tokens):
            samples = [prepared[i] for i in batch]
            for i, sample, hidden in zip(batch, samples, engine.capture(samples)):
                writer.add(i, sample.input_ids, sample.loss_mask, hidden)
            bar.update(sum(lengths[i] for i in batch))
    except KeyboardInterrupt:
        writer.close(complete=False)  # keep what was captured; the next run resumes after it
        raise
    except BaseException:
        writer.abort()
        raise
    finally:
        bar.close()
        getattr(engine, "close", lambda: None)()
    return writer.close()
