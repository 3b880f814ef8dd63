"""eyas: train EAGLE-3 speculative-decoding drafters for any causal LM."""

__version__ = "0.1.0"
