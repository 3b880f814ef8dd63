"""eyas's KV connector for vLLM's `extract_hidden_states` speculative method.

vLLM loads this module inside its scheduler and workers through
`kv_transfer_config={"kv_connector": "EyasHiddenStatesConnector",
"kv_connector_module_path": "eyas.vllm.connector", ...}`. With
`extract_hidden_states`, vLLM itself writes the requested layers' states of every prompt
token into a cache-only KV group, `[blocks, L, block_size, H]`. This connector only uses
the connector interface to get them out:

  scheduler  request_finished(request, block_ids): hold the blocks, queue a save
             build_connector_meta(): hand the queued saves to the workers
  worker     register_kv_caches(): find the hidden-state cache tensor
             get_finished(): gather each finished prompt's rows, write one spool file
             (see `spool.py`), report the request done so vLLM frees its blocks

Unlike vLLM's example connector it needs no CUDA stream or pinned memory on the CPU (a
GPU copy is asynchronous, with an event), so it runs on both. Only TP rank 0 of the
pipeline stage that holds the cache writes; `get_finished_count() == 1` tells vLLM so.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from eyas.vllm.rows import copy_rows
from eyas.vllm.spool import KEY, PARAM_ERROR, PARAM_FILE, PARAM_KEY, spool_file, write_error, write_hidden
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.logger import init_logger

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = init_logger(__name__)

CONNECTOR = "EyasHiddenStatesConnector"


@dataclass
class PendingSave:
    req_id: str
    path: str
    token_ids: torch.Tensor  # [T] int64, the prompt
    block_ids: tuple[list[int], ...]  # per KV-cache group; the worker picks the hidden-state group's


@dataclass
class EyasConnectorMetadata(KVConnectorMetadata):
    saves: list[PendingSave] = field(default_factory=list)


class EyasHiddenStatesConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig"):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        spec = vllm_config.speculative_config
        if spec is None or spec.method != "extract_hidden_states":
            raise ValueError(f"{CONNECTOR} needs speculative_config method 'extract_hidden_states'.")
        self.layer_ids = sorted(set(spec.draft_model_config.hf_config.eagle_aux_hidden_state_layer_ids))
        self.spool = Path(self._kv_transfer_config.get_from_extra_config("spool_dir", ""))
        if not self.spool.is_dir():
            raise ValueError(f"{CONNECTOR}: kv_connector_extra_config.spool_dir {str(self.spool)!r} is not a folder.")
        # Only workers see per-layer specs; the scheduler hands them every group's block ids.
        self.hidden_layer = _hidden_state_layer(kv_cache_config) if role == KVConnectorRole.WORKER else None
        if role == KVConnectorRole.WORKER and self.hidden_layer is None and vllm_config.parallel_config.pipeline_parallel_size == 1:
            raise ValueError(f"{CONNECTOR}: vLLM made no hidden-state cache layer.")
        # scheduler side
        self._queued: list[PendingSave] = []
        owner = self._kv_transfer_config.get_from_extra_config("owner_pid", None)
        if role == KVConnectorRole.SCHEDULER and owner:
            threading.Thread(target=_stop_when_gone, args=(int(owner),), name="eyas-owner-watch", daemon=True).start()
        # worker side
        self._cache: torch.Tensor | None = None  # [blocks, L, block_size, H]
        self._writes_here = False
        self._copy_events: dict[str, Any] = {}  # req_id -> CUDA event of its device-to-host copy
        self._finished: set[str] = set()  # req ids the scheduler reported finished, not yet released
        self._writer = ThreadPoolExecutor(
            max_workers=int(self._kv_transfer_config.get_from_extra_config("writer_threads", 2)),
            thread_name_prefix="eyas-spool",
        )

    # ---- scheduler side ----

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False  # store-only: never loads

    def update_state_after_alloc(self, request: "Request", blocks: Any, num_external_tokens: int) -> None:
        pass

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        saves, self._queued = self._queued, []
        return EyasConnectorMetadata(saves=saves)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(self, request: "Request", block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """Hold the blocks of a fully prefilled prompt until a worker has copied its rows."""
        params = request.kv_transfer_params or {}
        key = str(params.get(PARAM_KEY) or request.request_id)
        if not KEY.fullmatch(key):
            return False, {PARAM_ERROR: f"invalid {PARAM_KEY} {key!r}"}
        prompt = request.prompt_token_ids
        if prompt is None or request.num_computed_tokens < len(prompt):
            return False, {PARAM_KEY: key, PARAM_ERROR: "the request ended before its whole prompt was prefilled"}
        path = str(spool_file(self.spool, key))
        token_ids = torch.tensor(prompt, dtype=torch.int64)
        self._queued.append(PendingSave(request.request_id, path, token_ids, tuple(list(b) for b in block_ids)))
        return True, {PARAM_KEY: key, PARAM_FILE: path}

    # ---- worker side ----

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed import get_tensor_model_parallel_rank

        name = self.hidden_layer[1] if self.hidden_layer else None
        # Pipeline stages without the extraction layer hold nothing; TP ranks > 0 hold copies.
        self._writes_here = name in kv_caches and get_tensor_model_parallel_rank() == 0
        self._cache = kv_caches[name] if self._writes_here else None

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        pass  # vLLM's cache-only layer already wrote the states; get_finished reads them

    def wait_for_save(self) -> None:
        pass

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Copy out the rows of newly finished prompts; report those whose copy is complete."""
        if not self._writes_here:
            return None, None  # another worker reports (get_finished_count() == 1)
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        if isinstance(meta, EyasConnectorMetadata):
            for save in meta.saves:
                self._copy_out(save)
        self._finished |= finished_req_ids
        done = {r for r in self._finished if r in self._copy_events and _complete(self._copy_events[r])}
        for r in done:
            del self._copy_events[r]
        self._finished -= done
        return done or None, None

    def _copy_out(self, save: PendingSave) -> None:
        assert self._cache is not None
        rows, event = copy_rows(self._cache, save.block_ids[self.hidden_layer[0]], len(save.token_ids))
        self._copy_events[save.req_id] = event
        self._writer.submit(self._write, save, rows, event).add_done_callback(_log_failure)

    def _write(self, save: PendingSave, rows: torch.Tensor, event: Any) -> None:
        try:
            if event is not None:
                event.synchronize()
            write_hidden(Path(save.path), rows, save.token_ids, self.layer_ids)
        except Exception as e:  # the client is waiting for this file: tell it why it will not come
            write_error(Path(save.path), f"{type(e).__name__}: {e}")
            raise

    def get_finished_count(self) -> int:
        return 1  # one writer per request (see the module docstring)

    def shutdown(self) -> None:
        self._writer.shutdown(wait=True)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: "VllmConfig") -> str | None:
        return None


def _stop_when_gone(owner: int) -> None:
    """vLLM's engine processes outlive a capture process that is killed (SIGKILL, OOM) and
    keep their memory, so the rerun that should resume cannot start. The engine core
    (where the scheduler-side connector lives) stops itself once its owner is gone."""
    while True:
        time.sleep(1.0)
        try:
            os.kill(owner, 0)
        except ProcessLookupError:
            logger.error("eyas: the capture process %d is gone; stopping this engine.", owner)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        except PermissionError:
            pass  # alive, owned by another user


def _complete(event: Any) -> bool:
    return event is None or event.query()


def _log_failure(future) -> None:
    if future.exception() is not None:
        logger.error("eyas: writing hidden states failed: %r", future.exception())


def _hidden_state_layer(kv_cache_config: "KVCacheConfig | None") -> tuple[int, str] | None:
    """(KV-cache group, layer name) of vLLM's extraction layer; None where this process
    does not hold it (a pipeline stage before the last). The layer has its own group, or
    shares one with the attention layers when the block sizes agree."""
    from vllm.v1.kv_cache_interface import HiddenStateCacheSpec

    found = []
    for i, group in enumerate(kv_cache_config.kv_cache_groups if kv_cache_config else []):
        specs = getattr(group.kv_cache_spec, "kv_cache_specs", None) or dict.fromkeys(group.layer_names, group.kv_cache_spec)
        found += [(i, name) for name, spec in specs.items() if isinstance(spec, HiddenStateCacheSpec)]
    if len(found) > 1:
        raise ValueError(f"{CONNECTOR}: expected one hidden-state cache layer, found {[n for _, n in found]}.")
    return found[0] if found else None
