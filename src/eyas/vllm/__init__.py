"""eyas's vLLM adapter, shared by capture, regenerate, export and preflight: engine configs,
the capture backend on vLLM's own `extract_hidden_states` path, and the checks run against the
installed vLLM's own classes.

  engine     tested versions, the speculative + KV-transfer configs, --engine-arg parsing
  connector  the KV connector vLLM loads into its scheduler and workers (imports vLLM)
  spool      the per-request file the connector writes and the client reads (no vLLM)
  target     identity and layer ids from config + tokenizer, before any engine starts
  preflight  what the installed vLLM cannot run (EAGLE-3 support, layer ids, head size, model config), from its own classes
  backend    in-process `vllm.LLM`            endpoint   client of a running `vllm serve`
  serve      the `vllm serve` command line    options    typed options and the backend factory

eyas never builds vLLM's Scheduler, Request or KVCacheConfig objects: it passes configs
to `vllm.LLM` / `vllm serve` and implements the connector interface, nothing more.
"""

from eyas.vllm.options import CaptureVLLMOptions, EngineOptions, make_vllm_backend, print_serve_command

__all__ = ["CaptureVLLMOptions", "EngineOptions", "make_vllm_backend", "print_serve_command"]
