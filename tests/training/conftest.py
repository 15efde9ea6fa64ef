"""Fixtures of the feature and training tests: a tiny random Llama target (8 layers, hidden 32,
vocabulary 256, a word-level tokenizer), tokenized conversations over it, and its feature store."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tiny_models import build_word_level_target, single_thread

VOCAB = 256
NUM_SAMPLES = 24


@pytest.fixture(autouse=True)
def single_threaded(one_thread) -> None:
    """Every training test runs on one thread (tests/conftest.py)."""


def make_samples(count: int, seed: int = 1):
    from eyas.features.tokenized import TokenizedSample

    generator = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(count):
        length = int(torch.randint(12, 40, (1,), generator=generator))
        ids = torch.randint(0, VOCAB // 2, (length,), generator=generator)  # half the vocabulary used
        mask = torch.zeros(length, dtype=torch.int64)
        mask[length // 3:] = 1  # prompt, then answer
        samples.append(TokenizedSample(f"s{i}", ids, mask))
    return samples


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_word_level_target(tmp_path_factory.mktemp("tiny-target"), VOCAB)


@pytest.fixture(scope="session")
def tokenized_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from eyas.features.tokenized import write_tokenized

    path = tmp_path_factory.mktemp("data") / "train.tokenized.jsonl"
    write_tokenized(path, make_samples(NUM_SAMPLES))
    return path


@pytest.fixture(scope="session")
def tiny_target(tiny_target_dir: Path):
    from eyas.engine.target import load_target

    return load_target(tiny_target_dir, dtype="float32")


@pytest.fixture(scope="session")
def feature_store_dir(tmp_path_factory: pytest.TempPathFactory, tiny_target_dir: Path,
                      tokenized_file: Path, tiny_target) -> Path:
    """float32 features (exact), so that offline and online training can be compared bit for bit."""
    from eyas.features.extract import FeatureConfig, extract_features

    out = tmp_path_factory.mktemp("features") / "store"
    with single_thread():
        extract_features(FeatureConfig(model=str(tiny_target_dir), data=str(tokenized_file), output=str(out),
                                       dtype="float32", samples_per_shard=10), target=tiny_target,
                         progress=False)
    return out
