"""eyas: train speculative-decoding drafters (EAGLE-3, DFlash and P-EAGLE) for any causal LM."""

__version__ = "0.1.0"
