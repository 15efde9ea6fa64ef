"""The engine layouts of an EAGLE-3 head: tensor names, config keys, layer-id conventions.

| format      | config                                  | layer ids (boundary b -> written)         | layer names |
|-------------|-----------------------------------------|-------------------------------------------|-------------|
| sglang      | LlamaForCausalLMEagle3, HF llama keys   | eagle_config.eagle_aux_hidden_state_layer_ids = b - 1 (SGLang adds 1) | midlayer.*  |
| vllm        | Eagle3LlamaForCausalLM, HF llama keys   | eagle_aux_hidden_state_layer_ids = b      | midlayer.*  |
| speculators | Eagle3Speculator, transformer_layer_config + speculators_config | eagle_aux_hidden_state_layer_ids = b | layers.0.* |

All three hold fc.weight, norm.weight, lm_head.weight, d2t (int64 offsets), t2d (bool) and,
only when asked, embed_tokens.weight (engines share the target's embedding when it is absent).
Each exported config also carries `eyas_export` (format, boundary ids, target layer count) so
that `eyas export --check` and the import back need no guessing; engines ignore the key. A
`manifest.json` (size and sha256 of both files, utils/integrity.py) lets `--check` and the import
catch a changed, truncated or missing file; engines ignore it too. The weights default to the
target's dtype and the speculators verifier is the target's Hugging Face id (export/target.py).

Usage:
    export_head(load_head("runs/a/head"), "export/sglang", "sglang")   # dtype: the target's
    head = import_head("export/sglang", embedding=target.model.embed_tokens.weight)
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import Tensor

from eyas import __version__
from eyas.eagle3.checkpoint import EMBEDDING_NAME, head_state_dict, load_head_state
from eyas.eagle3.config import Eagle3Config, check_target_layer_ids
from eyas.eagle3.head import Eagle3Head
from eyas.eagle3.vocab import vocab_from_d2t
from eyas.errors import EyasError
from eyas.export.target import resolve_export_dtype, verifier_name
from eyas.utils.integrity import read_safetensors, verify_files, write_manifest
from eyas.utils.io import atomic_dir, read_json

FORMATS = ("sglang", "vllm", "speculators")
ARCHITECTURES = {
    "sglang": "LlamaForCausalLMEagle3",
    "vllm": "Eagle3LlamaForCausalLM",
    "speculators": "Eagle3Speculator",
}
LAYER_PREFIX = {"sglang": "midlayer.", "vllm": "midlayer.", "speculators": "layers.0."}
MARKER = "eyas_export"
EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


def check_format(name: str) -> str:
    if name not in FORMATS:
        raise EyasError(f"unknown export format '{name}'; accepted: {', '.join(FORMATS)}")
    return name


# ---- layer-id conventions --------------------------------------------------------------------
def engine_layer_ids(format_name: str, boundary_ids: list[int]) -> list[int]:
    """Boundary ids (ours) -> the ids the engine's config holds."""
    if format_name == "sglang":
        if min(boundary_ids) < 1:
            raise EyasError(f"SGLang reads layer ids as 'output of layer i' and cannot express the "
                            f"embedding output (boundary id 0) in {boundary_ids}")
        return [b - 1 for b in boundary_ids]
    return list(boundary_ids)


def boundary_layer_ids(format_name: str, engine_ids: list[int]) -> list[int]:
    """The engine's ids -> boundary ids (ours)."""
    if format_name == "sglang":
        return [int(i) + 1 for i in engine_ids]
    return [int(i) for i in engine_ids]


# ---- tensor names ----------------------------------------------------------------------------
def to_engine_name(format_name: str, name: str) -> str:
    return LAYER_PREFIX[format_name] + name[len("midlayer."):] if name.startswith("midlayer.") else name


def from_engine_name(format_name: str, name: str) -> str:
    prefix = LAYER_PREFIX[format_name]
    return "midlayer." + name[len(prefix):] if name.startswith(prefix) else name


def expected_shapes(config: Eagle3Config, format_name: str) -> dict[str, tuple[int, ...]]:
    """Every tensor an export holds (embed_tokens.weight is optional), by engine name."""
    h, i, v, n = config.hidden_size, config.intermediate_size, config.vocab_size, config.draft_vocab_size
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    ours = {
        "fc.weight": (h, config.fused_input_size),
        "midlayer.input_layernorm.weight": (h,),
        "midlayer.hidden_norm.weight": (h,),
        "midlayer.self_attn.q_proj.weight": (q, 2 * h),
        "midlayer.self_attn.k_proj.weight": (kv, 2 * h),
        "midlayer.self_attn.v_proj.weight": (kv, 2 * h),
        "midlayer.self_attn.o_proj.weight": (h, q),
        "midlayer.post_attention_layernorm.weight": (h,),
        "midlayer.mlp.gate_proj.weight": (i, h),
        "midlayer.mlp.up_proj.weight": (i, h),
        "midlayer.mlp.down_proj.weight": (h, i),
        "norm.weight": (h,),
        "lm_head.weight": (n, h),
        "d2t": (n,),
        "t2d": (v,),
        EMBEDDING_NAME: (v, h),
    }
    return {to_engine_name(format_name, name): shape for name, shape in ours.items()}


# ---- configs ---------------------------------------------------------------------------------
def llama_layer_config(config: Eagle3Config, dtype_name: str) -> dict[str, Any]:
    """The Hugging Face llama keys of the one decoder layer."""
    return {
        "model_type": "llama",
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": config.rope_scaling,
        "max_position_embeddings": config.max_position_embeddings,
        "vocab_size": config.vocab_size,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": dtype_name,
    }


def export_config(config: Eagle3Config, format_name: str, dtype_name: str = "float32",
                  speculative_tokens: int = 3, target_name: str = "") -> dict[str, Any]:
    """config.json of `format_name` for a head of `config`; `target_name` is the speculators
    verifier (export/target.py resolves it)."""
    ids = engine_layer_ids(format_name, config.target_layer_ids)
    marker = {"format": format_name, "target_layer_ids": list(config.target_layer_ids),
              "layer_id_convention": "boundary (0 = embeddings, k = residual entering layer k)",
              "target_num_hidden_layers": config.target_num_hidden_layers,
              "target_model": config.target_model, "eyas_version": __version__}
    common = {"draft_vocab_size": config.draft_vocab_size, "target_hidden_size": config.target_hidden_size}
    if format_name == "sglang":
        return {"architectures": [ARCHITECTURES["sglang"]], **llama_layer_config(config, dtype_name),
                **common, "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids,
                                           "use_aux_hidden_state": True}, MARKER: marker}
    if format_name == "vllm":
        return {"architectures": [ARCHITECTURES["vllm"]], **llama_layer_config(config, dtype_name),
                **common, "eagle_aux_hidden_state_layer_ids": ids,
                "eagle_config": {"use_aux_hidden_state": True}, MARKER: marker}
    return {
        "architectures": [ARCHITECTURES["speculators"]],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": llama_layer_config(config, dtype_name),
        **common,
        "norm_before_residual": False,
        "eagle_aux_hidden_state_layer_ids": ids,
        "tie_word_embeddings": False,
        "torch_dtype": dtype_name,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": target_name,
                         "architectures": list(config.target_architectures)},
        },
        MARKER: marker,
    }


def export_head(head: Eagle3Head, output: str | Path, format_name: str, dtype: str = "auto",
                include_embedding: bool = False, speculative_tokens: int = 3,
                target_name: str | None = None, model: str | None = None) -> Path:
    """Write `head` as config.json + model.safetensors (+ manifest.json) in the layout of
    `format_name`. dtype "auto" = the target's (of `model` when given, else of the target the
    head was trained with); a speculators export needs a resolvable verifier (`target_name`)."""
    check_format(format_name)
    dtype = resolve_export_dtype(head.config, dtype, model)
    # Engines capture the residual entering layers 1..L-1 only, in ascending order.
    check_target_layer_ids(head.config.target_layer_ids, head.config.target_num_hidden_layers)
    verifier = verifier_name(head.config, target_name, model) if format_name == "speculators" else ""
    if include_embedding and not head.embedding_set:
        raise EyasError("--with-embedding needs the target's embedding: pass --model")
    output = Path(output)
    if output.exists() and any(output.iterdir()):
        raise EyasError(f"{output} exists and is not empty; choose a new folder")
    if output.exists():
        output.rmdir()
    state = head_state_dict(head, include_embedding=include_embedding, dtype=EXPORT_DTYPES[dtype])
    state = {to_engine_name(format_name, name): tensor for name, tensor in state.items()}
    config = export_config(head.config, format_name, dtype, speculative_tokens, verifier)
    with atomic_dir(output) as tmp:
        save_file(state, str(tmp / WEIGHTS_NAME), metadata={"format": "pt", "producer": "eyas"})
        (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
        for file in tmp.iterdir():  # readable by the engine's user (safetensors writes 0600)
            os.chmod(file, 0o644 & ~_umask())
        write_manifest(tmp, [CONFIG_NAME, WEIGHTS_NAME])
    return output


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# ---- import back -----------------------------------------------------------------------------
def detect_format(raw: dict[str, Any]) -> str | None:
    marker = raw.get(MARKER) or {}
    if marker.get("format") in FORMATS:
        return marker["format"]
    if raw.get("speculators_model_type") == "eagle3":
        return "speculators"
    architectures = raw.get("architectures") or []
    if "Eagle3LlamaForCausalLM" in architectures:
        return "vllm"
    if "LlamaForCausalLMEagle3" in architectures:
        return "sglang" if "eagle_aux_hidden_state_layer_ids" not in raw else "vllm"
    return None


def read_export_config(folder: str | Path, format_name: str | None = None) -> tuple[str, dict[str, Any]]:
    path = Path(folder) / CONFIG_NAME
    if not path.is_file():
        raise EyasError(f"{folder} has no {CONFIG_NAME}")
    raw = read_json(path)
    if not isinstance(raw, dict):
        raise EyasError(f"{path} is not a model config (a JSON object expected)")
    found = format_name or detect_format(raw)
    if found is None:
        raise EyasError(f"cannot tell the format of {folder}; pass --format ({', '.join(FORMATS)})")
    return check_format(found), raw


def config_from_export(raw: dict[str, Any], format_name: str) -> Eagle3Config:
    """The Eagle3Config an exported config describes (layer ids back to boundary ids)."""
    layer = raw["transformer_layer_config"] if format_name == "speculators" else raw
    marker = raw.get(MARKER) or {}
    if format_name == "sglang":
        engine_ids = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    else:
        engine_ids = raw.get("eagle_aux_hidden_state_layer_ids")
    if engine_ids is None:
        raise EyasError("the config names no eagle_aux_hidden_state_layer_ids; the engine would pick "
                        "its default layers, which eyas cannot check: add them to the config")
    verifier = (raw.get("speculators_config") or {}).get("verifier") or {}
    try:
        hidden = layer["hidden_size"]
        heads = layer["num_attention_heads"]
        return Eagle3Config(
            hidden_size=hidden, intermediate_size=layer["intermediate_size"],
            num_attention_heads=heads, num_key_value_heads=layer.get("num_key_value_heads") or heads,
            head_dim=layer.get("head_dim") or hidden // heads, vocab_size=layer["vocab_size"],
            draft_vocab_size=raw.get("draft_vocab_size") or layer["vocab_size"],
            target_hidden_size=raw.get("target_hidden_size") or hidden,
            target_layer_ids=boundary_layer_ids(format_name, engine_ids),
            target_num_hidden_layers=marker.get("target_num_hidden_layers"),
            rms_norm_eps=layer.get("rms_norm_eps", 1e-6), rope_theta=layer.get("rope_theta", 10000.0),
            rope_scaling=layer.get("rope_scaling"),
            max_position_embeddings=layer.get("max_position_embeddings", 4096),
            target_model=marker.get("target_model") or verifier.get("name_or_path", ""),
            target_architectures=verifier.get("architectures") or ["LlamaForCausalLM"],
        )
    except KeyError as error:
        raise EyasError(f"the exported config lacks the key {error}") from None
    except (TypeError, ValueError) as error:
        raise EyasError(f"the exported config holds a value of the wrong kind ({error})") from None


def import_head(folder: str | Path, format_name: str | None = None, embedding: Tensor | None = None,
                dtype: torch.dtype = torch.float32) -> Eagle3Head:
    """Load an SGLang / vLLM / speculators head folder into the eyas head class (its files
    checked against an eyas manifest when it has one)."""
    weights = Path(folder) / WEIGHTS_NAME
    if (Path(folder) / CONFIG_NAME).is_file() and not weights.is_file():
        raise EyasError(f"{folder} has no {WEIGHTS_NAME} (sharded heads are not supported)")
    if weights.is_file():
        verify_files(folder, [CONFIG_NAME, WEIGHTS_NAME], warn=False)  # foreign heads have none
    format_name, raw = read_export_config(folder, format_name)
    config = config_from_export(raw, format_name)
    state = {from_engine_name(format_name, k): v for k, v in read_safetensors(weights).items()}
    if "d2t" not in state:  # a head over the full vocabulary
        state["d2t"] = torch.zeros(config.draft_vocab_size, dtype=torch.int64)
    if "t2d" not in state:
        state["t2d"] = vocab_from_d2t(state["d2t"], config.vocab_size).t2d
    head = Eagle3Head(config)
    load_head_state(head, state, str(weights))
    head = head.to(dtype)
    if embedding is not None:
        head.set_embedding(embedding.to(dtype))
    return head.eval()
