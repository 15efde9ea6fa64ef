"""eyas: train EAGLE-3 draft heads and serve LLMs with lossless speculative decoding."""

from eyas import openmp_spin

openmp_spin.apply()  # before anything imports torch (openmp_spin.py)

__version__ = "0.1.0"
