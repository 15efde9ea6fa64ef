"""Medusa heads: config, module and checkpoint (shared by training and the engine)."""

from eyas.medusa.checkpoint import load_medusa, load_medusa_state, read_medusa_config, save_medusa
from eyas.medusa.config import MedusaConfig
from eyas.medusa.head import MedusaHeads, ResidualBlock

__all__ = [
    "MedusaConfig",
    "MedusaHeads",
    "ResidualBlock",
    "load_medusa",
    "load_medusa_state",
    "read_medusa_config",
    "save_medusa",
]
