"""Fixtures of the CUDA tests: a tiny random Llama target (vocabulary 256, a word-level
tokenizer with a chat template) that needs no packaged model. Every test here is skipped on a
machine without a CUDA device; on one, `pytest tests/cuda` checks the GPU paths against the CPU.
EYAS_CUDA_TESTS_ON_CPU=1 runs them with the CPU standing in for the GPU (a dry run of the tests'
own logic, on a machine without one)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tiny_models import build_word_level_target

VOCAB = 256
TEMPLATE = ("{% for m in messages %}t1 {{ m['content'] }} t2 {% endfor %}"
            "{% if add_generation_prompt %}t3 {% endif %}")


@pytest.fixture(scope="session")
def cuda_target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_word_level_target(tmp_path_factory.mktemp("cuda-target"), VOCAB, hidden_size=64,
                                   intermediate_size=128, num_hidden_layers=6, max_position_embeddings=512,
                                   chat_template=TEMPLATE)


@pytest.fixture(scope="session")
def prompts() -> list[list[int]]:
    """Prompts with repeats in them (so that prompt lookup drafts), of different lengths."""
    generator = torch.Generator().manual_seed(3)
    out = []
    for length in (9, 17, 30, 12):
        head = torch.randint(4, VOCAB, (length,), generator=generator).tolist()
        out.append(head + head[: length // 2])
    return out
