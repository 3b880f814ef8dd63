"""Generators: token-id prompts in, the target's continuation (up to its end-of-turn
token) out. Both stop on the same ids: the tokenizer's EOS and the generation config's."""

from __future__ import annotations

from typing import Any

import torch

from eyas.models.attention import kv_layout
from eyas.models.eos import cut_at_stop, eos_ids, saved_generation_config
from eyas.models.dtype import ENGINE_DTYPE
from eyas.models.load import load_target, load_tokenizer
from eyas.models.resolve import resolve_model
from eyas.regenerate.static import StaticGreedy, supports_static
from eyas.vllm.engine import base_kwargs, check_vllm_version, start_llm, stop_llm


def cache_tokens_within(config, budget_bytes: int, itemsize: int, most: int = 1 << 21) -> int:
    """Cache slots (one per token and row) whose keys and values fit `budget_bytes`: a group of
    thousands of conversations is cut into batches of at most this many slots, so an 8B target
    gets ~10x fewer than a 135M one. MLA models cache full keys (nope + rope dims) and values."""
    _, heads, k_dim, v_dim = kv_layout(config)
    per_token = config.get_text_config(decoder=True).num_hidden_layers * heads * (k_dim + v_dim) * itemsize
    return max(1024, min(most, budget_bytes // per_token))


class HFGenerator:
    """transformers on one device. Greedy decoding of full-attention models takes the static-
    cache path (`StaticGreedy`: length-sorted batches of up to `cache_tokens` cache slots);
    sampling, and models with sliding-window layers, take batched `model.generate`."""

    def __init__(self, model: str, dtype: str = "float32", device: str = "cpu", cache_tokens: int | None = None):
        self.model, self.tokenizer = load_target(model, dtype=dtype, device=device)
        self.device = torch.device(device)
        self.stops = eos_ids(saved_generation_config(resolve_model(model)), self.tokenizer)
        self.pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.stops[0]
        self.slots = slots = cache_tokens or self._default_cache_tokens()
        self.greedy = StaticGreedy(self.model, self.pad, self.stops, slots) if supports_static(self.model) else None

    def _default_cache_tokens(self) -> int:
        """A CPU batch stays small (16k slots); a GPU's takes half of what its memory leaves after
        the weights, at most 2M slots (a 135M model's ~46 GiB in bf16). From the device's total,
        not its free memory, so that the same GPU batches a sampled run alike every time."""
        if self.device.type != "cuda":
            return 1 << 14
        total = torch.cuda.get_device_properties(self.device).total_memory
        weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
        return cache_tokens_within(self.model.config, max(total - weights, 0) // 2, self.model.dtype.itemsize)

    def generate(self, prompts: list[list[int]], max_new_tokens: list[int], temperature: float, seed: int) -> list[list[int]]:
        if temperature == 0 and self.greedy is not None:
            return self.greedy.generate(prompts, max_new_tokens)
        return self.sample(prompts, max_new_tokens, temperature, seed)

    @torch.inference_mode()
    def sample(self, prompts: list[list[int]], max_new_tokens: list[int], temperature: float, seed: int) -> list[list[int]]:
        """Batched `model.generate`, left-padded: sampling, and greedy decoding of any model; in
        batches whose rows x (longest prompt + longest answer) fit the cache budget, since a group
        can hold thousands of conversations. One seed for the whole call, drawn from in order."""
        torch.manual_seed(seed)
        rows = max(1, self.slots // (max(len(p) for p in prompts) + max(max_new_tokens)))
        return [ids for b in range(0, len(prompts), rows)
                for ids in self._generate(prompts[b:b + rows], max_new_tokens[b:b + rows], temperature)]

    def _generate(self, prompts: list[list[int]], max_new_tokens: list[int], temperature: float) -> list[list[int]]:
        T = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), T), self.pad, dtype=torch.long)  # [B, T], left-padded
        attention_mask = torch.zeros(len(prompts), T, dtype=torch.long)
        for b, p in enumerate(prompts):
            input_ids[b, T - len(p):] = torch.tensor(p)
            attention_mask[b, T - len(p):] = 1
        sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0} if temperature > 0 else {
            "do_sample": False, "temperature": None, "top_k": None, "top_p": None}
        out = self.model.generate(input_ids=input_ids.to(self.device), attention_mask=attention_mask.to(self.device),
                                  max_new_tokens=max(max_new_tokens), eos_token_id=self.stops, pad_token_id=self.pad,
                                  **sampling)  # [B, T + new]
        new = out[:, T:].tolist()
        return [cut_at_stop(ids[:n], self.stops) for ids, n in zip(new, max_new_tokens)]

    def close(self) -> None:
        self.model = None


class VLLMGenerator:
    """`vllm.LLM.generate` over all prompts at once; vLLM batches and caches shared prefixes."""

    def __init__(self, model: str, dtype: str = ENGINE_DTYPE, max_len: int = 2048, tensor_parallel_size: int = 1,
                 pipeline_parallel_size: int = 1, engine_args: dict[str, Any] | None = None):
        check_vllm_version()
        folder = resolve_model(model)
        self.tokenizer = load_tokenizer(model)
        self.stops = eos_ids(saved_generation_config(folder), self.tokenizer)
        kwargs = base_kwargs(folder, dtype, tensor_parallel_size, pipeline_parallel_size, 1,
                             {"max_model_len": max_len, **(engine_args or {})})
        self.llm = start_llm(kwargs, model)

    def generate(self, prompts: list[list[int]], max_new_tokens: list[int], temperature: float, seed: int) -> list[list[int]]:
        from vllm import SamplingParams

        params = [SamplingParams(max_tokens=n, temperature=temperature, stop_token_ids=self.stops,
                                 seed=seed + i if temperature > 0 else None) for i, n in enumerate(max_new_tokens)]
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [cut_at_stop(list(o.outputs[0].token_ids), self.stops) for o in outputs]

    def close(self) -> None:
        stop_llm(self.llm)
        self.llm = None
