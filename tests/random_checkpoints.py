"""Random checkpoints written straight to disk (no transformers model in memory): a Llama
safetensors folder, and GGUF files of chosen tensor types (gguf.GGUFWriter)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch


def llama_tensors(layers: int, hidden: int, intermediate: int, heads: int, kv_heads: int,
                  vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Hugging Face names -> float32 tensors of a random Llama (output layer untied)."""
    generator = torch.Generator().manual_seed(seed)
    head_dim = hidden // heads

    def rand(*shape: int, scale: float = 0.05) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * scale

    tensors = {"model.embed_tokens.weight": rand(vocab, hidden, scale=1.0),
               "model.norm.weight": 1 + rand(hidden), "lm_head.weight": rand(vocab, hidden, scale=0.4)}
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors.update({
            p + "input_layernorm.weight": 1 + rand(hidden),
            p + "post_attention_layernorm.weight": 1 + rand(hidden),
            p + "self_attn.q_proj.weight": rand(heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": rand(kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": rand(kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": rand(hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": rand(intermediate, hidden),
            p + "mlp.up_proj.weight": rand(intermediate, hidden),
            p + "mlp.down_proj.weight": rand(hidden, intermediate),
        })
    return tensors


def write_llama_folder(folder: Path, layers: int = 2, hidden: int = 128, intermediate: int = 256,
                       heads: int = 4, kv_heads: int = 2, vocab: int = 512, seed: int = 0,
                       dtype: torch.dtype = torch.bfloat16) -> Path:
    """A Hugging Face folder (config.json + model.safetensors, no tokenizer) of a random Llama."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": vocab,
              "hidden_size": hidden, "intermediate_size": intermediate, "num_hidden_layers": layers,
              "num_attention_heads": heads, "num_key_value_heads": kv_heads, "rms_norm_eps": 1e-6,
              "max_position_embeddings": 256, "tie_word_embeddings": False}
    (folder / "config.json").write_text(json.dumps(config))
    tensors = llama_tensors(layers, hidden, intermediate, heads, kv_heads, vocab, seed)
    save_file({k: v.to(dtype).contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    return folder


def write_gguf(path: Path, tensors: dict[str, tuple[np.ndarray, str]], architecture: str = "llama") -> Path:
    """A GGUF holding `tensors` (GGUF name -> (float32 array, type name)), each quantized with
    gguf.quants where it can be (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, BF16, F16, F32); for other
    types (K-quants) the bytes are random: enough for reading the types, not the values."""
    import gguf

    writer = gguf.GGUFWriter(str(path), architecture)
    for name, (array, kind) in tensors.items():
        qtype = gguf.GGMLQuantizationType[kind]
        if kind == "F32":
            writer.add_tensor(name, array.astype(np.float32))
        elif kind == "F16":
            writer.add_tensor(name, array.astype(np.float16))
        else:
            try:
                data = gguf.quants.quantize(array.astype(np.float32), qtype)
            except NotImplementedError:
                rows, cols = array.shape
                block, size = gguf.GGML_QUANT_SIZES[qtype]
                data = np.random.default_rng(0).integers(0, 256, (rows, cols // block * size), dtype=np.uint8)
            writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
