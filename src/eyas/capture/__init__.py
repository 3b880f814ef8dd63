"""Capture the target's hidden states into a store: a generic run loop (`run`) over
interchangeable backends (`hf` in-process transformers, `vllm`)."""
