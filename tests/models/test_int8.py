"""int8 weights (--dtype int8): the kernel's values and their independence of the rows beside
them, a Q8_0 GGUF held exactly, the cache that round-trips bit for bit apart from int4's, and a
Q8_0 model whose int8 output follows float32."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from random_checkpoints import write_llama_folder
from spec_checks import assert_greedy_equals_plain

from eyas.models import extension
from eyas.models.config import ModelConfig
from eyas.models.layerwise import load_layerwise
from eyas.models.quant import INT8_GROUP, Int8Linear, int8_available, quantize_int8_groups
from eyas.models.weight_source import open_weights

pytestmark = pytest.mark.skipif(not int8_available(), reason="no int8 dot-product kernel in this build")
CPU = torch.device("cpu")


def kernel_reference(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """What csrc/int8_gemm.cpp computes, in float64: x [N, I] rounded to 14-bit integers per 32
    inputs, times codes [O, I] * scale [O, I/32]."""
    rows, inputs = x.shape
    groups = x.reshape(rows, inputs // INT8_GROUP, INT8_GROUP)
    amax = groups.abs().amax(dim=-1, keepdim=True)
    inverse = torch.where(amax > 0, 8191.0 / amax, torch.zeros_like(amax))
    quantized = torch.round(groups * inverse).double() * (amax.double() / 8191)
    weights = codes.double().reshape(codes.shape[0], -1, INT8_GROUP) * scale.double()[..., None]
    return torch.einsum("ngi,ogi->no", quantized, weights)


def test_the_int8_kernel_multiplies_14_bit_activations_by_the_codes_row_by_row():
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 48, bias=True)
    layer = Int8Linear(linear)
    x = torch.randn(11, 96) * torch.linspace(0.01, 10, 96)  # groups of very different sizes
    x[3, :32] = 0  # an all-zero group
    y = layer(x)
    codes, scale = quantize_int8_groups(linear.weight.detach())
    expected = kernel_reference(x, codes, scale) + linear.bias.detach().double()
    assert torch.allclose(y.double(), expected, rtol=1e-5, atol=1e-4)
    # close to the float layer: 8-bit weights, 14-bit activations
    assert (y - linear(x)).norm() / linear(x).norm() < 0.01
    # each row's values depend on that row alone, whatever rows share the call (1..11: every tile)
    for count in (1, 3, 8, 9):
        assert torch.equal(layer(x[:count]), y[:count])
    assert torch.equal(layer(x[5:6]), y[5:6])


def test_avx2_and_avx512vnni_give_the_same_bits():
    kernels = extension.module().int8dot_kernels()
    if len(kernels) < 2:
        pytest.skip("one int8 dot-product implementation in this build")
    torch.manual_seed(1)
    layer = Int8Linear(torch.nn.Linear(128, 64, bias=False))
    x = torch.randn(9, 128)
    before = extension.module().int8dot_kernel()
    outputs = []
    try:
        for name in kernels:
            extension.module().set_int8dot_kernel(name)
            outputs.append(layer(x))
    finally:
        extension.module().set_int8dot_kernel(before)
    assert all(torch.equal(outputs[0], other) for other in outputs[1:])


def test_a_q8_0_block_comes_back_with_its_own_codes_and_scale():
    import gguf

    rng = np.random.default_rng(0)
    weight = (rng.standard_normal((32, 256)) * rng.uniform(1e-3, 1.0, (32, 1))).astype(np.float32)
    raw = gguf.quants.quantize(weight, gguf.GGMLQuantizationType.Q8_0)  # per block: f16 scale, 32 int8
    blocks = raw.reshape(32, 8, 34)
    q8_scale = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)  # [32, 8]
    q8_codes = blocks[..., 2:].copy().view(np.int8).reshape(32, 256)
    values = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q8_0))
    codes, scale = quantize_int8_groups(values)
    assert torch.equal(codes, torch.from_numpy(q8_codes))
    assert torch.equal(scale, torch.from_numpy(q8_scale))
    # a 16-bit source: within half a step of each group's largest weight / 127
    weight = torch.from_numpy(weight)
    codes, scale = quantize_int8_groups(weight)
    error = (codes.float().reshape(32, 8, 32) * scale[..., None]).reshape(32, 256) - weight
    assert (error.abs().reshape(32, 8, 32).amax(-1) <= scale * 0.5 * (1 + 1e-3)).all()


def test_the_int8_cache_round_trips_bit_for_bit_beside_the_int4_cache(tmp_path):
    folder = write_llama_folder(tmp_path / "model", layers=2, hidden=128, intermediate=256)
    config = ModelConfig.from_folder(folder)
    root = tmp_path / "cache"
    fresh = load_layerwise(config, open_weights(folder), "int8", CPU, name="m", cache_root=root)
    int4 = load_layerwise(config, open_weights(folder), "int4", CPU, name="m", cache_root=root)
    cached = load_layerwise(config, open_weights(folder), "int8", CPU, name="m", cache_root=root)
    folders = sorted(path.parent.name[:-17] for path in root.glob("*/manifest.json"))
    assert folders == ["m", "m-int8"]  # int4's and int8's, neither pruned by the other
    fresh_state, cached_state = fresh.state_dict(), cached.state_dict()
    assert fresh_state.keys() == cached_state.keys()
    for name, tensor in fresh_state.items():
        assert torch.equal(tensor, cached_state[name]), name
    linears = [m for m in cached.modules() if isinstance(m, Int8Linear)]
    assert len(linears) == 4 * config.num_hidden_layers
    ids = torch.tensor([[5, 17, 300, 42, 9, 77]])  # [1, 6]
    with torch.inference_mode():
        logits = cached(ids).logits
        assert torch.equal(fresh(ids).logits, logits)
        reference = load_layerwise(config, open_weights(folder), "float32", CPU)(ids).logits
        assert not torch.equal(int4(ids).logits, logits)
    # int8 follows float32 far more closely than int4 on a float source
    assert (logits - reference).norm() < 0.2 * (int4(ids).logits - reference).norm()


def test_a_damaged_int8_cache_is_rebuilt_with_a_message(tmp_path, capsys):
    folder = write_llama_folder(tmp_path / "model", layers=1, hidden=64, intermediate=128)
    config = ModelConfig.from_folder(folder)
    reference = load_layerwise(config, open_weights(folder), "int8", CPU, cache_root=tmp_path / "cache")
    (file,) = (tmp_path / "cache").glob("*/model.safetensors")
    data = bytearray(file.read_bytes())
    data[-100] ^= 0xFF
    file.write_bytes(bytes(data))
    capsys.readouterr()
    rebuilt = load_layerwise(config, open_weights(folder), "int8", CPU, cache_root=tmp_path / "cache")
    err = capsys.readouterr().err
    assert "int8 cache" in err and "damaged" in err and "rebuilding" in err
    for name, tensor in reference.state_dict().items():
        assert torch.equal(tensor, rebuilt.state_dict()[name]), name


def test_int8_speculative_equals_int8_plain(mtbench_prompt_ids):
    """The Python layers of an int8 model round each row's activations to integers: its
    attention runs in float64 (as unfused int4), so a verification pass gives each row the
    bits of a one-token step and speculation stays token-identical."""
    from eyas.engine.generate import SamplingParams, generate
    from eyas.engine.speculative.proposers.draft_model import DraftModelProposer
    from eyas.engine.speculative.proposers.ngram import NgramConfig, NgramProposer
    from eyas.engine.target import load_target

    target = load_target("smollm2-135m", dtype="int8")
    assert target.precision == "int8" and target.kv_dtype == torch.float64
    prompts = mtbench_prompt_ids[:2]
    params = SamplingParams(max_tokens=32)
    expected = [generate(target, prompt, params).token_ids for prompt in prompts]
    tree = NgramProposer(NgramConfig(max_n=3, min_n=1, max_matches=3))
    assert_greedy_equals_plain(target, prompts, tree, 6, 32, expected)
    totals = assert_greedy_equals_plain(target, prompts, DraftModelProposer(target, name="self"), 4, 32,
                                        expected)
    assert totals["accepted_tokens"] == totals["draft_tokens"] > 0


@pytest.mark.slow
def test_int8_greedy_output_of_a_q8_0_smollm2_equals_float32(tmp_path, monkeypatch):
    """A real model whose decoder matrices are Q8_0 (SmolLM2's GGUF re-quantized): int8 holds
    its weights exactly, so only the activations' 14-bit rounding separates it from float32."""
    import importlib.util

    from eyas.engine.generate import SamplingParams, generate
    from eyas.engine.target import load_target
    from eyas.models.tokenizer import chat_prompt_ids

    monkeypatch.setenv("EYAS_CACHE", str(tmp_path / "cache"))
    script = Path(__file__).resolve().parents[2] / "scripts" / "requantize-gguf.py"
    spec = importlib.util.spec_from_file_location("requantize_gguf", script)
    requantize = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(requantize)
    from eyas.models.registry import resolve_model
    from eyas.models.weight_source import gguf_file

    q8 = requantize.requantize(gguf_file(resolve_model("smollm2-135m")), tmp_path / "smollm2-q8_0.gguf")
    float32 = load_target(str(q8), dtype="float32")
    int8 = load_target(str(q8), dtype="int8")
    params = SamplingParams(max_tokens=24)
    for question in ("Write a Python function that reverses a string.", "What is the capital of France?"):
        prompt = chat_prompt_ids(float32.tokenizer, [{"role": "user", "content": question}])
        assert generate(int8, prompt, params).token_ids == generate(float32, prompt, params).token_ids
