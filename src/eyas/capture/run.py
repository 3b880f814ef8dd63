"""The capture run loop, shared by every backend: resume, batch, capture, write."""

from __future__ import annotations

import time
from typing import Any, Callable

import torch
from tqdm import tqdm

from eyas.capture.config import CaptureConfig
from eyas.capture.hf import HFCapturer
from eyas.capture.staging import HostStager
from eyas.data.batching import token_budget_batches
from eyas.data.prepared import PreparedData, PreparedSample
from eyas.data.template import check_same_template
from eyas.device import parse_device
from eyas.distributed import all_reduce, barrier, init, shutdown
from eyas.errors import EyasError
from eyas.lock import output_lock
from eyas.models.dtype import model_dtype
from eyas.models.load import DTYPES
from eyas.paths import check_confined
from eyas.store import StoreWriter
from eyas.store.format import manifest_header, read_manifest
from eyas.vllm import make_vllm_backend  # light: vLLM itself is imported only when used

# Called with each batch's samples just before the engine captures them (bench/capture_vllm.py
# times a plain prefill of the same batch there).
BatchHook = Callable[[list[PreparedSample]], None]


def capture(cfg: CaptureConfig, progress: bool = True, on_batch: BatchHook | None = None) -> dict[str, Any]:
    """Capture every prepared sample of `cfg.data` not yet in the store at `cfg.out`; return the
    manifest. The samples were rendered with the chat template recorded in the data; a
    `cfg.chat_template` file, if given, must be that template.

    Under `torchrun`, rank r of W owns the samples whose position is r modulo W: ownership
    does not depend on what is already stored, so ranks resume independently and never
    capture a sample twice, whatever the other ranks have done. The ranks of one job share
    the store's lock; any other run on the same store is refused.
    """
    check_confined(cfg.out, {"--data": cfg.data, "--model": cfg.model, "--chat-template": cfg.chat_template})
    if cfg.backend == "hf":
        parse_device(cfg.device)
    with output_lock(cfg.out, "capture"):
        return _capture(cfg, progress, on_batch)


def _run_dtype(cfg: CaptureConfig, dev: torch.device) -> str:
    """The dtype the target runs in (models.load.model_dtype), one name per dtype (bf16 is bfloat16)."""
    name = model_dtype(cfg.model_dtype, None if cfg.backend == "vllm" else dev.type)
    return str(DTYPES[name]).removeprefix("torch.") if name in DTYPES else name


def _open_backend(cfg: CaptureConfig, dev: torch.device):
    """The capturer of `cfg.backend`, the target running in `_run_dtype`."""
    if cfg.backend == "vllm":
        return make_vllm_backend(cfg.model, cfg.layers, _run_dtype(cfg, dev), cfg.vllm)
    return HFCapturer(cfg.model, layers=cfg.layers, dtype=_run_dtype(cfg, dev), device=str(dev))


def _capture(cfg: CaptureConfig, progress: bool, on_batch: BatchHook | None) -> dict[str, Any]:
    backend, data, out = cfg.backend, cfg.data, cfg.out
    prepared = PreparedData(data)
    if prepared.chat_template is not None:
        check_same_template(prepared.chat_template, cfg.chat_template, f"The prepared data in {data}")
    ranks, dev = init(cfg.device if backend == "hf" else "cpu", fsdp=False)  # vLLM places the model itself
    if ranks.enabled and backend != "hf":
        raise EyasError(f"--backend {backend} parallelises inside the engine; run it without torchrun.")
    engine = _open_backend(cfg, dev)
    engine.identity.check_same(prepared.identity, f"The prepared data in {data}")
    header = manifest_header(engine.identity, engine.layer_ids, cfg.dtype, engine.hidden_size, prepared.fingerprint,
                             prepared.chat_template, backend=backend, model_dtype=_run_dtype(cfg, dev),
                             excluded_prompts=prepared.excluded_prompts)
    writer = StoreWriter(out, header, shard_bytes=int(cfg.shard_mb * (1 << 20)), expected_samples=len(prepared))
    lengths = [prepared.length(i) for i in range(len(prepared))]
    todo = [i for i in range(ranks.rank, len(prepared), ranks.world) if i not in writer.done]
    desc = f"capture ({backend})" + (f" rank {ranks.rank}/{ranks.world}" if ranks.enabled else "")
    bar = tqdm(total=sum(lengths[i] for i in todo), unit="tok", unit_scale=True, desc=desc,
               disable=not progress or not ranks.main)
    started = time.monotonic()
    stager = HostStager(dev, fp8=writer.dtype == torch.float8_e4m3fn)  # fp8: quantized on the capture device
    pending = None  # the previous batch, its states still on their way to the host

    def write(batch: list[int], samples: list, collect) -> None:
        for i, sample, (hidden, scale) in zip(batch, samples, collect()):
            writer.add(i, sample.input_ids, sample.loss_mask, hidden, scale=scale)
        bar.update(sum(lengths[i] for i in batch))

    try:
        for batch in token_budget_batches(todo, lengths, cfg.batch_tokens):
            samples = [prepared[i] for i in batch]
            if on_batch is not None:
                on_batch(samples)
            staged = (batch, samples, stager.start(engine.capture(samples)))
            if pending:
                write(*pending)  # while the GPU runs this batch
            pending = staged
        if pending:
            write(*pending)
    except KeyboardInterrupt:
        writer.close()  # keep what was captured; the next run resumes after it
        raise
    except BaseException:
        writer.abort()
        raise
    finally:
        bar.close()
        getattr(engine, "close", lambda: None)()
    manifest = writer.close(expected_samples=len(prepared))
    elapsed = time.monotonic() - started  # before any collective, which would wait for the other ranks
    # The job's rate: tokens summed over ranks, over the slowest rank's time.
    tokens = all_reduce(torch.tensor([float(sum(lengths[i] for i in todo))], device=dev), ranks).item()
    seconds, waited = all_reduce(torch.tensor([elapsed, writer.wait_seconds], device=dev), ranks, op="max").tolist()
    if progress and ranks.main and tokens:
        print(f"captured {int(tokens):,} tokens in {seconds:.1f} s: {tokens / seconds:,.0f} tok/s"
              + (f" over {ranks.world} processes" if ranks.enabled else "")
              + f"; {waited:.1f} s of it waiting for the store to reach the disk")
    barrier(ranks)  # every rank's shards are in the manifest
    shutdown(ranks)
    return read_manifest(out) if ranks.enabled else manifest
