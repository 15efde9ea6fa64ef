"""The lean model equals transformers' implementation: logits within 1e-4, greedy tokens equal."""

from __future__ import annotations

import functools
from contextlib import contextmanager

import pytest
import torch

from tiny_models import build_tiny_model
from eyas.engine.target import load_target

ARCHITECTURES = {
    "llama": dict(model_type="llama"),
    "llama3-rope-scaling": dict(model_type="llama", rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}, rope_theta=500000.0),
    "llama-tied": dict(model_type="llama", tie_word_embeddings=True),
    "mistral": dict(model_type="mistral", sliding_window=None),
    "qwen2": dict(model_type="qwen2"),
    "qwen3": dict(model_type="qwen3", head_dim=32),
}


def hf_model(folder):
    """transformers' model of a folder; a resolved GGUF folder's weights are in its GGUF."""
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    from eyas.models.weight_source import gguf_file

    gguf = gguf_file(Path(folder))
    if gguf is not None:
        with gguf_metadata_read_once():
            return AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                        dtype=torch.float32).eval()
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@contextmanager
def gguf_metadata_read_once():
    """transformers parses a GGUF's metadata twice (config, then weights) and rebuilds gguf's
    tensor-name map once per module (~400 times): ~25 s of SmolLM2's ~28 s load. Both are pure
    functions of their arguments; memoized while loading, the weights read are the same."""
    import gguf

    saved = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader = functools.lru_cache(maxsize=None)(saved[0])
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(saved[1])
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = saved


@pytest.fixture(scope="module")
def smollm2_reference(smollm_target):
    """transformers' SmolLM2, read from the same GGUF, loaded once for this module's tests."""
    return hf_model(str(smollm_target.folder))


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_tiny_architecture_logits_and_greedy_match_transformers(name, tmp_path, smollm_tokenizer):
    folder = build_tiny_model(tmp_path, smollm_tokenizer, **ARCHITECTURES[name])
    reference = hf_model(folder)
    ours = load_target(str(folder), dtype="float32").model
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 49152, (2, 40), generator=generator)
    with torch.no_grad():
        expected = reference(ids).logits
        got = ours(ids).logits
    assert torch.allclose(got, expected, atol=1e-4, rtol=0), (got - expected).abs().max()
    # Greedy continuation with the KV cache equals transformers' generate.
    from eyas.engine.generate import generate
    from eyas.engine.sampling import SamplingParams

    target = load_target(str(folder), dtype="float32")
    prompt = ids[0, :12].tolist()
    with torch.no_grad():
        hf_out = reference.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=24,
                                    min_new_tokens=24, attention_mask=torch.ones(1, 12, dtype=torch.long))
    ours_out = generate(target, prompt, SamplingParams(max_tokens=24, ignore_eos=True)).token_ids
    assert ours_out == hf_out[0, 12:].tolist()


def test_taps_are_the_residual_stream_entering_each_layer(tiny_target, tiny_model_dir):
    reference = hf_model(tiny_model_dir)
    ids = torch.randint(3, 49152, (1, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        states = reference(ids, output_hidden_states=True).hidden_states  # [emb, l0, l1(normed)]
        out = tiny_target.model(ids, tap_layers=(0, 1))
    hidden = tiny_target.config.hidden_size
    assert torch.allclose(out.taps[..., :hidden], states[0], atol=1e-5)
    assert torch.allclose(out.taps[..., hidden:], states[1], atol=1e-5)
    # hidden is the final state after the norm: lm_head(hidden) gives the logits
    assert torch.allclose(tiny_target.model.lm_head(out.hidden), out.logits, atol=1e-5)


def test_smollm2_logits_match_transformers_on_real_prompts(smollm_target, smollm2_reference,
                                                           mtbench_prompt_ids):
    reference = smollm2_reference
    for prompt in mtbench_prompt_ids[:2]:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            expected = reference(ids).logits
            got = smollm_target.model(ids).logits
        assert torch.allclose(got, expected, atol=1e-4, rtol=0), (got - expected).abs().max()


def test_smollm2_greedy_tokens_match_transformers(smollm_target, smollm2_reference,
                                                  mtbench_prompt_ids):
    from eyas.engine.generate import generate
    from eyas.engine.sampling import SamplingParams

    reference = smollm2_reference
    prompt = mtbench_prompt_ids[2]
    with torch.no_grad():
        hf_out = reference.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=32,
                                    attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    expected = [t for t in hf_out[0, len(prompt):].tolist() if t != 2]
    assert generate(smollm_target, prompt, SamplingParams(max_tokens=32)).token_ids == expected


def test_int4_holds_the_gguf_codes_exactly(smollm_target, smollm_int4_target):
    """SmolLM2's weights are dequantized Q4_1: re-quantizing recovers them without error."""
    from eyas.models.quant import quantize_groups

    weight = smollm_target.model.layers[5].mlp.gate_up_proj.weight_t.t()  # stored [in, out]
    codes, scale, low = quantize_groups(weight, 32)
    rebuilt = (codes.reshape(weight.shape[0], -1, 32) * scale[..., None] + low[..., None])
    assert torch.equal(rebuilt.reshape(weight.shape), weight)


def test_int4_logits_stay_close_to_float32(smollm_target, smollm_int4_target, mtbench_prompt_ids):
    """int4 computes its matmuls with bf16 activations: close to float32, not bit-equal."""
    ids = torch.tensor([mtbench_prompt_ids[0]])
    with torch.no_grad():
        full = smollm_target.model(ids).logits[0]
        quant = smollm_int4_target.model(ids).logits[0]
    top1_agreement = (full.argmax(-1) == quant.argmax(-1)).float().mean().item()
    assert top1_agreement >= 0.95
    difference = (full - quant).abs()
    assert difference.mean().item() < 0.15, difference.mean()
    assert difference.max().item() < 2.5, difference.max()
