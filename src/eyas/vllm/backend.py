"""The in-process vLLM capture backend: `vllm.LLM` with `extract_hidden_states` and eyas's
connector, prefill only (`max_tokens=1`).

vLLM runs its engine core and workers in their own processes (tensor and pipeline parallel
as asked; data parallel needs a server, see `endpoint.py`); the connector in the worker writes each prompt's states to a spool
file, and `capture` reads them back, checks them against the prompt, and deletes them.
"""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any

import torch

from eyas.data.prepared import PreparedSample
from eyas.errors import EyasError
from eyas.options import AUTO_LAYERS
from eyas.models.dtype import ENGINE_DTYPE
from eyas.vllm.engine import check_vllm_version, engine_kwargs, start_llm, stop_llm, text_only
from eyas.vllm.spool import PARAM_ERROR, PARAM_KEY, read_hidden, spool_file, wait_for
from eyas.vllm.preflight import preflight
from eyas.vllm.target import describe_target


class VLLMCapturer:
    """Returns the states at `layer_ids` of each sample, computed by vLLM."""

    def __init__(self, model: str, layers: str = AUTO_LAYERS, dtype: str = ENGINE_DTYPE, tensor_parallel_size: int = 1,
                 pipeline_parallel_size: int = 1, engine_args: dict | None = None, spool: str | None = None,
                 file_timeout: float = 600.0):
        self.vllm_version = check_vllm_version()
        target = describe_target(model, layers)
        self.identity, self.layer_ids = target.identity, target.layer_ids
        self.hidden_size = self.identity.hidden_size
        engine_args = text_only(target.config, engine_args)
        preflight(target.config, model, self.layer_ids, dtype, "use --backend hf", engine_args, target.folder)
        self.file_timeout = file_timeout
        self._keys = (f"{uuid.uuid4().hex[:12]}-{i}" for i in itertools.count())
        self.spool = Path(tempfile.mkdtemp(prefix="eyas-spool-", dir=spool))
        try:
            kwargs = engine_kwargs(target.folder, self.layer_ids, self.spool, dtype, tensor_parallel_size,
                                   pipeline_parallel_size, 1, engine_args, owner_pid=os.getpid())
            self.llm = start_llm(kwargs, model)
        except BaseException:
            shutil.rmtree(self.spool, ignore_errors=True)
            raise

    def capture(self, batch: list[PreparedSample]) -> list[torch.Tensor]:
        """Prefill the batch in one `generate` call -> per sample [T_i, L, H] (engine dtype, CPU)."""
        from vllm import SamplingParams

        keys = [next(self._keys) for _ in batch]
        params = [SamplingParams(max_tokens=1, temperature=0.0, extra_args={"kv_transfer_params": {PARAM_KEY: k}})
                  for k in keys]
        prompts = [{"prompt_token_ids": s.input_ids.tolist()} for s in batch]
        try:
            outputs = self.llm.generate(prompts, params, use_tqdm=False)
        except Exception as e:  # the engine died (its log above has the cause); shards written so far are kept
            raise EyasError(f"vLLM failed during capture: {type(e).__name__}: {e}") from e
        return [self._collect(out, key, sample) for out, key, sample in zip(outputs, keys, batch)]

    def _collect(self, output: Any, key: str, sample: PreparedSample) -> torch.Tensor:
        reply = output.kv_transfer_params or {}
        if reply.get(PARAM_KEY) != key or PARAM_ERROR in reply:
            raise EyasError(f"vLLM did not save hidden states for sample {sample.source_index}: "
                            f"{reply.get(PARAM_ERROR) or f'kv_transfer_params {reply!r}'}.")
        path = spool_file(self.spool, key)
        try:
            error = wait_for(path, self.file_timeout)
        except TimeoutError as e:
            raise EyasError(f"eyas's connector never wrote the states of sample {sample.source_index} ({e}).") from None
        if error:
            raise EyasError(f"eyas's connector failed on sample {sample.source_index}: {error}")
        hidden, token_ids, layer_ids = read_hidden(path)
        path.unlink()
        check_hidden(hidden, token_ids, layer_ids, sample.input_ids, self.layer_ids, self.hidden_size)
        return hidden

    def close(self) -> None:
        stop_llm(getattr(self, "llm", None))
        self.llm = None
        shutil.rmtree(self.spool, ignore_errors=True)


def check_hidden(hidden: torch.Tensor, token_ids: torch.Tensor, layer_ids: tuple[int, ...], prompt: torch.Tensor,
                 want_ids: tuple[int, ...], hidden_size: int) -> None:
    """Refuse states that do not belong to this prompt, these layers and this model."""
    if not torch.equal(token_ids, prompt.to(token_ids.dtype)):
        raise EyasError(f"the engine saved states for a different prompt ({len(token_ids)} tokens, "
                        f"expected {len(prompt)}); nothing was written.")
    if tuple(layer_ids) != tuple(want_ids):
        raise EyasError(f"the engine extracts layer ids {list(layer_ids)}, not {list(want_ids)}; "
                        f"start it with the same --layers.")
    if tuple(hidden.shape) != (len(prompt), len(want_ids), hidden_size):
        raise EyasError(f"the engine returned states of shape {tuple(hidden.shape)}, expected "
                        f"{(len(prompt), len(want_ids), hidden_size)}: is it serving the same model?")
