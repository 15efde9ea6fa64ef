"""Shared fixtures: the embedded SmolLM2 target and tiny random models built from configs."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch

from tiny_models import build_tiny_model, single_thread

warnings.filterwarnings("ignore", category=UserWarning)
torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture
def one_thread():
    """Run the test on one torch thread (use: pytestmark = pytest.mark.usefixtures("one_thread"))."""
    with single_thread():
        yield


@pytest.fixture(scope="session")
def smollm_tokenizer():
    from eyas.models.tokenizer import load_tokenizer

    return load_tokenizer("smollm2-135m")


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
