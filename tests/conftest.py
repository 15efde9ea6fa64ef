"""Shared fixtures: the embedded SmolLM2 target and tiny random models built from configs."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch

warnings.filterwarnings("ignore", category=UserWarning)
torch.set_num_threads(min(2, os.cpu_count() or 1))

TINY_DEFAULTS = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                     rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                     pad_token_id=2)


@pytest.fixture(scope="session")
def smollm_tokenizer():
    from eyas.models.tokenizer import load_tokenizer

    return load_tokenizer("smollm2-135m")


def build_tiny_model(folder: Path, tokenizer, model_type: str = "llama", seed: int = 0,
                     **overrides) -> Path:
    """Save a random Hugging Face model of `model_type` (+ the SmolLM2 tokenizer) to `folder`."""
    import transformers

    classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }
    config_class, model_class = classes[model_type]
    torch.manual_seed(seed)
    config = config_class(**{**TINY_DEFAULTS, **overrides})
    model = model_class(config).eval()
    # Random init gives near-uniform logits; scale the output layer up so that greedy choices
    # are decisive, as in a trained model (ties would make token equality tests meaningless).
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, smollm_tokenizer) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"), smollm_tokenizer)


@pytest.fixture(scope="session")
def tiny_target(tiny_model_dir):
    from eyas.engine.target import load_target

    return load_target(str(tiny_model_dir), dtype="float32")


@pytest.fixture(scope="session")
def smollm_target():
    from eyas.engine.target import load_target

    return load_target("smollm2-135m", dtype="float32")


@pytest.fixture(scope="session")
def smollm_int4_target():
    from eyas.engine.target import load_target

    return load_target("smollm2-135m", dtype="int4")


@pytest.fixture(scope="session")
def mtbench_prompt_ids(smollm_tokenizer) -> list[list[int]]:
    from eyas.bench.prompts import mtbench_first_turns
    from eyas.models.tokenizer import chat_prompt_ids

    return [chat_prompt_ids(smollm_tokenizer, [{"role": "user", "content": q}])
            for q in mtbench_first_turns(8)]
