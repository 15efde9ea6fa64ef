"""`MedusaConfig`: the shape of a set of Medusa heads and the target they read.

Head k (k = 1..K) reads the target's last hidden state at position t (after the final norm:
what the target's lm_head reads to predict token t + 1) and predicts token t + 1 + k.
"""

from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, fields
from typing import Any

from eyas.errors import EyasError
from eyas.models.config import ModelConfig

CONFIG_FORMAT = "eyas-medusa"
CONFIG_VERSION = 1


@dataclass
class MedusaConfig:
    hidden_size: int  # the target's
    vocab_size: int  # the target's vocabulary
    num_heads: int = 4  # K
    num_layers: int = 1  # residual blocks per head
    draft_vocab_size: int | None = None  # None: the heads share the target's output layer
    #   (frozen, not stored); N: one trained output layer over N target ids, shared by the heads
    target_model: str = ""  # how the target was named when the heads were trained
    target_num_hidden_layers: int | None = None

    def __post_init__(self) -> None:
        for name in ("hidden_size", "vocab_size", "num_heads", "num_layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise EyasError(f"medusa: {name} must be a positive integer, got {value!r}")
        if self.draft_vocab_size is not None and not 0 < self.draft_vocab_size <= self.vocab_size:
            raise EyasError(f"medusa: draft_vocab_size must be in 1..{self.vocab_size} (the target "
                            f"vocabulary) or None (share the target's output layer), got "
                            f"{self.draft_vocab_size}")

    @property
    def shares_target_output(self) -> bool:
        return self.draft_vocab_size is None

    @property
    def output_size(self) -> int:
        """Width of the heads' logits: the draft vocabulary, or the whole target vocabulary."""
        return self.vocab_size if self.draft_vocab_size is None else self.draft_vocab_size

    @classmethod
    def for_target(cls, target: ModelConfig, num_heads: int = 4, num_layers: int = 1,
                   draft_vocab_size: int | None = None, target_model: str = "") -> MedusaConfig:
        if draft_vocab_size is not None:
            draft_vocab_size = min(draft_vocab_size, target.vocab_size)
        return cls(hidden_size=target.hidden_size, vocab_size=target.vocab_size, num_heads=num_heads,
                   num_layers=num_layers, draft_vocab_size=draft_vocab_size,
                   target_model=target_model, target_num_hidden_layers=target.num_hidden_layers)

    def to_dict(self) -> dict[str, Any]:
        return {"format": CONFIG_FORMAT, "format_version": CONFIG_VERSION, **asdict(self)}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> MedusaConfig:
        if raw.get("format") != CONFIG_FORMAT:
            raise EyasError(f"not an eyas Medusa config (format={raw.get('format')!r}, expected "
                            f"{CONFIG_FORMAT!r}); Medusa heads are written by "
                            f"`eyas train --method medusa`")
        if raw.get("format_version", 0) > CONFIG_VERSION:
            raise EyasError(f"Medusa config version {raw['format_version']} is newer than this eyas "
                            f"understands ({CONFIG_VERSION}); upgrade eyas")
        required = [f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING]
        missing = [name for name in required if name not in raw]
        if missing:
            raise EyasError(f"Medusa config is missing keys: {', '.join(missing)}")
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in raw.items() if k in names})
