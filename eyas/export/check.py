"""`eyas export --check DIR`: validate an exported head without loading it into an engine.

Checks, reading only the safetensors header plus d2t/t2d:
  - config.json has the keys its format requires (architectures, sizes, draft_vocab_size,
    layer ids where that format keeps them);
  - every expected tensor is present, nothing unexpected, each with the shape the config
    implies; weights share one float dtype, d2t is int64, t2d bool;
  - d2t maps draft ids to increasing target ids inside the vocabulary, and t2d agrees with it;
  - the layer ids, converted back to boundary ids, are three ids in range, equal to the ids the
    eyas marker recorded, and (with a target) below its layer count; SGLang's reading of ids
    whose first entry is not 1 differs between versions: a warning says so.

Usage:
    report = check_export("export/sglang", target_config=ModelConfig.from_folder(folder))
    print(report.render()); report.ok
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from eyas.eagle3.checkpoint import EMBEDDING_NAME
from eyas.errors import EyasError
from eyas.export.formats import (
    ARCHITECTURES,
    MARKER,
    WEIGHTS_NAME,
    config_from_export,
    expected_shapes,
    read_export_config,
    to_engine_name,
)
from eyas.models.config import ModelConfig

REQUIRED_KEYS = {
    "sglang": ("architectures", "hidden_size", "intermediate_size", "num_attention_heads",
               "num_key_value_heads", "num_hidden_layers", "rms_norm_eps", "vocab_size",
               "draft_vocab_size", "eagle_config"),
    "vllm": ("architectures", "hidden_size", "intermediate_size", "num_attention_heads",
             "num_key_value_heads", "num_hidden_layers", "rms_norm_eps", "vocab_size",
             "draft_vocab_size", "eagle_aux_hidden_state_layer_ids"),
    "speculators": ("architectures", "speculators_model_type", "transformer_layer_config",
                    "draft_vocab_size", "norm_before_residual", "eagle_aux_hidden_state_layer_ids",
                    "speculators_config"),
}
FLOAT_DTYPES = {torch.float32, torch.bfloat16, torch.float16}


@dataclass
class CheckReport:
    folder: str
    format: str = ""
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    facts: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors

    def render(self) -> str:
        lines = [f"{self.folder}: {'OK' if self.ok else 'FAILED'} ({self.format or 'unknown'} format)"]
        lines += [f"  {fact}" for fact in self.facts]
        lines += [f"  warning: {w}" for w in self.warnings]
        lines += [f"  error: {e}" for e in self.errors]
        return "\n".join(lines)


def check_export(folder: str | Path, format_name: str | None = None,
                 target_config: ModelConfig | None = None) -> CheckReport:
    report = CheckReport(folder=str(folder))
    try:
        format_name, raw = read_export_config(folder, format_name)
    except EyasError as error:
        report.errors.append(str(error))
        return report
    report.format = format_name
    # 1. Config keys of the format.
    missing = [k for k in REQUIRED_KEYS[format_name] if k not in raw]
    if missing:
        report.errors.append(f"config.json lacks {missing}")
        return report
    if ARCHITECTURES[format_name] not in raw["architectures"] and not (
            format_name == "vllm" and ARCHITECTURES["sglang"] in raw["architectures"]):
        report.errors.append(f"architectures {raw['architectures']} do not name {ARCHITECTURES[format_name]}")
    try:
        config = config_from_export(raw, format_name)
    except EyasError as error:
        report.errors.append(str(error))
        return report
    layer = raw["transformer_layer_config"] if format_name == "speculators" else raw
    if layer.get("num_hidden_layers", 1) != 1:
        report.errors.append(f"num_hidden_layers is {layer['num_hidden_layers']}; an EAGLE-3 head has 1")
    # 2. Tensor names, shapes and dtypes (header only).
    weights = Path(folder) / WEIGHTS_NAME
    if not weights.is_file():
        report.errors.append(f"no {WEIGHTS_NAME}")
        return report
    expected = expected_shapes(config, format_name)
    optional = {to_engine_name(format_name, EMBEDDING_NAME)}
    with safe_open(str(weights), framework="pt") as handle:
        names = set(handle.keys())
        for name in sorted(set(expected) - names - optional):
            report.errors.append(f"missing tensor {name}")
        for name in sorted(names - set(expected)):
            report.errors.append(f"unexpected tensor {name}")
        float_dtypes = set()
        for name in sorted(names & set(expected)):
            piece = handle.get_slice(name)
            shape = tuple(piece.get_shape())
            if shape != expected[name]:
                report.errors.append(f"{name} has shape {shape}, the config implies {expected[name]}")
            dtype = _dtype(piece.get_dtype())
            if name == "d2t" and dtype != torch.int64:
                report.errors.append(f"d2t is {dtype}, expected int64 offsets")
            elif name == "t2d" and dtype != torch.bool:
                report.errors.append(f"t2d is {dtype}, expected bool")
            elif name not in ("d2t", "t2d"):
                float_dtypes.add(dtype)
        if not float_dtypes <= FLOAT_DTYPES or len(float_dtypes) > 1:
            report.errors.append(f"weights must share one float dtype, found {sorted(map(str, float_dtypes))}")
        # 3. d2t / t2d consistency.
        if {"d2t", "t2d"} <= names and not report.errors:
            _check_vocab(handle.get_tensor("d2t"), handle.get_tensor("t2d"), report)
    report.facts.append(f"tensors: {len(names)}; weights {sorted(map(str, float_dtypes))}; draft vocabulary "
                        f"{config.draft_vocab_size} of {config.vocab_size}; embedding "
                        f"{'included' if optional & names else 'shared from the target'}")
    # 4. Layer ids.
    _check_layer_ids(raw, format_name, config.target_layer_ids, target_config, report)
    if target_config is not None:
        if target_config.vocab_size != config.vocab_size:
            report.errors.append(f"vocab_size {config.vocab_size} differs from the target's "
                                 f"{target_config.vocab_size}")
        if target_config.hidden_size != config.target_hidden_size:
            report.errors.append(f"target_hidden_size {config.target_hidden_size} differs from the "
                                 f"target's hidden size {target_config.hidden_size}")
    return report


def _dtype(name: str) -> torch.dtype | str:
    return {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
            "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
            "U8": torch.uint8, "BOOL": torch.bool}.get(name, name)


def _check_vocab(d2t: torch.Tensor, t2d: torch.Tensor, report: CheckReport) -> None:
    kept = torch.arange(d2t.numel()) + d2t
    if d2t.numel() and (int(kept.min()) < 0 or int(kept.max()) >= t2d.numel()):
        report.errors.append("d2t maps draft ids outside the target vocabulary (offsets expected: "
                             "target_id = draft_id + d2t[draft_id])")
        return
    if bool((kept[1:] <= kept[:-1]).any()):
        report.errors.append("d2t does not map draft ids to increasing target ids")
    if int(t2d.sum()) != d2t.numel() or not bool(t2d[kept].all()):
        report.errors.append("t2d does not mark exactly the target ids that d2t maps to")


def _check_layer_ids(raw: dict, format_name: str, boundary: list[int],
                     target_config: ModelConfig | None, report: CheckReport) -> None:
    marker = raw.get(MARKER) or {}
    report.facts.append(f"target layers (boundary ids): {boundary}")
    if boundary != sorted(boundary) or len(set(boundary)) != len(boundary):
        report.warnings.append(f"layer ids {boundary} are not strictly increasing")
    if marker.get("target_layer_ids") is not None and list(marker["target_layer_ids"]) != boundary:
        report.errors.append(f"layer ids in the config map to boundary ids {boundary}, but the head was "
                             f"trained on {marker['target_layer_ids']} (an off-by-one silently kills "
                             f"acceptance)")
    layers = target_config.num_hidden_layers if target_config else marker.get("target_num_hidden_layers")
    if layers is not None and max(boundary) > layers:
        report.errors.append(f"boundary id {max(boundary)} exceeds the target's {layers} layers")
    if format_name == "sglang" and boundary[0] != 2:
        report.warnings.append("SGLang versions differ in how they read layer ids whose first entry is "
                               "not 1 (some add 1 only then); check the served acceptance")
