"""Capture through a running `vllm serve` (shared or multi-node deployments).

The server runs eyas's connector (`eyas capture --backend vllm --print-serve-command`
prints how to start it) and writes each prompt's states into a spool folder that this
client can read too (a shared filesystem). Each sample is one `/v1/completions` request
with its token ids, `max_tokens=1`, and a fresh file key. A failed attempt (server down,
too slow, wrong prompt in the file) is retried with backoff, then reported; nothing from
a failed attempt ever reaches the store. Needs no vLLM on this machine.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from eyas.data.prepared import PreparedSample
from eyas.errors import EyasError
from eyas.options import AUTO_LAYERS
from eyas.vllm.backend import check_hidden
from eyas.vllm.spool import PARAM_ERROR, PARAM_KEY, error_file, read_hidden, spool_file, wait_for
from eyas.vllm.target import describe_target


class Transient(Exception):
    """A failed attempt worth repeating."""


class EndpointCapturer:
    def __init__(self, model: str, endpoint: str, spool: str, layers: str = AUTO_LAYERS, served_model_name: str | None = None,
                 concurrency: int = 8, request_timeout: float = 120.0, retries: int = 3, backoff: float = 1.0):
        target = describe_target(model, layers)
        self.identity, self.layer_ids = target.identity, target.layer_ids
        self.hidden_size = self.identity.hidden_size
        self.endpoint = endpoint.rstrip("/")
        self.spool = Path(spool)
        if not self.spool.is_dir():
            raise EyasError(f"--spool {spool} is not a folder: give the folder the server writes to "
                            f"(as this machine sees it).")
        self.timeout, self.retries, self.backoff = request_timeout, retries, backoff
        self.concurrency = concurrency
        self._run = uuid.uuid4().hex[:12]
        self._abandoned: list[Path] = []  # files of failed attempts the server may still write
        self.served_model = served_model_name or self._served_model()

    def _served_model(self) -> str:
        """Ask the server which model it serves (also proves it is up before any work)."""
        reply = self._retrying("GET /v1/models", lambda: self._http("GET", "/v1/models"))
        names = [m.get("id") for m in reply.get("data", [])]
        if len(names) != 1:
            raise EyasError(f"{self.endpoint} serves {names}; name the target with --served-model-name.")
        return names[0]

    def capture(self, batch: list[PreparedSample]) -> list[torch.Tensor]:
        """One request per sample, `concurrency` at a time -> per sample [T_i, L, H]."""
        with ThreadPoolExecutor(max_workers=self.concurrency) as pool:
            return list(pool.map(self._one, batch))

    def _one(self, sample: PreparedSample) -> torch.Tensor:
        return self._retrying(f"sample {sample.source_index}", lambda: self._attempt(sample))

    def _retrying(self, what: str, attempt):
        reasons = []
        for n in range(self.retries + 1):
            try:
                return attempt()
            except Transient as e:
                reasons.append(f"attempt {n + 1}: {e}")
                if n < self.retries:
                    time.sleep(self.backoff * 2**n)
        raise EyasError(f"vLLM endpoint {self.endpoint} failed for {what} after {self.retries + 1} attempts; "
                        f"nothing of it was written. " + "; ".join(reasons))

    def _attempt(self, sample: PreparedSample) -> torch.Tensor:
        key = f"{self._run}-{uuid.uuid4().hex[:8]}"
        path = spool_file(self.spool, key)
        prompt = sample.input_ids.tolist()
        try:
            reply = self._http("POST", "/v1/completions", {
                "model": self.served_model, "prompt": prompt, "max_tokens": 1, "temperature": 0.0,
                "kv_transfer_params": {PARAM_KEY: key},
            })
            params = reply.get("kv_transfer_params") or {}
            if params.get(PARAM_KEY) != key or PARAM_ERROR in params:
                raise Transient(params.get(PARAM_ERROR) or f"the reply carries no states for this request ({params!r}); "
                                f"is the server running eyas's connector?")
            try:
                error = wait_for(path, self.timeout)
            except TimeoutError as e:
                raise Transient(str(e)) from None
            if error:
                raise Transient(f"the server's connector failed: {error}")
            hidden, token_ids, layer_ids = read_hidden(path)
        except Transient:
            self._abandoned.append(path)
            raise
        path.unlink()
        if not torch.equal(token_ids, sample.input_ids.to(token_ids.dtype)):
            raise Transient(f"the server saved states for a different prompt ({len(token_ids)} tokens, sent {len(prompt)})")
        check_hidden(hidden, token_ids, layer_ids, sample.input_ids, self.layer_ids, self.hidden_size)
        return hidden

    def _http(self, method: str, route: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.endpoint + route, data=data, method=method,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as e:
            detail = e.read()[:300].decode(errors="replace")
            if e.code < 500 and e.code != 429:
                raise EyasError(f"vLLM endpoint {self.endpoint}{route} refused the request (HTTP {e.code}): {detail}") from None
            raise Transient(f"HTTP {e.code}: {detail}") from None
        except (urllib.error.URLError, TimeoutError, ConnectionError, json.JSONDecodeError) as e:
            raise Transient(f"{type(e).__name__}: {getattr(e, 'reason', e)}") from None

    def close(self) -> None:
        """Remove files that failed attempts left behind (the server may have written them late)."""
        for path in self._abandoned:
            path.unlink(missing_ok=True)
            error_file(path).unlink(missing_ok=True)
