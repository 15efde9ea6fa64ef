"""What the head needs from the target: its config, its features, its embedding and lm_head.

Offline training never loads the whole target: it reads only the embedding (shared, frozen, by
the head) and the lm_head (which turns the stored last hidden state into the target's logits).

Usage:
    info = describe_target("smollm2-135m")           # folder, ModelConfig, architectures
    embedding, lm_head = load_output_weights(info)    # [V, H] each, float32
    taps, hidden = compute_target_features(target.model, input_ids, info.default_layer_ids)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
from torch import Tensor

from eyas.eagle3.config import default_target_layer_ids
from eyas.errors import EyasError
from eyas.models.config import ModelConfig
from eyas.models.kv_cache import KVCache
from eyas.models.llama import Transformer
from eyas.models.registry import resolve_model
from eyas.models.weight_source import open_weights

EMBEDDING_KEYS = ("model.embed_tokens.weight", "embed_tokens.weight")
LM_HEAD_KEYS = ("lm_head.weight",)


@dataclass
class TargetInfo:
    spec: str
    folder: Path
    config: ModelConfig
    architectures: list[str]

    @property
    def default_layer_ids(self) -> list[int]:
        return default_target_layer_ids(self.config.num_hidden_layers)


def describe_target(spec: str | Path) -> TargetInfo:
    """Resolve a model spec (alias, folder, .gguf) and read its config, without weights."""
    folder = resolve_model(str(spec))
    raw = json.loads((folder / "config.json").read_text())
    return TargetInfo(spec=str(spec), folder=folder, config=ModelConfig.from_dict(raw),
                      architectures=list(raw.get("architectures") or ["LlamaForCausalLM"]))


def _read_first(names: set[str], read, keys: Sequence[str]) -> Tensor | None:
    for key in keys:
        if key in names:
            return read(key)
    return None


def load_output_weights(info: TargetInfo) -> tuple[Tensor, Tensor]:
    """The target's token embedding and lm_head weights, [V, H] each, as float32 (read from
    the safetensors files, or the GGUF, one tensor each)."""
    source = open_weights(info.folder, heads=info.config.num_attention_heads,
                          kv_heads=info.config.num_key_value_heads)
    names = source.names()
    embedding = _read_first(names, source.get, EMBEDDING_KEYS)
    if embedding is None:
        raise EyasError(f"no token embedding ({' or '.join(EMBEDDING_KEYS)}) in the weights of "
                        f"{info.folder}")
    lm_head = None if info.config.tie_word_embeddings else _read_first(names, source.get, LM_HEAD_KEYS)
    if lm_head is None:
        lm_head = embedding
    return embedding.float(), lm_head.float()


@torch.no_grad()
def compute_target_features(
    model: Transformer,
    input_ids: Tensor,  # [B, T], right-padded (padding never reaches a real row: causal)
    tap_layers: Sequence[int],  # boundary ids
) -> tuple[Tensor, Tensor]:
    """taps [B, T, 3H] (residual entering each tap layer) and hidden [B, T, H] (after the norm).

    An int4 target on a CPU runs its fused C++ layer stack (the serving engine's: the same
    values the head reads when it drafts, ~1.5x the Python layers' speed), which keeps keys and
    values in a cache: one is made for the call."""
    cache = None
    if model.fused_layers() is not None:
        config = model.config
        batch, length = input_ids.shape
        cache = KVCache(config.num_hidden_layers, batch, config.num_key_value_heads, length, config.head_dim,
                        dtype=model.kv_dtype, device=input_ids.device)
    out = model(input_ids, cache=cache, tap_layers=tuple(tap_layers), logits_at=None)
    assert out.taps is not None
    return out.taps, out.hidden
