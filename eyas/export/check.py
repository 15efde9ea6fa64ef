"""`eyas export --check DIR`: validate an exported head without loading it into an engine.

Checks:
  - both files match the sizes and sha256 digests of the export's manifest.json (an export
    without one, not written by eyas or by an older eyas, is checked without: a warning says so),
    and model.safetensors can be read at all (a truncated file is an error, not a traceback);
  - config.json has the keys its format requires (architectures, sizes, draft_vocab_size,
    layer ids where that format keeps them);
  - every expected tensor is present, nothing unexpected, each with the shape the config
    implies; weights share one float dtype (the config's torch_dtype), d2t is int64, t2d bool;
    every weight is finite (a NaN or inf is an error);
  - d2t maps draft ids to increasing target ids inside the vocabulary, and t2d agrees with it;
  - the layer ids, converted back to boundary ids, are three distinct ascending ids in 1..L-1 of
    the target (`--model`, else the layer count the eyas marker recorded), equal to the ids the
    marker recorded; SGLang's reading of ids whose first entry is not 1 differs between versions:
    a warning says so;
  - with the target's dtype known, the weights are in it (SGLang refuses a mismatch at start-up);
  - a speculators verifier is a name the engines can resolve (not an eyas alias).

Usage:
    report = check_export("export/sglang", target_config=ModelConfig.from_folder(folder),
                          target_dtype="bfloat16")
    print(report.render()); report.ok
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from eyas.eagle3.checkpoint import EMBEDDING_NAME
from eyas.eagle3.config import check_target_layer_ids
from eyas.errors import EyasError
from eyas.export.formats import (
    ARCHITECTURES,
    CONFIG_NAME,
    MARKER,
    WEIGHTS_NAME,
    config_from_export,
    expected_shapes,
    read_export_config,
    to_engine_name,
)
from eyas.models.config import ModelConfig
from eyas.models.registry import ALIASES
from eyas.utils.integrity import MANIFEST_NAME, verify_files

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
                 target_config: ModelConfig | None = None,
                 target_dtype: str | None = None) -> CheckReport:
    report = CheckReport(folder=str(folder))
    # 0. File integrity against the manifest (every fault is reported; the checks go on).
    try:
        if not verify_files(folder, [CONFIG_NAME, WEIGHTS_NAME], warn=False):
            report.warnings.append(f"no {MANIFEST_NAME}: file digests not checked (an export not "
                                   f"written by this eyas)")
    except EyasError as error:
        report.errors.append(str(error))
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
    # 2.-3. Tensor names, shapes, dtypes and finite values; d2t/t2d.
    weights = Path(folder) / WEIGHTS_NAME
    if not weights.is_file():
        report.errors.append(f"no {WEIGHTS_NAME}")
        return report
    expected = expected_shapes(config, format_name)
    optional = {to_engine_name(format_name, EMBEDDING_NAME)}
    try:
        names, float_dtypes = _check_tensors(weights, expected, optional, report)
    except Exception as error:  # SafetensorError, OSError: a truncated or foreign file
        report.errors.append(f"{weights} cannot be read: {error}")
        return report
    report.facts.append(f"tensors: {len(names)}; weights {sorted(map(str, float_dtypes))}; draft vocabulary "
                        f"{config.draft_vocab_size} of {config.vocab_size}; embedding "
                        f"{'included' if optional & names else 'shared from the target'}")
    # 4. Layer ids, dtype, verifier.
    _check_layer_ids(raw, format_name, config.target_layer_ids, target_config, report)
    _check_dtype(layer.get("torch_dtype"), float_dtypes, format_name, target_dtype, report)
    if format_name == "speculators":
        verifier = ((raw.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
        if not verifier or verifier in ALIASES:
            hint = f" (its Hugging Face id is {ALIASES[verifier].hf_id})" if verifier in ALIASES else ""
            report.errors.append(f"the verifier {verifier!r} is not a model vLLM or speculators can "
                                 f"resolve{hint}: re-export with --target-name")
    if target_config is not None:
        if target_config.vocab_size != config.vocab_size:
            report.errors.append(f"vocab_size {config.vocab_size} differs from the target's "
                                 f"{target_config.vocab_size}")
        if target_config.hidden_size != config.target_hidden_size:
            report.errors.append(f"target_hidden_size {config.target_hidden_size} differs from the "
                                 f"target's hidden size {target_config.hidden_size}")
    return report


def _check_tensors(weights: Path, expected: dict[str, tuple[int, ...]], optional: set[str],
                   report: CheckReport) -> tuple[set[str], set]:
    """Names, shapes, dtypes and finiteness of every tensor; d2t/t2d consistency. Returns the
    names found and the float dtypes of the weights."""
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
                if dtype in FLOAT_DTYPES:
                    _check_finite(name, handle.get_tensor(name), report)
        if not float_dtypes <= FLOAT_DTYPES or len(float_dtypes) > 1:
            report.errors.append(f"weights must share one float dtype, found {sorted(map(str, float_dtypes))}")
        # 3. d2t / t2d consistency.
        if {"d2t", "t2d"} <= names and not any(e.startswith(("d2t", "t2d")) for e in report.errors):
            _check_vocab(handle.get_tensor("d2t"), handle.get_tensor("t2d"), report)
    return names, float_dtypes


def _check_finite(name: str, tensor: torch.Tensor, report: CheckReport) -> None:
    nan, inf = int(torch.isnan(tensor).sum()), int(torch.isinf(tensor).sum())
    if nan or inf:
        report.errors.append(f"{name} holds {nan} NaN and {inf} infinite values (a diverged or "
                             f"damaged head: every weight must be finite)")


def _check_dtype(config_dtype: str | None, float_dtypes: set, format_name: str,
                 target_dtype: str | None, report: CheckReport) -> None:
    if len(float_dtypes) != 1:
        return
    found = str(next(iter(float_dtypes))).removeprefix("torch.")
    if config_dtype is not None and config_dtype != found:
        report.errors.append(f"config.json says torch_dtype {config_dtype}, the weights are {found}")
    if target_dtype is not None and target_dtype != found:
        message = (f"the weights are {found}, the target is {target_dtype}: re-export with --dtype "
                   f"{target_dtype} (or leave --dtype out)")
        if format_name == "sglang":  # SGLang runs the draft in its config's dtype
            report.errors.append(message + "; SGLang refuses the mismatch at start-up")
        else:
            report.warnings.append(message)


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
    if marker.get("target_layer_ids") is not None and list(marker["target_layer_ids"]) != boundary:
        report.errors.append(f"layer ids in the config map to boundary ids {boundary}, but the head was "
                             f"trained on {marker['target_layer_ids']} (an off-by-one silently kills "
                             f"acceptance)")
    recorded = marker.get("target_num_hidden_layers")
    layers = target_config.num_hidden_layers if target_config else recorded
    if target_config is not None and recorded is not None and recorded != layers:
        report.errors.append(f"the head was trained for a target of {recorded} layers, the target "
                             f"has {layers}")
    try:  # distinct, ascending, each in 1..L-1 (what SGLang and vLLM can capture)
        check_target_layer_ids(boundary, layers)
    except EyasError as error:
        report.errors.append(str(error))
    if layers is None:
        report.warnings.append("the target's layer count is unknown: pass --model to check the ids "
                               "against its depth")
    if format_name == "sglang" and boundary[0] != 2:
        report.warnings.append("SGLang versions differ in how they read layer ids whose first entry is "
                               "not 1 (some add 1 only then); check the served acceptance")
