"""A resumed `eyas features` re-verifies the shards on disk and rebuilds a bad one; token id errors."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from eyas.errors import EyasError
from eyas.features.extract import FeatureConfig, extract_features
from eyas.features.store import FeatureStore
from eyas.features.tokenized import TokenizedSample, read_tokenized, write_tokenized
from tiny_models import build_tiny_model, single_thread

LAYER_IDS = [1, 2, 3]
NUM_SAMPLES = 12
PER_SHARD = 5  # shards of 5, 5 and 2 samples


@pytest.fixture(scope="module")
def tiny_four_layer_dir(tmp_path_factory: pytest.TempPathFactory, smollm_tokenizer) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-4"), smollm_tokenizer, num_hidden_layers=4,
                            vocab_size=256, hidden_size=32, intermediate_size=64)


@pytest.fixture(scope="module")
def tiny_four_layer(tiny_four_layer_dir: Path):
    from eyas.engine.target import load_target

    return load_target(str(tiny_four_layer_dir), dtype="float32")


@pytest.fixture(scope="module")
def tokenized(tmp_path_factory: pytest.TempPathFactory) -> Path:
    generator = torch.Generator().manual_seed(3)
    samples = []
    for i in range(NUM_SAMPLES):
        length = 8 + i
        mask = (torch.arange(length) >= length // 2).long()
        samples.append(TokenizedSample(f"s{i}", torch.randint(0, 256, (length,), generator=generator), mask))
    path = tmp_path_factory.mktemp("data") / "train.jsonl"
    write_tokenized(path, samples)
    return path


@pytest.fixture(scope="module")
def complete_store(tmp_path_factory: pytest.TempPathFactory, tiny_four_layer_dir: Path, tiny_four_layer,
                   tokenized: Path) -> Path:
    folder = tmp_path_factory.mktemp("features") / "store"
    extract(folder, tiny_four_layer_dir, tiny_four_layer, tokenized)
    return folder


def extract(folder: Path, model_dir: Path, target, data: Path):
    with single_thread():
        return extract_features(FeatureConfig(model=str(model_dir), data=str(data), output=str(folder),
                                              target_layer_ids=LAYER_IDS, dtype="float32",
                                              samples_per_shard=PER_SHARD), target=target, progress=False)


def truncate(path: Path) -> str:
    size = path.stat().st_size
    with open(path, "r+b") as handle:
        handle.truncate(size // 2)
    return f"is truncated ({size // 2} bytes, {size} written)"


def flip_a_byte(path: Path) -> str:
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))
    return "is corrupted: sha256 "


def cut_the_entry(path: Path) -> str:
    entry = path.with_suffix(".json")
    entry.write_text(entry.read_text()[:40])
    return "has an unreadable entry file shard-00001.json"


@pytest.mark.parametrize("damage", [truncate, flip_a_byte, cut_the_entry])
def test_a_rerun_reports_a_bad_shard_and_rebuilds_only_it(damage, tmp_path: Path, complete_store: Path,
                                                          tiny_four_layer_dir: Path, tiny_four_layer,
                                                          tokenized: Path, capsys) -> None:
    store = tmp_path / "store"
    shutil.copytree(complete_store, store)
    original = json.loads((store / "index.json").read_text())
    problem = damage(store / "shard-00001.safetensors")
    seen: list[int] = []
    hook = tiny_four_layer.model.register_forward_hook(
        lambda module, args, kwargs, out: seen.append(args[0].shape[1]), with_kwargs=True)
    try:
        summary = extract(store, tiny_four_layer_dir, tiny_four_layer, tokenized)
    finally:
        hook.remove()
    err = capsys.readouterr().err
    assert f"[eyas] features: {store / 'shard-00001.safetensors'} {problem}" in err and "rebuilding it" in err
    assert summary.rebuilt == ["shard-00001.safetensors"]
    assert seen == [13, 14, 15, 16, 17]  # the five samples of shard 1 (lengths 8 + i), nothing else
    rebuilt = json.loads((store / "index.json").read_text())
    assert [s["sha256"] for s in rebuilt["shards"]] == [s["sha256"] for s in original["shards"]]
    FeatureStore(store).verify()


def test_a_rerun_over_a_good_store_computes_nothing(tmp_path: Path, complete_store: Path,
                                                    tiny_four_layer_dir: Path, tokenized: Path) -> None:
    store = tmp_path / "store"
    shutil.copytree(complete_store, store)
    summary = extract(store, tiny_four_layer_dir, None, tokenized)  # no target: it would be loaded if needed
    assert summary.rebuilt == [] and summary.tokens_computed == 0


def test_reading_a_truncated_shard_names_the_truncation(tmp_path: Path, complete_store: Path) -> None:
    store = tmp_path / "store"
    shutil.copytree(complete_store, store)
    problem = truncate(store / "shard-00002.safetensors")
    expected = f"shard-00002.safetensors {problem} (listed in index.json); re-run `eyas features`"
    with pytest.raises(EyasError, match=re.escape(expected)):
        FeatureStore(store).sample(NUM_SAMPLES - 1)


@pytest.mark.parametrize("ids, message", [
    ([5, -3, 7], "token id -3 at position 1 is outside the target vocabulary 0..255"),
    ([300, 4, -1], "token id 300 at position 0 is outside the target vocabulary 0..255"),
    ([1, 2, 256], "token id 256 at position 2 is outside the target vocabulary 0..255"),
])
def test_a_token_id_outside_the_vocabulary_is_named(tmp_path: Path, ids: list[int], message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"id": "x", "input_ids": ids, "loss_mask": [0, 1, 1]}) + "\n")
    with pytest.raises(EyasError, match=rf"bad.jsonl:1: {message}"):
        read_tokenized(path, vocab_size=256)
    if min(ids) < 0:  # a negative id is refused even without a vocabulary size
        with pytest.raises(EyasError, match=r"token id -\d+ at position \d is outside ids >= 0"):
            read_tokenized(path)


def test_a_cut_index_is_a_one_line_error(tmp_path: Path, complete_store: Path) -> None:
    store = tmp_path / "store"
    shutil.copytree(complete_store, store)
    index = store / "index.json"
    index.write_text(index.read_text()[:100])
    with pytest.raises(EyasError, match=rf"{re.escape(str(index))} is not valid JSON"):
        FeatureStore(store)
