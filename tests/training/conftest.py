"""Fixtures of the feature and training tests: a tiny random Llama target (8 layers, hidden 32,
vocabulary 256, a word-level tokenizer), tokenized conversations over it, and its feature store."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tiny_models import single_thread

VOCAB = 256
NUM_SAMPLES = 24


@pytest.fixture(autouse=True)
def single_threaded(one_thread) -> None:
    """Every training test runs on one thread (tests/conftest.py)."""


def build_tiny_target(folder: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=8,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # a peaked output layer: the target's argmax is not a coin toss
        model.lm_head.weight.mul_(40.0)
    model.save_pretrained(folder)
    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="t0").save_pretrained(folder)
    return folder


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
    return build_tiny_target(tmp_path_factory.mktemp("tiny-target"))


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
