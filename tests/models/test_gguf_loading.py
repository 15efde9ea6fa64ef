"""GGUF files read tensor by tensor: values, names, the rotary un-permutation, and what
`--dtype auto` picks for each GGUF type (small synthetic GGUFs written with the gguf package)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from random_checkpoints import llama_tensors, write_gguf

from eyas.engine.target import auto_precision, resolve_precision
from eyas.models.quant import int8_available
from eyas.models.config import ModelConfig
from eyas.models.gguf_loader import GGUFSource, gguf_source_info, hf_name
from eyas.models.weight_source import SOURCE_INFO, open_weights

HIDDEN, HEADS, KV_HEADS = 64, 4, 2
CPU = torch.device("cpu")


def llama_cpp_permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to q and k rows of a Llama."""
    return (weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


GGUF_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
              "lm_head.weight": "output.weight"}
LAYER = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
         "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
         "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
         "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
         "mlp.down_proj.weight": "ffn_down.weight"}


def gguf_name(name: str) -> str:
    if name in GGUF_NAMES:
        return GGUF_NAMES[name]
    _, _, index, rest = name.split(".", 3)
    return f"blk.{index}.{LAYER[rest]}"


def write_llama_gguf(path: Path, matrix_type: str, layers: int = 2) -> dict[str, torch.Tensor]:
    """A random Llama as a GGUF whose decoder matrices have `matrix_type` (q/k rows permuted as
    llama.cpp writes them); returns the Hugging Face tensors it was made from."""
    tensors = llama_tensors(layers, HIDDEN, 128, HEADS, KV_HEADS, vocab=256, seed=1)
    entries = {}
    for name, tensor in tensors.items():
        array = tensor.numpy()
        if name.endswith("q_proj.weight"):
            array = llama_cpp_permute(array, HEADS)
        elif name.endswith("k_proj.weight"):
            array = llama_cpp_permute(array, KV_HEADS)
        kind = "F32" if array.ndim == 1 else ("Q8_0" if "embed" in name or "lm_head" in name else matrix_type)
        entries[gguf_name(name)] = (array, kind)
    write_gguf(path, entries)
    return tensors


def gguf_folder(tmp_path: Path, gguf: Path, layers: int = 2) -> Path:
    """What registry.gguf_to_folder makes (config, eyas_source.json), without a tokenizer."""
    folder = tmp_path / "resolved"
    folder.mkdir()
    config = {"model_type": "llama", "vocab_size": 256, "hidden_size": HIDDEN, "intermediate_size": 128,
              "num_hidden_layers": layers, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
              "tie_word_embeddings": False}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / SOURCE_INFO).write_text(json.dumps(gguf_source_info(gguf)))
    return folder


def test_gguf_names_map_to_hugging_face_names():
    assert hf_name("blk.3.attn_output.weight") == "model.layers.3.self_attn.o_proj.weight"
    assert hf_name("blk.0.attn_q.bias") == "model.layers.0.self_attn.q_proj.bias"
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("output.weight") == "lm_head.weight"
    assert hf_name("rope_freqs.weight") is None


@pytest.mark.parametrize("matrix_type", ["F32", "F16", "Q8_0", "Q4_1", "Q5_0"])
def test_gguf_tensors_read_as_gguf_quants_dequantizes_them_with_q_k_unpermuted(tmp_path, matrix_type):
    import gguf

    path = tmp_path / "model.gguf"
    original = write_llama_gguf(path, matrix_type)
    source = GGUFSource(path, heads=HEADS, kv_heads=KV_HEADS)
    assert source.names() == set(original)
    reader = gguf.GGUFReader(str(path))
    raw = {t.name: t for t in reader.tensors}
    for name in original:
        tensor = raw[gguf_name(name)]
        reference = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = HEADS if "q_proj" in name else KV_HEADS
            # undoing llama.cpp's permutation restores the original row order exactly
            assert np.array_equal(llama_cpp_permute(source.get(name).numpy(), heads), reference), name
        else:
            assert np.array_equal(source.get(name).numpy(), reference), name
    if matrix_type == "F32":  # lossless: the Hugging Face tensors themselves come back
        for name, tensor in original.items():
            if ".layers." in name:  # (embedding and output layer are Q8_0)
                assert torch.equal(source.get(name), tensor), name


def test_an_int4_load_from_a_gguf_equals_one_from_its_dequantized_safetensors(tmp_path):
    from safetensors.torch import save_file

    from eyas.models.layerwise import load_layerwise

    gguf = tmp_path / "model.gguf"
    write_llama_gguf(gguf, "Q4_1")
    folder = gguf_folder(tmp_path, gguf)
    config = ModelConfig.from_folder(folder)
    source = open_weights(folder, heads=HEADS, kv_heads=KV_HEADS)
    assert isinstance(source, GGUFSource)
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "config.json").write_text((folder / "config.json").read_text())
    save_file({name: source.get(name) for name in source.names()}, str(plain / "model.safetensors"))
    from_gguf = load_layerwise(config, source, "int4", CPU, cache_root=tmp_path / "cache")
    from_folder = load_layerwise(config, open_weights(plain), "int4", CPU, cache_root=tmp_path / "cache")
    folder_state = from_folder.state_dict()
    for name, tensor in from_gguf.state_dict().items():
        if not name.startswith("lm_head."):  # the GGUF's untied output layer: a screen of its rows
            assert torch.equal(tensor, folder_state[name]), name
    # the untied embedding and output layer stay in the GGUF, read row by row: the same rows
    assert "embed_tokens.weight" not in from_gguf.state_dict()
    assert torch.equal(from_gguf.embed_tokens(torch.arange(256)), folder_state["embed_tokens.weight"])
    ids = torch.tensor([[3, 14, 15, 92, 65]])
    with torch.inference_mode():
        assert torch.equal(from_gguf(ids).logits, from_folder(ids).logits)
        again = load_layerwise(config, source, "int4", CPU, cache_root=tmp_path / "cache")  # cached
        assert torch.equal(again(ids).logits, from_folder(ids).logits)
        greedy = again(ids, greedy=True).logits.argmax(-1)
        assert torch.equal(greedy, from_folder(ids).logits.argmax(-1))


AUTO = [("Q4_0", "int4"), ("Q4_1", "int4"), ("Q4_K", "int4"), ("Q5_0", "int4"), ("Q5_1", "int4"),
        ("Q5_K", "int4"), ("Q6_K", "int4"), ("Q8_0", "int8"), ("F16", "int8"),
        ("BF16", "int8"), ("F32", "int8")]


@pytest.mark.parametrize("matrix_type, expected", AUTO)
def test_dtype_auto_picks_int4_up_to_6_bits_int8_above_and_says_why(tmp_path, capsys,
                                                                     matrix_type, expected):
    rng = np.random.default_rng(0)
    matrix = rng.standard_normal((256, 256)).astype(np.float32)  # K-quants: 256-wide blocks
    path = write_gguf(tmp_path / "model.gguf", {
        "token_embd.weight": (matrix, "Q8_0"),  # not a decoder matrix: does not count
        "blk.0.attn_q.weight": (matrix, matrix_type), "blk.0.ffn_down.weight": (matrix, matrix_type),
        "blk.0.attn_norm.weight": (matrix[0], "F32"),
    })
    folder = tmp_path / "resolved"
    folder.mkdir()
    (folder / SOURCE_INFO).write_text(json.dumps(gguf_source_info(path)))
    if expected == "int8" and not int8_available():
        expected = "float32"  # no int8 dot-product kernel here: said in the reason
    assert auto_precision(CPU, folder)[0] == expected
    assert resolve_precision("auto", CPU, folder) == expected
    err = capsys.readouterr().err
    assert f"--dtype auto: {expected}" in err and matrix_type in err
    assert resolve_precision("float32", CPU, folder) == "float32"  # an explicit choice stands
    assert capsys.readouterr().err == ""
    if expected == "int8":
        assert ("held exactly" in err) == (matrix_type == "Q8_0")


def test_dtype_auto_is_float32_for_a_hugging_face_folder_and_bfloat16_on_cuda(tmp_path):
    assert auto_precision(CPU, tmp_path) == ("float32", "not a GGUF: the checkpoint's own weights, unquantized")
    assert auto_precision(torch.device("cuda"), tmp_path)[0] == "bfloat16"
