"""`ModelConfig`: the architecture of a Llama-family target, read from a Hugging Face config.

Covers Llama 2/3.x (incl. Llama-3 rope scaling), SmolLM2, Mistral, Qwen2/2.5 (q/k/v bias) and
Qwen3 (per-head q/k RMSNorm). Unknown keys of the Hugging Face config are ignored.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eyas.errors import EyasError

# model_type -> (q/k/v projections carry a bias, per-head q/k norm). A plain dict is the registry.
ARCHITECTURES: dict[str, tuple[bool, bool]] = {
    "llama": (False, False),
    "mistral": (False, False),
    "qwen2": (True, False),
    "qwen3": (False, True),
}

ROPE_TYPES = ("default", "llama3", "linear")


@dataclass
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    model_type: str = "llama"
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if self.model_type not in ARCHITECTURES:
            raise EyasError(
                f"unsupported model_type '{self.model_type}'; supported: {', '.join(ARCHITECTURES)}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise EyasError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in ROPE_TYPES:
            raise EyasError(f"unsupported rope_type '{rope_type}'; supported: {', '.join(ROPE_TYPES)}")

    @property
    def context_length(self) -> int:
        """Longest sequence the model attends over exactly (sliding window included)."""
        if self.sliding_window:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    @classmethod
    def from_dict(cls, hf: dict[str, Any]) -> ModelConfig:
        """Map a Hugging Face config.json (transformers 4.x or 5.x layout) onto ModelConfig."""
        model_type = hf.get("model_type", "llama")
        default_bias, qk_norm = ARCHITECTURES.get(model_type, (False, False))
        # transformers 5 nests rope settings under rope_parameters; 4.x keeps them at top level.
        rope = dict(hf.get("rope_parameters") or {})
        legacy_scaling = hf.get("rope_scaling")
        if legacy_scaling:
            rope.update(legacy_scaling)
        rope_theta = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
        if "type" in rope and "rope_type" not in rope:
            rope["rope_type"] = rope.pop("type")
        rope_scaling = rope if rope.get("rope_type", "default") != "default" else None
        eos = hf.get("eos_token_id")
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        heads = hf["num_attention_heads"]
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", default_bias)),
            qk_norm=qk_norm,
            model_type=model_type,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            sliding_window=hf.get("sliding_window") if hf.get("use_sliding_window", True) else None,
        )

    @classmethod
    def from_folder(cls, folder: str | Path) -> ModelConfig:
        return cls.from_dict(json.loads((Path(folder) / "config.json").read_text()))
