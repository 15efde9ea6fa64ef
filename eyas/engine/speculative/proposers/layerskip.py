"""`layerskip`: self-speculation by layer skipping (SWIFT, Draft & Verify, LayerSkip): the target
drafts for itself with some of its decoder layers left out. No extra weights.

Specs (`--draft`):
    layerskip                    = layerskip:auto
    layerskip:auto               the skipped layers, chain length and confidence threshold come
                                 from a calibration on sample prompts (layerskip_calibrate.py),
                                 run once per model and precision and cached
    layerskip:LAYERS             the decoder layers to SKIP, 0-based (Transformer.layers[i]),
                                 e.g. 4,5,6 or 4-9,12; every other layer runs
    ...[:MIN_CONFIDENCE]         e.g. layerskip:auto:0.6 or layerskip:10-19:0: end a chain at a
                                 draft whose probability under the draft is below this (0 = off;
                                 auto: the calibrated value)

The draft is `DraftModelProposer` over the target itself with `skip_layers`: a chain drafted one
token at a time, with a KV cache of its own that holds only the layers that run. After a
rejection, the next step finds the longest prefix of that cache that is still valid (by token
ids) and writes from there: the keys of rejected drafts are overwritten before anything reads
them. Verification is the target's usual full pass, so the output is exactly the target's.
In single-stream decoding with the fallback on, the chain is priced like a draft model's
(chain_pricing.py: the skipping draft's measured pass against the target's): a skip set whose
draft costs nearly a target pass decodes at plain speed instead of losing to it.
"""

from __future__ import annotations

from dataclasses import dataclass

from eyas.engine.speculative.proposers.draft_model import DraftModelProposer
from eyas.engine.target import Target
from eyas.errors import EyasError

SPEC_HELP = ("layerskip[:auto|LAYERS[:MIN_CONFIDENCE]] (LAYERS = decoder layers to skip, 0-based, "
             "e.g. 4,5,6 or 4-9,12)")


@dataclass
class LayerSkipConfig:
    num_layers: int  # decoder layers of the target
    skip_layers: tuple[int, ...]  # 0-based decoder layers the draft leaves out, sorted
    min_confidence: float = 0.0  # end a chain at a draft less likely than this (0 = never)
    max_draft_tokens: int | None = None  # longest chain (None: the caller's budget)

    def __post_init__(self) -> None:
        self.skip_layers = tuple(sorted(set(int(i) for i in self.skip_layers)))
        bad = [i for i in self.skip_layers if not 0 <= i < self.num_layers]
        if bad:
            raise EyasError(f"layerskip: layers {bad} do not exist; this target has decoder layers "
                            f"0..{self.num_layers - 1}")
        if not self.skip_layers:
            raise EyasError("layerskip: no layer to skip; the draft would be the target itself "
                            "(use --draft self for that)")
        if len(self.skip_layers) >= self.num_layers:
            raise EyasError(f"layerskip: skipping all {self.num_layers} layers leaves no draft; "
                            "keep at least one")
        if not 0.0 <= self.min_confidence < 1.0:
            raise EyasError(f"layerskip: MIN_CONFIDENCE must be in [0, 1), got {self.min_confidence}")
        if self.max_draft_tokens is not None and self.max_draft_tokens < 1:
            raise EyasError(f"layerskip: max_draft_tokens must be >= 1, got {self.max_draft_tokens}")

    @property
    def kept_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if i not in self.skip_layers)


def parse_layers(text: str) -> list[int]:
    """'4,5,6' or '4-9,12' -> [4, 5, 6] / [4, 5, 6, 7, 8, 9, 12]."""
    layers: list[int] = []
    try:
        for part in text.split(","):
            part = part.strip()
            if not part:
                continue
            if "-" in part:
                first, last = (int(x) for x in part.split("-", 1))
                if last < first:
                    raise ValueError(part)
                layers.extend(range(first, last + 1))
            else:
                layers.append(int(part))
    except ValueError:
        raise EyasError(f"layerskip: bad layer list '{text}'; expected decoder layers to skip, "
                        f"0-based, like 4,5,6 or 4-9,12") from None
    return layers


def parse_confidence(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise EyasError(f"layerskip: bad MIN_CONFIDENCE '{text}'; expected a number in [0, 1), "
                        f"e.g. layerskip:auto:0.6") from None


class LayerSkipProposer(DraftModelProposer):
    """The target without `config.skip_layers` drafts a chain for the full target to verify."""

    def __init__(self, target: Target, config: LayerSkipConfig, slots: int = 4096,
                 calibration: dict | None = None) -> None:
        super().__init__(target, name="layerskip", slots=slots, skip_layers=config.skip_layers,
                         min_confidence=config.min_confidence,
                         max_draft_tokens=config.max_draft_tokens, priced=True)
        self.config = config
        self.calibration = calibration  # what `auto` measured (reported in the stats)

    def stats(self) -> dict:
        out: dict = {"skip_layers": list(self.config.skip_layers),
                     "kept_layers": len(self.config.kept_layers),
                     "min_confidence": self.config.min_confidence}
        if self.calibration is not None:
            out["calibration"] = self.calibration
        return out


def build_layerskip(target: Target, option: str) -> LayerSkipProposer:
    """The proposer of a `layerskip[:...]` spec (its part after 'layerskip:')."""
    layers_text, _, confidence_text = option.partition(":")
    layers_text = layers_text.strip() or "auto"
    num_layers = target.config.num_hidden_layers
    confidence = parse_confidence(confidence_text) if confidence_text else None
    if layers_text == "auto":
        from eyas.engine.speculative.layerskip_calibrate import load_or_calibrate

        result = load_or_calibrate(target)
        config = LayerSkipConfig(num_layers, tuple(result.skip_layers),
                                 result.min_confidence if confidence is None else confidence,
                                 result.draft_length)
        return LayerSkipProposer(target, config, calibration=result.summary())
    config = LayerSkipConfig(num_layers, tuple(parse_layers(layers_text)), confidence or 0.0)
    return LayerSkipProposer(target, config)
