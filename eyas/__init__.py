"""eyas: train EAGLE-3 draft heads and serve LLMs with lossless speculative decoding."""

__version__ = "0.1.0"
