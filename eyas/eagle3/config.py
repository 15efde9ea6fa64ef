"""`Eagle3Config`: the shape of an EAGLE-3 draft head and the target it reads.

Layer ids are stored in ONE convention, boundary ids: k = the residual stream entering target
layer k (0 = the embedding output, L = the output of the last layer before the final norm).
That is what `Transformer.forward(tap_layers=...)` takes and what vLLM reads; the export
converts it for the engines that read something else (SGLang: k - 1).
"""

from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any

from eyas.errors import EyasError
from eyas.models.config import ModelConfig

CONFIG_FORMAT = "eyas-eagle3"
CONFIG_VERSION = 1
NUM_TAPS = 3  # EAGLE-3 fuses exactly three target hidden states (engines assume it)


def default_target_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3's default taps: entering layers {2, L//2, L-3} (boundary ids).

    A target too shallow for those to be three distinct ids in 1..L-1 (fewer than 8 layers, as
    the tiny test models) gets {1, L//2, L-1} instead, which is valid from 4 layers up.
    """
    ids = [2, num_layers // 2, num_layers - 3]
    if ids[0] < ids[1] < ids[2]:
        return ids
    return [1, num_layers // 2, num_layers - 1]


def check_target_layer_ids(layer_ids: list[int], num_layers: int | None,
                           allow_edges: bool = False) -> list[int]:
    """Validate boundary ids and return them as ints; raise `EyasError` naming what is accepted.

    Three distinct ids in ascending order (every engine concatenates the captured states in
    ascending layer order), each in 1..L-1: the residual entering a layer that has a layer before
    it, which is what SGLang and vLLM capture (vLLM adds a residual that does not exist before
    layer 0; no engine captures after the last layer). `allow_edges` also accepts 0 and L, which
    eyas's own engine reads (a head loaded for eyas alone); training, features and export do not.
    """
    try:
        ids = [int(i) for i in layer_ids]
    except (TypeError, ValueError):
        raise EyasError(f"target_layer_ids must be integers, got {layer_ids!r}") from None
    if len(ids) != NUM_TAPS:
        raise EyasError(f"target_layer_ids must hold {NUM_TAPS} boundary ids, got {ids}")
    if len(set(ids)) != len(ids):
        raise EyasError(f"target layer ids {ids} repeat a layer: {NUM_TAPS} distinct ids are needed")
    if ids != sorted(ids):
        raise EyasError(f"target layer ids {ids} are not in ascending order: engines concatenate the "
                        f"captured states in layer order, so write them as {sorted(ids)} (and train "
                        f"on them in that order)")
    lowest = 0 if allow_edges else 1
    if num_layers is None:
        highest, bound = None, f">= {lowest}"
    else:
        highest = num_layers if allow_edges else num_layers - 1
        bound = f"{lowest}..{highest} for a target of {num_layers} layers"
    for i in ids:
        if i < lowest or (highest is not None and i > highest):
            raise EyasError(
                f"target layer id {i} is out of range: boundary ids are {bound} "
                f"(k = the residual entering layer k; 0, the embeddings, and L, after the last "
                f"layer, cannot be captured by SGLang or vLLM)"
            )
    return ids


@dataclass
class Eagle3Config:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # the target's vocabulary (t2d has this length)
    draft_vocab_size: int  # rows of the head's lm_head (d2t has this length)
    target_hidden_size: int
    target_layer_ids: list[int]  # boundary ids, see the module docstring
    target_num_hidden_layers: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    target_model: str = ""  # how the target was named when the head was trained
    target_architectures: list[str] = field(default_factory=lambda: ["LlamaForCausalLM"])

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "vocab_size", "draft_vocab_size",
                     "target_hidden_size", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise EyasError(f"{name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise EyasError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.draft_vocab_size > self.vocab_size:
            raise EyasError(
                f"draft_vocab_size ({self.draft_vocab_size}) cannot exceed the target "
                f"vocabulary ({self.vocab_size})"
            )
        if self.fused_input_size == self.hidden_size:
            raise EyasError(
                f"3 * target_hidden_size ({self.fused_input_size}) equals hidden_size: the head "
                f"could not tell fused taps from its own output"
            )
        self.target_layer_ids = check_target_layer_ids(self.target_layer_ids,
                                                       self.target_num_hidden_layers,
                                                       allow_edges=True)

    @property
    def fused_input_size(self) -> int:
        """Width of the concatenated taps that `fc` reads."""
        return NUM_TAPS * self.target_hidden_size

    @classmethod
    def for_target(
        cls,
        target: ModelConfig,
        draft_vocab_size: int,
        target_layer_ids: list[int] | None = None,
        target_model: str = "",
        target_architectures: list[str] | None = None,
    ) -> Eagle3Config:
        """A head shaped like one decoder layer of `target` (what EAGLE-3 uses)."""
        # The head is always a plain Llama layer (no q/k norm, no bias) whatever the target is.
        layer_ids = target_layer_ids or default_target_layer_ids(target.num_hidden_layers)
        return cls(
            hidden_size=target.hidden_size,
            intermediate_size=target.intermediate_size,
            num_attention_heads=target.num_attention_heads,
            num_key_value_heads=target.num_key_value_heads,
            head_dim=target.head_dim,
            vocab_size=target.vocab_size,
            draft_vocab_size=min(draft_vocab_size, target.vocab_size),
            target_hidden_size=target.hidden_size,
            target_layer_ids=list(layer_ids),
            target_num_hidden_layers=target.num_hidden_layers,
            rms_norm_eps=target.rms_norm_eps,
            rope_theta=target.rope_theta,
            rope_scaling=target.rope_scaling,
            max_position_embeddings=target.max_position_embeddings,
            target_model=target_model,
            target_architectures=list(target_architectures or ["LlamaForCausalLM"]),
        )

    def to_dict(self) -> dict[str, Any]:
        return {"format": CONFIG_FORMAT, "format_version": CONFIG_VERSION, **asdict(self)}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Eagle3Config:
        if raw.get("format") != CONFIG_FORMAT:
            raise EyasError(
                f"not an eyas EAGLE-3 head config (format={raw.get('format')!r}, expected "
                f"{CONFIG_FORMAT!r}); to import an SGLang/vLLM/speculators head use "
                f"`eyas export --import`"
            )
        if raw.get("format_version", 0) > CONFIG_VERSION:
            raise EyasError(
                f"head config version {raw['format_version']} is newer than this eyas "
                f"understands ({CONFIG_VERSION}); upgrade eyas"
            )
        required = [f.name for f in fields(cls)
                    if f.default is MISSING and f.default_factory is MISSING]
        missing = [name for name in required if name not in raw]
        if missing:
            raise EyasError(f"head config is missing keys: {', '.join(missing)}")
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in raw.items() if k in names})
